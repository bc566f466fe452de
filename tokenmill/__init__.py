"""tokenmill: an LLM inference engine with a paged KV cache and continuous batching.

``LLM`` loads on first use (PEP 562): ``import tokenmill`` and the CLI's ``--help`` do not import torch;
an engine does, when it is built.
"""

from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.version import __version__
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "LoRARequest",
           "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from tokenmill.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
