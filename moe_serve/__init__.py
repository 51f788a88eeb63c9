"""moe-serve: a serving engine for mixture-of-experts language models."""
from moe_serve.engine.llm import LLM
from moe_serve.outputs import CompletionOutput, RequestOutput
from moe_serve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
