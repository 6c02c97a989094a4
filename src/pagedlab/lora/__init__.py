"""LoRA adapters: ``request`` (``LoRARequest``), ``adapter`` (reading PEFT directories),
``ops`` (the token-to-slot mapping and the torch shrink/expand), ``layers`` (``LoRALinear``
around the model's projections) and ``manager`` (GPU slots and the CPU cache, both LRU).
See docs/lora.md."""
