"""vLLM's engine setting ``logprobs_mode``: what the logprobs of a completion hold. In each mode the
values (the sampled token's and its rank, the top alternatives, ``logprob_token_ids``' and their
ranks, ``cumulative_logprob``) are checked against a reference computed here from HF transformers'
float32 logits of the same prefix, with vLLM's processing written out (logit_bias, repetition,
presence and frequency penalties, then for a sampled row temperature, min-p, top-k and top-p), for
greedy and seeded rows in one batch; prompt logprobs stay raw. Then trace replay, thinking budgets,
speculative decoding and beam search under it, the refusals, the server's -9999.0 for -inf, and the
lab's run keys of specs that do not set it."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import KV_BYTES, random_prompts
from pagedlab import LLM, BeamSearchParams, SamplingParams
from pagedlab.config import EngineConfig
from pagedlab.engine.step_inputs import HostToDevice, build_sampling_metadata
from pagedlab.engine.thinking_budget import ThinkingBudget, ThinkingMarkers
from pagedlab.layers import sampler as sampler_module
from pagedlab.layers.sampler import Sampler
from pagedlab.outputs import Logprob
from test_lab_run_keys import bench_spec, dataset_spec, keys

MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
NEG_INF = float("-inf")
TOL = 1e-4
LABELS = [5, 17, 300, 999]
TOP = 10  # more than the filtered row's top_k: its last alternatives are -inf in processed modes
CPU = HostToDevice(torch.device("cpu"))


def processed(raw: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """vLLM's processed logits of one row, written out: logit_bias, the repetition penalty over prompt
    and output, frequency and presence over the output; a sampled row then divided by T, min-p,
    top-k and top-p (the smallest set of most likely tokens whose mass reaches top_p)."""
    x = raw.clone()
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    seen = torch.tensor(sorted(set(prompt) | set(output)))
    x[seen] = torch.where(x[seen] > 0, x[seen] / p.repetition_penalty, x[seen] * p.repetition_penalty)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=x.numel()).float()
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    if p.temperature == 0:
        return x
    x = x / p.temperature
    if p.min_p:
        probs = x.softmax(-1)
        x[probs < p.min_p * probs.max()] = NEG_INF
    if p.top_k:
        x[x < x.topk(p.top_k).values[-1]] = NEG_INF
    if p.top_p < 1:
        probs, order = x.softmax(-1).sort(descending=True)
        before = probs.cumsum(0) - probs  # the mass of the tokens more likely than each
        x[order[before >= p.top_p]] = NEG_INF
    return x


def engine(tiny, mode: str, **kwargs) -> LLM:
    return LLM(tiny.path, device="cpu", kv_cache_memory_bytes=KV_BYTES, logprobs_mode=mode, **kwargs)


def hf_logits(tiny, ids: list[int]) -> torch.Tensor:
    """HF's float32 logits ``[len(ids), vocab]`` of the sequence (row i predicts token i + 1)."""
    with torch.no_grad():
        return tiny.hf_model(torch.tensor([ids])).logits[0].float()


def reference(tiny, prompt: list[int], tokens: list[int], p: SamplingParams, mode: str) -> torch.Tensor:
    """``[len(tokens), vocab]``: what ``mode`` returns where each of ``tokens`` is sampled."""
    logits = hf_logits(tiny, prompt + tokens)
    rows = []
    for j, raw in enumerate(logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]):
        x = raw if mode.startswith("raw_") else processed(raw, p, prompt, tokens[:j])
        rows.append(x if mode.endswith("_logits") else x.log_softmax(-1))
    return torch.stack(rows)


def assert_value(got: Logprob, row: torch.Tensor, token: int) -> None:
    assert got.logprob == pytest.approx(row[token].item(), abs=TOL), token


