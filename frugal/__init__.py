"""frugal: an LLM inference engine that serves big models with less memory per token."""

from frugal.llm import LLM
from frugal.request import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
