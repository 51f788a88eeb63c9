"""The pieces of EngineCore.execute that read and write requests: which sampled tokens a step keeps
(speculative drafts verified), prompt logprobs kept for the first output, one request's output."""
from __future__ import annotations

from moe_serve.protocol import EngineCoreOutput, TokenLogprob
from moe_serve.spec_decode import accept


def accept_sampled(out, result, spec):
    """Each sampling piece's rows: one, or with k draft tokens k + 1 (spec_decode.accept verifies).
    Returns the tokens kept and their logprobs per request id, the requests that sampled (with
    their output count before the step), and each one's row of its last accepted token."""
    sampled, logprobs, sampled_reqs, last_accepted, i = {}, {}, [], {}, 0
    for s in out.scheduled:
        if not s.samples:
            continue
        k = len(s.draft_ids)
        rows = result.token_ids[i:i + k + 1]
        keep = accept(rows, s.draft_ids) if k else rows
        sampled[s.request.request_id] = keep
        logprobs[s.request.request_id] = result.logprobs[i:i + len(keep)]
        sampled_reqs.append((s.request, s.request.num_output_tokens))
        last_accepted[s.request.request_id] = i + len(keep) - 1
        i += k + 1
        if k:
            spec.record(k, len(keep) - 1)
    return sampled, logprobs, sampled_reqs, last_accepted


def keep_prompt_logprobs(out, result) -> None:
    """The step's prompt logprobs onto their requests, sent with each one's first token. Before the
    scheduler's update: a request that ends in this step sends them now."""
    for s in out.scheduled:
        lps = result.prompt_logprobs.get(s.request.request_id)
        if lps:
            s.request.pending_prompt_logprobs += lps
            s.request.num_prompt_logprobs += len(lps)


def request_output(r, new: list[int], lps: list, before: int, now: float) -> EngineCoreOutput:
    """One request's output of a step: its new tokens (with logprobs), its finish, and with its
    first token the prompt's logprobs."""
    if r.first_token_time is None:
        r.first_token_time = now
    fin = r.is_finished
    prompt_lps = None
    if r.params.prompt_logprobs is not None and before == 0:  # its first token: the prompt's entries
        prompt_lps, r.pending_prompt_logprobs = r.pending_prompt_logprobs, []
    return EngineCoreOutput(
        r.request_id, new, fin, r.status.value if fin else None, r.stop_reason if fin else None,
        [TokenLogprob(t, lp[0], lp[1]) for t, lp in zip(new, lps)] if lps and lps[0] else None,
        r.num_cached_prompt_tokens, prompt_logprobs=prompt_lps)