def assert_rank(got: Logprob, row: torch.Tensor) -> None:
    """vLLM's rank (tokens at least as high), up to float noise between the two models; a -inf
    token ties with the whole vocabulary."""
    if got.logprob == NEG_INF:
        assert got.rank == row.numel()
    else:
        assert int((row > got.logprob + TOL).sum()) < got.rank <= int((row >= got.logprob - TOL).sum())


def assert_labels(completion, ref: torch.Tensor) -> None:
    """The sampled token and every label: their values and ranks, nothing else; the cumulative
    logprob sums the sampled tokens' values."""
    for token, row, record in zip(completion.token_ids, ref, completion.logprobs):
        assert set(record) == {token, *LABELS}
        for tid, got in record.items():
            assert_value(got, row, tid)
            assert_rank(got, row)
    want = sum(row[t].item() for t, row in zip(completion.token_ids, ref))
    assert completion.cumulative_logprob == pytest.approx(want, abs=TOL * len(ref))


def assert_top(completion, ref: torch.Tensor) -> None:
    """The top ``TOP`` alternatives (ranked 1..TOP): the reference's highest values, -inf ones
    included, each that of its token; the sampled token beside them."""
    for token, row, record in zip(completion.token_ids, ref, completion.logprobs):
        assert_value(record[token], row, token)
        top = {tid: got for tid, got in record.items() if got.rank <= TOP}
        assert sorted(got.rank for got in top.values()) == list(range(1, TOP + 1))
        assert sorted((got.logprob for got in top.values()), reverse=True) == pytest.approx(
            row.topk(TOP).values.tolist(), abs=TOL)
        for tid, got in top.items():
            assert_value(got, row, tid)


def mode_params() -> dict[str, SamplingParams]:
    """A greedy row and a filtered seeded one, both with a logit_bias and three penalties, a seeded
    row at T=1.3 and a plain seeded one at T=1 (nothing to process: processed equals raw)."""
    controls = dict(logit_bias={7: 1.5, 40: -2.0}, repetition_penalty=1.3, presence_penalty=0.4,
                    frequency_penalty=0.2)
    return {"greedy": SamplingParams(temperature=0, **controls),
            "filtered": SamplingParams(temperature=0.7, seed=11, top_k=8, top_p=0.8, min_p=0.1, **controls),
            "tempered": SamplingParams(temperature=1.3, seed=3),
            "plain": SamplingParams(temperature=1.0, seed=5)}


def assert_mode_in_one_batch(llm: LLM, tiny, mode: str) -> None:
    """Every row of ``mode_params`` twice in one batch, once with the labels (``logprob_token_ids``,
    no top alternatives) and once with the top ``TOP``: the same tokens (seeded or greedy), and in
    each the values ``mode`` names. Prompt logprobs are HF's raw log_softmax whatever the mode."""
    prompts = random_prompts(4, min_len=5, max_len=12, seed=3)
    rows = mode_params()
    params = [p.clone(max_tokens=6, ignore_eos=True, logprobs=0, logprob_token_ids=LABELS, prompt_logprobs=2)
              for p in rows.values()]
    params += [p.clone(max_tokens=6, ignore_eos=True, logprobs=TOP) for p in rows.values()]
    outs = llm.generate([{"prompt_token_ids": q} for q in prompts * 2], params, use_tqdm=False)
    for i, (prompt, p) in enumerate(zip(prompts, rows.values())):
        labelled, ranked = outs[i].outputs[0], outs[i + len(rows)].outputs[0]
        tokens = list(labelled.token_ids)
        assert list(ranked.token_ids) == tokens
        ref = reference(tiny, prompt, tokens, p, mode)
        assert_labels(labelled, ref)
        assert_top(ranked, ref)
        if mode.startswith("processed_") and p.temperature == 0:  # greedy: the processed argmax
            assert tokens == ref.argmax(-1).tolist()
        raw = hf_logits(tiny, prompt).log_softmax(-1)
        for position, (token, row) in enumerate(zip(prompt[1:], raw), 1):
            assert_value(outs[i].prompt_logprobs[position][token], row, token)
    filtered = outs[len(rows) + 1].outputs[0].logprobs
    assert all(math.isinf(lp.logprob) for record in filtered for lp in record.values()
               if lp.rank == TOP) == mode.startswith("processed_")


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_matches_the_reference_in_one_batch(tiny_llama, mode):
    with engine(tiny_llama, mode) as llm:
        assert_mode_in_one_batch(llm, tiny_llama, mode)


