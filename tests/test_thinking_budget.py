"""``thinking_token_budget``: B tokens in a thinking section, then the end marker, counted here from
the output ids alone (the span between the last start marker and the end marker); the B tokens
are the model's own (the unlimited run's); unlimited is token-identical to no budget; the count
holds under the asynchronous step loop and speculative decoding; bad values and configurations
are ValueErrors naming them."""

from __future__ import annotations

import pytest

import torch

from pagedlab import LLM, SamplingParams
from pagedlab.engine.step_inputs import HostToDevice, build_sampling_metadata
from pagedlab.engine.thinking_budget import ThinkingBudget, ThinkingMarkers, thinking_markers
from pagedlab.layers.sampler import Sampler
from pagedlab.sampling_params import StructuredOutputsParams
from test_server_support import TINY_KV_BYTES, build_tiny_thinking_model

QWEN3 = {"reasoning_parser": "qwen3"}
QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_thinking_model(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES, reasoning_config=QWEN3) as llm:
        yield llm


def ids_of(llm, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def greedy(max_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def generate(llm, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    return llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0].outputs[0].token_ids


def sections(tokens: list[int], start: list[int], end: list[int]) -> list[tuple[int, int | None]]:
    """(first token after each start marker, index of the end marker that closes it or None), found
    by scanning ``tokens`` for the markers: the reference the engine's count is checked against."""
    found, i, opened = [], 0, None
    while i < len(tokens):
        if opened is not None and tokens[i:i + len(end)] == end:
            found.append((opened, i))
            opened, i = None, i + len(end)
        elif tokens[i:i + len(start)] == start:
            opened, i = i + len(start), i + len(start)
        else:
            i += 1
    return found + ([(opened, None)] if opened is not None else [])


def test_validation_names_the_value():
    for bad in (-2, True, 1.5, 2.0, "3"):
        with pytest.raises(ValueError, match=rf"thinking_token_budget={bad!r} is invalid: "
                                             r"thinking_token_budget must be None, -1 \(unlimited\) or an "
                                             r"integer >= 0"):
            SamplingParams(thinking_token_budget=bad)
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None  # vLLM's "unlimited"
    assert SamplingParams(thinking_token_budget=0).thinking_token_budget == 0
    with pytest.raises(ValueError, match=r"thinking_token_budget=4 is invalid: thinking_token_budget must be "
                                         r"None with structured_outputs"):
        SamplingParams(thinking_token_budget=4, structured_outputs=StructuredOutputsParams(regex="a"))


@pytest.mark.parametrize("config, message", [
    ({"reasoning_start": "<think>"}, r"unknown key 'reasoning_start' \(allowed: reasoning_parser, "),
    ({"reasoning_parser": "r2"}, r"reasoning_parser must be one of \['deepseek_r1', 'qwen3'\]"),
    ({"reasoning_start_str": "<think>"}, r"give reasoning_start_str and reasoning_end_str, or a "
                                         r"reasoning_parser"),
    ({}, r"give reasoning_start_str and reasoning_end_str"),
    ({"reasoning_parser": "qwen3", "reasoning_end_str": 7}, r"its values must be strings"),
])
def test_bad_reasoning_configs_name_the_setting(llm, config, message):
    quoted = repr(config).replace("{", r"\{").replace("}", r"\}")
    with pytest.raises(ValueError, match=rf"reasoning_config={quoted} is invalid: {message}"):
        thinking_markers(config, llm.get_tokenizer(), 420)


def test_markers_from_strings_or_the_parser(llm):
    tokenizer, think, end = llm.get_tokenizer(), ids_of(llm, "<think>"), ids_of(llm, "</think>")
    assert len(think) == len(end) == 1
    assert llm.llm_engine.thinking_markers == ThinkingMarkers(tuple(think), tuple(end))
    phrase = thinking_markers({"reasoning_parser": "deepseek_r1", "reasoning_end_str": "so, answer:</think>"},
                              tokenizer, 420)
    assert phrase == ThinkingMarkers(tuple(think), tuple(ids_of(llm, "so, answer:</think>")))
    assert len(phrase.end) > 2 and phrase.end[-1] == end[0]
    with pytest.raises(ValueError, match=r"reasoning_end_str '</think>' encodes to \[6\], not to token "
                                         r"ids in \[0, 6\)"):
        thinking_markers(QWEN3, tokenizer, 6)


def test_a_budget_without_markers_is_refused(model_dir):
    with LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES) as plain:
        with pytest.raises(ValueError, match=r"thinking_token_budget=3 is invalid here: the engine knows no "
                                             r"thinking markers; start it with reasoning_config="):
            plain.generate("hello", greedy(thinking_token_budget=3), use_tqdm=False)
        assert not plain.llm_engine.has_unfinished_requests()
        unlimited = plain.generate("hello", greedy(thinking_token_budget=-1), use_tqdm=False)[0]
        assert len(unlimited.outputs[0].token_ids) == 16
    with pytest.raises(ValueError, match=r"reasoning_config=\{'bogus': 1\} is invalid: unknown key 'bogus'"):
        LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES, reasoning_config={"bogus": 1})


