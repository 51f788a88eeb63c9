"""Decode speed of light: the bytes each decode step must read, the device's memory bandwidth, and
the share of that ceiling the engine reaches while serving.

Decode of a mixture-of-experts model is memory-bound: a step reads every weight it uses once,
whatever the batch, plus the cache of every sequence. The least time a step can take is its bytes
over the memory bandwidth:

    step bytes = non-expert weights                      (attention, norms, routers, shared experts,
                                                          dense layers, the LM head; the input
                                                          embedding only when tied to the head)
               + experts hit * bytes per expert slot     (the distinct expert slots of this rank that
                                                          received a token in the step, per MoE
                                                          layer: the batch's real routing)
               + cache bytes of every sequence           (full attention: every cached token;
                                                          sliding / chunked: the tokens the query
                                                          sees; sparse (DSA): the top-k tokens plus
                                                          every indexer key; linear attention: the
                                                          state, read and written back)

The MoE layers mark the slots they compute into a per-step (layers, slots) tensor on the device,
inside any captured graph and without a host sync (`DecodeMeter.hits_LS`); the engine folds it into
a window total after each decode-only step and reads it back once per window. The achieved fraction
of a window is (window bytes / bandwidth) / window seconds, per rank: the gauge
`moe_serve:decode_speed_of_light_fraction`. Padded rows of a graph-replayed step route like real
ones, so their experts count (the step does read them).

A decode step's seconds are the whole turn of the step loop, not the forward alone: from the end
of the step before (of any kind, an empty lockstep one included) to the end of this one, so
scheduling, sampling, outputs and the ranks' agreement count, as they do for the clients. An idle
turn breaks the chain (`pause`): the next step counts from its own start.

Bandwidth: `--memory-bandwidth` (GB/s) when given; on a GPU the datasheet HBM figure of a known
model (`HBM_GBPS`); else a read-only stream measured at start-up (`measure_bandwidth`: a sum over a
buffer larger than the last-level cache, best of a few), as on a CPU. The stream reads about four
times the buffer (a second or more on a CPU with a large cache), so its figure is kept for a day in
`$MOE_SERVE_CACHE/read_bandwidth.json` under what it depends on (the device or CPU model, the
last-level cache, the memory, the threads): the engines started after the first on the same
machine reuse it, and the log says when it was measured. A figure measured while the machine was
busy (load average at or above the cores) is measured again by the first start that finds the
machine quiet; a start on a busy machine reuses it (a stream measured then would be contended
too), and the file keeps the best figure seen. Decode reads its weights and
caches and writes little, so the ceiling is what the memory can deliver to reads; a copy's
(read + write) / time is lower on most machines and would overstate the achieved fraction.
"""
from __future__ import annotations

import dataclasses
import glob
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

log = logging.getLogger("moe_serve.speed_of_light")

