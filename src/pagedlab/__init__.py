"""pagedlab: a PagedAttention LLM inference engine in PyTorch + Triton, with a research lab."""

from pagedlab.config import EngineConfig, EngineInfo
from pagedlab.llm import LLM
from pagedlab.outputs import (BeamSearchOutput, BeamSearchSequence, CompletionOutput, EngineStats, Logprob,
                              RequestMetrics, RequestOutput)
from pagedlab.sampling_params import BeamSearchParams, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestMetrics", "EngineStats", "EngineConfig", "EngineInfo", "BeamSearchOutput",
           "BeamSearchSequence", "__version__"]