@pytest.mark.parametrize("budget", [0, 1, 2, 5, 9])
def test_a_prompt_opened_section_gets_budget_tokens_then_the_end_marker(llm, budget):
    think, end = ids_of(llm, "<think>"), ids_of(llm, "</think>")
    prompt = ids_of(llm, "Why is the sky blue?") + think
    free = generate(llm, prompt, greedy(24))
    assert not sections(free, think, end)  # the model alone never closes (nor opens) a section here
    out = generate(llm, prompt, greedy(24, thinking_token_budget=budget))
    (first, closed), = sections(prompt + out, think, end)
    assert closed - first == budget and out[:budget] == free[:budget]
    assert out[budget:budget + 1] == end
    # after the marker nothing is forced: the model's own continuation of that prefix
    assert out[budget + 1:] == generate(llm, prompt + out[:budget + 1], greedy(24 - budget - 1))


@pytest.mark.parametrize("budget", [0, 1, 4])
def test_a_chat_template_that_opens_the_section_counts_its_newline(llm, budget):
    """Qwen3-2507's generation prompt ends with "<think>\\n": that newline is the section's first
    token (vLLM counts it too), so budget 0 closes at once, as budget 1 does."""
    think, end = ids_of(llm, "<think>"), ids_of(llm, "</think>")
    out = llm.chat(QUESTION, greedy(12, thinking_token_budget=budget), use_tqdm=False)[0]
    tokens = out.prompt_token_ids + out.outputs[0].token_ids
    (first, closed), = sections(tokens, think, end)
    assert closed - first == max(budget, 1)
    assert out.outputs[0].token_ids[max(budget - 1, 0)] == end[0]
    off = llm.chat(QUESTION, greedy(12, thinking_token_budget=budget), use_tqdm=False,
                   chat_template_kwargs={"enable_thinking": False})[0]
    plain = llm.chat(QUESTION, greedy(12), use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0]
    assert off.outputs[0].token_ids == plain.outputs[0].token_ids  # a closed section: nothing to force


def open_at(think: list[int], positions: set[int]):
    """A logits processor that makes the model write ``<think>`` at these output positions."""
    def processor(output_ids, logits):
        if len(output_ids) in positions:
            logits[:] = float("-inf")
            logits[think[0]] = 0.0
        return logits
    return processor


def test_every_section_the_model_opens_gets_the_budget(llm):
    think, end = ids_of(llm, "<think>"), ids_of(llm, "</think>")
    prompt = ids_of(llm, "Question: what is two plus two?")
    params = greedy(24, thinking_token_budget=3, logits_processors=[open_at(think, {0, 10})])
    out = generate(llm, prompt, params)
    assert out[0] == think[0] and out[10] == think[0]
    assert sections(out, think, end) == [(1, 4), (11, 14)]


