"""Speculative decoding's verify steps (every sequence its last token and K drafts: q = 1 + K tokens
each) are padded and captured as decode steps are (moe_serve/cuda_graph.py has the ladder, the
capture and the replay): their own ladder, one graph per size. `ModelRunner` reads what
`attach_verify_graphs` sets (`verify_q`, `verify_pad_sizes`, `verify_graphs`) when it pads a step.
A step of `build_engine`, right after the decode graphs (the same pool rules, the same agreement)."""
from __future__ import annotations

import logging

from torch import nn

from expert_parallel.runtime.layer import MoEContext
from moe_serve import cuda_graph
from moe_serve.config import EngineConfig
from moe_serve.input_batch import InputBatch
from moe_serve.runner.memory import KVCacheSize

# Logged under the runner's name, as the decode graphs are: operators and the launcher tests look for it.
log = logging.getLogger("moe_serve.model_runner")


def attach_verify_graphs(runner, kv: KVCacheSize, capture: bool) -> None:
    """The runner's verify ladder and graphs (`capture_verify_graphs` over its model and batch).
    Collective under expert parallelism where graphs are captured."""
    runner.verify_q, runner.verify_pad_sizes, runner.verify_graphs = \
        capture_verify_graphs(runner.model, runner.cfg, runner.moe_ctx, runner.batch, kv, capture)


def capture_verify_graphs(model: nn.Module, cfg: EngineConfig, moe_ctx: MoEContext, batch: InputBatch,
                          kv: KVCacheSize, capture: bool) -> tuple[int, list[int], cuda_graph.DecodeGraphs | None]:
    """Verify steps padded to their own ladder where graphs are captured (or pad_decode forces it),
    and one graph per size captured. Returns (q, ladder, graphs); (0, [], None) without speculative
    decoding, or where a block cannot hold q tokens (the padded rows sit in the scratch block).
    Steps with fewer drafts for some sequence, or mixed with prefill chunks, run eagerly."""
    gc, spec = cfg.graphs, cfg.speculative
    if cfg.device.type == "cpu":
        capture = False  # CPU recordings hold decode steps only (verify steps attend as prefills do)
    pad = capture if gc.pad_decode is None else gc.pad_decode
    if spec is None or not pad:
        return 0, [], None
    q = 1 + spec.num_speculative_tokens
    if q > cfg.cache.block_size:
        log.info("verify steps of %d tokens per sequence run eagerly: a cache block holds %d", q, cfg.cache.block_size)
        return 0, [], None
    sizes = cuda_graph.verify_capture_sizes(cfg.scheduler.max_num_seqs, gc.max_capture_size, q)
    if not capture:
        return q, sizes, None
    graphs = cuda_graph.DecodeGraphs(model, sizes, batch.max_blocks, cfg.cache.block_size, batch.max_model_len,
                                     kv.scratch_block, cfg.device, kv.group_scratch, kv.state_scratch, query_len=q)
    try:
        graphs.capture(cuda_graph.capture_agreement(moe_ctx.dispatcher))
    except Exception as e:  # noqa: BLE001 - as for decode graphs: verify steps stay eager
        log.warning("verify CUDA graph capture failed, running verify steps eagerly%s: %s: %s",
                    " (still padded: pad_decode)" if gc.pad_decode else " and unpadded", type(e).__name__,
                    str(e)[:300])
        return (q, sizes, None) if gc.pad_decode else (0, [], None)
    return q, sizes, graphs
