"""`moe-serve env` lists the weight formats each backend serves: every packed format the loader
accepts (moe_serve/quantization/formats.py) has a line for every expert backend the platform can
pick, and the readable output gives the line of the backend chosen here."""
from __future__ import annotations

import contextlib
import io

from moe_serve import platform
from moe_serve.entrypoints.env import _print, collect
from moe_serve.quantization.formats import PACKED_METHODS


def test_env_lists_each_format_for_each_backend():
    env = collect()
    table = env["weight_formats"]
    names = " ".join(table)
    assert all(m in names for m in PACKED_METHODS), names
    assert {"dense", "fp8", "mxfp4", "compressed-tensors int-quantized",
            "compressed-tensors float-quantized"} <= set(table)
    for name, f in table.items():
        assert set(f["backends"]) == set(platform.OPS["experts"]), name
    w8a8 = table["compressed-tensors int-quantized"]
    assert "activations int8 per token" in w8a8["what"]
    assert "quantized to int8 per token" in w8a8["backends"]["triton"]
    assert all("activations stay float" in w8a8["backends"][b] for b in ("torch", "cpu_c"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _print(env)
    chosen = env["platform"]["moe_backend"]
    text = out.getvalue()
    assert f"weight formats (served here by the {chosen} backend" in text
    assert f"  gptq: {table['gptq']['what']}; {table['gptq']['backends'][chosen]}" in text
