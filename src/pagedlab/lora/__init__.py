"""LoRA adapters: ``request`` (``LoRARequest``), ``adapter`` (reading PEFT directories),
``ops`` (the token-to-slot mapping and the torch shrink/expand), ``layers`` (``LoRALinear``
around the model's projections), ``manager`` (GPU slots and the CPU cache, both LRU),
``random_adapter`` (random adapters in PEFT's format for a model's shape) and ``bench``
(adapters spread over a benchmark's requests, and the HF+PEFT peer). See docs/lora.md."""
