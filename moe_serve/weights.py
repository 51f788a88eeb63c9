"""Checkpoint loading: stream safetensors tensors into the model, one tensor at a time.

Names follow the Hugging Face checkpoint. Expert tensors go to the MoE layers' stacked weights,
in either layout found on disk: per expert (`...experts.{j}.gate_proj.weight`, Mixtral's w1/w2/w3)
or fused 3-D (`...experts.gate_up_proj` (E, 2F, D) and `...experts.down_proj` (E, D, F), as
transformers 5 writes them). A rank reads only the experts it holds: per-expert tensors of other
experts are never read, and fused tensors are sliced on disk (`get_slice`) to the rows it holds.
"""
from __future__ import annotations

import json
import logging
import os
import re

import torch
from torch import nn
from tqdm import tqdm

from expert_parallel.runtime.layer import GroupedExperts

log = logging.getLogger("moe_serve.weights")

_PER_EXPERT = re.compile(r"^(?P<prefix>.*)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
_FUSED = re.compile(r"^(?P<prefix>.*)\.experts\.(?P<proj>gate_up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# FP8 KV cache scales, by the names vLLM's loaders take (per-tensor, one float each): the attention
# module's `self_attn.k_scale` (`self_attn.attn.k_scale`), ModelOpt's `k_proj.k_scale`, a fused
# `qkv_proj.k_scale`, compressed-tensors' `k_proj.output_scale`, and the older one `kv_scale` for both.
_KV_SCALE = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.self_attn\.(?:attn\.|(?P<proj>[kv]_proj|qkv_proj)\.)?"
                       r"(?P<which>k_scale|v_scale|kv_scale|output_scale)$")


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model={path!r}: no *.safetensors files found")
    return [os.path.join(path, f) for f in files]


def load_weights(model: nn.Module, path: str, dtype: torch.dtype, show_progress: bool = True,
                 quantization: str | None = None) -> None:
    """Fill every parameter of `model` from the safetensors checkpoint at `path` (a GGUF file loads
    through moe_serve/quantization/gguf_load.py, which uses this module's loader); errors name the
    tensor. Block-FP8 checkpoints load as FP8 (moe_serve/quantization/fp8.py); `quantization="fp8"`
    quantizes an unquantized checkpoint to block FP8 while it loads."""
    from safetensors import safe_open

    fp8_cfg = _checkpoint_fp8_config(model, path, quantization)
    experts = {name[: -len(".experts")]: m for name, m in model.named_modules()
               if isinstance(m, GroupedExperts) and name.endswith(".experts")}
    names_by_file = []
    for fp in checkpoint_files(path):
        with safe_open(fp, framework="pt") as f:
            names_by_file.append((fp, list(f.keys())))
    fp8_cfg = _make_fp8_storage(model, fp8_cfg, quantization, names_by_file, experts)
    packed = _make_packed_storage(model, names_by_file, experts)
    loader = _TensorLoader(model, dtype, experts, fp8_cfg, packed)
    bar = tqdm(total=sum(len(n) for _, n in names_by_file), desc="Loading weights", unit="tensor",
               disable=not show_progress)
    for fp, names in names_by_file:
        with safe_open(fp, framework="pt") as f:
            for raw in names:
                bar.update(1)
                loader.load(raw, f, fp)
    bar.close()
    loader.finish(path)


def tensor_loader(model: nn.Module, dtype: torch.dtype, path: str, quantization: str | None = None) -> "_TensorLoader":
    """A loader of checkpoint-named tensors into a model that was loaded already (its FP8 storage
    made): `load(name, file, where)` one tensor, `finish(path)` after a whole checkpoint. For
    weights replaced while serving (moe_serve/weight_sync.py)."""
    experts = {name[: -len(".experts")]: m for name, m in model.named_modules()
               if isinstance(m, GroupedExperts) and name.endswith(".experts")}
    from moe_serve.quantization import fp8

    fp8_cfg = _checkpoint_fp8_config(model, path, quantization)
    quant = (getattr(model, "hf", None) or {}).get("quantization_config") or {}
    if quant.get("quant_method") in ("compressed-tensors", "awq", "gptq", "gguf"):
        raise ValueError(f"weight updates of a {quant['quant_method']} (packed int4/int8) model are not supported yet")
    if fp8_cfg is None and quantization == "fp8":  # quantized at load: the same blocks again
        fp8_cfg = fp8.BlockFp8Config()
    return _TensorLoader(model, dtype, experts, fp8_cfg)


def _checkpoint_fp8_config(model: nn.Module, path: str, quantization: str | None):
    """The checkpoint's block-FP8 config (fp8.BlockFp8Config) or None; any other quantization the
    model does not load itself, or an unknown `quantization`, is an error."""
    from moe_serve.quantization import fp8

    quant = (getattr(model, "hf", None) or {}).get("quantization_config")
    fp8_cfg = None
    if quant and quant.get("quant_method") == "fp8":
        fp8_cfg = fp8.BlockFp8Config.from_hf(quant)
    elif quant and quant.get("quant_method") in ("compressed-tensors", "awq", "gptq", "gguf"):
        from moe_serve.quantization import formats

        formats.validate(quant)  # errors name the field
    elif quant and quant.get("quant_method") not in getattr(model, "quant_methods", ()):  # GPT-OSS: "mxfp4"
        raise ValueError(f"checkpoint {path!r} is quantized with quant_method={quant.get('quant_method')!r}; the "
                         f"supported quantized formats are block FP8 (quant_method 'fp8'), compressed-tensors' "
                         f"pack-quantized int4/int8 weights ('compressed-tensors'), AutoAWQ's int4 'gemm' ('awq'), GPTQ "
                         f"('gptq') "
                         f"and, for GPT-OSS, MXFP4 "
                         f"('mxfp4'); otherwise use an "
                         f"unquantized (bf16/fp16/fp32) checkpoint, or load_format='dummy' for its sizes")
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization={quantization!r} is not one of: fp8")
    return fp8_cfg


def _make_fp8_storage(model: nn.Module, fp8_cfg, quantization: str | None, names_by_file: list,
                      experts: dict):
    """Give FP8 storage to the modules that will hold FP8 weights, before any tensor loads: for a
    block-FP8 checkpoint exactly the weights that come with scales, for `quantization="fp8"` every
    quantizable one. Returns the config the loading follows (None: no FP8)."""
    from moe_serve.quantization import fp8

    if fp8_cfg is not None:
        scaled = set()
        own = getattr(model, "loads_own_scales", lambda name: False)  # DeepSeek-V4's FP4 experts
        for _, names in names_by_file:
            for raw in names:
                mapped = model.checkpoint_name(raw)
                if mapped and mapped.endswith(".weight_scale_inv") and not own(mapped):
                    name = mapped[: -len("_scale_inv")]
                    m = _PER_EXPERT.match(name)
                    scaled.add(f"{m.group('prefix')}.experts" if m and m.group("prefix") in experts else name)
        n = fp8.to_block_fp8(model, fp8_cfg.block, scaled)
        if n == 0:
            log.warning("quantization_config says block FP8, but no tensor has a weight_scale_inv: loading the "
                        "weights as they are stored")
        log.info("block FP8 checkpoint (weight_block_size %s, %s scales): %d modules keep FP8 weights",
                 list(fp8_cfg.block), fp8_cfg.scale_fmt, n)
    elif quantization == "fp8":
        fp8_cfg = fp8.BlockFp8Config()
        n = fp8.to_block_fp8(model, fp8_cfg.block, None)
        log.info("--quantization fp8: %d modules quantized to block FP8 (%s) while loading", n, list(fp8_cfg.block))
    return fp8_cfg


def _make_packed_storage(model: nn.Module, names_by_file: list, experts: dict):
    """Packed int4 / int8 checkpoints (compressed-tensors, AWQ: moe_serve/quantization/formats.py): give
    packed storage (moe_serve/quantization/packed.py) to the modules whose weights come packed (a
    `weight_packed` / `qweight` tensor), before any tensor loads: linear
    layers in place, a MoE layer's experts replaced by PackedExperts (`experts` updated). Returns
    the collector the loading feeds (None: not such a checkpoint)."""
    from moe_serve.layers.experts import packed_experts
    from moe_serve.layers.linear import Linear
    from moe_serve.quantization.formats import packed_collector

    collector = packed_collector(getattr(model, "hf", None) or {})
    if collector is None:
        return None
    ct = collector
    modules = dict(model.named_modules())
    expert_groups: dict[str, dict[str, tuple[int, int]]] = {}  # prefix -> {"w13"/"w2": (bits, group)}
    int8_acts: set[str] = set()  # MoE layers whose experts' scheme quantizes activations to int8 (W8A8)
    linears = 0
    for _, names in names_by_file:
        for raw in names:
            mapped = model.checkpoint_name(raw)
            split = ct.split_name(mapped) if mapped else None
            if split is None or not ct.is_weight(split[1]):
                continue
            module = split[0]
            scheme = collector.scheme(raw)
            m = _PER_EXPERT.match(module + ".weight")
            if m and m.group("prefix") in experts:
                ex = experts[m.group("prefix")]
                kind = model.expert_names.get(m.group("proj"))
                if kind is None:
                    raise ValueError(f"unexpected expert tensor {raw!r} ({ct.method})")
                which = "w2" if kind == "down" else "w13"
                got = (scheme.bits, scheme.group_size or (ex.w13.shape[2] if which == "w13" else ex.F))
                seen = expert_groups.setdefault(m.group("prefix"), {}).setdefault(which, got)
                if (getattr(scheme, "activations", None) or "").startswith("int8"):
                    int8_acts.add(m.group("prefix"))
                if seen != got:
                    raise ValueError(f"tensor {raw!r} ({ct.method}): {got[0]}-bit group {got[1]}, but the layer's "
                                     f"other {which} experts are {seen[0]}-bit group {seen[1]}: not supported")
                continue
            lin = modules.get(module)
            if not isinstance(lin, Linear):
                raise ValueError(f"tensor {raw!r} is quantized ({ct.method}, {ct.format}, {scheme.bits}-bit), but "
                                 f"{module!r} is not a linear layer or expert projection this engine keeps packed")
            if lin.qweight is None:
                lin.to_packed(scheme.bits, scheme.group_size or lin.in_features)
                lin.int8_activations = (getattr(scheme, "activations", None) or "").startswith("int8")
                linears += 1
    for prefix, groups in expert_groups.items():
        if len(groups) != 2 or groups["w13"][0] != groups["w2"][0]:
            raise ValueError(f"{prefix}.experts ({ct.method}): gate/up and down must all be packed with one bit width, "
                             f"got {groups}")
        new = packed_experts(experts[prefix], groups["w13"][0], (groups["w13"][1], groups["w2"][1]))
        new.int8_activations = prefix in int8_acts
        owner = modules[prefix]
        owner.experts = new
        experts[prefix] = new
    log.info("%s checkpoint (%s): %d linear layers and %d MoE layers' experts kept packed", ct.method, ct.format,
             linears, len(expert_groups))
    return collector


class _TensorLoader:
    """Puts checkpoint tensors, one at a time, where they belong (the model's own hook, an FP8
    scale, an expert slot, a parameter) and remembers what was filled, so `finish` can name what
    the checkpoint lacked."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, experts: dict, fp8_cfg, packed=None):
        self.model, self.dtype, self.experts, self.fp8_cfg = model, dtype, experts, fp8_cfg
        self.packed = packed  # formats.packed_collector's: packed weights' parts, collected
        # After the FP8 storage is made: the parameters as they will be filled.
        self.params = dict(model.named_parameters(remove_duplicate=True))
        self.scales = {name: b for name, b in model.named_buffers() if name.endswith("weight_scale_inv")}
        # A model may load some tensors itself (GPT-OSS: interleaved gate/up, expert biases, MXFP4
        # blocks): load_checkpoint_tensor(name, raw, file) returns the parameters it filled, or None.
        self.hook = getattr(model, "load_checkpoint_tensor", None)
        self.loaded: set[str] = set()
        self.skipped_layers: set[int] = set()
        # Layers a block-FP8 checkpoint gives in FP8 but the model holds dense (fp8.finish_block_fp8:
        # MLA's kv_b_proj), already dense: the model was loaded, and these are new weights for it.
        # Their blocks and scales wait here for each other, then dequantize as the load did.
        from moe_serve.quantization import fp8

        self.dense_fp8 = {} if fp8_cfg is None else {
            name + ".weight": m for name, m in model.named_modules()
            if fp8.dequantized_at_load(m) and getattr(m, "weight_scale_inv", None) is None}
        self.halves: dict[str, dict[str, torch.Tensor]] = {}
        self.kv_scales: dict[int, dict[str, float]] = {}  # layer -> {"k": k_scale, "v": v_scale}
        self.attention_by_layer: dict[int, list] | None = None  # made on the first scale

    def _kv_scale(self, kv: tuple[int, str], raw: str, t: torch.Tensor, fp: str) -> None:
        """A per-tensor FP8 KV cache scale (one positive float) for layer kv[0]: its K ("k"), V
        ("v") or both ("kv"). A model already serving an FP8 cache with its scales (a weight
        update) refuses other values: its cache holds values divided by the old ones."""
        if t.numel() != 1:
            raise ValueError(f"tensor {raw!r} in {fp} has shape {tuple(t.shape)}: only per-tensor KV cache scales "
                             f"(one value) are supported")
        value = float(t.float().reshape(()))
        if not 0 < value < float("inf"):
            raise ValueError(f"tensor {raw!r} in {fp} is {value}: a KV cache scale must be positive and finite")
        if self.attention_by_layer is None:
            self.attention_by_layer = _attention_of_layers(self.model)
        for m in self.attention_by_layer.get(kv[0], []):
            live = getattr(m, "kv_scales_live", False)
            if live and any(value != getattr(m, f"{w}_scale") for w in kv[1]):
                raise ValueError(f"tensor {raw!r} in {fp} is {value}, but layer {kv[0]} serves an FP8 KV cache "
                                 f"with k_scale={m.k_scale}, v_scale={m.v_scale}: KV cache scales cannot change "
                                 f"while serving (restart with the new checkpoint)")
        for which in kv[1]:
            self.kv_scales.setdefault(kv[0], {})[which] = value

    def finish_kv_scales(self) -> None:
        """The checkpoint's KV cache scales onto each layer's attention module, as (k_scale,
        v_scale) in `checkpoint_kv_scales` (1.0 for one it lacks); the runner applies them with an
        FP8 cache (moe_serve/runner/memory.py `apply_kv_scales`)."""
        if not self.kv_scales:
            return
        by_layer = self.attention_by_layer or _attention_of_layers(self.model)
        for layer, sc in sorted(self.kv_scales.items()):
            if not by_layer.get(layer):
                raise ValueError(f"the checkpoint ships KV cache scales for layer {layer}, which has no paged "
                                 f"attention in this model")
            for m in by_layer[layer]:
                m.checkpoint_kv_scales = (sc.get("k", 1.0), sc.get("v", 1.0))

    def load(self, raw: str, f, fp: str) -> None:
        """Load tensor `raw` of the open safetensors file f (at path fp)."""
        if (kv := _kv_scale_of(raw)) is not None:
            if kv[0] < getattr(self.model, "num_hidden_layers", 1 << 30):  # not an MTP layer's
                self._kv_scale(kv, raw, f.get_tensor(raw), fp)
            return
        name = self.model.checkpoint_name(raw)
        if name is None:
            mtp = _LAYER.match(raw)
            if mtp and int(mtp.group(1)) >= getattr(self.model, "num_hidden_layers", 1 << 30):
                self.skipped_layers.add(int(mtp.group(1)))
            return
        if self.packed is not None and self._load_packed(name, raw, f):
            return
        if self.hook is not None and (filled := self.hook(name, raw, f)):  # tensors the model loads itself
            self.loaded.update(filled)
            return
        if name.endswith(".weight_scale_inv"):
            if name[: -len("_scale_inv")] in self.dense_fp8:
                self._dense_fp8_half(name[: -len("_scale_inv")], "scale_inv", f.get_tensor(raw), raw)
                return
            _load_scale(self.model, name, raw, f.get_tensor(raw), self.experts, self.scales, fp)
            self.loaded.add(name)
            return
        if not self._load_expert(name, raw, f, fp):
            self._load_param(name, raw, f, fp)

    def _load_packed(self, name: str, raw: str, f) -> bool:
        """A part of a packed weight (compressed-tensors' weight_packed, weight_scale, ...; AWQ's qweight,
        qzeros, scales): collected
        until its module has all of them, then converted and placed; False if `name` is none."""
        split = self.packed.split_name(name)
        if split is None:
            return False
        module, suffix = split
        m = _PER_EXPERT.match(module + ".weight")
        expert = m is not None and m.group("prefix") in self.experts
        if expert and not self.experts[m.group("prefix")].holds(int(m.group("e"))):
            return True  # other ranks' experts are never read
        done = self.packed.take(module, suffix, f.get_tensor(raw), raw)
        if done is None:
            return True
        _, w = done
        if expert:
            kind = self.model.expert_names[m.group("proj")]
            self.experts[m.group("prefix")].load(int(m.group("e")), kind, w)
            which = "w2" if kind == "down" else "w13"
            self.loaded.update(f"{m.group('prefix')}.experts.{which}_{p}" for p in ("qweight", "scales", "offsets"))
        else:
            self.model.get_submodule(module).load_packed(w)
            self.loaded.update(f"{module}.{p}" for p in ("qweight", "qscales", "qoffsets", "weight"))  # weight: held dense
        return True

    def _load_expert(self, name: str, raw: str, f, fp: str) -> bool:
        """An expert tensor, per expert or fused, into its MoE layer's stacked weights; False if
        `name` is none."""
        m = _PER_EXPERT.match(name)
        if m and m.group("prefix") in self.experts:
            kind = self.model.expert_names.get(m.group("proj"))
            if kind is None:
                raise ValueError(f"unexpected expert tensor {raw!r} in {fp}")
            ex = self.experts[m.group("prefix")]
            e = int(m.group("e"))
            if ex.holds(e):  # other ranks' experts are never read
                t = f.get_tensor(raw)
                ex.load(e, kind, t if ex.fp8_block is not None else t.to(self.dtype))
            self.loaded.add(f"{m.group('prefix')}.experts.{'w2' if kind == 'down' else 'w13'}")
            return True
        m = _FUSED.match(name)
        if m and m.group("prefix") in self.experts:
            _load_fused(self.experts[m.group("prefix")], m.group("proj"), f.get_slice(raw), self.dtype, raw)
            self.loaded.add(f"{m.group('prefix')}.experts.{'w2' if m.group('proj') == 'down_proj' else 'w13'}")
            return True
        return False

    def _load_param(self, name: str, raw: str, f, fp: str) -> None:
        """Any other tensor: copied into the parameter of its name (quantized to FP8 on the way
        under `quantization="fp8"`)."""
        from moe_serve.quantization import fp8

        if name not in self.params:
            raise ValueError(f"unexpected tensor {raw!r} in {fp}: the model has no parameter {name!r}")
        t = f.get_tensor(raw)
        p = self.params[name]
        if t.dtype == fp8.FP8 and name in self.dense_fp8:
            self._dense_fp8_half(name, "weight", t, raw)
            return
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"tensor {raw!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        if p.dtype == fp8.FP8 and t.dtype != fp8.FP8:  # --quantization fp8
            q, scale = fp8.quantize_blocks(t, self.fp8_cfg.block)
            p.data.copy_(q)
            self.scales[name + "_scale_inv"].copy_(scale)
            self.loaded.add(name + "_scale_inv")
        elif p.dtype != fp8.FP8 and t.dtype == fp8.FP8:
            raise ValueError(f"tensor {raw!r} is FP8 but has no weight_scale_inv in the checkpoint")
        else:
            p.data.copy_(t.to(p.dtype))
        self.loaded.add(name)

    def _dense_fp8_half(self, name: str, part: str, t: torch.Tensor, raw: str) -> None:
        """One half (`part`: "weight" FP8 values or "scale_inv") of new block-FP8 weights for a layer
        held dense (`dense_fp8`); once both are here, dequantized into the layer's weight in place,
        exactly as fp8.finish_block_fp8 did at load (on the weight's device, into the model's dtype)."""
        from moe_serve.quantization import fp8

        halves = self.halves.setdefault(name, {})
        halves[part] = t
        if len(halves) < 2:
            return
        del self.halves[name]
        p = self.dense_fp8[name].weight
        q, s = halves["weight"], halves["scale_inv"]
        block = self.fp8_cfg.block
        if tuple(q.shape) != tuple(p.shape):
            raise ValueError(f"tensor {raw!r}: {name!r} has shape {tuple(q.shape)}, expected {tuple(p.shape)}")
        if tuple(s.shape) != fp8.scale_shape(*p.shape, block):
            raise ValueError(f"tensor {raw!r}: {name}_scale_inv has shape {tuple(s.shape)}, expected "
                             f"{fp8.scale_shape(*p.shape, block)} (the weight's blocks for its weight_block_size)")
        # The load's own steps: scales into float32 on the weight's device, then dequantize_blocks.
        scale = torch.empty(s.shape, dtype=torch.float32, device=p.device)
        scale.copy_(fp8.scale_to_float32(s))
        p.data.copy_(fp8.dequantize_blocks(q.to(p.device), scale, block, self.dtype).to(p.dtype))
        self.loaded.add(name)

    def check_pairs(self) -> None:
        """After the last tensor of an update: an error naming an FP8 weight held dense whose values
        came without their scales (or scales without values): it was not written."""
        if self.halves:
            name, halves = next(iter(self.halves.items()))
            got = next(iter(halves))
            raise ValueError(f"tensor {name + ('_scale_inv' if got == 'scale_inv' else '')!r} came without "
                             f"{name + ('' if got == 'scale_inv' else '_scale_inv')!r}: the layer is held dense, "
                             f"dequantized from both; send both in one update")

    def finish(self, path: str) -> None:
        """After the last tensor: FP8 weights finished, and an error naming every parameter (and
        non-expert scale) the checkpoint did not fill."""
        from moe_serve.quantization import fp8

        model = self.model
        self.check_pairs()
        self.finish_kv_scales()
        if self.skipped_layers:
            log.info("skipped the checkpoint's layer(s) %s after the model's %d: multi-token-prediction layers, not "
                     "used without speculative decoding", sorted(self.skipped_layers), model.num_hidden_layers)
        if self.fp8_cfg is not None:
            fp8.finish_block_fp8(model, self.dtype)
        if self.packed is not None:
            self.packed.finish(path)
        missing = sorted(n for n in self.params if n not in self.loaded and not _tied(model, n))
        missing += sorted(n for n in self.scales if n not in self.loaded and "experts" not in n)
        if missing:
            raise ValueError(f"checkpoint {path!r} is missing tensor(s): {', '.join(missing[:8])}"
                             + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def _attention_of_layers(model: nn.Module) -> dict[int, list]:
    """Each decoder layer's paged attention modules (those with KV cache scales), by layer index."""
    by_layer: dict[int, list] = {}
    for name, m in model.named_modules():
        if (hit := _LAYER.match(name)) and hasattr(m, "k_scale") and hasattr(m, "cache_kind"):
            by_layer.setdefault(int(hit.group(1)), []).append(m)
    return by_layer


def _kv_scale_of(raw: str) -> tuple[int, str] | None:
    """(layer, which of "k", "v", "kv") for a KV cache scale tensor's name (`_KV_SCALE`), else None."""
    m = _KV_SCALE.search(raw)
    if m is None:
        return None
    proj, which = m.group("proj"), m.group("which")
    if which == "output_scale":
        if proj not in ("k_proj", "v_proj"):
            return None
        return int(m.group("layer")), proj[0]
    if which == "kv_scale":
        return int(m.group("layer")), "kv"
    if proj in ("k_proj", "v_proj") and proj[0] != which[0]:
        return None  # k_proj.v_scale: no such convention
    return int(m.group("layer")), which[0]


def _load_scale(model: nn.Module, name: str, raw: str, t: torch.Tensor, experts: dict, scales: dict, fp: str) -> None:
    """A block-FP8 weight's `weight_scale_inv`: to its linear layer, or to its expert's slots."""
    from moe_serve.quantization import fp8
    m = _PER_EXPERT.match(name[: -len("_scale_inv")])
    if m and m.group("prefix") in experts:
        kind = model.expert_names.get(m.group("proj"))
        if kind is None:
            raise ValueError(f"unexpected expert tensor {raw!r} in {fp}")
        ex = experts[m.group("prefix")]
        if ex.holds(int(m.group("e"))):
            ex.load_scale_inv(int(m.group("e")), kind, fp8.scale_to_float32(t))
        return
    if name not in scales:
        raise ValueError(f"unexpected tensor {raw!r} in {fp}: the model has no FP8 weight {name[:-len('_scale_inv')]!r}")
    b = scales[name]
    if tuple(t.shape) != tuple(b.shape):
        raise ValueError(f"tensor {raw!r} has shape {tuple(t.shape)}, expected {tuple(b.shape)} (the weight's "
                         f"blocks for its weight_block_size)")
    b.copy_(fp8.scale_to_float32(t))


def _tied(model: nn.Module, name: str) -> bool:
    return name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False)


