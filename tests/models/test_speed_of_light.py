"""The decode speed of light (moe_serve/speed_of_light.py): the bytes the engine counts for its
decode steps, against a count made by hand from the checkpoint's files, its config and
transformers' own routing of the same tokens; and the fraction it reports."""
import json
import os
import random

import time

import pytest
import torch
from safetensors.torch import load_file

from moe_serve import LLM, SamplingParams

N_OUT = 6  # tokens per request: the first from the prefill step, then N_OUT - 1 decode steps


def by_hand(path: str, seqs: list[list[int]], prompt_lens: list[int]) -> int:
    """Bytes of every decode step of `seqs` (prompt + generated tokens, all prefilled in one step
    and decoded together), from the checkpoint alone: weights outside the experts (the untied input
    embedding is gathered, not read), the distinct experts transformers routes each step's tokens
    to per MoE layer, and K/V of the tokens each layer's query sees (a sliding layer its window)."""
    from transformers import AutoModelForCausalLM

    cfg = json.load(open(os.path.join(path, "config.json")))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in tensors.values())
    non_expert = sum(t.numel() * 4 for k, t in tensors.items()
                     if ".mlp.experts." not in k and k != "model.embed_tokens.weight")
    E = cfg.get("num_experts") or cfg["num_local_experts"]
    per_expert: dict[int, int] = {}  # layer index -> bytes of one expert (weights and biases)
    for k, t in tensors.items():
        if ".mlp.experts." in k:
            layer = int(k.split(".")[2])
            assert t.shape[0] == E
            per_expert[layer] = per_expert.get(layer, 0) + t[0].numel() * 4
    moe_layers = sorted(per_expert)
    kv_token = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4  # K and V of one token, one layer
    kinds = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    routes = []  # per sequence: per MoE layer, (T, top_k) expert ids
    with torch.no_grad():
        for s in seqs:
            out = hf(torch.tensor([s[:-1]]), output_router_logits=True)
            logits = [r for r in out.router_logits if r.shape[-1] == E]
            assert len(logits) == len(moe_layers)
            routes.append([r.reshape(len(s) - 1, E).topk(cfg["num_experts_per_tok"], -1).indices for r in logits])
    total = 0
    for j in range(1, N_OUT):  # decode step j: each sequence's token at position P + j - 1
        total += non_expert
        for li, layer in enumerate(moe_layers):
            hit = set()
            for b, p in enumerate(prompt_lens):
                hit |= set(routes[b][li][p + j - 1].tolist())
            total += len(hit) * per_expert[layer]
        for p in prompt_lens:
            n = p + j  # tokens cached once this step wrote its own
            total += sum((min(n, window) if kind == "sliding_attention" else n) * kv_token for kind in kinds)
    return total


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_decode_bytes_match_a_count_by_hand(arch, checkpoints, extra_checkpoints):
    path = checkpoints[arch] if arch in checkpoints else extra_checkpoints[arch]
    llm = LLM(path, dtype="float32", num_kv_blocks=64, speed_of_light_window=1e9, show_progress=False)
    meter = llm.engine.meter
    rng = random.Random(3)
    for batch in (1, 8):
        prompts = [[rng.randrange(10, 500) for _ in range(rng.randrange(4, 20))] for _ in range(batch)]
        before = (meter.total_bytes, meter.total_steps, meter.total_seconds)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=N_OUT, temperature=0, ignore_eos=True), use_tqdm=False)
        steps = meter.total_steps - before[1]
        counted = meter.total_bytes - before[0]
        seconds = meter.total_seconds - before[2]
        assert steps == N_OUT - 1, f"batch {batch}: {steps} decode steps metered"
        seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
        assert counted == by_hand(path, seqs, [len(p) for p in prompts]), f"batch {batch}"
        # The gauge: the window's bytes at the bandwidth, over the window's time.
        assert meter.fraction == pytest.approx(counted / meter.bandwidth / seconds, rel=1e-9)
        assert llm.engine.stats().decode_sol_fraction == meter.fraction > 0


def test_the_window_counts_the_whole_step_loop(checkpoints, monkeypatch):
    """A decode step's seconds run from the end of the step before to the end of its own: work the
    engine does outside the forward (here the scheduler's update, slowed down) counts, as it does
    for the clients; an idle spell between two calls does not."""
    import time

    llm = LLM(checkpoints["qwen3_moe"], dtype="float32", num_kv_blocks=64, speed_of_light_window=1e9,
              show_progress=False)
    meter, delay = llm.engine.meter, 0.05
    update = llm.engine.scheduler.update

    def slow_update(*args, **kwargs):
        time.sleep(delay)
        return update(*args, **kwargs)

    monkeypatch.setattr(llm.engine.scheduler, "update", slow_update)
    sp = SamplingParams(max_tokens=N_OUT, temperature=0, ignore_eos=True)
    for _ in range(2):
        before = (meter.total_steps, meter.total_seconds)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        steps, seconds = meter.total_steps - before[0], meter.total_seconds - before[1]
        assert steps == N_OUT - 1
        # Each decode step's turn holds one slowed update (of the step before it); the prefill
        # step's own time is not a decode step's, so the decode steps' seconds stay below the wall.
        assert steps * delay <= seconds < wall
        time.sleep(2 * delay)  # idle between the calls: the next call's first step does not count it


