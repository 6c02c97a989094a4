"""The output processor alone, behind a real scheduler, fed scripted tokens and logprobs over a
tokenizer of one character a token, so each expected text, logprob record and output is written
out by hand from vLLM's rules: logprobs=N gives the top N plus the sampled token, ranks count from
1, streamed text holds back (longest stop string - 1) characters unless the stop string is
included, and a parent request finishes when all ``n`` of its completions have."""

from __future__ import annotations

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pagedlab import SamplingParams
from pagedlab.engine.kv_cache import KVCacheManager
from pagedlab.engine.step_outputs import PromptLogprobsChunk, StepOutput
from pagedlab.engine.output_processor import OutputProcessor
from pagedlab.engine.request import Request
from pagedlab.engine.scheduler import Scheduler
from pagedlab.layers.sampler import TopLogprobs
from pagedlab.sampling_params import RequestOutputKind

EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    """Byte-level BPE without merges: every ASCII character is one token, and EOS is id 2."""
    specials = ["<pad>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")


class Engine:
    """LLMEngine's step loop over scripted tokens: schedule, append what was "sampled", let the
    output processor record it (a stop string it finds finishes the request), build the outputs."""

    def __init__(self, tokenizer, token_budget: int = 64):
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(KVCacheManager(64, 4, enable_prefix_caching=False), 8, token_budget, 256)
        self.processor = OutputProcessor(tokenizer)

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def add(self, request_id: str, params: SamplingParams, prompt: str = "Q:") -> list[Request]:
        children = [Request(f"{request_id}#{i}" if params.n > 1 else request_id, self.ids(prompt), params,
                            eos_token_ids=(EOS,), model_eos_token_id=EOS, index=i, parent_id=request_id)
                    for i in range(params.n)]
        self.processor.add_request(request_id, prompt, children)
        for child in children:
            self.scheduler.add_request(child)
        return children

    def step(self, tokens: dict[str, int], logprobs: dict[str, tuple] | None = None,
             prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None, stream: bool = True):
        """``tokens`` and ``logprobs`` (rows for ``_top``) by request id, for each request sampled."""
        batch = self.scheduler.schedule()
        sampled = self.scheduler.update_after_launch(batch)
        token_ids = [tokens[r.request_id] for r in sampled]
        appended = self.scheduler.update_from_output(sampled, token_ids)
        top = _top([logprobs[r.request_id] for r in sampled]) if logprobs is not None else None
        output = StepOutput(sampled, token_ids, top, prompt_logprobs or {})
        for hit in self.processor.process(batch.requests, output, appended):
            self.scheduler.finish_request(hit.request, "stop", stop_reason=hit.stop)
        outputs = self.processor.make_outputs(batch.requests, finished_only=not stream)
        return {o.request_id: o for o in outputs}

    def run_text(self, request_id: str, text: str) -> list:
        """One character of ``text`` a step; each step's output of ``request_id`` (none once it ended)."""
        return [self.step({request_id: t}).get(request_id) for t in self.ids(text)]


def _texts(outputs) -> list[str | None]:
    return [o.outputs[0].text if o is not None else None for o in outputs]


def test_streamed_text_holds_back_the_longest_stop_string_but_one(tokenizer):
    """No stop string completes: each cumulative output holds back the last two characters (the
    longest stop string, 3, minus 1) until the request ends at max_tokens and shows them all."""
    engine, text = Engine(tokenizer), "abcdefg"
    engine.add("r", SamplingParams(max_tokens=len(text), stop=["xyz", "q"]))
    outs = engine.run_text("r", text)
    assert _texts(outs) == ["", "", "a", "ab", "abc", "abcd", "abcdefg"]
    assert [o.outputs[0].token_ids for o in outs] == [engine.ids(text[:k]) for k in range(1, 8)]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"


def test_deltas_hold_back_the_same_and_add_up(tokenizer):
    engine, text = Engine(tokenizer), "abcdefg"
    engine.add("r", SamplingParams(max_tokens=len(text), stop=["xyz"], output_kind=RequestOutputKind.DELTA))
    assert _texts(engine.run_text("r", text)) == ["", "", "a", "b", "c", "d", "efg"]