def _row(params: SamplingParams, thinking: ThinkingBudget | None = None):
    """The parts of a scheduled request the sampler's metadata reads (prompt [1, 5], no output)."""
    class Row:
        sampling_params, seed, grammar, bad_words_token_ids = params, params.seed, None, []
        prompt_token_ids, output_token_ids, eos_token_ids = [1, 5], [], (2,)
        num_output_tokens = num_pending_tokens = 0
        all_token_ids = prompt_token_ids
    Row.thinking = thinking
    return Row()


def test_hand_computed_values_of_each_mode():
    """logits [2, 1, 0, -1]: a row at T=0.5 with top_k=2, and a greedy one with a logit_bias, in
    every mode, by hand; label 3 is dropped by the top-k row's filter (-inf, ranked last)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0]])
    params = [SamplingParams(temperature=0.5, top_k=2, seed=1, logprobs=3, logprob_token_ids=[3]),
              SamplingParams(temperature=0, logit_bias={3: 4.0}, logprobs=3, logprob_token_ids=[3])]
    meta = build_sampling_metadata([_row(p) for p in params], CPU, 4, [0, 0], 0)
    norm = lambda values: [v - math.log(sum(math.exp(u) for u in values)) for v in values]  # noqa: E731
    want = {"raw_logits": [[2, 1, 0, -1], [2, 1, 0, -1]],
            "raw_logprobs": [norm([2, 1, 0, -1])] * 2,
            "processed_logits": [[4, 2, NEG_INF, NEG_INF], [2, 1, 0, 3]],
            "processed_logprobs": [norm([4, 2]) + [NEG_INF, NEG_INF], norm([2, 1, 0, 3])]}
    for mode, rows in want.items():
        out = Sampler(mode)(logits.clone(), meta)
        assert out.token_ids[1].item() == 3  # the bias decides the greedy row in every mode
        top = out.logprobs
        for r, row in enumerate(rows):
            ranked = sorted(range(4), key=lambda t: -row[t])[:3]
            assert top.top_ids[r].tolist()[:2] == ranked[:2], mode
            assert top.top_logprobs[r].tolist() == pytest.approx(sorted(row, reverse=True)[:3]), mode
            assert top.label_logprobs[r, 0].item() == pytest.approx(row[3]), mode
            assert top.token_logprob[r].item() == pytest.approx(row[out.token_ids[r]]), mode
        assert top.label_ranks[:, 0].tolist() == ([4, 1] if mode.startswith("processed") else [4, 4]), mode


def test_raw_logprobs_does_no_processed_work(monkeypatch):
    """The default mode never computes processed values; a processed mode computes them once."""
    calls = []
    real = sampler_module.processed_scores
    monkeypatch.setattr(sampler_module, "processed_scores", lambda *a: calls.append(1) or real(*a))
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.8, top_p=0.5, seed=2, logprobs=2), SamplingParams(temperature=0)]
    meta = build_sampling_metadata([_row(p) for p in params], CPU, 50, [0, 0], 0)
    raw = Sampler()(logits.clone(), meta)
    assert not calls
    torch.testing.assert_close(raw.logprobs.top_logprobs, logits.log_softmax(-1).topk(2).values)
    assert Sampler("processed_logprobs")(logits.clone(), meta).token_ids.tolist() == raw.token_ids.tolist()
    assert calls == [1]


def test_forced_and_replayed_rows_under_processed_logprobs():
    """A thinking budget's forced token is part of the processing (logprob 0, every other token
    -inf); a trace's token replaces the drawn one after it, with the logprob of the distribution it
    was forced over (here -inf: top_k=1 kept another token), as vLLM's ``apply_trace``."""
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0, 0.5, 2.0, 0.0, 0.0]] * 2)
    budget = ThinkingBudget(ThinkingMarkers((5,), (7,)), 0, num_prompt_tokens=2)
    forced = _row(SamplingParams(temperature=0.9, seed=1, logprobs=1), budget)
    traced = _row(SamplingParams(temperature=0.9, top_k=1, seed=1, logprobs=1, trace_decode_token_ids=[4]))
    meta = build_sampling_metadata([forced, traced], CPU, 8, [0, 0], 0)
    out = Sampler("processed_logprobs")(logits.clone(), meta)
    assert out.token_ids.tolist() == [7, 4]
    assert out.logprobs.token_logprob.tolist() == [0.0, NEG_INF]
    assert out.logprobs.token_rank.tolist() == [1, 8]
    assert out.logprobs.top_ids.tolist() == [[7], [0]]
    assert out.logprobs.top_logprobs.tolist() == [[0.0], [0.0]]
    raw = Sampler()(logits.clone(), meta)
    assert raw.token_ids.tolist() == [7, 4]
    torch.testing.assert_close(raw.logprobs.token_logprob, logits.log_softmax(-1)[[0, 1], [7, 4]])