def _load_fused(ex: GroupedExperts, proj: str, sl, dtype: torch.dtype, raw: str) -> None:
    shape = tuple(sl.get_shape())
    E_local, twoF, D = ex.w13.shape
    F = twoF // 2
    for e, slots in ex.slots_of.items():
        w = sl[e].to(dtype)  # reads only expert e's rows from disk
        if proj == "gate_up_proj":
            if tuple(w.shape) == (D, 2 * F) and D != 2 * F:  # (E, D, 2F) layout: transpose to (2F, D)
                w = w.t()
            if tuple(w.shape) != (2 * F, D):
                raise ValueError(f"tensor {raw!r} has shape {shape}, expected (E, {2 * F}, {D})")
            ex.load(e, "gate_up", w)
        else:
            if tuple(w.shape) == (F, D) and F != D:
                w = w.t()
            if tuple(w.shape) != (D, F):
                raise ValueError(f"tensor {raw!r} has shape {shape}, expected (E, {D}, {F})")
            ex.load(e, "down", w)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """load_format='dummy': random weights (small normal, norms at 1) for a config alone."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            continue  # integer tables (DeepSeek-V4's tid2eid) keep the model's own default
        if name.endswith("norm.weight") or "layernorm" in name:
            p.data.fill_(1.0)
        elif "e_score_correction_bias" in name:
            p.data.zero_()
        else:
            fan_in = p.shape[-1]
            p.data.copy_((torch.randn(p.shape, generator=g) * fan_in ** -0.5).to(p.dtype))
