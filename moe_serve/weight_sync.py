"""Weights replaced in place while serving: the checks made before anything is written, the
loading of a checkpoint or of received tensors into the running model, and the torch.distributed
group a trainer broadcasts its tensors over (both ends of it).

Every check compares against a manifest: the served checkpoint's tensor names, dtypes and shapes
as its safetensors headers state them (read without reading any tensor). A same-architecture
checkpoint has the same manifest; a trainer's tensors are each one of its entries. The tensors
are then written through the loader that loaded the model (moe_serve/weights.py), into the live
parameters with copy_: the same HF name mapping, each expert-parallel rank keeping only its
experts' slices (and every replica of them), and the preparation the load gives each tensor (FP8
kept or quantized on the way where the model keeps FP8, block-FP8 weights the model holds dense
dequantized on arrival, MXFP4 experts kept packed or dequantized as at load), so that an update
serves what a fresh load of the same checkpoint serves; the tensors the model runs from keep their
addresses (captured decode graphs read them).

Broadcast protocol (the engine ranks' side: `UpdateGroup`; the trainer's: `trainer_group` and
`broadcast_tensors`): the trainer is rank 0 of a group of 1 + engine ranks, made over a TCPStore
the trainer hosts at master_address:master_port, keys prefixed by group_name; engine rank r joins
as rank_offset + r. Per update, the trainer broadcasts each named tensor, in the order named, from
rank 0; the engine receives them one at a time (memory: the largest tensor), on its device.
"""
from __future__ import annotations

import ctypes
import datetime
import os

import msgspec
import torch

# safetensors' dtype names -> torch's (what a trainer writes in `dtypes`, "torch." prefix optional)
_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
              "F8_E5M2": "float8_e5m2", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
              "BOOL": "bool"}


class TensorSpec(msgspec.Struct, array_like=True):
    dtype: str  # torch's name: "bfloat16"
    shape: list[int]


def checkpoint_manifest(path: str) -> dict[str, TensorSpec]:
    """{tensor name: its dtype and shape} of the safetensors checkpoint at `path` (headers only);
    ValueError naming `path` when it has none."""
    from safetensors import safe_open

    from moe_serve.weights import checkpoint_files

    if not os.path.isdir(path):
        raise ValueError(f"model_path={path!r} is not a directory")
    out: dict[str, TensorSpec] = {}
    for fp in checkpoint_files(path):
        with safe_open(fp, framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = TensorSpec(_ST_DTYPES.get(sl.get_dtype(), sl.get_dtype()), list(sl.get_shape()))
    return out


def dtype_name(dtype: str | torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16, "torch.bfloat16" and "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def check_tensors(manifest: dict[str, TensorSpec], names: list[str], dtypes: list[str], shapes: list[list[int]],
                  complete: bool = False) -> tuple[str, str] | None:
    """The first problem as (field, message naming the tensor), or None: a name the served
    checkpoint does not have, a dtype or shape other than its own, lists of different lengths, a
    name twice, a quantized tensor without its other half (FP8 values / scales, MXFP4 blocks /
    scales: the one cannot be used without the other); complete: every tensor of the manifest must be there (a checkpoint on disk)."""
    if not (len(names) == len(dtypes) == len(shapes)):
        return "names", f"names, dtypes and shapes must have one entry per tensor (got {len(names)}, {len(dtypes)}, " \
                        f"{len(shapes)})"
    seen = set()
    for name, dt, shape in zip(names, dtypes, shapes):
        spec = manifest.get(name)
        if spec is None:
            return "names", f"tensor {name!r} is not a tensor of the served model's checkpoint"
        if name in seen:
            return "names", f"tensor {name!r} is named twice"
        seen.add(name)
        if dtype_name(dt) != spec.dtype:
            return "dtypes", f"tensor {name!r} has dtype {dtype_name(dt)}, the served checkpoint's is {spec.dtype}"
        if list(shape) != spec.shape:
            return "shapes", f"tensor {name!r} has shape {list(shape)}, the served checkpoint's is {spec.shape}"
    for name in names:  # a quantized weight's values and scales: each meaningless without the other
        partner = _quantized_partner(name)
        if partner in manifest and partner not in seen:
            return "names", f"tensor {name!r} is quantized together with {partner!r}: send both in one update"
    if complete and len(seen) != len(manifest):
        missing = sorted(set(manifest) - seen)
        return "model_path", f"the checkpoint lacks tensor {missing[0]!r}" + \
            (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
    return None


def _quantized_partner(name: str) -> str | None:
    """The other half of a quantized tensor in a checkpoint's names: block FP8's `X.weight` and
    `X.weight_scale_inv`, MXFP4's `X_blocks` and `X_scales`; None for any other name."""
    for a, b in ((".weight", ".weight_scale_inv"), ("_blocks", "_scales")):
        if name.endswith(b):
            return name[: -len(b)] + a
        if name.endswith(a):
            return name[: -len(a)] + b
    return None


def check_checkpoint(manifest: dict[str, TensorSpec], path: str) -> tuple[str, str] | None:
    """check_tensors for the whole checkpoint at `path` against the served one's manifest."""
    try:
        new = checkpoint_manifest(path)
    except (ValueError, OSError) as e:
        return "model_path", str(e)
    names = sorted(new)
    problem = check_tensors(manifest, names, [new[n].dtype for n in names], [new[n].shape for n in names], True)
    return (("model_path", problem[1]) if problem else None)


# --- writing into the live model --------------------------------------------------------------
class _Slice:
    """What the loader reads of a fused tensor (safetensors' get_slice), over a tensor in memory."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    def get_shape(self) -> list[int]:
        return list(self.t.shape)

    def __getitem__(self, idx):
        return self.t[idx]


class _OneTensor:
    """A safetensors file's reading interface over one received tensor."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.t

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self.t)


class LiveWriter:
    """Writes checkpoint-named tensors into the running model (moe_serve/weights.py's loader, over
    the live parameters). One per update."""

    def __init__(self, model, cfg, path: str):
        from moe_serve.weights import tensor_loader

        self.model = model
        self.loader = tensor_loader(model, cfg.activation_dtype, path, cfg.model.quantization)

    def write(self, name: str, t: torch.Tensor) -> None:
        with torch.no_grad():
            self.loader.load(name, _OneTensor(t), "<received>")

    def load_checkpoint(self, path: str) -> None:
        """Every tensor of the checkpoint at `path`; an error names a tensor it lacks."""
        from safetensors import safe_open

        from moe_serve.weights import checkpoint_files

        with torch.no_grad():
            for fp in checkpoint_files(path):
                with safe_open(fp, framework="pt", device="cpu") as f:
                    for raw in f.keys():
                        self.loader.load(raw, f, fp)
            self.loader.finish(path)

    def finish(self) -> None:
        """After the last tensor: an error naming an FP8 weight held dense that came without its
        scales (or they without it), and a head tied to the embedding but kept as a copy of its own
        (prepare.py widens the head apart from the table) follows the new table."""
        self.loader.check_pairs()
        model = self.model
        if getattr(model, "tie_word_embeddings", False):
            params = dict(model.named_parameters(remove_duplicate=False))
            head, table = params.get("lm_head.weight"), params.get("model.embed_tokens.weight")
            if head is not None and table is not None and head.data_ptr() != table.data_ptr():
                with torch.no_grad():
                    head.copy_(table)


# --- the broadcast group ------------------------------------------------------------------------
def _group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str,
           timeout_s: float):
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    raise ValueError(f"backend={backend!r} is not one of: gloo, nccl")