def test_the_ceiling_is_a_read_stream_past_the_last_level_cache():
    import subprocess

    from moe_serve.speed_of_light import last_level_cache_bytes, measure_bandwidth, stream_bytes

    sizes = []  # the cache sizes the C library reports (cpuid), where it reports them
    for line in subprocess.run(["getconf", "-a"], capture_output=True, text=True).stdout.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("LEVEL") and name.endswith("CACHE_SIZE") and value.strip().isdigit():
            sizes.append(int(value.strip()))
    llc = last_level_cache_bytes("cpu")
    assert llc is None or llc >= max(sizes, default=0)
    import psutil

    # Twice the largest cache (the C library's figure too), unless an eighth of the free memory is less.
    cap = max(256 << 20, psutil.virtual_memory().available // 8)
    assert stream_bytes("cpu") >= min(max(256 << 20, 2 * max([llc or 0, *sizes])), cap)
    assert measure_bandwidth("cpu", 64 << 20, repeats=1) > 1e8


def test_bandwidth_override_and_refusal(checkpoints):
    from moe_serve.speed_of_light import device_bandwidth

    assert device_bandwidth("cpu", 123.0) == (123e9, "--memory-bandwidth")
    with pytest.raises(ValueError, match="memory_bandwidth"):
        LLM(checkpoints["qwen3_moe"], dtype="float32", memory_bandwidth=0.0, show_progress=False)
    bw, source = device_bandwidth("cpu")
    assert bw > 1e8 and source.startswith("read stream measured at")


def test_measured_bandwidth_kept_for_the_machine(tmp_path, monkeypatch):
    """The first process measures and keeps the figure under the machine's key; another process
    (this one with its own figure forgotten) reuses it and says when it was measured; a figure older
    than a day, one measured on a busy machine (once the machine is quiet), another machine's, or a
    corrupt file is measured again (and a busy machine's low figure is replaced by the new, higher
    one); a start on a busy machine reuses a busy machine's figure rather than measure under load."""
    import json

    from moe_serve import speed_of_light as sol

    monkeypatch.setenv("MOE_SERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(sol, "stream_bytes", lambda device="cpu": 32 << 20)
    monkeypatch.setattr(sol, "_MEASURED", {})
    monkeypatch.setattr(sol, "_machine_quiet", lambda: True)
    bw, source = sol.device_bandwidth("cpu")
    assert source == "read stream measured at start-up" and bw > 1e8
    kept = json.loads((tmp_path / "read_bandwidth.json").read_text())
    assert list(kept) == [sol._machine_key(torch.device("cpu"))] and kept[list(kept)[0]]["bytes_per_s"] == bw
    monkeypatch.setattr(sol, "_MEASURED", {})
    assert sol.device_bandwidth("cpu") == (bw, f"read stream measured at "
                                           f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(kept[list(kept)[0]]['at']))}"
                                           f" ({tmp_path / 'read_bandwidth.json'})")
    key = list(kept)[0]
    for stale in ("not json", {key: {"bytes_per_s": 1.0, "at": time.time() - 2 * sol.MEASURE_KEEP_S, "quiet": True}},
                  {key: {"bytes_per_s": 1.0, "at": time.time(), "quiet": False}},  # measured on a busy machine
                  {"cpu|another machine": {"bytes_per_s": 1.0, "at": time.time()}}):
        (tmp_path / "read_bandwidth.json").write_text(stale if isinstance(stale, str) else json.dumps(stale))
        monkeypatch.setattr(sol, "_MEASURED", {})
        again, source = sol.device_bandwidth("cpu")
        assert source == "read stream measured at start-up" and again > 1e8
    # The new figure joins another machine's, it does not replace the file's other entries.
    assert set(json.loads((tmp_path / "read_bandwidth.json").read_text())) == {key, "cpu|another machine"}
    # Busy now: a fresh figure from a busy moment is reused (a stream measured now would be contended
    # too); a stale one is still measured again.
    monkeypatch.setattr(sol, "_machine_quiet", lambda: False)
    busy = {key: {"bytes_per_s": 2.5e9, "at": time.time(), "quiet": False}}
    (tmp_path / "read_bandwidth.json").write_text(json.dumps(busy))
    monkeypatch.setattr(sol, "_MEASURED", {})
    bw, source = sol.device_bandwidth("cpu")
    assert bw == 2.5e9 and source.startswith("read stream measured at "), source
    busy[key]["at"] = time.time() - 2 * sol.MEASURE_KEEP_S
    (tmp_path / "read_bandwidth.json").write_text(json.dumps(busy))
    monkeypatch.setattr(sol, "_MEASURED", {})
    assert sol.device_bandwidth("cpu")[1] == "read stream measured at start-up"


