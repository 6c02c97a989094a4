"""Helpers for the server, AsyncEngine and lm-eval tests (no tests here).

``build_tiny_chat_model`` writes a tiny random Llama with a real (byte-level BPE) tokenizer and a
chat template into a directory, so text prompts, chat, stop strings and detokenization all run
on CPU in milliseconds. The model's vocabulary is exactly the tokenizer's, so every sampled id
decodes.
"""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Why is the sky blue? Because air scatters blue light more than red light.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "A server streams tokens to many clients at once, one step at a time.",
    "Question: what is two plus two?\nAnswer: four.",
    "Once upon a time there was a small language model that liked numbers: 0 1 2 3 4 5 6 7 8 9.",
    "user assistant system hello world, how are you today? I am fine, thank you!",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

TINY_KV_BYTES = 8 << 20


def build_tiny_chat_model(directory: Path, seed: int = 0, max_position_embeddings: int = 512) -> str:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    directory = Path(directory)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    vocab = tok.get_vocab_size()
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=max_position_embeddings, initializer_range=0.2,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(directory)
    return str(directory)


THINKING_TEMPLATE = (  # Qwen3's layout; the generation prompt opens the thinking section, as Qwen3-2507's
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


def build_tiny_thinking_model(directory: Path, seed: int = 0) -> str:
    """A tiny random Qwen3 whose byte-level BPE tokenizer has ``<think>`` and ``</think>`` as
    single special tokens, with ``THINKING_TEMPLATE`` as its chat template."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from conftest import build_tiny_model

    directory = Path(directory)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    fast.chat_template = THINKING_TEMPLATE
    fast.save_pretrained(directory)
    build_tiny_model(directory, "qwen3", seed=seed, vocab_size=tok.get_vocab_size())
    return str(directory)
