"""Tokenizer drift: two tokenizers of one vocabulary, and what their differences do to outputs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pagedlab.lab.repro.common import (DEFAULT_PROMPTS, CheckResult, NoProgress, corpus_bleu,
                                       greedy_params, reference_scores, verdict)
from pagedlab.lab.repro.compare import first_divergence


def load_tokenizer(tok):
    """A tokenizer as it is, or one loaded from a path with transformers (a path it cannot load
    is a ValueError naming it)."""
    if not isinstance(tok, (str, Path)):
        return tok
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(str(tok))
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer {str(tok)!r} could not be loaded (give a directory with tokenizer.json "
                         f"or tokenizer_config.json): {e}") from None


def tokenizer_drift(tokenizer_a, tokenizer_b, prompts: Sequence[str] = DEFAULT_PROMPTS, llm=None,
                    references: Sequence | None = None, max_tokens: int = 16,
                    num_examples: int = 3, progress=None) -> CheckResult:
    """Tokenize ``prompts`` (text) with two tokenizers (paths or loaded tokenizers): the fraction of
    prompts tokenized differently, up to ``num_examples`` examples side by side, and, with ``llm``
    (a pagedlab LLM whose vocabulary both tokenizers share), greedy outputs from each tokenization
    decoded by its own tokenizer: exact match between the two and BLEU (against ``references``
    when given, else B's outputs against A's). ``progress`` (see ``NoProgress``) counts the
    tokenizing and the generating."""
    progress = progress if progress is not None else NoProgress()
    progress.reset(total=2 if llm is not None else 1)
    tok_a, tok_b = load_tokenizer(tokenizer_a), load_tokenizer(tokenizer_b)
    texts = [p for p in prompts if isinstance(p, str)]
    if not texts:
        raise ValueError("the tokenizer check needs text prompts")
    if references is not None:  # token-id prompts have no text to tokenize: their references go too
        references = [r for p, r in zip(prompts, references, strict=True) if isinstance(p, str)]
    ids_a = [list(tok_a(t).input_ids) for t in texts]
    ids_b = [list(tok_b(t).input_ids) for t in texts]
    diff = [i for i, (a, b) in enumerate(zip(ids_a, ids_b)) if a != b]
    examples = [{"prompt": texts[i], "a_ids": ids_a[i], "b_ids": ids_b[i],
                 "a_tokens": tok_a.convert_ids_to_tokens(ids_a[i]),
                 "b_tokens": tok_b.convert_ids_to_tokens(ids_b[i]),
                 "first_divergence": first_divergence(ids_a[i], ids_b[i])} for i in diff[:num_examples]]
    metrics: dict = {"num_prompts": len(texts), "fraction_tokenized_differently": len(diff) / len(texts),
                     "mean_tokens_a": sum(map(len, ids_a)) / len(texts),
                     "mean_tokens_b": sum(map(len, ids_b)) / len(texts)}
    differs = bool(diff)
    progress.update()
    if llm is not None:
        gen_a, gen_b = _generate_both(llm, ids_a, ids_b, tok_a, tok_b, max_tokens)
        metrics.update(_output_metrics(gen_a, gen_b, references))
        for ex in examples:
            i = texts.index(ex["prompt"])
            ex["a_output"], ex["b_output"] = gen_a[i], gen_b[i]
        differs = differs or metrics["output_exact_match"] < 1.0
        progress.update()
    if differs:
        summary = f"{len(diff)}/{len(texts)} prompts tokenized differently"
        if "output_exact_match" in metrics:
            summary += f"; outputs identical for {metrics['output_exact_match']:.0%}"
        for key in ("bleu_delta", "bleu_b_vs_a"):
            if key in metrics:
                summary += f"; {key} {metrics[key]:.3g}"
        if examples:
            ex = examples[0]
            summary += f"\n    e.g. {ex['prompt']!r}:\n      A {ex['a_tokens']}\n      B {ex['b_tokens']}"
    else:
        summary = f"both tokenizers give the same ids for all {len(texts)} prompts"
    return CheckResult("tokenizer", verdict(differs), summary, metrics, {"examples": examples},
                       {"tokenizer_a": str(tokenizer_a) if isinstance(tokenizer_a, (str, Path)) else None,
                        "tokenizer_b": str(tokenizer_b) if isinstance(tokenizer_b, (str, Path)) else None,
                        "max_tokens": max_tokens})


def _generate_both(llm, ids_a, ids_b, tok_a, tok_b, max_tokens: int) -> tuple[list[str], list[str]]:
    """Greedy outputs of each tokenization, decoded by its own tokenizer."""
    params = greedy_params(max_tokens, None, ignore_eos=False)
    outs_a = llm.generate([{"prompt_token_ids": p} for p in ids_a], params, use_tqdm=False)
    outs_b = llm.generate([{"prompt_token_ids": p} for p in ids_b], params, use_tqdm=False)
    return ([tok_a.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outs_a],
            [tok_b.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outs_b])


def _output_metrics(gen_a: list[str], gen_b: list[str], references: Sequence | None) -> dict:
    """Exact match between the two outputs, and BLEU and exact match against the references (or
    B's BLEU against A's outputs without references)."""
    metrics: dict = {"output_exact_match": sum(a == b for a, b in zip(gen_a, gen_b)) / len(gen_a)}
    if references is None:
        b = corpus_bleu(gen_b, gen_a)
        if b is not None:
            metrics["bleu_b_vs_a"] = b
        return metrics
    scores_a, scores_b = reference_scores(gen_a, references), reference_scores(gen_b, references)
    metrics.update({f"{k}_a": v for k, v in scores_a.items()} | {f"{k}_b": v for k, v in scores_b.items()})
    if "bleu" in scores_a:
        metrics["bleu_delta"] = scores_b["bleu"] - scores_a["bleu"]
    return metrics
