"""Engine core: requests, scheduler, KV cache manager, model runner and the step loop."""

from pagedlab.engine.engine import LLMEngine

__all__ = ["LLMEngine"]
