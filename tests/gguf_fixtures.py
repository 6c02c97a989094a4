"""Tiny GGUF files written from the tiny random HF models, as llama.cpp's convert_hf_to_gguf.py lays
them out (its metadata keys and tensor names, Llama's rotary permutation of q and k), quantized with
the ``gguf`` package. The reference they are checked against is transformers' own GGUF loading."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _permute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's interleaving of each head's rotary halves (transformers undoes it on load)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def _add_tokenizer(writer, tokenizer_dir: Path) -> None:
    """The byte-level BPE tokenizer of ``tokenizer_dir`` (tests/test_server_support.py's) as GGUF fields."""
    import gguf

    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    kinds = gguf.TokenType
    writer.add_token_types([kinds.CONTROL if t in special else kinds.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(vocab[config["bos_token"]])
    writer.add_eos_token_id(vocab[config["eos_token"]])
    writer.add_pad_token_id(vocab[config["pad_token"]])
    writer.add_add_bos_token(True)
    writer.add_chat_template((tokenizer_dir / "chat_template.jinja").read_text())


def write_tiny_gguf(path: Path, hf_model, qtype: str = "F32", tokenizer_dir: Path | None = None,
                    split_max_tensors: int = 0, leave_out: tuple[str, ...] = ()) -> None:
    """``hf_model`` (a Llama, Mistral, Qwen2 or Qwen3) as a GGUF file: its 2-D weights in ``qtype``
    (a ``gguf.GGMLQuantizationType`` name gguf.quants can write), norms in F32, with the tokenizer
    of ``tokenizer_dir`` if given; ``split_max_tensors`` splits it as llama-gguf-split does, and the
    HF weights named in ``leave_out`` are not written."""
    import gguf

    cfg = hf_model.config
    arch = {"mistral": "llama"}.get(cfg.model_type, cfg.model_type)
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if tokenizer_dir is not None:
        _add_tokenizer(writer, Path(tokenizer_dir))
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    quant = gguf.GGMLQuantizationType[qtype]
    for name, tensor in hf_model.state_dict().items():
        if name in leave_out or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue
        base, suffix = name.rsplit(".", 1)
        weight = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            weight = _permute_rotary(weight, heads)
        if weight.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", gguf.quants.quantize(weight, quant),
                              raw_dtype=quant)
        else:
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