def trainer_group(master_address: str, master_port: int, world_size: int, group_name: str,
                  backend: str = "gloo", timeout_s: float = 600.0):
    """The trainer's end: rank 0 of the group, hosting its store. Call it while the engine's
    /init_weights_update_group request is in flight (each side waits for the other)."""
    return _group(master_address, master_port, 0, world_size, group_name, backend, timeout_s)


def _as_wire(t: torch.Tensor) -> torch.Tensor:
    """`t` as it travels: FP8 as its bytes (gloo has no FP8 type; a one-byte type's bytes are the
    same on the wire whatever the type, so a trainer broadcasting FP8 natively matches too)."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def broadcast_tensors(group, tensors) -> None:
    """The trainer's end of one update: each tensor, in the order the request names them."""
    for t in tensors:
        group.broadcast(_as_wire(t.contiguous()), 0).wait()


class UpdateGroup:
    """An engine rank's end of the group (rank rank_offset + its EP rank)."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                 backend: str, device: torch.device, timeout_s: float = 600.0):
        self.pg = _group(master_address, master_port, rank, world_size, group_name, backend, timeout_s)
        self.device = device if backend == "nccl" else torch.device("cpu")  # gloo moves host tensors

    def receive(self, dtype: str, shape: list[int]) -> torch.Tensor:
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
        self.pg.broadcast(_as_wire(t), 0).wait()
        return t


# --- memory given back while asleep (moe_serve/engine/features/weights_update.py) -----------------
_MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def release(tensors: list[torch.Tensor]) -> tuple[int, list[int]]:
    """Give the memory of `tensors` back to the OS; returns the bytes released and, per tensor, the
    storage bytes `restore` gives back (0: nothing to do there). CPU: madvise(MADV_DONTNEED) over
    each storage's whole pages, addresses kept (captured CPU graphs hold them; the pages read as
    zeros when next touched). CUDA: the storage is freed (resized to 0), and `restore` allocates
    it again, at another address."""
    libc = ctypes.CDLL(None, use_errno=True)
    done, freed, sizes = set(), 0, []
    for t in tensors:
        st = t.untyped_storage()
        sizes.append(0)
        if st.data_ptr() in done or st.nbytes() == 0:
            continue
        done.add(st.data_ptr())
        if t.device.type == "cpu":
            start = -(-st.data_ptr() // _PAGE) * _PAGE
            end = (st.data_ptr() + st.nbytes()) // _PAGE * _PAGE
            if end > start and libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED) == 0:
                freed += end - start
        else:
            freed += st.nbytes()
            sizes[-1] = st.nbytes()
            st.resize_(0)
    if any(sizes):
        torch.cuda.empty_cache()
    return freed, sizes


def restore(tensors: list[torch.Tensor], sizes: list[int]) -> None:
    """After `release`: the memory taken again and zeroed (CUDA: the storages allocated again; CPU:
    every page touched now, so that a shortage shows at the wake and not in the middle of a step)."""
    for t, n in zip(tensors, sizes):
        if n:
            t.untyped_storage().resize_(n)
    with torch.no_grad():
        for t in tensors:
            t.zero_()
