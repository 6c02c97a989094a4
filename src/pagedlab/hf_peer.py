"""The HF transformers peer of ``pagedlab bench`` (docs/benchmarks.md): a model of the benchmark's
shape with random weights, in bfloat16, or quantized to FP8 the way a transformers user gets it.

``--backend hf --quantization fp8`` builds the random bfloat16 model, then hands its weights to
``from_pretrained(None, config=..., state_dict=..., quantization_config=FineGrainedFP8Config())``:
transformers' own loader swaps the linear layers for its ``FP8Linear`` and quantizes each weight
as it loads it (E4M3, one scale per 128x128 block; activations quantized per token and 128-wide
group at run time), exactly as from a bfloat16 checkpoint on disk, without writing one (16 GB for
the Llama-3-8B shape). The LM head and embeddings stay bfloat16, as transformers leaves them.
"""

from __future__ import annotations

import copy
import json

import torch

HF_QUANTIZATIONS = (None, "fp8")


def check_hf_quantization(quantization: str | None, with_lora: bool = False) -> None:
    """A ValueError unless the HF peer runs ``quantization`` (None: bfloat16; "fp8":
    ``FineGrainedFP8Config``) on this machine, with LoRA adapters if ``with_lora``; called
    before any model is built."""
    _check_known(quantization)
    if quantization is not None and with_lora:
        raise ValueError(f"--num-loras with --backend hf runs PEFT adapters on bfloat16 weights only, not "
                         f"with --quantization {quantization}: run the HF peer without --quantization")
    if quantization == "fp8":
        reason = fp8_unavailable()
        if reason is not None:
            raise ValueError(f"--backend hf --quantization fp8 (transformers' FineGrainedFP8Config) cannot "
                             f"run here: {reason}")


def _check_known(quantization: str | None) -> None:
    if quantization not in HF_QUANTIZATIONS:
        raise ValueError(f"--backend hf with --quantization {quantization} is not supported: the HF "
                         "transformers peer runs no quantization (bfloat16) or fp8 (transformers' "
                         "FineGrainedFP8Config)")


def fp8_unavailable() -> str | None:
    """Why transformers' FineGrainedFP8 cannot run a forward pass here, or None when it can."""
    if not torch.cuda.is_available():
        return "it needs a CUDA GPU (transformers raises 'No GPU or XPU found' without one)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return (f"it needs compute capability 8.9 or higher, this GPU has {major}.{minor} (transformers "
                "would dequantize the weights back to bfloat16)")
    return fp8_kernel_unavailable()


def fp8_kernel_unavailable() -> str | None:
    """Why transformers' FP8 matmul kernel does not load, or None when it does. Since 5.x that
    kernel is not in the transformers wheel: ``FP8Linear`` fetches it from the Hugging Face Hub
    through the ``kernels`` package at its first forward pass."""
    try:
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel
    except ImportError:
        return None  # transformers 4.x: its FP8 Triton matmul ships inside transformers
    try:
        load_finegrained_fp8_kernel()
    except Exception as e:  # ImportError without `kernels`; a Hub download error without network
        return f"transformers' FP8 matmul kernel does not load ({type(e).__name__}: {e})"
    return None


def load_hf_peer(hf_config, dtype: torch.dtype = torch.bfloat16, quantization: str | None = None):
    """HF transformers model of ``hf_config``'s shape with random weights, on the GPU when there is
    one, sdpa attention; ``quantization="fp8"`` quantizes it through ``FineGrainedFP8Config``
    (see the module docstring) and checks that its linear layers hold FP8 weights."""
    import transformers

    _check_known(quantization)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype,
                                                              attn_implementation="sdpa")
    if quantization == "fp8":
        model = reload_with(model, transformers.FineGrainedFP8Config())
        check_fp8_linears(model)
    return model.eval()


def reload_with(model, quantization_config):
    """``model`` loaded again by ``from_pretrained`` from its own weights (no checkpoint on disk)
    with ``quantization_config`` (None: as it is), on its device."""
    state = model.state_dict()
    device = model.device
    config = copy.deepcopy(model.config)  # from_pretrained records the quantization in the config
    cls, dtype = type(model), model.dtype
    reloaded = cls.from_pretrained(None, config=config, state_dict=state, dtype=dtype,
                                   quantization_config=quantization_config,
                                   device_map={"": device}, attn_implementation="sdpa")
    del state
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return reloaded.eval()


def check_fp8_linears(model) -> int:
    """The number of transformers ``FP8Linear`` layers in ``model``; a RuntimeError if there are
    none or one holds weights that are not float8_e4m3fn (transformers leaves a weight whose
    shape is not a multiple of its block size in 16 bits)."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    layers = {name: m.weight.dtype for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    wrong = {name: dtype for name, dtype in layers.items() if dtype != torch.float8_e4m3fn}
    if not layers or wrong:
        raise RuntimeError(f"the HF FP8 peer is not quantized: {len(layers)} FP8Linear layers"
                           + (f", these not float8_e4m3fn: {wrong}" if wrong else ""))
    return len(layers)


def weight_bytes(model) -> int:
    """Bytes of ``model``'s parameters (FP8 weights, their scales and the 16-bit rest), each
    shared parameter once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_weight_bytes(model) -> int:
    """The weight bytes a decode step reads: all parameters less the input embedding (a step
    reads its tokens' rows only), unless the embedding is also the LM head (tied)."""
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight
    return weight_bytes(model) - (0 if tied else embedding.numel() * embedding.element_size())


def row_record(model, quantization: str | None) -> dict:
    """What a benchmark row of the peer records about its weights (``WorkloadResult.extra``)."""
    record = {"quantization": quantization, "weight_gib": weight_bytes(model) / 2**30}
    if quantization is not None:
        config = model.config.quantization_config
        # a JSON round trip: the config holds tuples and an enum
        record["quantization_config"] = json.loads(json.dumps(config.to_dict() if hasattr(config, "to_dict")
                                                              else config))
    return record
