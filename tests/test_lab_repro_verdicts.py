"""pagedlab.lab.repro: verdicts and numbers against references worked out by hand or computed
independently (the exact KL over the whole vocabulary, the batch order each variant runs)."""

from __future__ import annotations

import json
import math

import pytest

from conftest import KV_BYTES
from conftest import REPRO_PROMPTS as PROMPTS
from pagedlab import SamplingParams
from pagedlab.lab import repro


# ---- precision and hf: the coarse KL and teacher forcing ---------------------------------------------
def test_topk_kl_gives_a_missing_token_the_kth_logprob_not_the_actual_tokens():
    """Teacher forcing lists a position's top-k and the actual token, which may rank far below it.
    P and Q are one distribution but for ranks 2 and 3 swapped by a hair (exact KL ~1e-11): P's
    rank-2 token, missing from Q's top-2, must get Q's 2nd logprob (KL ~0), not the actual
    token's 1e-5, which made the KL 1.83."""
    probs = [0.5, 0.2 + 1e-6, 0.2 - 1e-6, 0.1 - 1e-5, 1e-5]
    p = [math.log(x) for x in probs]
    q = [p[0], p[2], p[1], p[3], p[4]]
    exact = sum(math.exp(a) * (a - b) for a, b in zip(p, q))
    p_listed, q_listed = {0: p[0], 1: p[1], 4: p[4]}, {0: q[0], 2: q[2], 4: q[4]}
    assert repro.topk_kl(p_listed, q_listed, k=2) == pytest.approx(exact, abs=1e-9)


def test_topk_kl_of_a_nan_is_inf_and_of_a_zero_probability_token_nothing():
    """A float16 position whose logits overflowed has NaN logprobs: its KL must be inf, so the mean
    KL exceeds any threshold (a NaN mean compared below every threshold: SAME). A listed token of
    probability 0 on both sides adds 0 (its 0 * -inf term made the KL NaN)."""
    nan, inf = math.nan, math.inf
    p = {0: math.log(0.7), 1: math.log(0.2)}
    assert repro.topk_kl(p, {0: math.log(0.7), 1: nan}) == inf
    assert repro.topk_kl({0: nan, 1: math.log(0.2)}, p) == inf
    assert repro.topk_kl({0: 0.0, 1: -inf}, {0: 0.0, 1: -inf}) == 0.0


def test_precision_kl_at_small_k_stays_below_the_exact_kl(chat_dir):
    """float32 against float16 on the tiny model: the mean and max KL from the top-5 are lower
    bounds of those over the whole vocabulary (k = 420); taking the floor from the actual token
    made the top-5 mean KL 0.0024, past the 1e-3 threshold, where the exact one is 7e-6."""
    args = {"kv_cache_memory_bytes": KV_BYTES, "device": "cpu"}
    kl = {k: repro.precision_drift(chat_dir, PROMPTS[:3], dtypes=("float32", "float16"), max_tokens=4, k=k,
                                   engine_args=args).metrics for k in (5, 420)}
    assert 0 < kl[5]["float16.mean_kl"] <= kl[420]["float16.mean_kl"]
    assert kl[5]["float16.max_kl"] <= kl[420]["float16.max_kl"]


def test_teacher_forced_past_the_vocabulary_lists_all_of_it(chat_llm):
    """``precision_drift`` promises the exact KL for a ``k`` at or past the vocabulary (420 tokens
    here), but the engine refused prompt_logprobs over 420: k = 10,000 must list every token of
    each position, whose probabilities then sum to 1."""
    from pagedlab.lab.repro.compare import teacher_forced

    positions = teacher_forced(chat_llm, [[1, 40, 41, 42]], k=10_000)[0]
    assert len(positions) == 3
    for dist in positions:
        assert len(dist) == 420 and sum(math.exp(lp) for lp in dist.values()) == pytest.approx(1.0, abs=1e-4)


def test_teacher_forced_checks_refuse_k_below_1(chat_llm, chat_dir, capsys):
    """With k = 0 teacher forcing lists only the actual token, which the top-1 then took for the
    most likely one: hf_parity read a correct engine as DIFFERS (top-1 agreement 33%) and
    precision_drift put a bfloat16 drift's top-1 agreement at 100% (87.5% at k = 1). k < 1 is
    refused, on the command line before any model loads."""
    from pagedlab.lab.repro_cli import main

    with pytest.raises(ValueError, match="k=0 is invalid"):
        repro.hf_parity(chat_llm, PROMPTS, max_tokens=2, k=0)
    with pytest.raises(ValueError, match="k=0 is invalid"):
        repro.precision_drift(chat_dir, PROMPTS, dtypes=("float32", "bfloat16"), k=0)
    for check in ("hf", "precision"):
        assert main(["repro", "check", "--model", chat_dir, "--device", "cpu", "--checks", f"batch,{check}",
                     "--top-k", "0"]) == 2
        out, err = capsys.readouterr()
        assert "--top-k: k=0 is invalid" in err and "loading" not in out, (out, err)