def test_included_stop_strings_hold_nothing_back(tokenizer):
    """With include_stop_str_in_output the stop string stays in the text, so no prefix of it is
    ever cut: every output shows all the text so far, and the final one ends with the stop."""
    engine = Engine(tokenizer)
    engine.add("r", SamplingParams(max_tokens=20, stop=["xyz"], include_stop_str_in_output=True))
    outs = engine.run_text("r", "abxyzcd")
    assert _texts(outs) == ["a", "ab", "abx", "abxy", "abxyz", None, None]
    assert (outs[4].outputs[0].finish_reason, outs[4].outputs[0].stop_reason) == ("stop", "xyz")


def test_stop_string_cuts_the_text_where_it_starts(tokenizer):
    """A stop string the new character completes is cut away with all after it (the text before
    it stays), one of one character too; the request finishes with it as its stop_reason."""
    engine = Engine(tokenizer)
    engine.add("long", SamplingParams(max_tokens=20, stop=["cd", "bcdx"]))
    engine.add("short", SamplingParams(max_tokens=20, stop=["!"]))
    outs = [engine.step({"long": a, "short": b}) for a, b in zip(engine.ids("abcdef"), engine.ids("xy!zzz"))]
    long, short = outs[3]["long"].outputs[0], outs[2]["short"].outputs[0]
    assert (long.text, long.finish_reason, long.stop_reason, long.token_ids) == ("ab", "stop", "cd",
                                                                                  engine.ids("abcd"))
    assert (short.text, short.finish_reason, short.stop_reason) == ("xy", "stop", "!")
    assert [len(o) for o in outs] == [2, 2, 2, 1, 0, 0]  # each stops being output once it finished


def _top(rows: list[tuple]) -> TopLogprobs:
    """A step's logprobs: per row (sampled token's logprob, its rank, [(top id, logprob)...],
    [(label logprob, label rank)...])."""
    return TopLogprobs(
        token_logprob=torch.tensor([r[0] for r in rows]), token_rank=torch.tensor([r[1] for r in rows]),
        top_ids=torch.tensor([[t for t, _ in r[2]] for r in rows]),
        top_logprobs=torch.tensor([[lp for _, lp in r[2]] for r in rows]),
        label_logprobs=torch.tensor([[lp for lp, _ in r[3]] for r in rows]),
        label_ranks=torch.tensor([[rank for _, rank in r[3]] for r in rows]))


def _records(position) -> dict[int, tuple[float, int, str | None]]:
    return {t: (pytest.approx(lp.logprob), lp.rank, lp.decoded_token) for t, lp in position.items()}


def test_logprob_records_hold_the_top_n_the_sampled_token_and_the_labels(tokenizer):
    """One step of a batch whose widest request asks for 3 logprobs: each gets its own top N
    (ranks 1..N), the sampled token with its true rank, label ids with theirs, and each entry's
    text; with detokenize=False no text."""
    engine = Engine(tokenizer)
    a, b, c = (engine.ids(ch)[0] for ch in "abc")
    x, y = engine.ids("x")[0], engine.ids("y")[0]
    engine.add("one", SamplingParams(max_tokens=5, logprobs=1))
    engine.add("three", SamplingParams(max_tokens=5, logprobs=3, logprob_token_ids=[y]))
    engine.add("raw", SamplingParams(max_tokens=5, logprobs=1, detokenize=False))
    engine.add("plain", SamplingParams(max_tokens=5))
    top, label = [(a, -0.5), (b, -1.0), (c, -2.0)], [(-4.0, 9)]
    outs = engine.step({"one": x, "three": c, "raw": a, "plain": a}, {
        "one": (-3.0, 7, top, label), "three": (-2.0, 3, top, label), "raw": (-0.5, 1, top, label),
        "plain": (-0.5, 1, top, label)})
    assert _records(outs["one"].outputs[0].logprobs[0]) == {x: (-3.0, 7, "x"), a: (-0.5, 1, "a")}
    assert _records(outs["three"].outputs[0].logprobs[0]) == {
        c: (-2.0, 3, "c"), y: (-4.0, 9, "y"), a: (-0.5, 1, "a"), b: (-1.0, 2, "b")}
    assert _records(outs["raw"].outputs[0].logprobs[0]) == {a: (-0.5, 1, None)}
    assert outs["plain"].outputs[0].logprobs is None and outs["plain"].outputs[0].cumulative_logprob is None


