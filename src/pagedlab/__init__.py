"""pagedlab: a PagedAttention LLM inference engine in PyTorch + Triton, with a research lab."""

from pagedlab.engine.engine import EngineStats
from pagedlab.llm import LLM
from pagedlab.outputs import (BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestMetrics,
                              RequestOutput)
from pagedlab.sampling_params import BeamSearchParams, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestMetrics", "EngineStats", "BeamSearchOutput", "BeamSearchSequence", "__version__"]
