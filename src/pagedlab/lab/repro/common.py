"""What the reproducibility checks share: the result record, the default prompts, prompt files,
encoding, greedy sampling params and corpus BLEU."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedlab.sampling_params import SamplingParams

DEFAULT_PROMPTS = (
    "The capital of France is",
    "Explain why the sky is blue in one sentence.",
    "Write a short poem about the sea.",
    "Question: what is two plus two?\nAnswer:",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Translate to French: good morning, my friend.",
    "def fibonacci(n):",
)
ALL_CHECKS = ("batch", "seeds", "precision", "tokenizer", "padding", "hf", "lora", "spec")


class NoProgress:
    """Where a check reports its progress when nobody watches. A check takes ``progress``: an
    object with tqdm's ``reset(total=N)`` (called once, with the check's units of work: prompts,
    seeds, dtypes, variants) and ``update(n=1)`` (after each unit); a ``tqdm`` bar is one."""

    def reset(self, total: int | None = None) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass


@dataclass
class CheckResult:
    """The outcome of one check: ``verdict`` is "same" or "differs"; ``metrics`` are flat numbers
    (stored as the run's metrics); ``details`` holds per-variant numbers and examples."""

    check: str
    verdict: str
    summary: str
    metrics: dict[str, float] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def same(self) -> bool:
        return self.verdict == "same"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def format(self) -> str:
        """A few human-readable lines: the verdict, the summary and the numbers."""
        lines = [f"[{self.check}] {self.verdict.upper()}: {self.summary}"]
        for k, v in self.metrics.items():
            lines.append(f"    {k:<40} {_fmt(v)}")
        return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def verdict(differs: bool) -> str:
    return "differs" if differs else "same"


# ---- prompts ---------------------------------------------------------------------------------------
def load_prompts(path: str | Path) -> tuple[list, list | None]:
    """Prompts (and references, when given) from a file: ``.jsonl`` lines with "prompt" (text) or
    "prompt_token_ids" and optional "reference"; ``.json`` a list of such objects or strings; any
    other file, one text prompt per non-empty line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--prompts {str(path)!r} is not a file")
    text = path.read_text()
    if path.suffix not in (".jsonl", ".json"):
        prompts = [line for line in text.splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"--prompts {str(path)!r} holds no prompts")
        return prompts, None
    try:
        lines = [line for line in text.splitlines() if line.strip()]
        items = json.loads(text) if path.suffix == ".json" else [json.loads(line) for line in lines]
    except ValueError as e:
        raise ValueError(f"--prompts {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(items, list) or not items:
        raise ValueError(f"--prompts {str(path)!r} holds no prompts: give a non-empty list of objects with "
                         "'prompt' or 'prompt_token_ids' (or of strings)")
    pairs = [_prompt_item(item, i, path) for i, item in enumerate(items)]
    refs = [r for _, r in pairs]
    return [p for p, _ in pairs], (refs if any(r is not None for r in refs) else None)


def _prompt_item(item, i: int, path: Path) -> tuple:
    """One (prompt, reference) of a JSON prompt file: text, or a list of token ids; the reference
    text, or a non-empty list of texts (any of which counts as a match)."""
    where = f"--prompts {str(path)!r} item {i}"
    if isinstance(item, str):
        return item, None
    if not isinstance(item, dict) or not ("prompt" in item or "prompt_token_ids" in item):
        raise ValueError(f"{where} has no 'prompt' or 'prompt_token_ids'")
    ref = item.get("reference")
    if ref is not None and not (isinstance(ref, str) or (isinstance(ref, list) and ref
                                                         and all(isinstance(r, str) for r in ref))):
        raise ValueError(f"{where}: 'reference' is {ref!r:.80}, not text or a non-empty list of texts")
    if "prompt" in item:
        if not isinstance(item["prompt"], str):
            raise ValueError(f"{where}: 'prompt' is {item['prompt']!r:.80}, not text")
        return item["prompt"], ref
    ids = item["prompt_token_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise ValueError(f"{where}: 'prompt_token_ids' is {ids!r:.80}, not a non-empty list of token ids")
    return list(ids), ref


def encode_all(llm, prompts: Sequence) -> list[list[int]]:
    """Token ids of each prompt (text through the engine's tokenizer; id lists as they are)."""
    if not prompts:
        raise ValueError("no prompts: give at least one prompt (text or token ids)")
    out = []
    for p in prompts:
        if isinstance(p, str):
            tok = llm.get_tokenizer()
            if tok is None:
                raise ValueError("text prompts need a tokenizer, and this model has none: give token-id "
                                 "prompts")
            out.append(list(tok(p).input_ids))
        elif isinstance(p, dict):
            out.append(encode_all(llm, [p.get("prompt_token_ids", p.get("prompt"))])[0])
        else:
            out.append([int(t) for t in p])
    return out


def greedy_params(max_tokens: int, logprobs: int | None = 0, ignore_eos: bool = True):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=ignore_eos)


def reference_scores(texts: list[str], references: Sequence) -> dict[str, float]:
    """Exact match (the stripped text equals any of the prompt's references) and corpus BLEU
    (against its first) over the prompts that have a reference; {} when none has one."""
    pairs = [(t, [r] if isinstance(r, str) else list(r)) for t, r in zip(texts, references) if r]
    if not pairs:
        return {}
    scores = {"exact_match": sum(t.strip() in {r.strip() for r in rs} for t, rs in pairs) / len(pairs)}
    bleu = corpus_bleu([t for t, _ in pairs], [rs[0] for _, rs in pairs])
    if bleu is not None:
        scores["bleu"] = bleu
    return scores


def corpus_bleu(hyps: list[str], refs: list[str]) -> float | None:
    try:
        import sacrebleu
    except ImportError:
        return None
    return float(sacrebleu.corpus_bleu(hyps, [refs]).score)
