"""``pagedlab bench serve``'s prompts and figures, without a server: hand-computed references."""

from __future__ import annotations

import json

from pagedlab.server.bench_serve import load_dataset


def test_output_len_flag_overrides_the_datasets_lengths(tmp_path):
    """``--output-len`` is every request's output length, as vLLM's; without it a record's
    ``output_len`` (or ``max_tokens``) holds, and 128 where a record gives none."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in (
        {"prompt": "a", "output_len": 4}, {"prompt": "b", "max_tokens": 9}, {"prompt": "c"})))
    assert [s.output_len for s in load_dataset(str(data), 3, 7, shuffle=False)] == [7, 7, 7]
    assert [s.output_len for s in load_dataset(str(data), 3, None, shuffle=False)] == [4, 9, 128]
