"""``pagedlab bench serve``'s prompts: random token ids of exact lengths (vLLM's random dataset),
or the records of a JSON/JSONL file, ShareGPT conversations sampled as vLLM samples them."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass
class RequestSpec:
    """One request to send: its prompt (text or token ids), its prompt length where known and
    its output length."""

    prompt: str | list[int]
    prompt_len: int | None  # known for token-id prompts and ShareGPT's (counted by the server)
    output_len: int | None


def check_range_ratio(range_ratio: float) -> None:
    """A ValueError naming ``--random-range-ratio`` unless it is in [0, 1)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio={range_ratio} is invalid: it must be in [0, 1)")


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int,
                    range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0) -> list[RequestSpec]:
    """Random token-id prompts; lengths uniform in [len * (1 - r), len * (1 + r)] (vLLM's random
    dataset), each after a shared random prefix of ``prefix_len`` tokens."""
    check_range_ratio(range_ratio)
    if input_len < 1 or output_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]

    def length(n: int) -> int:
        return max(1, rng.randint(math.floor(n * (1 - range_ratio)), math.ceil(n * (1 + range_ratio))))

    specs = []
    for _ in range(num_prompts):
        ids = prefix + [rng.randrange(vocab_size) for _ in range(length(input_len))]
        specs.append(RequestSpec(ids, len(ids), length(output_len)))
    return specs


def sharegpt_spec(record: dict, output_len: int | None, count_tokens) -> RequestSpec | None:
    """vLLM's ShareGPT sample of a record: the first turn is the prompt, and the second's token
    count the output length (unless ``output_len``); None for fewer than two turns, or a pair vLLM
    skips: under 4 tokens (the reply's only when it sets the length), a prompt over 1,024 tokens,
    or prompt and output over 2,048. ``count_tokens(text)`` counts as the model's tokenizer."""
    turns = [t for t in record["conversations"] if isinstance(t, dict)]
    if len(turns) < 2 or not turns[0].get("value"):
        return None
    prompt = turns[0]["value"]
    prompt_len = count_tokens(prompt)
    out = output_len if output_len is not None else count_tokens(turns[1].get("value", ""))
    if prompt_len < 4 or (output_len is None and out < 4) or prompt_len > 1024 or prompt_len + out > 2048:
        return None
    return RequestSpec(prompt, prompt_len, out)  # vLLM's prompt_len, kept where the server gives no usage


def load_dataset(path: str, num_prompts: int, output_len: int | None, seed: int = 0, shuffle: bool = True,
                 count_tokens=None) -> list[RequestSpec]:
    """``num_prompts`` requests from a JSON list or JSONL file (see the module doc), the records
    shuffled by ``seed`` first, cycled through when too few: ``output_len`` (``--output-len``) is
    every request's, else a record's ``output_len`` or ``max_tokens``, else 128; ShareGPT records
    go through ``sharegpt_spec`` with ``count_tokens``."""
    text = Path(path).read_text()
    try:
        records = json.loads(text)
        if isinstance(records, dict):
            records = records.get("data") or records.get("requests") or [records]
    except json.JSONDecodeError:
        records = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i} is not valid JSON: {e}") from None
    order = list(range(len(records)))
    if shuffle:
        random.Random(seed).shuffle(order)
    specs = []
    for i in order:
        spec = _record_spec(records[i], f"record {i} of {path}", output_len, count_tokens)
        if spec is not None:
            specs.append(spec)
        if len(specs) == num_prompts:
            break
    if not specs:
        raise ValueError(f"{path} holds no usable prompts")
    if num_prompts > len(specs):  # cycle through the file
        specs = [specs[i % len(specs)] for i in range(num_prompts)]
    return specs[:num_prompts]


def _record_spec(r, where: str, output_len: int | None, count_tokens) -> RequestSpec | None:
    if not isinstance(r, dict):
        raise ValueError(f"{where} is not an object")
    if "prompt_token_ids" not in r and "prompt" not in r:
        if "conversations" not in r:
            raise ValueError(f"{where} has no 'prompt', 'prompt_token_ids' or 'conversations'")
        if count_tokens is None:
            raise ValueError(f"{where} is a ShareGPT conversation: sizing it needs count_tokens")
        return sharegpt_spec(r, output_len, count_tokens)
    prompt = r["prompt_token_ids"] if "prompt_token_ids" in r else r["prompt"]
    if not prompt:
        return None
    out = output_len if output_len is not None else r.get("output_len", r.get("max_tokens"))
    return RequestSpec(prompt, len(prompt) if isinstance(prompt, list) else None,
                       int(out) if out is not None else 128)


