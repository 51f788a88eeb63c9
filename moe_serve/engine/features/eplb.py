"""Online expert rebalancing as a step feature (the state machine: expert_parallel/rebalance/eplb.py)."""
from __future__ import annotations

import msgspec

from moe_serve.engine.features.base import MinInt, StepFeature
from moe_serve.protocol import EplbStats


class EplbAgreement(msgspec.Struct):
    """busy: 1 while any rank's part of the pending item (tuning, a layer's transfer) is unfinished;
    digest: a tuned placement waiting to be taken up (0: none). MAX and MIN of the digest agree iff
    every rank tuned the same placement."""

    busy: int = 0
    digest: int = 0
    digest_min: MinInt = 0


class Eplb(StepFeature):
    """Advances the rebalancing between steps, at the same turn on every rank, and times every step
    (its load hook, which counts the routed tokens, sits on the model runner)."""

    name = "eplb"

    def __init__(self, manager):
        self.manager = manager  # EplbManager

    @classmethod
    def build(cls, ctx) -> "Eplb":
        """The online rebalancer over the model's MoE layers, its load hook on the runner (after the
        recorder's). Last: it makes a process group (a collective)."""
        import os

        from expert_parallel.rebalance.eplb import EplbManager, tuner_fn
        from expert_parallel.runtime.layer import MoE, default_physical_to_logical
        from moe_serve.models.registry import num_logical_experts

        cfg = ctx.cfg
        E = num_logical_experts(cfg.model.architecture, cfg.model.hf)
        moes = [m for m in ctx.model.modules() if isinstance(m, MoE)]
        rows = ctx.moe_ctx.physical_to_logical or [default_physical_to_logical(E, ctx.num_slots) for _ in moes]
        par = cfg.parallel
        # Nodes (torchrun's LOCAL_WORLD_SIZE ranks each) and the router's expert groups, so the
        # tuner also keeps tokens near their node on a multi-node job.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", par.world_size) or par.world_size)
        nodes = par.world_size // local if par.world_size % local == 0 else 1
        groups = cfg.model.hf.get("n_group")
        groups = groups if nodes > 1 and isinstance(groups, int) and groups > 0 and E % groups == 0 else None
        mgr = EplbManager(moes, rows, E, par.eplb, par.rank, par.world_size, cfg.device,
                          tune_fn=tuner_fn(nodes, groups, par.replica_split))
        ctx.runner.load_hooks.append(mgr.record)
        return cls(mgr)

    def agreement(self) -> EplbAgreement:
        busy, digest = self.manager.local_state()
        return EplbAgreement(busy, digest, digest)

    def apply_agreement(self, agreed: EplbAgreement, group=None) -> None:
        self.manager.boundary(agreed.busy, group, (agreed.digest, -agreed.digest_min))

    def after_forward(self, sched, result, seconds: float) -> None:
        self.manager.end_step(seconds)

    def stats(self) -> EplbStats:
        m = self.manager
        return EplbStats(rebalances=m.rebalances, balancedness=m.balancedness, last_transfer_s=m.last_transfer_s)