def test_a_phrase_before_the_tag_is_forced_whole(model_dir):
    config = {"reasoning_start_str": "<think>", "reasoning_end_str": "so, answer:</think>"}
    with LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES, reasoning_config=config) as llm:
        think, end = ids_of(llm, "<think>"), ids_of(llm, "so, answer:</think>")
        prompt = ids_of(llm, "Why is the sky blue?") + think
        free = generate(llm, prompt, greedy(20))
        for budget in (0, 3):
            out = generate(llm, prompt, greedy(20, thinking_token_budget=budget))
            assert out[:budget] == free[:budget] and out[budget:budget + len(end)] == end
            (first, closed), = sections(prompt + out, think, end)
            assert closed - first == budget


def test_unlimited_is_token_identical_to_no_budget(llm, model_dir):
    prompts = [{"prompt_token_ids": ids_of(llm, "Why is the sky blue?") + ids_of(llm, "<think>")}] * 2

    def run(engine, **budget) -> list:
        params = [greedy(20, logprobs=2, **budget),
                  SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=20, ignore_eos=True, **budget)]
        return [(c.token_ids, c.logprobs) for o in engine.generate(prompts, params, use_tqdm=False)
                for c in o.outputs]

    with LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES) as plain:  # no markers at all
        reference = run(plain)
    assert run(llm) == run(llm, thinking_token_budget=None) == run(llm, thinking_token_budget=-1) == reference


def test_sampled_completions_each_keep_their_count(llm):
    think, end = ids_of(llm, "<think>"), ids_of(llm, "</think>")
    prompt = ids_of(llm, "Once upon a time") + think
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=12, ignore_eos=True,
                            thinking_token_budget=5)
    outs = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs
    assert len({tuple(c.token_ids) for c in outs}) > 1
    for c in outs:
        (first, closed), = sections(prompt + c.token_ids, think, end)
        assert closed - first == 5


def test_the_count_holds_ahead_of_read_back_and_under_speculation(model_dir):
    """Step N+1 is launched before step N's token is read back: a batch whose forced token may
    depend on it samples once it is read back, so the running-ahead loop, the synchronous one and
    n-gram speculation (proposals of the repetitive tiny model, forced rows among them) agree."""
    prompts, params = [], []
    for i, budget in enumerate([0, 1, 2, 3, 6, 11, None, 4]):
        prompts.append({"prompt_token_ids": list(range(20 + i, 30 + 2 * i)) + [5]})  # 5: "<think>"
        params.append(SamplingParams(temperature=0.8 if i % 3 == 2 else 0, seed=i, max_tokens=18 + i,
                                     ignore_eos=True, thinking_token_budget=budget))
    runs = {}
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    for name, args in {"sync": {"async_scheduling": False}, "ahead": {"async_scheduling": True},
                       "ngram": {"speculative_config": ngram}}.items():
        with LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES, reasoning_config=QWEN3, **args) as llm:
            runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            if name == "ngram":
                assert llm.get_stats().spec_decode_num_accepted_tokens > 0
    assert runs["ahead"] == runs["sync"] == runs["ngram"]
    for prompt, p, out in zip(prompts, params, runs["sync"]):
        found = sections(prompt["prompt_token_ids"] + out, [5], [6])
        if p.thinking_token_budget is not None:
            assert found[0][1] - found[0][0] == p.thinking_token_budget


def test_the_loop_still_runs_ahead_with_a_budget(model_dir):
    with LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES, reasoning_config=QWEN3,
             async_scheduling=True) as llm:
        engine = llm.llm_engine
        engine.add_request("r", [30, 31, 5], greedy(6, thinking_token_budget=3))
        counts, outs = [], []
        while engine.has_unfinished_requests():
            outs = engine.step()
            counts.append([len(o.outputs[0].token_ids) for o in outs])
    assert counts == [[], [1], [2], [3], [4], [5], [6]]  # the first call only launches
    assert outs[0].outputs[0].token_ids[3] == 6  # "</think>" after three tokens


