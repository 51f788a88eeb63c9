"""What the packed formats' loaders share (compressed_tensors.py, gptq_awq.py): a config's list of
module names, and the collector that keeps a module's tensors until its format can convert them.
Its own module so that formats.py, which imports the loaders, is not imported by them."""
from __future__ import annotations


def name_list(q: dict, field: str, method: str) -> tuple[str, ...]:
    """quantization_config.<field>, a list of module names or patterns (compressed-tensors' `ignore`,
    AWQ's `modules_to_not_convert`), as a tuple; an error names the field and the format."""
    names = q.get(field) or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"quantization_config.{field}={names!r} ({method}) must be a list of names")
    return tuple(names)


class PartsCollector:
    """The collector the weight loader feeds a packed format's tensors to (moe_serve/weights.py), one
    at a time in any order: `split_name` says which (module, suffix) a tensor is, `is_weight` which
    suffix marks a quantized module (one a module), `scheme` a module's scheme (errors name the
    tensor); `take` keeps a module's parts until `needs(scheme)` are all here and returns (module,
    `convert(parts, scheme, module)`), None before; `finish` names a module left incomplete."""

    method = format = ""
    needed = ""  # the parts a module needs, as `finish` names them

    def __init__(self, cfg):
        self.cfg = cfg
        self.pending: dict[str, dict] = {}

    def needs(self, scheme) -> set[str]:
        raise NotImplementedError

    def convert(self, parts: dict, scheme, module: str):
        raise NotImplementedError

    def take(self, module: str, suffix: str, t, raw: str):
        scheme = self.scheme(raw)
        parts = self.pending.setdefault(module, {})
        parts[suffix] = t
        if not self.needs(scheme) <= set(parts):
            return None
        del self.pending[module]
        return module, self.convert(parts, scheme, module)

    def finish(self, path: str) -> None:
        if self.pending:
            module, parts = next(iter(self.pending.items()))
            raise ValueError(f"checkpoint {path!r}: quantized module {module!r} ({self.method}, {self.format}) has "
                             f"only {sorted(parts)}; {self.needed} are needed")
