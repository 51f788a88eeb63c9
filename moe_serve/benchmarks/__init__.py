"""Benchmarks shipped with the package, shaped like vLLM's `vllm bench`:

- `moe-serve bench serve`: load any OpenAI-compatible server (`serve.py`, workloads in
  `datasets.py`, the HTTP client in `endpoint.py`, /metrics in `server_metrics.py`, plots in
  `plot.py`); its JSON result follows `result_schema.json`.
- `moe-serve bench throughput` / `moe-serve bench latency`: the offline engine (`offline.py`).

Imports are light: nothing here pulls in torch until an offline benchmark builds its engine.
"""
import os

RESULT_SCHEMA_PATH = os.path.join(os.path.dirname(__file__), "result_schema.json")


def result_schema() -> dict:
    """The JSON Schema of `moe-serve bench serve --save-result` files."""
    import json

    with open(RESULT_SCHEMA_PATH) as f:
        return json.load(f)