def test_which_rows_wait_for_their_pending_tokens():
    """A row waits for the pending tokens before it only where some outcome of them forces it: an
    open section within reach of its budget, or one that could open among them."""
    def waits(budget: int, tokens: list[int], num_pending: int) -> bool:
        tracker = ThinkingBudget(ThinkingMarkers((5,), (6,)), budget, num_prompt_tokens=2)
        return tracker.needs_pending_tokens(tokens, num_pending)

    assert not waits(3, [1, 2], 1)  # closed: a pending "<think>" opens a section of count 0
    assert waits(0, [1, 2], 1)  # ... which budget 0 forces at once
    assert not waits(1, [1, 2], 1) and waits(1, [1, 2], 2)  # two pending tokens: "<think>" and one more
    assert not waits(3, [1, 5, 7], 1)  # count 1, + 1 < 3
    assert waits(3, [1, 5, 7, 7], 1)  # count 2, + 1 reaches 3
    assert not waits(3, [1, 5, 7, 7], 0)  # every token known: built at launch
    assert not waits(3, [1, 5, 7, 6], 1)  # closed again


def test_forced_tokens_by_hand_with_proposals():
    """Markers spanning tokens, a proposal before the row: the forced token as counted by hand."""
    budget = ThinkingBudget(ThinkingMarkers((3, 4), (7, 8)), 2, num_prompt_tokens=2)
    assert budget.forced_token([1, 3]) is None
    assert budget.forced_token([1, 3], [4, 9]) is None  # opened by the proposal: count 1
    assert budget.forced_token([1, 3], [4, 9, 9]) == 7
    assert budget.forced_token([1, 3, 4, 9, 9]) == 7
    assert budget.forced_token([1, 3, 4, 9, 9], [7]) == 8
    assert budget.forced_token([1, 3, 4, 9, 9, 7, 8]) is None  # closed
    assert budget.forced_token([1, 3, 4, 9, 9, 7, 8], [3, 4, 9, 9]) == 7  # a new section, a new budget
    # a prompt that holds more than the budget gets the whole marker at once
    over = ThinkingBudget(ThinkingMarkers((5,), (7, 8)), 1, num_prompt_tokens=5)
    assert over.forced_token([5, 9, 9, 9, 9]) == 7
    assert over.forced_token([5, 9, 9, 9, 9, 7]) == 8
    assert over.forced_token([5, 9, 9, 9, 9, 7, 8]) is None


class _Row:
    """The parts of a scheduled request the sampler's metadata reads: prompt [1, "<think>"], no
    output yet, "</think>" (7) its EOS and a bad word, a thinking budget of 0 where ``forced``."""

    def __init__(self, params: SamplingParams, forced: bool):
        self.sampling_params, self.seed, self.grammar = params, params.seed, None
        self.prompt_token_ids, self.output_token_ids, self.eos_token_ids = [1, 5], [], (7,)
        self.all_token_ids = self.prompt_token_ids
        self.bad_words_token_ids = [[7]]
        markers = ThinkingMarkers((5,), (7,))
        self.thinking = ThinkingBudget(markers, 0, num_prompt_tokens=2) if forced else None


def test_the_forced_token_wins_over_every_other_control():
    """min_tokens' EOS ban, a bad word, a -inf bias, allowed ids, top-k at a high temperature: the
    row forced to "</think>" takes it all the same, and the unforced row keeps its argmax."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0, min_tokens=3, allowed_token_ids=[1, 2]),
              SamplingParams(temperature=1.9, seed=4, top_k=1, logit_bias={7: float("-inf")}),
              SamplingParams(temperature=0.7, top_p=0.5, seed=5), SamplingParams(temperature=0, min_tokens=3)]
    rows = [_Row(p, forced=i < 3) for i, p in enumerate(params)]
    meta = build_sampling_metadata(rows, HostToDevice(torch.device("cpu")), 50, [0] * 4, 0)
    tokens = Sampler()(logits.clone(), meta).token_ids.tolist()
    unforced = logits[3].clone()
    unforced[7] = float("-inf")
    assert tokens == [7, 7, 7, unforced.argmax().item()]
