"""The front end's one place for turning engine-core token outputs into what clients see:
incremental detokenization, stop strings with hold-back, and the finish decision for stop strings.

A stop string is found here, after the core has already advanced the request: the processor
finishes the request for the client at once (text cut at the stop string) and returns its id so
the caller aborts it in the core, which frees its blocks. Tokens the core produced for it
meanwhile are dropped (the request is no longer known here). Pure Python, no torch.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from moe_serve.protocol import EngineCoreOutput, EngineOutput
from moe_serve.sampling_params import SamplingParams
from moe_serve.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _State:
    detok: IncrementalDetokenizer
    params: SamplingParams
    num_prompt_tokens: int
    hold: int  # characters held back while the text could end in the start of a stop string
    emitted: int = 0  # characters of text already emitted
    num_output_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}
        self._lock = threading.Lock()  # requests are added from handler threads, processed elsewhere

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        hold = max((len(s) for s in params.stop_strings), default=1) - 1
        st = _State(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens), params,
                    len(prompt_token_ids), hold)
        with self._lock:
            self._states[request_id] = st

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._states.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def process(self, outs: list[EngineCoreOutput]) -> tuple[list[EngineOutput], list[str]]:
        """Outputs for clients, and the ids of requests a stop string finished (to abort in the core)."""
        results: list[EngineOutput] = []
        stopped: list[str] = []
        for o in outs:
            with self._lock:
                st = self._states.get(o.request_id)
            if st is None:  # finished here already (stop string) or never known
                continue
            finished, reason, stop_reason = o.finished, o.finish_reason, o.stop_reason
            detok = st.detok
            new = o.new_token_ids
            if finished and reason == "stop" and not isinstance(stop_reason, str) and new and \
                    not st.params.include_stop_str_in_output:
                new = new[:-1]  # the token that stopped it (EOS, stop_token_ids) is not text, as in vLLM
            for t in new:
                detok.add(t)
            st.num_output_tokens += len(o.new_token_ids)
            if finished:
                detok.flush()
            text = detok.text
            found = self._find_stop(st.params.stop_strings, text, st.emitted)
            if found is not None and reason != "abort":
                idx, s = found
                text = text[: idx + (len(s) if st.params.include_stop_str_in_output else 0)]
                if not finished:
                    stopped.append(o.request_id)
                finished, reason, stop_reason = True, "stop", s
            elif not finished and st.hold:
                text = text[: max(st.emitted, len(text) - st.hold)]
            start, st.emitted = st.emitted, max(st.emitted, len(text))
            results.append(EngineOutput(o.request_id, list(o.new_token_ids), text[start:], finished, reason,
                                        stop_reason, o.logprobs, st.num_prompt_tokens, o.num_cached_tokens,
                                        st.num_output_tokens, o.prompt_logprobs, o.routed_experts))
            if finished:
                self.forget(o.request_id)
        return results, stopped

    @staticmethod
    def _find_stop(stops: list[str], text: str, emitted: int) -> tuple[int, str] | None:
        best = None
        for s in stops:
            i = text.find(s, max(0, emitted - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        return best