# Peak HBM bandwidth in GB/s by device name (substrings, the most specific first).
HBM_GBPS: list[tuple[str, float]] = [
    ("GB300", 8000.0), ("B300", 8000.0), ("GB200", 8000.0), ("B200", 8000.0),
    ("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("H800", 3350.0),
    ("H20", 4000.0), ("A100-SXM4-80GB", 2039.0), ("A100 80GB", 1935.0), ("A100", 1555.0),
    ("L40S", 864.0), ("L4", 300.0), ("MI355X", 8000.0), ("MI325X", 6000.0), ("MI300X", 5300.0),
]


MIN_STREAM_BYTES = 256 << 20  # the read stream's least buffer, whatever the cache


# glibc's sysconf numbers of _SC_LEVEL2_CACHE_SIZE, _SC_LEVEL3_CACHE_SIZE and _SC_LEVEL4_CACHE_SIZE
# (bits/confname.h): Python's os.sysconf knows no names for them.
_GLIBC_SC_CACHE_SIZES = (191, 194, 197)


def _libc_cache_sizes() -> list[int]:
    """The L2, L3 and L4 sizes glibc reports (from cpuid: `getconf -a`'s LEVEL*_CACHE_SIZE), those it
    knows; none off glibc."""
    import ctypes

    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return []
    except (ValueError, OSError):  # not glibc
        return []
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return []
    libc.sysconf.restype = ctypes.c_long
    libc.sysconf.argtypes = (ctypes.c_int,)
    return [size for size in (libc.sysconf(n) for n in _GLIBC_SC_CACHE_SIZES) if size > 0]


def last_level_cache_bytes(device: torch.device | str = "cpu") -> int | None:
    """The largest cache between this device's cores and its memory (None when unknown): a GPU's
    L2; a CPU's largest as Linux lists it for CPU 0 (sysfs) or the C library reports it (cpuid),
    whichever is larger (the two disagree on some virtual machines and chiplet CPUs)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)) or None
    best = max(_libc_cache_sizes(), default=0)
    for entry in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(entry, "type")) as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(os.path.join(entry, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        try:
            size = int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
        except ValueError:
            continue
        best = max(best, size)
    return best or None


def stream_bytes(device: torch.device | str = "cpu") -> int:
    """The read stream's buffer: twice the last-level cache, at least MIN_STREAM_BYTES, and on a
    CPU at most an eighth of the memory available now."""
    device = torch.device(device)
    want = max(MIN_STREAM_BYTES, 2 * (last_level_cache_bytes(device) or 0))
    if device.type == "cpu":
        import psutil

        want = min(want, max(MIN_STREAM_BYTES, psutil.virtual_memory().available // 8))
    return want


def measure_bandwidth(device: torch.device | str, nbytes: int | None = None, repeats: int = 3) -> float:
    """Read bandwidth in bytes/s: a sum over an `nbytes` float32 buffer (default `stream_bytes`:
    larger than the last-level cache, so the reads come from memory), best of `repeats`, with the
    threads this process computes with. A sum reads every byte once and writes nothing."""
    device = torch.device(device)
    nbytes = nbytes or stream_bytes(device)
    buf = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    buf.fill_(1.0)  # first touch: page faults and allocation are not bandwidth
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        sync()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


_MEASURED: dict[str, tuple[float, str]] = {}  # per device, once per process (engines after the first reuse it)
MEASURE_KEEP_S = 86400.0  # how long another process on this machine reuses a measured figure


def device_bandwidth(device: torch.device | str, override_gbps: float | None = None) -> tuple[float, str]:
    """(bytes/s, where the figure comes from) for the memory the decode step reads."""
    if override_gbps is not None:
        if not override_gbps > 0:
            raise ValueError(f"--memory-bandwidth={override_gbps} GB/s must be positive")
        return override_gbps * 1e9, "--memory-bandwidth"
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, gbps in HBM_GBPS:
            if key in name:
                return gbps * 1e9, f"{name} datasheet"
        bw, when = _measured(device)
        return bw, f"{name}: read stream {when} (not in the table)"
    bw, when = _measured(device)
    return bw, f"read stream {when}"


def _measured(device: torch.device) -> tuple[float, str]:
    """(bytes/s, when it was measured): this process's figure, else this machine's within
    MEASURE_KEEP_S (the cache file), else a new measurement, written there."""
    key = str(device)
    if key not in _MEASURED:
        import json
        from pathlib import Path

        root = os.environ.get("MOE_SERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "moe-serve")
        path = Path(root) / "read_bandwidth.json"
        machine = _machine_key(device)
        try:
            with open(path) as f:
                known = json.load(f)
        except (OSError, ValueError):
            known = {}
        entry = known.get(machine) if isinstance(known, dict) else None
        fresh = (isinstance(entry, dict) and isinstance(entry.get("bytes_per_s"), (int, float))
                 and entry["bytes_per_s"] > 0 and 0 <= time.time() - entry.get("at", 0) < MEASURE_KEEP_S)
        quiet = _machine_quiet()
        if fresh and (entry.get("quiet") is True or not quiet):
            at = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry["at"]))
            _MEASURED[key] = (float(entry["bytes_per_s"]), f"measured at {at} ({path})")
        else:
            # Other work on the machine only lowers a read stream's figure: one measured while the
            # machine was busy is measured again once it is quiet, and the figure kept is the best seen.
            bw = measure_bandwidth(device)
            _MEASURED[key] = (bw, "measured at start-up")
            known = known if isinstance(known, dict) else {}
            if fresh and entry["bytes_per_s"] >= bw:
                known[machine] = dict(entry, quiet=bool(entry.get("quiet")) or quiet)
            else:
                known[machine] = {"bytes_per_s": bw, "at": time.time(), "quiet": quiet}
            try:  # written whole, then renamed: an engine starting beside this one reads all or nothing
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(known, indent=1))
                os.replace(tmp, path)
            except OSError as e:
                log.warning("speed of light: could not keep the measured bandwidth in %s: %s", path, e)
    return _MEASURED[key]


def _machine_quiet() -> bool:
    """Whether the machine looks idle enough for a read stream to measure the memory, not the
    contention: a 1-minute load average below the cores."""
    try:
        return os.getloadavg()[0] < (os.cpu_count() or 1)
    except OSError:
        return False


def _machine_key(device: torch.device) -> str:
    """What a measured read bandwidth depends on: the device (a GPU's name), or the CPU's model, its
    last-level cache, the machine's memory and the threads the stream ran with."""
    if device.type == "cuda":
        return f"cuda|{torch.cuda.get_device_name(device)}"
    import platform

    import psutil

    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return (f"{device.type}|{model}|llc={last_level_cache_bytes(device)}|mem={psutil.virtual_memory().total}"
            f"|threads={torch.get_num_threads()}")


@dataclass(frozen=True)
class CacheRead:
    """What one cache-owning layer reads per decode query of a sequence holding `n` tokens (the
    new one included)."""

    kind: str  # "full" | "sliding" | "chunked" | "state" | "sparse"
    bytes_per_token: int = 0  # paged layers: K and V (or the latent) of one token (one entry when group > 1)
    tokens: int = 0  # sliding: the window; chunked: the chunk; sparse: top-k (entries when group > 1)
    index_bytes_per_token: int = 0  # sparse: the indexer key of one token or entry (every one is scored)
    state_bytes: int = 0  # state layers: one sequence's state
    # Compressed caches (DeepSeek-V4): one entry per finished group of `group` tokens; the step whose
    # token finishes a group also reads the raw rows it pools, pool_bytes_per_token for each of the
    # last pool_span tokens.
    group: int = 1
    pool_span: int = 0
    pool_bytes_per_token: int = 0

    def bytes_for(self, n: int) -> int:
        if self.kind == "state":
            return 2 * self.state_bytes  # read, then written back in place
        if self.kind == "sliding":
            return min(n, self.tokens) * self.bytes_per_token
        if self.kind == "chunked":
            return ((n - 1) % self.tokens + 1) * self.bytes_per_token
        entries = n // self.group
        pooled = min(n, self.pool_span) * self.pool_bytes_per_token if n % self.group == 0 else 0
        if self.kind == "sparse":
            return min(entries, self.tokens) * self.bytes_per_token + entries * self.index_bytes_per_token + pooled
        return entries * self.bytes_per_token + pooled

    @property
    def per_token(self) -> bool:
        """Full, one entry per token, nothing pooled: bytes_per_token times the tokens."""
        return self.kind == "full" and self.group == 1 and not self.pool_bytes_per_token


def _per_token(t: torch.Tensor | None) -> int:
    """Bytes per cached token of a paged cache tensor (blocks, block_size, ...)."""
    return 0 if t is None else t.numel() * t.element_size() // (t.shape[0] * t.shape[1])


def _in_cache_bytes(reads: CacheRead, rows) -> CacheRead:
    """A PagedRows' reads, which its owner counts in its compute dtype (`rows.dtype`), in the bytes
    of the cache bound to it (an FP8 cache: one per value)."""
    cache = rows.caches[0] if rows.caches else None
    built = torch.empty((), dtype=rows.dtype).element_size()
    if cache is None or cache.element_size() == built:
        return reads
    r = cache.element_size() / built
    return dataclasses.replace(reads, bytes_per_token=int(reads.bytes_per_token * r),
                               index_bytes_per_token=int(reads.index_bytes_per_token * r),
                               pool_bytes_per_token=int(reads.pool_bytes_per_token * r))


def cache_read_of(layer) -> CacheRead:
    from attention.state import StateCache

    if isinstance(layer, StateCache):
        return CacheRead("state", state_bytes=layer.slot_bytes())
    if hasattr(layer, "reads"):  # attention/layer.py PagedRows: its owner says what a query reads
        return _in_cache_bytes(layer.reads, layer) if layer.reads else CacheRead("full")
    if getattr(layer, "latent_cache", None) is not None:
        index = getattr(layer, "index_cache", None)
        topk = getattr(layer, "topk", None)
        if topk is not None:  # DSA: the latent of the top-k tokens; the keys of all (when it indexes)
            return CacheRead("sparse", _per_token(layer.latent_cache), topk, _per_token(index))
        return CacheRead("full", _per_token(layer.latent_cache))
    kind = layer.cache_kind
    return CacheRead(kind.kind, _per_token(layer.k_cache) + _per_token(layer.v_cache), kind.tokens)


@dataclass
class DecodeBytes:
    """What one decode step of this rank must read, from the built and bound model."""

    non_expert_bytes: int
    embedding_bytes: int  # the input embedding table: not counted (a step gathers a row per token)
    slot_bytes: list[int]  # per MoE layer: one local expert slot (weights, biases, scales)
    reads: list[CacheRead]

    @classmethod
    def of(cls, model, attn_layers: list) -> "DecodeBytes":
        moe_layers = sorted(_moe_layers(model), key=lambda m: m.layer_index)
        expert_ptrs: set[int] = set()
        slot_bytes = []
        for m in moe_layers:
            tensors = m.slot_tensors()
            expert_ptrs |= {t.data_ptr() for t in tensors.values()}
            n = len(m.experts.local_logical)
            slot_bytes.append(sum(t.numel() * t.element_size() for t in tensors.values()) // max(n, 1))
        emb = model.model.embed_tokens.weight
        tied = model.lm_head.weight.data_ptr() == emb.data_ptr()
        seen: set[int] = set()
        non_expert = 0
        named = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers()
                                                  if b.is_floating_point() or b.element_size() == 1]
        for name, t in named:
            if name.startswith("mtp."):
                continue
            p = t.data_ptr()
            if (p in seen or p in expert_ptrs or t.numel() == 0 or (p == emb.data_ptr() and not tied)
                    or name.rsplit(".", 1)[-1] in _POSITION_TABLES):
                continue
            seen.add(p)
            non_expert += t.numel() * t.element_size()
        drafts = _draft_module_ids(model)
        return cls(non_expert, 0 if tied else emb.numel() * emb.element_size(), slot_bytes,
                   [cache_read_of(layer) for layer in attn_layers if id(layer) not in drafts])

    def cache_bytes(self, context_lens: list[int]) -> int:
        """Cache bytes a decode step reads for sequences holding these many tokens (new one included).
        Full layers (most) in one product with the tokens in all; the others per sequence."""
        full = sum(r.bytes_per_token for r in self.reads if r.per_token)
        rest = [r for r in self.reads if not r.per_token]
        return full * sum(context_lens) + sum(r.bytes_for(n) for n in context_lens for r in rest)

    def step_bytes(self, slots_hit_per_layer: list[int], context_lens: list[int]) -> int:
        return (self.non_expert_bytes + sum(h * b for h, b in zip(slots_hit_per_layer, self.slot_bytes))
                + self.cache_bytes(context_lens))


# Position-indexed buffers (rotary frequencies): a step uses its positions' rows only.
_POSITION_TABLES = ("inv_freq",)


@dataclass
class Window:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    fixed_bytes: int = 0  # weights outside the experts, and caches: known on the host
    started: float = field(default_factory=time.monotonic)


class DecodeMeter:
    """Counts the bytes of this rank's decode-only steps and their time, window by window."""

    def __init__(self, model, attn_layers: list, moe_ctx, device, bandwidth: float, source: str,
                 window_s: float = 5.0, rank: int = 0):
        self.bytes = DecodeBytes.of(model, attn_layers)
        self.bandwidth, self.source, self.window_s, self.rank = bandwidth, source, window_s, rank
        L = len(self.bytes.slot_bytes)
        slots = max((len(m.experts.local_logical) for m in _moe_layers(model)), default=0)
        # Column 0 takes the ids of rows whose slot is elsewhere (-1) or padded out.
        self.hits_LS = torch.zeros(L, slots + 1, dtype=torch.int32, device=device) if L else None
        self._slot_bytes = (torch.tensor(self.bytes.slot_bytes, dtype=torch.int64, device=device)
                            if L else None)
        self._expert_bytes = torch.zeros((), dtype=torch.int64, device=device)
        # On the CPU the counts are read through numpy views of the same memory: a step's few tiny
        # torch ops cost more there (each about 10-40 us on caches the weights just streamed past).
        on_host = L > 0 and torch.device(device).type == "cpu"
        self._hits_np = self.hits_LS.numpy() if on_host else None
        self._slot_bytes_np = np.asarray(self.bytes.slot_bytes, dtype=np.int64) if on_host else None
        self._host_expert_bytes = 0
        moe_ctx.experts_hit_LS = self.hits_LS
        self.window = Window()
        self.fraction = 0.0  # the last closed window's
        self.last = {"bytes_per_step": 0.0, "tokens_per_s": 0.0, "seconds": 0.0}
        self.total_bytes = 0
        self.total_seconds = 0.0
        self.total_steps = 0
        self._turn_end: float | None = None  # when the step loop's last busy turn ended (None: idle since)

    def begin_step(self) -> None:
        """Before any step's forward: a step after an idle spell counts from here."""
        if self._turn_end is None:
            self._turn_end = time.perf_counter()
        if self._hits_np is not None:
            self._hits_np.fill(0)
        elif self.hits_LS is not None:
            self.hits_LS.zero_()

    def end_step(self, context_lens: list[int] | None) -> None:
        """After every step this rank runs (an empty lockstep one too): a decode-only step (its
        sequences' cache lengths, new token included) is counted, over the time since the step
        before ended; another kind only moves that mark."""
        now = time.perf_counter()
        seconds = now - (self._turn_end if self._turn_end is not None else now)
        self._turn_end = now
        if context_lens is not None:
            self._count_decode_step(context_lens, seconds)

    def pause(self) -> float | None:
        """An idle turn of the step loop: close the window (if it holds steps) and count the next
        step from its own start."""
        self._turn_end = None
        return self.close_window() if self.window.steps else None

    def _count_decode_step(self, context_lens: list[int], seconds: float) -> None:
        w = self.window
        if self._hits_np is not None:  # distinct slots hit per layer, weighted by slot bytes
            self._host_expert_bytes += int(np.count_nonzero(self._hits_np[:, 1:], axis=1) @ self._slot_bytes_np)
        elif self.hits_LS is not None:  # the same on the device, read back once a window
            self._expert_bytes += ((self.hits_LS[:, 1:] > 0).sum(1) * self._slot_bytes).sum()
        w.fixed_bytes += self.bytes.non_expert_bytes + self.bytes.cache_bytes(context_lens)
        w.steps += 1
        w.tokens += len(context_lens)
        w.seconds += seconds
        if time.monotonic() - w.started >= self.window_s:
            self.close_window()

    def close_window(self) -> float | None:
        """Fold the open window into the totals and the gauge (one read of the device counter)."""
        w = self.window
        if not w.steps:
            return None
        expert_bytes = int(self._expert_bytes.item()) + self._host_expert_bytes
        self._expert_bytes.zero_()
        self._host_expert_bytes = 0
        total = w.fixed_bytes + expert_bytes
        self.total_bytes += total
        self.total_seconds += w.seconds
        self.total_steps += w.steps
        self.fraction = total / self.bandwidth / w.seconds if w.seconds > 0 else 0.0
        self.last = {"bytes_per_step": total / w.steps, "tokens_per_s": w.tokens / w.seconds if w.seconds else 0.0,
                     "seconds": w.seconds}
        log.info("rank %d decode: %.1f tokens/s over %d steps, %.2f MB read per step, %.1f%% of speed of light "
                 "(%.1f GB/s, %s)", self.rank, self.last["tokens_per_s"], w.steps, self.last["bytes_per_step"] / 1e6,
                 100 * self.fraction, self.bandwidth / 1e9, self.source)
        self.window = Window()
        return self.fraction


def _moe_layers(model) -> list:
    from expert_parallel.runtime.layer import MoE

    skip = _draft_module_ids(model)
    return [m for m in model.modules() if isinstance(m, MoE) and id(m) not in skip]


def _draft_module_ids(model) -> set[int]:
    """The modules of a model's multi-token-prediction layers: not part of a one-token decode
    step (they run after it, when speculative decoding drafts with them)."""
    mtp = getattr(model, "mtp", None)
    return {id(m) for m in mtp.modules()} if mtp is not None else set()
