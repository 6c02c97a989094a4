"""``FlatLogprobs`` (vLLM's ``vllm.logprobs.FlatLogprobs``) as a container: its columns written out
by hand for each append, and every read (index, iteration, slices of any step, ``+``) checked
against the list of dicts it stands for; and ``SamplingParams.flat_logprobs``, which asks for it."""

from __future__ import annotations

import copy
import itertools
import pickle

import pytest

import pagedlab
from pagedlab import FlatLogprobs, Logprob, RequestOutput, SamplingParams
from pagedlab.outputs import CompletionOutput

# four positions as a list of dicts: none (prompt position 0), two entries, one, three
POSITIONS = [None,
             {7: Logprob(-0.5, 1, "a"), 3: Logprob(-1.5, 4, "b")},
             {9: Logprob(-0.25, 1, None)},
             {1: Logprob(-2.0, 3, "x"), 2: Logprob(-0.1, 1, "y"), 4: Logprob(-1.0, 2, "z")}]
# the same, read back: a position recorded as None has no entries
READ = [{} if p is None else p for p in POSITIONS]


def built(positions=POSITIONS) -> FlatLogprobs:
    flat = FlatLogprobs()
    for position in positions:
        flat.append(position)
    return flat


def test_append_fills_the_columns_position_after_position():
    assert built() == FlatLogprobs(
        start_indices=[0, 0, 2, 3], end_indices=[0, 2, 3, 6], token_ids=[7, 3, 9, 1, 2, 4],
        logprobs=[-0.5, -1.5, -0.25, -2.0, -0.1, -1.0], ranks=[1, 4, 1, 3, 1, 2],
        decoded_tokens=["a", "b", None, "x", "y", "z"])
    assert len(built()) == 4 and len(FlatLogprobs()) == 0 and not FlatLogprobs()


def test_positions_read_back_as_the_dicts_they_stand_for():
    flat = built()
    assert [flat[i] for i in range(4)] == list(flat) == READ
    assert flat[-1] == READ[-1] and flat[0] == {}
    assert list(flat[1]) == [7, 3]  # each position's entries in the order given
    with pytest.raises(IndexError):
        flat[4]
    with pytest.raises(TypeError):
        flat["1"]
    flat[1][7].logprob = 0.0  # a read is a fresh dict: the container is left as it was
    assert flat[1][7].logprob == -0.5


def test_append_fast_takes_columns_and_keeps_a_repeated_id_twice():
    """vLLM's rule: columns go in as given, so a token id given twice is stored twice, and the
    position reads back as a dict does, with its last entry."""
    flat = FlatLogprobs()
    flat.append_fast([5, 6, 5], [-1.0, -2.0, -0.5], [3, 2, 1], itertools.repeat(None))
    assert flat.token_ids == [5, 6, 5] and flat.end_indices == [3]
    assert flat[0] == {5: Logprob(-0.5, 1, None), 6: Logprob(-2.0, 2, None)}


def test_extend_adds_each_position_from_a_list_or_another_container():
    for source in (POSITIONS[2:], built()[2:]):
        flat = built(POSITIONS[:2])
        flat.extend(source)
        assert flat == built(POSITIONS[:2] + POSITIONS[2:]) == built()
    twice = built()
    twice.extend(twice)  # itself: its positions as they were when the call began
    assert list(twice) == READ + READ
    twice += built()[:1]
    assert len(twice) == 9 and twice[8] == {}


@pytest.mark.parametrize("index", [slice(None), slice(1, 3), slice(2, None), slice(None, -1), slice(3, 1),
                                   slice(4, 9), slice(None, None, 2), slice(1, None, 2),
                                   slice(None, None, -1), slice(3, 0, -2), slice(0, 0)],
                         ids=lambda s: f"[{s.start}:{s.stop}:{s.step}]")
def test_a_slice_is_a_container_of_the_list_slice(index):
    """Any slice, empty ones too (where vLLM's raises IndexError), gives a new container whose
    columns start at 0, equal to one built from the list of dicts sliced the same way."""
    part = built()[index]
    assert isinstance(part, FlatLogprobs)
    assert part == built(POSITIONS[index])
    assert list(part) == READ[index]
    assert part.start_indices[:1] == ([0] if len(part) else [])


def test_a_slice_and_a_sum_are_copies():
    flat = built()
    whole = flat[:]
    whole.append(None)
    joined = flat + built(POSITIONS[1:2])
    assert len(flat) == 4 and len(whole) == 5
    assert list(joined) == READ + READ[1:2] and len(flat) == 4
    with pytest.raises(TypeError):
        flat + list(flat)


def test_positions_cannot_be_replaced_deleted_or_inserted():
    flat = built()
    for change in (lambda: flat.__setitem__(0, {}), lambda: flat.__delitem__(0), lambda: flat.insert(0, {}),
                   flat.pop, flat.reverse):
        with pytest.raises(TypeError, match="FlatLogprobs positions cannot"):
            change()
    assert flat == built()


def test_equality_copies_and_pickling():
    flat = built()
    assert flat == built() and flat != built(POSITIONS[:3])
    assert flat != READ  # a container equals a container only, as vLLM's dataclass
    assert copy.deepcopy(flat) == flat and pickle.loads(pickle.dumps(flat)) == flat


def test_request_output_add_joins_flat_deltas():
    """``RequestOutput.add`` (the async engine's merge of DELTA outputs) joins flat sample and
    prompt logprobs as it joins lists."""
    def output(prompt, sample, tokens):
        completion = CompletionOutput(0, "", tokens, -1.0, sample)
        return RequestOutput("r", None, [1, 2, 3], prompt, [completion], False)

    merged = output(built(POSITIONS[:2]), built(POSITIONS[2:3]), [9]).add(
        output(built(POSITIONS[2:3]), built(POSITIONS[3:]), [2]))
    assert merged.prompt_logprobs == built(POSITIONS[:3])
    assert merged.outputs[0].logprobs == built(POSITIONS[2:]) and merged.outputs[0].token_ids == [9, 2]


def test_exported_beside_logprob():
    from pagedlab import logprobs, outputs

    assert pagedlab.FlatLogprobs is logprobs.FlatLogprobs and "FlatLogprobs" in pagedlab.__all__
    assert pagedlab.Logprob is logprobs.Logprob is outputs.Logprob


def test_the_sampling_field_is_a_bool_defaulting_to_false():
    """vLLM's default (False: lists of dicts); a value other than True or False (a string such as
    "no" would read as true) is a ValueError naming the field; clone() and equality see it."""
    assert SamplingParams().flat_logprobs is False
    flat = SamplingParams(logprobs=1, flat_logprobs=True)
    assert flat.clone() == flat != SamplingParams(logprobs=1) == flat.clone(flat_logprobs=False)
    for bad in ("no", 1, None):
        with pytest.raises(ValueError,
                           match=f"flat_logprobs={bad!r} is invalid: flat_logprobs must be True or False"):
            SamplingParams(flat_logprobs=bad)
