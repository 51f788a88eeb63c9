"""Elastic EP as the front end sees it, a part of `AsyncEngine` (engine/async_engine.py, its one
user): when rank 0's core says the ranks regrouped, every open request is resubmitted to a member
with the tokens it has streamed; GET /ranks shows the members."""
from __future__ import annotations

import logging

from moe_serve.protocol import ElasticChange, EngineStats, NewRequest

log = logging.getLogger("moe_serve.async_engine")


class ElasticMembers:
    """AsyncEngine's regroup handling and its /ranks view (mixed into AsyncEngine, whose request
    tables and router it updates under its lock)."""

    # --- elastic EP: the ranks regrouped --------------------------------------------------------------
    def _on_elastic(self, msg: ElasticChange) -> None:
        if msg.phase == "recovering":
            self.elastic_state = "recovering"
            log.warning("the ranks are regrouping (generation %d): %s", msg.generation, msg.reason)
            return
        members = [i.rank for i in msg.members]
        resubmitted = 0
        with self._lock:
            self.generation = msg.generation
            self.live = members
            self.rank_info = {i.rank: i for i in msg.members}
            self.lost_ranks = sorted((set(self.lost_ranks) | set(msg.lost)) - set(members))
            for r in range(self.world_size):
                if r not in members:
                    self.rank_stats[r] = EngineStats()
                self._cores_done[r] = r not in members  # shutdown waits for the members only
            self.router.reset(members)  # every member's cache was made again
            self._rank_load = [0] * self.world_size
            for cid in list(self._owner):
                prompt, cp = self._requests[cid]
                done = list(self._generated.get(cid, ()))
                cost = max(1, len(prompt) + (cp.max_tokens or self.max_model_len - len(prompt)) - len(done))
                rank, _ = self.router.pick(cid, prompt + done, self._rank_load)
                self._rank_load[rank] += cost
                self._owner[cid] = (rank, cost)
                self._inbox.put((rank, NewRequest(cid, prompt, cp, None, done), msg.generation))
                resubmitted += 1
            self.elastic_state = "serving"
        m = self.metrics
        m.ep_world_size = len(members)
        if msg.lost:
            m.elastic_recoveries += 1
            m.elastic_recovery.observe(msg.seconds)
        m.elastic_resubmitted += resubmitted
        log.warning("generation %d serving on ranks %s (%s; regrouped in %.2fs): %d request(s) in flight resubmitted",
                    msg.generation, members, msg.reason or "planned", msg.seconds, resubmitted)

    def ranks_view(self) -> dict:
        """GET /ranks: every member's id, EP rank, host, pid of its engine core, state and expert slots."""
        with self._lock:
            live, info, state = list(self.live), dict(self.rank_info), self.elastic_state
        return {"generation": self.generation, "world_size": len(live), "state": state, "lost": list(self.lost_ranks),
                "ranks": [{"rank": r, "ep_rank": i, "host": info[r].host, "pid": info[r].pid, "state": state,
                           "expert_slots": info[r].expert_slots} for i, r in enumerate(live)]}
