"""Tiny random models for tests, examples and trying the lab without a checkpoint (no downloads)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_CORPUS = (
    "the quick brown fox jumps over the lazy dog",
    "a cat sat on the mat and the dog sat on the log",
    "what is the capital of france paris is the capital of france",
    "two plus two is four and three plus three is six",
    "translate hello to french bonjour translate goodbye to french au revoir",
    "question answer yes no true false one two three four five six seven eight nine ten",
)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")


def make_tiny_model(path: str | Path, tokenizer: bool = True, corpus=DEFAULT_CORPUS, vocab_size: int = 512,
                    hidden_size: int = 64, num_layers: int = 2, max_position_embeddings: int = 512,
                    seed: int = 0) -> Path:
    """Save a random Llama (64 hidden, 2 layers, GQA 4/2 heads) to ``path`` in HF layout. With
    ``tokenizer``, also a word-level tokenizer trained on ``corpus`` with a chat template, and the
    model's vocabulary is the tokenizer's (so every sampled id decodes to a word)."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fast = None
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                            show_progress=False)
        tok.train_from_iterator(list(corpus), trainer)
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                    eos_token="</s>", pad_token="<unk>")
        fast.chat_template = CHAT_TEMPLATE
        vocab_size = len(fast)
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    if fast is not None:
        fast.save_pretrained(path)
    return path