def test_compare_outputs_counts_a_missing_logprob_and_refuses_other_prompts():
    """Equal tokens but a logprob missing on one side is no agreement (infinite difference, not a
    shorter comparison); runs over different numbers of prompts are refused, not cut to the shorter."""
    from pagedlab.lab.repro.compare import compare_outputs

    same = compare_outputs([[1, 2, 3]], [[-0.5, -1.0, -2.0]], [[1, 2, 3]], [[-0.5, -1.0, -2.0]])
    assert same == {"prompts_differing": 0, "first_divergence": None, "max_logprob_diff": 0.0}
    short = compare_outputs([[1, 2, 3]], [[-0.5, -1.0, -2.0]], [[1, 2, 3]], [[-0.5, -1.0]])
    assert short["prompts_differing"] == 0 and short["max_logprob_diff"] == math.inf
    with pytest.raises(ValueError):
        compare_outputs([[1], [2]], [[-1.0], [-1.0]], [[1]], [[-1.0]])


# ---- padding ----------------------------------------------------------------------------------------
def test_padding_check_decodes_plain_greedy_whatever_the_generation_config(chat_dir):
    """A generation config's no_repeat_ngram_size (1 here) counts a batch row's left padding as
    generated n-grams and bans the pad token in the batch only: with the correct mask the check
    must still say SAME (it decodes plain greedy, as the engine's reference runs do), and leave the
    model's generation config as it was."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(chat_dir, dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()
    hf.generation_config.no_repeat_ngram_size = 1
    ok = repro.padding_check(hf, PROMPTS, max_tokens=8)
    assert ok.verdict == "same" and ok.metrics["padded_prompts"] > 0, ok.format()
    assert hf.generation_config.no_repeat_ngram_size == 1


# ---- batch: the shuffled variant ---------------------------------------------------------------------
def test_batch_shuffled_runs_two_prompts_in_the_other_order(chat_llm, monkeypatch):
    """Two prompts shuffled at seed 0 came back in their own order, so ``shuffled`` reran
    ``full_batch`` and tested nothing; it must run them as [second, first], and map the outputs
    back to their prompts (the verdict stays SAME on a correct engine)."""
    batches = []
    generate = chat_llm.generate

    def recording(prompts, *args, **kwargs):
        batches.append([p["prompt_token_ids"] for p in prompts])
        return generate(prompts, *args, **kwargs)

    monkeypatch.setattr(chat_llm, "generate", recording)
    first, second = list(range(5, 15)), list(range(20, 33))
    r = repro.batch_consistency(chat_llm, [first, second], max_tokens=4, variants=["shuffled"])
    assert batches == [[first], [second], [second, first]]  # batch 1 each, then the variant
    assert r.verdict == "same", r.format()


def test_batch_prefix_caching_on_and_off_are_prefix_cache_on_and_full_batch(chat_llm, monkeypatch):
    """``prefix_cache_off`` ran full_batch's plan (prefix caching off, as every variant but
    ``prefix_cache_on``) in one pass as full_batch does: the same run under a second name, counted
    twice among the variants that differ. The on/off pair is ``prefix_cache_on`` and full_batch,
    whose engines differ in prefix caching alone; no variant but shuffled (its order) runs
    full_batch's plan, and asking for ``prefix_cache_off`` says it is full_batch."""
    from pagedlab.lab.repro.batch import _variant_plans

    original = {"enable_prefix_caching": True, "enable_chunked_prefill": True, "max_num_batched_tokens": 64}
    plans = _variant_plans(original, 16, 128)
    assert [n for n, plan in plans.items() if plan == plans["full_batch"]] == ["full_batch", "shuffled"]
    caching = []
    generate = chat_llm.generate

    def recording(prompts, *args, **kwargs):
        caching.append(chat_llm.get_engine_info().config.enable_prefix_caching)
        return generate(prompts, *args, **kwargs)

    monkeypatch.setattr(chat_llm, "generate", recording)
    repro.batch_consistency(chat_llm, PROMPTS[:2], max_tokens=2, variants=["full_batch", "prefix_cache_on"])
    # batch 1 twice (the reference), full_batch, then prefix_cache_on's warming pass and its own
    assert caching == [False, False, False, True, True]
    with pytest.raises(ValueError, match="prefix_cache_off is full_batch"):
        repro.batch_consistency(chat_llm, PROMPTS[:1], max_tokens=1, variants=["prefix_cache_off"])


