"""vLLM's ``SamplingParams.repetition_detection``: the detector on sequences written by hand and
against a brute-force reference, reading the output's tail alone; ``RepetitionDetectionParams``'
errors (vLLM's rules); and ``LLM.generate`` cutting a tiny model's output exactly where a forced
pattern reaches ``min_count``, with vLLM's finish_reason "repetition" and stop_reason
"repetition_detected", its precedence (EOS and stop ids, then length, then repetition; a stop string
in the same token wins), ``min_tokens``, ``n`` > 1, asynchronous and speculative steps."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

import pagedlab
from conftest import KV_BYTES
from pagedlab import LLM, SamplingParams
from pagedlab.engine.repetition import ends_in_repetition
from pagedlab.sampling_params import RepetitionDetectionParams, UnknownArgumentError
from test_server_support import TINY_KV_BYTES, build_tiny_chat_model


def rd(max_pattern_size: int, min_count: int, min_pattern_size: int = 0) -> RepetitionDetectionParams:
    return RepetitionDetectionParams(max_pattern_size=max_pattern_size, min_pattern_size=min_pattern_size,
                                     min_count=min_count)


def reference(output: list[int], params: RepetitionDetectionParams) -> bool:
    """The definition, spelled out: some size's last ``size * min_count`` tokens are its last
    ``size`` tokens ``min_count`` times over."""
    for size in range(max(params.min_pattern_size, 1), params.max_pattern_size + 1):
        span = size * params.min_count
        if span <= len(output) and output[-span:] == output[-size:] * params.min_count:
            return True
    return False


# ---- the detector ---------------------------------------------------------------------------------
@pytest.mark.parametrize("output, params, found", [
    ([7, 7, 7], rd(1, 3), True),  # size 1, exactly min_count
    ([7, 7], rd(1, 3), False),  # one short
    ([1, 7, 7, 7], rd(1, 3), True),  # what comes before the repetition does not matter
    ([7, 7, 7, 8], rd(1, 3), False),  # only the end counts: the run is over
    ([1, 2, 1, 2, 1, 2], rd(2, 3), True),  # size 2
    ([2, 1, 2, 1, 2], rd(2, 3), False),  # two and a half copies
    ([1, 2, 1, 2], rd(4, 2), True),
    ([5, 1, 2, 3, 1, 2, 3], rd(3, 2), True),  # size 3 = max_pattern_size
    ([5, 1, 2, 3, 1, 2, 3], rd(2, 2), False),  # the pattern is longer than max_pattern_size
    ([5, 1, 2, 3, 1, 2, 3], rd(5, 2, min_pattern_size=4), False),  # and shorter than min_pattern_size
    ([4, 4, 4, 4, 4], rd(3, 3), True),  # min_pattern_size 0 means 1
    ([4, 4, 4, 4, 4], rd(3, 3, min_pattern_size=1), True),
    ([4, 4, 4, 4, 4], rd(3, 3, min_pattern_size=2), False),  # [4, 4] three times needs six
    ([4, 4, 4, 4, 4, 4], rd(3, 3, min_pattern_size=2), True),
    ([1, 2, 9, 1, 2, 8, 1, 2], rd(3, 3), False),  # [1, 2] three times, but not in a row
    ([1, 2, 1, 2, 9, 1, 2], rd(3, 3), False),
    ([3, 1, 2, 3, 1, 2, 3], rd(3, 3), False),  # [3, 1, 2] twice and a third one cut short
    ([9, 9, 9, 9], rd(0, 0), False),  # max_pattern_size 0: no detection
    ([], rd(2, 2), False),
])
def test_hand_computed_sequences(output, params, found):
    assert ends_in_repetition(output, params) is found
    assert reference(output, params) is found  # the reference agrees with the hand


def test_only_output_tokens_count():
    prompt = [3, 3, 3, 3]
    assert not ends_in_repetition(prompt + [3], rd(1, 3), num_prompt_tokens=4)
    assert not ends_in_repetition(prompt + [3, 3], rd(1, 3), num_prompt_tokens=4)
    assert ends_in_repetition(prompt + [3, 3, 3], rd(1, 3), num_prompt_tokens=4)
    assert not ends_in_repetition([1, 2, 1, 2, 1] + [2], rd(2, 2), num_prompt_tokens=5)


def test_agrees_with_the_definition_on_random_sequences():
    rng = random.Random(0)
    found = 0
    for _ in range(4000):
        big = rng.randint(0, 6)
        params = rd(big, rng.randint(2, 4), min_pattern_size=rng.randint(0, big))
        prompt = [rng.randint(0, 2) for _ in range(rng.randint(0, 4))]
        output = [rng.randint(0, 2) for _ in range(rng.randint(0, 14))]
        want = reference(output, params)
        assert ends_in_repetition(prompt + output, params, len(prompt)) is want, (prompt, output, params)
        found += want
    assert 200 < found < 3800  # both answers were tried often


class _Untouchable:
    """A token the detector must never compare: it lies before the tail (or in the prompt)."""

    def __eq__(self, other):
        raise AssertionError("the detector read a token outside the output's tail")

    __ne__ = __eq__
    __hash__ = object.__hash__


@pytest.mark.parametrize("tail, params, found", [
    ([5, 6, 7] * 4, rd(3, 4), True),
    ([1, 2, 3] + [5, 6, 7] * 3, rd(3, 4), False),
    ([8] * 12, rd(6, 2, min_pattern_size=6), True),
    ([1, 2, 3, 4, 5] + [8] * 7, rd(6, 2, min_pattern_size=4), False),  # sizes 4-6 all match the last 8
    (list(range(12)), rd(6, 2), False),
])
def test_a_long_sequence_is_read_at_its_tail_only(tail, params, found):
    """30,000 tokens that raise when compared, then the last max_pattern_size * min_count (12): the
    answer comes from the tail alone, so each step's check costs the same at any length; and a
    prompt is never read."""
    tokens = [_Untouchable()] * 30_000 + tail
    assert ends_in_repetition(tokens, params, num_prompt_tokens=10) is found
    assert ends_in_repetition([_Untouchable()] * 3 + [7, 7], rd(4, 2), num_prompt_tokens=3)


# ---- RepetitionDetectionParams: vLLM's rules, errors naming the value ----------------------------
@pytest.mark.parametrize("kwargs, says", [
    (dict(max_pattern_size=-1), "max_pattern_size=-1 is invalid: max_pattern_size must be >= 0"),
    (dict(max_pattern_size=3, min_pattern_size=-1, min_count=2),
     "min_pattern_size=-1 is invalid: min_pattern_size must be in [0, max_pattern_size] = [0, 3]"),
    (dict(max_pattern_size=3, min_pattern_size=4, min_count=2), "min_pattern_size=4 is invalid"),
    (dict(min_pattern_size=1), "min_pattern_size=1 is invalid"),  # > max_pattern_size 0, as vLLM
    (dict(max_pattern_size=3, min_count=1), "min_count=1 is invalid: min_count must be >= 2 when "),
    (dict(max_pattern_size=3), "min_count=0 is invalid"),  # vLLM: min_count must be given with a size
    (dict(max_pattern_size="3", min_count=2), "max_pattern_size='3' is invalid: max_pattern_size must be "
                                              "an integer"),
    (dict(max_pattern_size=3.0, min_count=2), "max_pattern_size=3.0 is invalid"),
    (dict(max_pattern_size=3, min_count=True), "min_count=True is invalid"),
])
def test_invalid_params_name_the_value(kwargs, says):
    with pytest.raises(ValueError) as e:
        RepetitionDetectionParams(**kwargs)
    assert says in str(e.value)


def test_valid_params():
    assert rd(0, 0) == RepetitionDetectionParams()  # vLLM's defaults: disabled
    assert RepetitionDetectionParams(min_count=1).min_count == 1  # ignored while max_pattern_size is 0
    numpy_ints = RepetitionDetectionParams(np.int64(4), np.int64(2), np.int64(3))  # a sweep's table
    assert numpy_ints == rd(4, 3, min_pattern_size=2) and type(numpy_ints.min_count) is int
    with pytest.raises(UnknownArgumentError, match="did you mean 'min_count'"):
        RepetitionDetectionParams(max_pattern_size=2, min_cout=2)
    assert pagedlab.RepetitionDetectionParams is RepetitionDetectionParams


def test_sampling_params_field():
    assert SamplingParams().repetition_detection is None
    given = SamplingParams(repetition_detection={"max_pattern_size": 4, "min_count": 3})
    assert given.repetition_detection == rd(4, 3)  # a dict of its fields (a lab YAML's) is converted
    assert given.clone(max_tokens=5).repetition_detection == rd(4, 3)
    assert given.to_dict()["repetition_detection"] == {"max_pattern_size": 4, "min_pattern_size": 0,
                                                       "min_count": 3}
    with pytest.raises(ValueError, match=r"repetition_detection=5 is invalid: repetition_detection must be "
                                         r"None or a RepetitionDetectionParams"):
        SamplingParams(repetition_detection=5)
    with pytest.raises(ValueError, match="min_count=1 is invalid"):
        SamplingParams(repetition_detection={"max_pattern_size": 4, "min_count": 1})


# ---- LLM.generate ---------------------------------------------------------------------------------
PREFIX, CYCLE = [10, 11], [20, 21, 22]
CUT = len(PREFIX) + 3 * len(CYCLE)  # where [20, 21, 22] has come three times in a row: 11 tokens
PROMPT = [1, 40, 41, 42, 43]


def forced(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """A logits processor that makes the model write PREFIX, then CYCLE forever."""
    step = len(output_ids)
    token = PREFIX[step] if step < len(PREFIX) else CYCLE[(step - len(PREFIX)) % len(CYCLE)]
    out = torch.full_like(logits, float("-inf"))
    out[token] = 0.0
    return out


def five_or_six(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """Tokens 5 and 6 alone, equally likely: a seeded coin."""
    out = torch.full_like(logits, float("-inf"))
    out[[5, 6]] = 0.0
    return out


@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory):
    """A tiny random Llama with a tokenizer (so text and stop strings are checked too)."""
    with LLM(build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat")), dtype="float32",
             kv_cache_memory_bytes=TINY_KV_BYTES) as llm:
        yield llm


def _generate(llm, params, prompt=PROMPT):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs


def test_output_is_cut_where_the_pattern_reaches_min_count(chat_llm):
    cycling = PREFIX + CYCLE * 20
    base = SamplingParams(temperature=0.0, max_tokens=40, logits_processors=[forced],
                          repetition_detection=rd(3, 3))
    out, = _generate(chat_llm, base)
    assert out.token_ids == cycling[:CUT] == [10, 11, 20, 21, 22, 20, 21, 22, 20, 21, 22]
    assert (out.finish_reason, out.stop_reason) == ("repetition", "repetition_detected")
    assert out.text == chat_llm.get_tokenizer().decode(cycling[:CUT])  # the last token's text is kept

    out, = _generate(chat_llm, base.clone(max_tokens=CUT - 1))  # one token short of the third copy
    assert out.token_ids == cycling[:CUT - 1] and (out.finish_reason, out.stop_reason) == ("length", None)
    out, = _generate(chat_llm, base.clone(max_tokens=CUT))  # both at once: vLLM checks the length first
    assert out.token_ids == cycling[:CUT] and out.finish_reason == "length"
    out, = _generate(chat_llm, base.clone(stop_token_ids=[22]))  # a stop id first too
    assert out.token_ids == PREFIX + CYCLE and (out.finish_reason, out.stop_reason) == ("stop", 22)
    # min_tokens holds detection off (as every stop), then the repeating tail ends it at once
    out, = _generate(chat_llm, base.clone(min_tokens=CUT + 2))
    assert out.token_ids == cycling[:CUT + 2] and out.finish_reason == "repetition"
    # a size or a count out of reach: the sequence runs to max_tokens
    for params in (rd(2, 3), rd(3, 13)):
        out, = _generate(chat_llm, base.clone(repetition_detection=params))
        assert out.token_ids == cycling[:40] and out.finish_reason == "length"


def test_a_stop_string_completed_by_the_same_token_wins(chat_llm):
    """vLLM's output processor sets finish_reason "stop" wherever the new text completes a stop
    string, whatever the engine ended the request with."""
    tokenizer = chat_llm.get_tokenizer()
    a, = tokenizer.encode("a", add_special_tokens=False)
    assert tokenizer.decode([a] * 4) == "aaaa"
    base = SamplingParams(temperature=0.0, max_tokens=20, allowed_token_ids=[a],
                          repetition_detection=rd(1, 4))
    out, = _generate(chat_llm, base.clone(stop=["aaaa"]))
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == ([a] * 4, "", "stop", "aaaa")
    out, = _generate(chat_llm, base.clone(stop=["aaaaa"]))
    assert (out.token_ids, out.text, out.finish_reason) == ([a] * 4, "aaaa", "repetition")


def first_repetition(tokens: list[int], params: RepetitionDetectionParams) -> int | None:
    """How many tokens a sequence keeps: up to the first at which it ends in a repetition."""
    return next((k for k in range(1, len(tokens) + 1) if reference(tokens[:k], params)), None)


def test_each_of_n_completions_is_cut_on_its_own(chat_llm):
    """n=3 seeded coin flips: each completion is its uncut self (the same seed, no detection) up to
    the first token at which its own tail repeats (or whole, to max_tokens, where it never does)."""
    params = rd(3, 3, min_pattern_size=2)  # [5, 5, 5] is no repetition here, [5, 5] * 3 is
    plain = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=30, logits_processors=[five_or_six])
    uncut = [c.token_ids for c in _generate(chat_llm, plain)]
    cut = _generate(chat_llm, plain.clone(repetition_detection=params))
    keeps = [first_repetition(tokens, params) for tokens in uncut]
    assert None in keeps and len({k for k in keeps if k is not None}) > 1  # cut at two lengths, one not cut
    assert [c.token_ids for c in cut] == [tokens[:k or 30] for tokens, k in zip(uncut, keeps)]
    assert [c.finish_reason for c in cut] == ["length" if k is None else "repetition" for k in keeps]


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


@pytest.mark.parametrize("engine_args", [dict(async_scheduling=True), dict(speculative_config=NGRAM)],
                         ids=["async-steps", "ngram-speculation"])
def test_several_tokens_in_flight_are_cut_at_the_same_token(tiny_llama, engine_args):
    """A step read back after the next was launched, or one that keeps several proposed tokens: the
    tokens after the one that completed the repetition are dropped, not kept."""
    params = SamplingParams(temperature=0.0, max_tokens=30, allowed_token_ids=[9],
                            repetition_detection=rd(2, 6))
    prompts = [[9] * 8, [3, 9, 9, 4, 9, 9]]
    with LLM(tiny_llama.path, dtype="float32", kv_cache_memory_bytes=KV_BYTES, **engine_args) as llm:
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.get_stats()
    for out in outs:
        assert out.token_ids == [9] * 6 and out.finish_reason == "repetition"
    assert stats.generation_tokens == 12
    if "speculative_config" in engine_args:
        assert stats.spec_decode_num_accepted_tokens > 0  # steps kept several tokens


def _follow(sequence: list[int]):
    """A logits processor that makes the model write ``sequence``."""
    def follow(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(logits, float("-inf"))
        out[sequence[len(output_ids)]] = 0.0
        return out

    return follow


def test_cycles_of_every_size_are_cut_in_one_batch(chat_llm):
    assert_cycles_cut(chat_llm)


def assert_cycles_cut(llm) -> None:
    """Cycles of 1..4 tokens after a prefix, against sizes 1..4 and counts 2..3, in one batch: each
    is cut where the brute-force reference first finds a repetition in its own output."""
    prefixes = {1: [30], 2: [30, 31], 3: [31, 30, 31], 4: [33, 30, 31, 32]}
    cases = list(itertools.product(range(1, 5), range(1, 5), (2, 3)))
    sequences = [prefixes[n] + list(range(50, 50 + n)) * 20 for n, _, _ in cases]
    params = [SamplingParams(temperature=0.0, max_tokens=30, logits_processors=[_follow(seq)],
                             repetition_detection=rd(largest, count))
              for seq, (_, largest, count) in zip(sequences, cases)]
    outs = [o.outputs[0] for o in llm.generate([PROMPT] * len(cases), params, use_tqdm=False)]
    for out, seq, (cycle, largest, count) in zip(outs, sequences, cases):
        keep = first_repetition(seq[:30], rd(largest, count))
        assert out.token_ids == seq[:keep or 30], (cycle, largest, count)
        assert out.finish_reason == ("length" if keep is None else "repetition")
        assert (keep is not None) == (cycle <= largest)  # found exactly where the cycle fits the sizes
