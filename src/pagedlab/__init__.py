"""pagedlab: a PagedAttention LLM inference engine in PyTorch + Triton, with a research lab.

The public names load on first use (``from pagedlab import LLM`` imports the engine then), so
``import pagedlab`` and the command line's ``--help`` start without torch.
"""

from __future__ import annotations

import importlib
__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagedlab.llm",
    "SamplingParams": "pagedlab.sampling_params",
    "BeamSearchParams": "pagedlab.sampling_params",
    "RepetitionDetectionParams": "pagedlab.sampling_params",
    "RequestOutput": "pagedlab.outputs",
    "CompletionOutput": "pagedlab.outputs",
    "Logprob": "pagedlab.logprobs",
    "FlatLogprobs": "pagedlab.logprobs",
    "RequestMetrics": "pagedlab.outputs",
    "EngineStats": "pagedlab.outputs",
    "BeamSearchOutput": "pagedlab.outputs",
    "BeamSearchSequence": "pagedlab.outputs",
    "EngineConfig": "pagedlab.config",
    "EngineInfo": "pagedlab.config",
    "EngineArgs": "pagedlab.cli.engine_args",
    "LLMEngine": "pagedlab.engine.engine",
    "TextPrompt": "pagedlab.inputs",
    "TokensPrompt": "pagedlab.inputs",
    "LoRARequest": "pagedlab.lora.request",
}

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RepetitionDetectionParams", "RequestOutput",
           "CompletionOutput", "Logprob", "FlatLogprobs", "RequestMetrics", "EngineStats", "BeamSearchOutput",
           "BeamSearchSequence", "EngineConfig", "EngineInfo", "EngineArgs", "LLMEngine",
           "TextPrompt", "TokensPrompt", "LoRARequest", "__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedlab' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__():
    return __all__