# ---- seeds ------------------------------------------------------------------------------------------
def test_cli_seeds_check_samples_as_the_experiments_runs_do(chat_dir, tmp_path):
    """An experiment whose ``sampling:`` sets temperature and max_tokens alone samples its runs with
    top_p 1.0 (``SamplingParams(**sampling)``, as the lab runner builds them); the seeds check of
    ``--experiment`` must too, not the CLI's own top_p 0.95 for the fields the section leaves out."""
    from pagedlab.lab.repro_cli import main

    sampling = {"temperature": 0.7, "max_tokens": 3}
    experiment = tmp_path / "exp.yaml"
    experiment.write_text(f"name: warm\nmodel: {chat_dir}\nsampling: {json.dumps(sampling)}\n"
                          "dataset:\n  prompts: [{prompt: hello}]\nmetrics: [output_length]\n")
    out = tmp_path / "report.json"
    assert main(["repro", "check", "--model", chat_dir, "--device", "cpu", "--kv-cache-memory-bytes", "16MiB",
                 "--checks", "seeds", "--num-seeds", "2", "--experiment", str(experiment),
                 "--out", str(out)]) == 0
    used = json.loads(out.read_text())["checks"][0]["params"]["sampling"]
    runner = SamplingParams(**sampling)
    for name in ("temperature", "top_p", "top_k", "min_p", "max_tokens"):
        assert used[name] == getattr(runner, name), name


def test_seeds_check_flags_a_metric_that_is_nan_on_one_seed(chat_llm):
    """A metric NaN on one seed (or inf: then its std is NaN) has a NaN spread, which compared
    below every threshold, so the check said SAME; it must be flagged."""
    values = iter([0.5, math.nan, -1.0, -math.inf])

    def metrics(outputs, references):
        return {"score": next(values)}

    params = SamplingParams(temperature=0.0, max_tokens=1)
    for _ in range(2):  # [0.5, NaN], then [-1.0, -inf]
        r = repro.seed_sensitivity(chat_llm, PROMPTS[:1], params, seeds=range(2), metrics_fn=metrics,
                                   threshold=1e9)
        assert r.details["flagged"] == ["score"] and r.verdict == "differs", r.format()


def test_seeds_check_with_threshold_0_passes_a_metric_equal_on_every_seed(chat_llm):
    """A threshold of 0 flags any variation, so a metric equal on every seed must keep std 0: three
    0.1s summed to 0.30000000000000004, a mean above their max and a std of 2e-17 that was flagged."""
    assert repro.summarize([0.1, 0.1, 0.1]) == {"mean": 0.1, "std": 0.0, "ci95_low": 0.1, "ci95_high": 0.1,
                                                 "min": 0.1, "max": 0.1}
    r = repro.seed_sensitivity(chat_llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=1),
                               seeds=range(3), metrics_fn=lambda outputs, references: {"score": 0.1},
                               threshold=0.0)
    assert r.verdict == "same" and r.details["flagged"] == [], r.format()


@pytest.mark.parametrize("limit", [math.nan, -0.5, "0.1", True])
def test_checks_refuse_a_limit_that_is_no_number_ge_0_before_any_work(limit):
    """Every comparison with NaN is false, so a check against a NaN tolerance could never fail, and
    a negative one fails identical runs: each check refuses them, naming the argument, before it
    touches its engine or model (None and a missing path here)."""
    calls = [(repro.batch_consistency, (None,), "logprob_tolerance"),
             (repro.hf_parity, (None,), "logprob_tolerance"),
             (repro.padding_check, ("no/such/model",), "logprob_tolerance"),
             (repro.precision_drift, ("no/such/model",), "kl_threshold"),
             (repro.seed_sensitivity, (None,), "threshold")]
    for check, args, name in calls:
        with pytest.raises(ValueError, match=f"{name}={limit!r} is invalid: give a number >= 0"):
            check(*args, **{name: limit})
    with pytest.raises(ValueError, match=r"threshold\['bleu'\]=.* is invalid"):
        repro.seed_sensitivity(None, threshold={"chrf": 0.1, "bleu": limit})


# ---- inputs that leave nothing to compare ----------------------------------------------------------
def test_precision_drift_refuses_a_single_variant(chat_dir):
    """One variant is compared with nothing: the check loaded it and said SAME ("match float32")
    whatever the other precisions would do. The command line refused it; the function must too."""
    with pytest.raises(ValueError, match="give at least two precision variants"):
        repro.precision_drift(chat_dir, PROMPTS[:1], dtypes=("float32",), max_tokens=1,
                              engine_args={"kv_cache_memory_bytes": KV_BYTES, "device": "cpu"})