def test_a_tied_sampled_token_among_the_top_n_takes_its_top_n_rank(tokenizer):
    """vLLM's record: the sampled token's vocabulary rank counts every token tied with it (2 here,
    a ties b), but where it is among the top N the entry is the top N's, so the top N rank 1..N."""
    engine = Engine(tokenizer)
    a, b = engine.ids("a")[0], engine.ids("b")[0]
    engine.add("r", SamplingParams(max_tokens=5, logprobs=2))
    out = engine.step({"r": a}, {"r": (-0.5, 2, [(a, -0.5), (b, -0.5)], [])})["r"].outputs[0]
    assert _records(out.logprobs[0]) == {a: (-0.5, 1, "a"), b: (-0.5, 2, "b")}


def test_cumulative_logprob_sums_the_sampled_tokens(tokenizer):
    engine = Engine(tokenizer)
    a, b = engine.ids("a")[0], engine.ids("b")[0]
    engine.add("r", SamplingParams(max_tokens=2, logprobs=1))
    engine.step({"r": b}, {"r": (-1.25, 2, [(a, -0.5)], [])})
    out = engine.step({"r": a}, {"r": (-0.75, 1, [(a, -0.75)], [])})["r"].outputs[0]
    assert out.cumulative_logprob == pytest.approx(-2.0)
    assert [lp.logprob for pos, t in zip(out.logprobs, out.token_ids) for lp in [pos[t]]] == [-1.25, -0.75]


def test_prompt_logprobs_hold_the_top_n_whatever_logprobs_says(tokenizer):
    """prompt_logprobs=2 with no logprobs: each prompt position past the first gets its top 2 and
    the prompt's own token (vLLM's prompt_logprobs); position 0 has none."""
    engine = Engine(tokenizer)
    (request,) = engine.add("r", SamplingParams(max_tokens=1, prompt_logprobs=2), prompt="abc")
    a, b, c = engine.ids("abc")
    top = [(c, -0.1), (a, -0.2)]
    chunk = PromptLogprobsChunk(1, [b, c], _top([(-3.0, 5, top, []), (-0.1, 1, top, [])]))
    out = engine.step({"r": a}, prompt_logprobs={"r": chunk})["r"]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 3
    assert _records(out.prompt_logprobs[1]) == {b: (-3.0, 5, "b"), c: (-0.1, 1, "c"), a: (-0.2, 2, "a")}
    assert _records(out.prompt_logprobs[2]) == {c: (-0.1, 1, "c"), a: (-0.2, 2, "a")}
    assert request.is_finished and out.finished


def _prompt_chunks(engine: Engine, prompt: str, budget: int) -> list[dict[str, PromptLogprobsChunk]]:
    """The prompt logprob chunks chunked prefill computes for request "r" in steps of ``budget``
    tokens: a chunk over tokens [s, e) scores tokens s+1 .. e (within the prompt); position p's
    sampled-token logprob is -p, its top 1 is (token "z", -0.01)."""
    ids, z = engine.ids(prompt), engine.ids("z")[0]
    chunks = []
    for s in range(0, len(ids), budget):
        targets = ids[s + 1:min(s + budget + 1, len(ids))]
        rows = [(-float(s + 1 + j), 2, [(z, -0.01)], []) for j in range(len(targets))]
        chunks.append({"r": PromptLogprobsChunk(s + 1, targets, _top(rows))} if targets else {})
    return chunks


def test_delta_prompt_logprobs_carry_each_chunks_positions_once(tokenizer):
    """DELTA with prompt_logprobs through chunked prefill (8 prompt tokens, 3 a step): each
    output carries only the positions recorded since the last one (the first with position 0's
    None, later ones none), and merged with ``RequestOutput.add`` they equal the cumulative
    output of the same run."""
    prompt, a = "abcdefgh", tokenizer.encode("a", add_special_tokens=False)[0]
    runs = {}
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        engine = Engine(tokenizer, token_budget=3)
        engine.add("r", SamplingParams(max_tokens=2, prompt_logprobs=1, output_kind=kind), prompt=prompt)
        runs[kind] = [engine.step({"r": a}, prompt_logprobs=chunk)["r"]
                      for chunk in _prompt_chunks(engine, prompt, 3) + [{}]]
    deltas, cumulative = runs[RequestOutputKind.DELTA], runs[RequestOutputKind.CUMULATIVE]
    assert [len(o.prompt_logprobs) for o in deltas] == [4, 3, 1, 0]
    assert deltas[0].prompt_logprobs[0] is None
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert [[pos[t].logprob for pos, t in zip(o.prompt_logprobs, ids[start:]) if pos is not None]
            for o, start in zip(deltas, (0, 4, 7, 8))] == [[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0], [-7.0], []]
    assert [len(o.prompt_logprobs) for o in cumulative] == [8] * 4
    merged = deltas[0]
    for later in deltas[1:]:
        merged = merged.add(later)
    assert merged.prompt_logprobs == cumulative[-1].prompt_logprobs
    assert merged.outputs[0].token_ids == cumulative[-1].outputs[0].token_ids == [a, a]


