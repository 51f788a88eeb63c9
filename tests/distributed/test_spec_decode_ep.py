"""Speculative decoding under expert parallelism, n-gram drafts and the checkpoint's MTP layer:
ranks whose pieces carry drafts and ranks that decode one token, or nothing, agree on every step's
shape (the all-reduced token count; no decode padding while any rank verifies drafts), with
overlap's micro-batch split too; the MTP layer's MoE block runs its passes on every rank in every
step (an idle rank's are empty). Greedy text through HTTP stays the single-process plain engine's."""
from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from tests.distributed.jobs import TorchrunJob
from tests.distributed.test_launcher import ARGS, PROMPTS, _complete_all, expected_texts

SPEC = {"ngram": ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'],
        "mtp": ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']}
LOOPY = PROMPTS + [[7, 8, 9] * 6, [300, 301, 302, 303] * 4]


@pytest.mark.parametrize("method,arch", [("ngram", "deepseek_v3"), ("mtp", "deepseek_v3_mtp_copy"),
                                         ("mtp", "deepseek_v4_mtp_copy")])
def test_ep2_greedy_text_unchanged(checkpoints, extra_checkpoints, method, arch):
    """DeepSeek-V3 (MLA) and DeepSeek-V4, two ranks. N-gram: overlap's micro-batches on (split at
    any size). MTP (the checkpoints whose MTP layer drafts well, tests/checkpoints.py): steps padded
    as where graphs are captured, so verify steps of 3 tokens per sequence pad to a shape both
    ranks agree on (the idle rank's empty steps too), and the MTP passes run on both."""
    path = checkpoints[arch] if arch in checkpoints else extra_checkpoints[arch]
    extra = ["--enable-overlap", "--overlap-min-tokens", "1"] if method == "ngram" else ["--pad-decode"]
    want = expected_texts(path, LOOPY, 24)
    job = TorchrunJob(2, ["--model", path, *ARGS, *SPEC[method], *extra])
    try:
        assert asyncio.run(_complete_all(job.url, LOOPY[:1], 24)) == want[:1]  # the other rank idles
        assert asyncio.run(_complete_all(job.url, LOOPY, 24)) == want
        text = httpx.get(job.url + "/metrics", timeout=10).text
        metric = {name: float(v) for name, v in re.findall(r"^(moe_serve:spec_decode_\w+)\{[^}]*\} (\S+)$", text, re.M)}
        assert metric["moe_serve:spec_decode_num_draft_tokens_total"] >= \
            metric["moe_serve:spec_decode_num_accepted_tokens_total"] > 0, metric
        assert metric["moe_serve:spec_decode_num_drafts_total"] > 0
    finally:
        job.kill()
