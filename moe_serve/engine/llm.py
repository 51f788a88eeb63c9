"""The offline API, shaped like vLLM's: LLM(model=...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import itertools
import logging

from tqdm import tqdm

from moe_serve.engine.args import EngineArgs
from moe_serve.engine.core import build_engine
from moe_serve.engine.output_processor import OutputProcessor
from moe_serve.protocol import NewRequest
from moe_serve.routed_experts import RoutedExperts, refusal
from moe_serve.outputs import CompletionOutput, Logprob, RequestOutput
from moe_serve.sampling_params import SamplingParams, child_params

log = logging.getLogger("moe_serve.llm")


class LLM:
    """Offline batched generation on one process (EP=1): the same EngineCore as the server's
    core process, stepped in this process, and the same OutputProcessor as the server's front end.

    Keywords are those of `EngineArgs` (dtype, max_model_len, max_num_batched_tokens, max_num_seqs,
    kv_cache_memory, block_size, enable_prefix_caching, moe_backend, attention_backend, load_format, ...).
    """

    def __init__(self, model: str, **kwargs):
        self.args = EngineArgs(model=model, **kwargs)
        cfg = self.args.create_engine_config()
        self.engine = build_engine(cfg, show_progress=self.args.show_progress)
        from moe_serve.tokenizer import Tokenizer

        self.tokenizer = Tokenizer(cfg.model.path)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; returns RequestOutputs in the prompts' order.

        All prompts are validated before any runs, so one bad prompt raises ValueError and leaves
        the engine untouched.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        parsed = [self._prompt_ids(p) for p in prompts]
        for (_, ids), sp in zip(parsed, params):
            self.engine.validate(ids, sp)
            if sp.return_routed_experts and self.engine.feature("routed_experts") is None:
                raise ValueError(refusal(False))
            if sp.structured_outputs is not None:
                from moe_serve.structured_output.grammar import check_spec

                check_spec(sp.structured_outputs)
        outputs: list[RequestOutput] = []
        index: dict[str, tuple[int, int]] = {}
        for (text, ids), sp in zip(parsed, params):
            rid = str(next(self._ids))
            ro = RequestOutput(rid, text, ids)
            for i in range(sp.n):
                cid = f"{rid}-{i}"
                ro.outputs.append(CompletionOutput(i, "", [], 0.0 if sp.logprobs is not None else None,
                                                   [] if sp.logprobs is not None else None))
                index[cid] = (len(outputs), i)
                cp = child_params(sp, i)
                self.output_processor.add_request(cid, ids, cp)
                rejected = self.engine.add_request(NewRequest(cid, ids, cp))
                if rejected is not None:
                    raise ValueError(rejected.stop_reason)
            outputs.append(ro)
        bar = tqdm(total=len(index), desc="Generating", disable=not use_tqdm)
        rows: dict[str, RoutedExperts] = {}  # return_routed_experts: each sequence's rows so far
        while self.engine.has_unfinished():
            outs, stopped = self.output_processor.process(self.engine.step())
            self.engine.abort_requests(stopped)  # stop strings: free their blocks before the next step
            for eo in outs:
                oi, ci = index[eo.request_id]
                co = outputs[oi].outputs[ci]
                co.token_ids.extend(eo.new_token_ids)
                co.text += eo.new_text
                outputs[oi].num_cached_tokens = eo.num_cached_tokens
                if eo.logprobs is not None:
                    for lp in eo.logprobs:
                        co.logprobs.append(self._logprob_dict(lp))
                        co.cumulative_logprob += lp.logprob
                if eo.prompt_logprobs is not None and outputs[oi].prompt_logprobs is None:  # every sample has them
                    outputs[oi].prompt_logprobs = [None] + [self._logprob_dict(lp) for lp in eo.prompt_logprobs]
                if eo.routed_experts is not None:
                    rows.setdefault(eo.request_id, RoutedExperts()).add(eo.routed_experts)
                if eo.finished:
                    co.finish_reason, co.stop_reason = eo.finish_reason, eo.stop_reason
                    if eo.request_id in rows:
                        co.routed_experts = rows.pop(eo.request_id).as_array()
                    bar.update(1)
        bar.close()
        self.engine.features.idle()  # the call's last decode steps: into the speed-of-light figures
        for ro in outputs:
            ro.finished = all(c.finish_reason is not None for c in ro.outputs)
        return outputs

    def _logprob_dict(self, lp) -> dict:
        """{token id: Logprob} of one position: its top tokens (ranks 1, 2, ...) and the token itself."""
        d = {tid: Logprob(v, i + 1, self.tokenizer.decode([tid], False)) for i, (tid, v) in enumerate(lp.top)}
        rank = lp.rank if lp.rank is not None else (d[lp.token_id].rank if lp.token_id in d else None)
        d[lp.token_id] = Logprob(lp.logprob, rank, self.tokenizer.decode([lp.token_id], False))
        return d