def test_seed_sensitivity_refuses_a_repeated_seed(chat_llm):
    """Seeds [7, 7] rerun one run, so every metric had std 0 and hot sampling (temperature 1.5,
    flagged over distinct seeds) was SAME; a repeat shrinks the spread of any seed list."""
    hot = SamplingParams(temperature=1.5, max_tokens=6, logprobs=0)
    assert not repro.seed_sensitivity(chat_llm, PROMPTS, hot, seeds=[7, 8], threshold=0.0).same
    for seeds in ([7, 7], [7, 8, 7]):
        with pytest.raises(ValueError, match=r"repeats a seed: give each seed once"):
            repro.seed_sensitivity(chat_llm, PROMPTS, hot, seeds=seeds, threshold=0.0)


# ---- the command line's report ----------------------------------------------------------------------
def test_cli_report_keeps_a_check_whose_storing_failed(chat_dir, tmp_path, monkeypatch):
    """A check's result was kept for --out only after the database stored it: a storing error lost
    the finished check from the report (which then listed no check at all)."""
    pytest.importorskip("sqlalchemy")
    from pagedlab.lab.repro_cli import main

    def store_fails(*args, **kwargs):
        raise RuntimeError("database gone")

    monkeypatch.setattr(repro, "store_result", store_fails)
    out = tmp_path / "report.json"
    with pytest.raises(RuntimeError, match="database gone"):
        main(["repro", "check", "--model", chat_dir, "--device", "cpu", "--kv-cache-memory-bytes", "16MiB",
              "--checks", "batch", "--max-tokens", "2", "--no-progress", "--db", str(tmp_path / "r.db"),
              "--out", str(out)])
    report = json.loads(out.read_text())
    assert [c["check"] for c in report["checks"]] == ["batch"]
    assert report["checks"][0]["verdict"] == "same" and "database gone" in report["error"]


def test_cli_precision_check_decodes_without_the_speculative_config(tmp_path, monkeypatch):
    """--speculative-config is what the spec check compares; the other checks decode plainly (the
    shared model is loaded without it), but the precision check's engines were loaded with it."""
    from pagedlab.lab.repro_cli import main

    seen = {}

    def precision(model, prompts, **kwargs):
        seen.update(kwargs["engine_args"])
        return repro.CheckResult("precision", "same", "recorded")

    monkeypatch.setattr(repro, "precision_drift", precision)
    assert main(["repro", "check", "--model", "some/model", "--device", "cpu", "--no-progress", "--checks",
                 "precision", "--speculative-config", '{"num_speculative_tokens": 2}']) == 0
    assert seen["device"] == "cpu" and seen.get("speculative_config") is None


@pytest.mark.parametrize("reference", [5, [], ["ok", 7], {"text": "x"}])
def test_load_prompts_refuses_a_reference_that_is_no_text(reference, tmp_path, chat_llm):
    """A reference that is no text was taken, and the seeds check's exact match / BLEU failed on it
    (``list(5)``: TypeError) only after the model loaded and the checks before it ran."""
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hello", "reference": reference}) + "\n")
    with pytest.raises(ValueError, match=r"item 0: 'reference' is .*, not text or a non-empty list of texts"):
        repro.load_prompts(f)
    f.write_text(json.dumps({"prompt": "hello", "reference": ["hi", "hey"]}) + "\n")
    prompts, refs = repro.load_prompts(f)
    r = repro.seed_sensitivity(chat_llm, prompts, SamplingParams(temperature=0.0, max_tokens=2),
                               seeds=range(2), references=refs)
    assert r.metrics["exact_match.mean"] == 0.0 and r.same, r.format()


# ---- spec --------------------------------------------------------------------------------------------
def test_spec_check_says_when_nothing_was_proposed(chat_llm):
    """One token per prompt leaves no decode step to speculate on: no proposal was verified, yet the
    check read SAME with "0% of proposed tokens accepted" as if speculation had been tested."""
    idle = repro.speculation_parity(chat_llm, prompts=[[9, 10, 11]], max_tokens=1, seeds=(0,))
    assert idle.metrics["num_drafts"] == 0 and "speculation was not tested" in idle.summary, idle.format()
    busy = repro.speculation_parity(chat_llm, prompts=PROMPTS[:1], max_tokens=20, seeds=(0,))
    assert busy.metrics["num_drafts"] > 0 and "not tested" not in busy.summary, busy.format()
    assert busy.same and chat_llm.get_engine_info().config.speculative_config is None


def test_batch_check_refuses_an_empty_variant_list(chat_llm):
    """No variant compares nothing: the batch-1 reference ran and the result failed on ``max()`` of
    no variant."""
    with pytest.raises(ValueError, match=r"batch variant\(s\) none given; choose from \['full_batch'"):
        repro.batch_consistency(chat_llm, PROMPTS[:1], max_tokens=1, variants=[])
