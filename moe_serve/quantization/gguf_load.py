"""Loading a GGUF file's tensors into the model, the block-quantized ones kept packed.

The file is presented to the weight loader (moe_serve/weights.py `_TensorLoader`) as a checkpoint
with Hugging Face tensor names: `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight`,
and a stacked expert tensor `blk.N.ffn_gate_exps.weight` (E, F, D) is E per-expert tensors
`model.layers.N.mlp.experts.{e}.gate_proj.weight`, each read from its own rows of the file. A
block-quantized tensor (gguf_types.PACKED_TYPES) whose module keeps packed weights (a linear layer,
a MoE layer's experts) arrives as a PackedWeight; elsewhere (the embedding table, the output head,
a router) it is dequantized exactly (PackedWeight.dequantize) into the model's dtype. Float tensors
load as they are stored. Files of the "llama" architecture (Mixtral's) store q and k rows in
llama.cpp's rotary order, put back as they load (packed rows move whole: codes, scales, offsets).
"""
from __future__ import annotations

import logging
import re

import torch
from torch import nn
from tqdm import tqdm

from moe_serve.quantization import gguf_file, gguf_types
from moe_serve.quantization.packed import PackedWeight, unpack_nibbles

log = logging.getLogger("moe_serve.weights")

# GGUF tensor -> Hugging Face name, for the architectures gguf_file.ARCHITECTURES serves.
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
          "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
# Stacked experts -> the per-expert projection names of each architecture's checkpoints.
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_EXPERTS_W123 = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}  # MiniMax-M2
_EXPERT_NAMES = {"minimax-m2": _EXPERTS_W123}
_GGUF_NAME = re.compile(r"^(?:blk\.(?P<layer>\d+)\.)?(?P<base>\w+?)\.(?P<suffix>weight|bias)$")


def hf_names(t, arch: str) -> list[tuple[str, int | None]]:
    """The Hugging Face tensor name(s) a GGUF reader tensor of architecture `arch` stands for:
    [(name, None)], or for a stacked expert tensor [(per-expert name, e)] for each expert e. Unknown
    tensors are an error naming them."""
    m = _GGUF_NAME.match(t.name)
    base = m and m.group("base")
    experts = _EXPERT_NAMES.get(arch, _EXPERTS)
    if m and m.group("layer") is None and base in _TOP:
        return [(f"{_TOP[base]}.{m.group('suffix')}", None)]
    if m and m.group("layer") is not None:
        pre = f"model.layers.{m.group('layer')}."
        if base in _BLOCK:
            return [(f"{pre}{_BLOCK[base]}.{m.group('suffix')}", None)]
        if base == "exp_probs_b":  # the router's selection bias (MiniMax-M2)
            return [(f"{pre}mlp.e_score_correction_bias", None)]
        if base in experts and m.group("suffix") == "weight":
            n = gguf_file.logical_shape(t)[0]
            return [(f"{pre}mlp.experts.{e}.{experts[base]}.weight", e) for e in range(n)]
    raise ValueError(f"GGUF tensor {t.name!r} ({gguf_types.type_name(int(t.tensor_type))}) has no counterpart in "
                     f"this engine's model")


def unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation for the "llama" architecture (its
    converter stores each head's rotary pairs interleaved: row (h, j, i) of the file is row
    (h, i, j) of the checkpoint, i in 0..1, j in 0..half): checkpoint rows = file rows[index]."""
    half = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, half, 2).transpose(1, 2).reshape(n_rows)


class GgufCheckpoint:
    """The file's tensors under Hugging Face names, as the weight loader reads a safetensors file:
    `keys()`, `get_tensor(name)`. The names in `packed` (set before loading) come as PackedWeight of
    the bits recorded there, other block-quantized tensors dequantized."""

    def __init__(self, path: str):
        self.entries: dict[str, tuple[object, int | None]] = {}
        arch = gguf_file.architecture(path)
        r = gguf_file.reader(path)
        # llama files permute q and k rows (per head, per kv head): undone as they load
        self.row_order: dict[str, int] = {} if arch != "llama" else {
            "attn_q": int(gguf_file.field(r, "llama.attention.head_count")),
            "attn_k": int(gguf_file.field(r, "llama.attention.head_count_kv",
                                          gguf_file.field(r, "llama.attention.head_count")))}
        for t in r.tensors:
            for name, e in hf_names(t, arch):
                self.entries[name] = (t, e)
        self.packed: dict[str, int] = {}  # raw (Hugging Face) names handed over packed -> their bits

    def keys(self) -> list[str]:
        return list(self.entries)

    def qtype(self, name: str) -> int:
        return int(self.entries[name][0].tensor_type)

    def get_tensor(self, name: str):
        t, e = self.entries[name]
        shape = gguf_file.logical_shape(t)
        data = t.data if e is None else t.data[e]
        if e is not None:
            shape = shape[1:]
        qtype = int(t.tensor_type)
        if not gguf_types.is_packed(qtype):
            out = gguf_types.to_float(data, qtype, shape)
        else:
            out = gguf_types.to_packed(data, qtype, shape)
            if name not in self.packed:
                out = out.dequantize(torch.float32)
            elif self.packed[name] == 8 and out.bits == 4:  # beside 8-bit experts: the codes one a byte
                out = PackedWeight(8, unpack_nibbles(out.qweight), out.scales, out.offsets, out.group_size, out.shape)
        if t.name.endswith("ffn_gate_inp_shexp.weight") and out.dim() == 1:
            out = out.unsqueeze(0)  # the shared expert's gate: (D,) in GGUF, a (1, D) linear weight
        if (heads := self.row_order.get(t.name.split(".")[-2])) is not None:
            index = unpermute_rows(shape[0], heads)
            if isinstance(out, PackedWeight):
                out = PackedWeight(out.bits, out.qweight[index].contiguous(), out.scales[index].contiguous(),
                                   out.offsets[index].contiguous(), out.group_size, out.shape)
            else:
                out = out[index].contiguous()
        return out


class GgufPacked:
    """The packed-tensor collector `_TensorLoader` feeds (the interface of the other packed
    formats' collectors): a packed tensor arrives whole, as a PackedWeight, under its model name."""

    method = "gguf"

    def __init__(self, model_names: set[str]):
        self.model_names = model_names

    def split_name(self, name: str):
        if name in self.model_names:
            return name[: -len(".weight")], "weight"
        return None

    def take(self, module: str, suffix: str, w, raw: str):
        return module, w

    def finish(self, path: str) -> None:
        pass


def load_gguf(model: nn.Module, path: str, dtype: torch.dtype, show_progress: bool = True) -> None:
    """Fill every parameter of `model` from the GGUF file at `path` (moe_serve/weights.py's loader
    over GgufCheckpoint); linear layers and experts whose tensors are block-quantized keep them packed."""
    from expert_parallel.runtime.layer import GroupedExperts
    from moe_serve import weights

    ckpt = GgufCheckpoint(path)
    experts = {name[: -len(".experts")]: m for name, m in model.named_modules()
               if isinstance(m, GroupedExperts) and name.endswith(".experts")}
    packed_names = _make_packed_storage(model, ckpt, experts)
    loader = weights._TensorLoader(model, dtype, experts, None, GgufPacked(packed_names))
    names = ckpt.keys()
    for raw in tqdm(names, desc="Loading weights", unit="tensor", disable=not show_progress):
        loader.load(raw, ckpt, path)
    loader.finish(path)


def _make_packed_storage(model: nn.Module, ckpt: GgufCheckpoint, experts: dict) -> set[str]:
    """Packed storage for the linear layers and MoE experts whose GGUF tensors are block-quantized,
    before any tensor loads (as weights.py does for the other packed formats); returns the model
    names of the tensors that load packed and records their bits in `ckpt.packed`. A MoE layer's
    gate/up experts share one bit width, and its down experts one: Q4_K_M's 4-bit gate/up stay 4-bit
    beside its Q6_K down (a byte a code); a Q4_K expert among 8-bit ones of its kind is held a byte a
    code. A layer whose experts are not all block-quantized loads dense, dequantized."""
    from moe_serve.layers.experts import packed_experts
    from moe_serve.layers.linear import Linear

    modules = dict(model.named_modules())
    packed: set[str] = set()
    # MoE layer prefix -> {"w13" / "w2": {group size: GGUF type name}}, and its expert tensors
    groups: dict[str, dict[str, dict[int, str]]] = {}
    bits_of: dict[tuple[str, str], int] = {}  # (MoE layer prefix, "w13" / "w2") -> the widest codes there
    members: dict[str, list[tuple[str, str]]] = {}
    for raw in ckpt.keys():
        qtype = ckpt.qtype(raw)
        mapped = model.checkpoint_name(raw)
        if mapped is None or not mapped.endswith(".weight"):
            continue
        m = re.match(r"^(?P<prefix>.*)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$", mapped)
        if m and m.group("prefix") in experts:
            prefix = m.group("prefix")
            members.setdefault(prefix, []).append((raw, mapped))
            if not gguf_types.is_packed(qtype):
                groups.setdefault(prefix, {})["float"] = {0: gguf_types.type_name(qtype)}
                continue
            bits, group = gguf_types.packed_layout(qtype)
            which = "w2" if model.expert_names.get(m.group("proj")) == "down" else "w13"
            groups.setdefault(prefix, {}).setdefault(which, {}).setdefault(group, gguf_types.type_name(qtype))
            bits_of[prefix, which] = max(bits_of.get((prefix, which), 0), bits)
            continue
        lin = modules.get(mapped[: -len(".weight")])
        if gguf_types.is_packed(qtype) and isinstance(lin, Linear) and not getattr(lin, "weight_used_directly",
                                                                                    False):
            bits, group = gguf_types.packed_layout(qtype)
            lin.to_packed(bits, group)
            ckpt.packed[raw] = bits
            packed.add(mapped)
    for prefix, layout in groups.items():
        for which in ("w13", "w2"):
            if len(layout.get(which, {})) > 1:
                types = ", ".join(layout[which].values())
                raise ValueError(f"{prefix}.experts (GGUF): the {which} experts mix {types}, whose groups "
                                 f"({', '.join(map(str, layout[which]))}) differ: not supported")
        if set(layout) != {"w13", "w2"}:
            log.info("%s.experts: not every expert tensor is block-quantized (%s): loaded dense", prefix,
                     ", ".join(sorted({t for g in layout.values() for t in g.values()})))
            continue
        for raw, mapped in members[prefix]:
            proj = re.match(r"^.*\.experts\.\d+\.(\w+)\.weight$", mapped).group(1)
            ckpt.packed[raw] = bits_of[prefix, "w2" if model.expert_names.get(proj) == "down" else "w13"]
            packed.add(mapped)
        new = packed_experts(experts[prefix], (bits_of[prefix, "w13"], bits_of[prefix, "w2"]),
                             (next(iter(layout["w13"])), next(iter(layout["w2"]))))
        modules[prefix].experts = new
        experts[prefix] = new
    log.info("GGUF checkpoint: %d tensors kept packed (%s)", len(packed),
             ", ".join(sorted({gguf_types.type_name(ckpt.qtype(r)) for r in ckpt.packed})) or "none")
    return packed