def test_trace_replay_reports_the_processed_distribution(tiny_llama):
    """A trace replayed at T=0.8 with top_k=5 under processed_logprobs: each trace token's value
    and rank in the processed distribution of its prefix, -inf (ranked last) where top-k dropped it."""
    prompt = random_prompts(1, min_len=6, max_len=6, seed=4)[0]
    trace = torch.randint(3, 1000, (6,), generator=torch.Generator().manual_seed(2)).tolist()
    p = SamplingParams(temperature=0.8, top_k=5, seed=1, logprobs=2, trace_decode_token_ids=trace)
    with engine(tiny_llama, "processed_logprobs", enable_trace_replay=True) as llm:
        completion = llm.generate([{"prompt_token_ids": prompt}], p, use_tqdm=False)[0].outputs[0]
    assert list(completion.token_ids) == trace
    ref = reference(tiny_llama, prompt, trace, p, "processed_logprobs")
    assert ref[torch.arange(len(trace)), trace].isinf().any()  # the case the test is about
    for token, row, record in zip(trace, ref, completion.logprobs):
        assert_value(record[token], row, token)
        assert_rank(record[token], row)


def test_speculative_decoding_keeps_each_modes_values(tiny_llama):
    """n-gram speculation samples every proposed position as plain decoding would, so its tokens
    and processed logprobs are those of the engine without it."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    prompts = [{"prompt_token_ids": [4, 5, 6, 7] * 6}, {"prompt_token_ids": [9, 8] * 10}]
    params = [SamplingParams(temperature=0, max_tokens=12, logprobs=3, repetition_penalty=1.1),
              SamplingParams(temperature=0.6, top_k=20, seed=7, max_tokens=12, logprobs=3)]
    with engine(tiny_llama, "processed_logprobs") as llm:
        plain = llm.generate(prompts, params, use_tqdm=False)
        llm.set_model_args(speculative_config=ngram)
        speculated = llm.generate(prompts, params, use_tqdm=False)
        assert llm.get_stats().spec_decode_num_accepted_tokens > 0
    for a, b in zip(plain, speculated):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert set(x) == set(y)
            assert [x[t].logprob for t in x] == pytest.approx([y[t].logprob for t in x])


def test_beam_search_scores_logprobs_and_refuses_logits(tiny_llama):
    """Beam search's greedy steps: processed and raw logprobs agree, so do the beams; an engine
    returning logits refuses it (vLLM would add the logits up as logprobs)."""
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    prompt = [{"prompt_token_ids": random_prompts(1, seed=6)[0]}]
    beams = {}
    for mode in ("raw_logprobs", "processed_logprobs"):
        with engine(tiny_llama, mode) as llm:
            beams[mode] = [(b.tokens, b.cum_logprob) for b in llm.beam_search(prompt, params)[0].sequences]
    assert [t for t, _ in beams["raw_logprobs"]] == [t for t, _ in beams["processed_logprobs"]]
    assert [c for _, c in beams["raw_logprobs"]] == pytest.approx([c for _, c in beams["processed_logprobs"]])
    refused = pytest.raises(ValueError, match=r"logprobs_mode='raw_logits' is invalid for beam_search")
    with engine(tiny_llama, "raw_logits") as llm, refused:
        llm.beam_search(prompt, params)


def test_a_bad_mode_is_refused_by_name_and_the_cli_flag_sets_it():
    with pytest.raises(ValueError, match=r"logprobs_mode='processed' is invalid: logprobs_mode must be one "
                                         r"of \('raw_logprobs', 'raw_logits', 'processed_logprobs', "
                                         r"'processed_logits'\)"):
        EngineConfig(logprobs_mode="processed").validate()
    from pagedlab.cli.engine_args import engine_config_from_args
    from pagedlab.cli.main import build_parser

    args = build_parser().parse_args(["generate", "--logprobs-mode", "processed_logits"])
    assert engine_config_from_args(args).logprobs_mode == "processed_logits"
    assert engine_config_from_args(build_parser().parse_args(["generate"])).logprobs_mode == "raw_logprobs"


def test_run_keys_of_specs_without_it_are_unchanged():
    """The keys pagedlab gave these specs before logprobs_mode existed (computed at a46855c); the
    default spelled out says the same, another mode is another run."""
    sampling, before = {"max_tokens": 4, "temperature": 0.5, "logprobs": 2}, ["d:209c18b4e21f2378249e122e"]
    assert keys(dataset_spec(sampling)) == before
    assert keys(dataset_spec(sampling, {"logprobs_mode": "raw_logprobs"})) == before
    assert keys(dataset_spec(sampling, {"logprobs_mode": "processed_logprobs"})) != before
    assert keys(bench_spec()) == ["k:22fec3b14f2e0f579f18978a"]


def test_the_server_writes_minus_infinity_as_vllm_does(tmp_path):
    """Under processed_logprobs a top-2 request's other alternatives are -inf: the completions and
    chat endpoints write them as -9999.0 (vLLM's value, which JSON can hold), not null."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from pagedlab.engine.async_engine import AsyncEngine
    from pagedlab.server.app import ServerThread, build_app
    from test_server_support import TINY_KV_BYTES, build_tiny_chat_model

    llm = LLM(build_tiny_chat_model(tmp_path), kv_cache_memory_bytes=TINY_KV_BYTES,
              logprobs_mode="processed_logprobs")
    engine = AsyncEngine.from_llm(llm)
    sampling = {"max_tokens": 2, "temperature": 0.8, "top_k": 2, "seed": 1,
                "return_tokens_as_token_ids": True}
    try:
        with ServerThread(build_app(engine, served_model_names=["tiny"])) as srv:
            completion = httpx.post(srv.url + "/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": "Why is the sky", "logprobs": 4, **sampling}).json()
            chat = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={
                "model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "logprobs": True,
                "top_logprobs": 4, **sampling}).json()
    finally:
        engine.shutdown()
        llm.close()
    for top in completion["choices"][0]["logprobs"]["top_logprobs"]:
        assert sorted(top.values())[:2] == [-9999.0, -9999.0] and min(sorted(top.values())[2:]) > -9999.0
    for entry in chat["choices"][0]["logprobs"]["content"]:
        values = sorted(alt["logprob"] for alt in entry["top_logprobs"])
        assert values[:2] == [-9999.0, -9999.0] and values[2] > -9999.0 and entry["logprob"] > -9999.0
