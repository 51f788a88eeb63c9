"""moe-serve: a serving engine for mixture-of-experts language models.

Imports are lazy: `import moe_serve.scheduler` (or the protocol, sampling parameters, the front
end's output processing) does not pull in torch; `from moe_serve import LLM` does.
"""
__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from moe_serve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from moe_serve.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from moe_serve import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'moe_serve' has no attribute {name!r}")