def test_a_parent_finishes_when_all_its_completions_have(tokenizer):
    """n=2: completion 0 ends on EOS at the first step, completion 1 runs to max_tokens; the
    parent's outputs stay unfinished until the second ends, and the last holds both whole."""
    engine = Engine(tokenizer)
    first, second = engine.add("p", SamplingParams(n=2, max_tokens=3))
    a = engine.ids("a")[0]
    outs = [engine.step({first.request_id: EOS, second.request_id: a}) for _ in range(2)]
    outs.append(engine.step({second.request_id: a}))
    assert [o["p"].finished for o in outs] == [False, False, True]
    final = outs[-1]["p"].outputs
    assert [(c.index, c.token_ids, c.text, c.finish_reason) for c in final] == [
        (0, [EOS], "", "stop"), (1, [a] * 3, "aaa", "length")]
    assert not engine.processor.has_request("p")


def test_unstreamed_steps_return_finished_parents_only(tokenizer):
    """stream=False (LLM.generate's loop): nothing until a parent finishes, then its one final output."""
    engine = Engine(tokenizer)
    engine.add("short", SamplingParams(max_tokens=1))
    engine.add("long", SamplingParams(max_tokens=3, output_kind=RequestOutputKind.DELTA))
    a = engine.ids("a")[0]
    outs = [engine.step({"short": a, "long": a}, stream=False)] + [
        engine.step({"long": a}, stream=False) for _ in range(2)]
    assert [sorted(o) for o in outs] == [["short"], [], ["long"]]
    assert outs[0]["short"].finished and outs[0]["short"].outputs[0].token_ids == [a]
    assert outs[2]["long"].finished and outs[2]["long"].outputs[0].token_ids == [a] * 3  # none sent before
    assert engine.processor.num_unfinished == 0


def test_flat_prompt_logprobs_keep_the_first_recording_of_a_redone_prefill(tokenizer):
    """A prefill redone after a preemption scores the prompt's rows again: a list takes the new
    records, a ``FlatLogprobs`` (flat_logprobs=True) keeps those it holds and appends the rest in
    order. Here the redone chunk over positions 1..3 scores each -10 lower."""
    prompt, a = "abcdefgh", tokenizer.encode("a", add_special_tokens=False)[0]
    finals = {}
    for flat in (False, True):
        engine = Engine(tokenizer, token_budget=3)
        engine.add("r", SamplingParams(max_tokens=2, prompt_logprobs=1, flat_logprobs=flat), prompt=prompt)
        first, second, third = _prompt_chunks(engine, prompt, 3)
        chunk = first["r"]
        redone = PromptLogprobsChunk(chunk.start, chunk.token_ids, TopLogprobs(
            chunk.logprobs.token_logprob - 10, chunk.logprobs.token_rank, chunk.logprobs.top_ids,
            chunk.logprobs.top_logprobs, None, None))
        for chunks in (first, {"r": redone}, second, third):
            out = engine.step({"r": a}, prompt_logprobs=chunks)
        finals[flat] = out["r"].prompt_logprobs
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    logprobs = {flat: [pos[t].logprob for pos, t in zip(finals[flat][1:], ids[1:])] for flat in finals}
    assert logprobs[True] == [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0]
    assert logprobs[False] == [-11.0, -12.0, -13.0, -4.0, -5.0, -6.0, -7.0]
    assert finals[True][0] == {} and finals[False][0] is None and len(finals[True]) == len(ids)