# --- bytes per cache kind and per expert slot, by hand from each checkpoint's config ---------------
LENS = [1, 2, 3, 7, 8, 9, 15, 16, 17, 40]  # cached tokens of a sequence at a decode step (new one included)


def _cache_by_hand(cfg: dict, elem: int, n: int) -> int:
    """Bytes one decode query of a sequence holding n tokens reads of every layer's cache."""
    t = cfg["model_type"]
    L = cfg["num_hidden_layers"]
    if t in ("deepseek_v3", "deepseek_v32"):
        latent = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * elem  # MLA: the latent and its rope part
        if t == "deepseek_v3":
            return L * n * latent
        # DSA: the top-k tokens' latents, and every token's indexer key
        return L * (min(n, cfg["index_topk"]) * latent + n * cfg["index_head_dim"] * elem)
    if t == "qwen3_next":
        kd, vd = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        conv = (2 * hk * kd + hv * vd) * (cfg["linear_conv_kernel_dim"] - 1)  # the short convolution's last inputs
        state = (conv + hv * kd * vd) * 4  # and the delta rule's state: float32, read then written back
        full = L // cfg["full_attention_interval"]
        kv = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * elem
        return (L - full) * 2 * state + full * n * kv
    if t == "deepseek_v4":
        hd, I, W, k = cfg["head_dim"], cfg["index_head_dim"], cfg["sliding_window"], cfg["index_topk"]
        total = 0
        for kind in cfg["layer_types"]:
            total += min(n, W) * hd * elem  # the window's shared K = V
            if kind == "sliding_attention":
                continue
            m = cfg["compress_rates"][kind]
            entries, finishes = n // m, n % m == 0
            if kind == "heavily_compressed_attention":  # every entry; a finished group pools m raw kv + gate rows
                total += entries * hd * elem + (finishes and min(n, m) * 2 * hd * elem)
            else:  # CSA: top-k entries, every index key; groups overlap, so pooling reads 2m rows (and the indexer's)
                total += (min(entries, k) * hd * elem + entries * I * elem
                          + (finishes and min(n, 2 * m) * 2 * (hd + I) * elem))
        return total
    kv = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * elem
    kinds = cfg.get("layer_types") or ["full_attention"] * L
    return sum((min(n, cfg["sliding_window"]) if k == "sliding_attention" else n) * kv for k in kinds)


def _slot_by_hand(cfg: dict, elem: int, quant: str | None) -> int:
    """Bytes of one routed expert: its three projections (gate and up fused or not) as stored."""
    D = cfg["hidden_size"]
    F = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    if quant == "fp8":  # one byte a weight, a float32 scale per 128 x 128 block of each matrix
        blocks = 2 * (-(-F // 128)) * (-(-D // 128)) + (-(-D // 128)) * (-(-F // 128))
        return 3 * D * F + 4 * blocks
    if quant == "mxfp4":  # two weights a byte, a one-byte scale per 32 weights; biases as served
        return (3 * D * F) // 2 + (3 * D * F) // 32 + (2 * F + D) * elem
    return 3 * D * F * elem


@pytest.mark.parametrize("arch, kwargs, quant", [
    ("deepseek_v3", {}, None),  # MLA
    ("deepseek_v3", {"quantization": "fp8"}, "fp8"),
    ("deepseek_v32", {}, None),  # DSA
    ("qwen3_next", {}, None),  # linear-attention state beside full attention
    ("deepseek_v4", {}, None),  # V4's window rows and compressed entries
    ("gpt_oss_mxfp4", {}, "mxfp4"),
    ("qwen3_moe", {"dtype": "bfloat16"}, None),
])
def test_cache_and_slot_bytes_by_hand(arch, kwargs, quant, checkpoints, extra_checkpoints):
    path = checkpoints[arch] if arch in checkpoints else extra_checkpoints[arch]
    cfg = json.load(open(os.path.join(path, "config.json")))
    kwargs = {"dtype": "float32", **kwargs}
    elem = 2 if kwargs["dtype"] == "bfloat16" else 4
    llm = LLM(path, num_kv_blocks=64, speed_of_light_window=1e9, show_progress=False, **kwargs)
    counted = llm.engine.meter.bytes
    want = _slot_by_hand(cfg, elem, quant)
    assert counted.slot_bytes and all(b == want for b in counted.slot_bytes), (counted.slot_bytes, want)
    # Caches hold activations: a bf16 model whose layers all run in our CPU kernels keeps float32
    # ones (EngineConfig.activation_dtype), else the model's dtype.
    cache_elem = llm.engine.cfg.activation_dtype.itemsize
    assert cache_elem in (elem, 4)
    for n in LENS:
        assert counted.cache_bytes([n]) == _cache_by_hand(cfg, cache_elem, n), n
    assert counted.cache_bytes(LENS) == sum(_cache_by_hand(cfg, cache_elem, n) for n in LENS)
