"""pagedlab.lab.repro: each check reports the identical case as "same" and a deliberately
perturbed case (batch-dependent logits, sampling noise, another dtype, a tokenizer with one merge
removed, an all-ones attention mask with left padding) as "differs"."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch

from conftest import KV_BYTES
from conftest import REPRO_PROMPTS as PROMPTS
from pagedlab import LLM, SamplingParams
from pagedlab.lab import repro


@pytest.fixture(scope="module")
def merge_removed_dir(chat_dir, tmp_path_factory):
    """The same model with a tokenizer that lacks its first (most frequent) BPE merge."""
    out = tmp_path_factory.mktemp("repro_chat_b") / "m"
    shutil.copytree(chat_dir, out)
    tok = json.loads((out / "tokenizer.json").read_text())
    tok["model"]["merges"].pop(0)
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return str(out)


# ---- batch --------------------------------------------------------------------------------------------
def test_batch_consistency_same(chat_llm):
    before = chat_llm.llm_engine.config
    r = repro.batch_consistency(chat_llm, PROMPTS, max_tokens=8)
    assert r.verdict == "same", r.format()
    assert r.metrics["max_prompts_differing"] == 0 and r.metrics["first_divergence"] is None
    assert set(r.details) == {"full_batch", "shuffled", "prefix_cache_on", "chunked_prefill",
                              "no_chunked_prefill"}
    assert chat_llm.llm_engine.config == before  # the plan is restored


def test_batch_consistency_detects_batch_dependent_logits(chat_llm, monkeypatch):
    model = chat_llm.llm_engine.runner.model
    original = model.compute_logits
    noise = torch.randn(len(chat_llm.get_tokenizer()), generator=torch.Generator().manual_seed(0))

    def batch_dependent(hidden):  # logits shift with the number of rows: a batch-variance bug
        logits = original(hidden)
        return logits + 3.0 * (hidden.shape[0] - 1) * noise[: logits.shape[-1]].to(logits.dtype)

    monkeypatch.setattr(model, "compute_logits", batch_dependent)
    r = repro.batch_consistency(chat_llm, PROMPTS, max_tokens=8, variants=["full_batch", "shuffled"])
    assert r.verdict == "differs", r.format()
    assert r.metrics["full_batch.prompts_differing"] > 0
    assert r.metrics["first_divergence"] is not None


def test_compare_outputs_by_hand():
    ref_ids, ref_lps = [[1, 2, 3], [4, 5, 6]], [[-0.1, -0.9, -0.3], [-1.0, -1.0, -1.0]]
    ids, lps = [[1, 2, 3], [4, 9, 6]], [[-0.1, -0.2, -0.3], [-1.5, -3.0, -9.0]]
    # prompt 0 agrees, |Δ| 0.7 at token 1; prompt 1 diverges at token 1, so only token 0 (0.5) counts
    from pagedlab.lab.repro.compare import compare_outputs

    got = compare_outputs(ref_ids, ref_lps, ids, lps)
    assert got == {"prompts_differing": 1, "first_divergence": 1, "max_logprob_diff": pytest.approx(0.7)}


def test_batch_consistency_detects_logprob_drift_without_token_changes(chat_llm, monkeypatch):
    model = chat_llm.llm_engine.runner.model
    original = model.compute_logits

    def batch_dependent_temperature(hidden):  # scaled logits: the same argmax, other logprobs
        return original(hidden) * (1.0 + 0.01 * (hidden.shape[0] - 1))

    monkeypatch.setattr(model, "compute_logits", batch_dependent_temperature)
    r = repro.batch_consistency(chat_llm, PROMPTS, max_tokens=8, variants=["full_batch"])
    assert r.metrics["full_batch.prompts_differing"] == 0  # the same tokens...
    assert r.metrics["full_batch.max_logprob_diff"] > 1e-3  # ...with moved logprobs
    assert r.verdict == "differs", r.format()
    loose = repro.batch_consistency(chat_llm, PROMPTS, max_tokens=8, variants=["full_batch"],
                                    logprob_tolerance=1.0)
    assert loose.verdict == "same", loose.format()


def test_batch_prefix_cache_variant_reads_the_cache_or_says_it_did_not(chat_llm):
    long = [list(range(5, 45)), list(range(50, 83))]  # 40 and 33 tokens
    r = repro.batch_consistency(chat_llm, long, max_tokens=4, variants=["prefix_cache_on", "full_batch"])
    # the warm pass caches each prompt's full 16-token blocks but the last token's: 32 + 32
    assert r.metrics["prefix_cache_on.cached_prompt_tokens"] == 64
    assert r.details["full_batch"]["cached_prompt_tokens"] == 0 and "tested nothing" not in r.summary
    short = repro.batch_consistency(chat_llm, [list(range(5, 15)), list(range(20, 36))], max_tokens=4,
                                    variants=["prefix_cache_on"])
    assert short.metrics["prefix_cache_on.cached_prompt_tokens"] == 0
    assert "prefix_cache_on read no prompt token from the cache, so it tested nothing" in short.summary
    alone = repro.batch_consistency(chat_llm, [list(range(5, 15))], max_tokens=4, variants=["full_batch"])
    assert "one prompt: full_batch and shuffled ran it alone, so they tested nothing" in alone.summary


def test_checks_refuse_no_prompts(chat_llm):
    for check in (repro.batch_consistency, repro.seed_sensitivity):
        with pytest.raises(ValueError, match="no prompts: give at least one prompt"):
            check(chat_llm, [])


def test_first_divergence():
    assert repro.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert repro.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert repro.first_divergence([1, 2], [1, 2, 3]) == 2


# ---- seeds -------------------------------------------------------------------------------------------
def test_seed_sensitivity_greedy_is_same_sampling_differs(chat_llm):
    greedy = repro.seed_sensitivity(chat_llm, PROMPTS,
                                    SamplingParams(temperature=0.0, max_tokens=12, logprobs=0),
                                    seeds=range(3))
    assert greedy.verdict == "same", greedy.format()
    assert greedy.metrics["mean_token_logprob.std"] < 1e-6  # prefix-cache hits may move the last bits
    hot = repro.seed_sensitivity(chat_llm, PROMPTS,
                                 SamplingParams(temperature=1.5, max_tokens=12, logprobs=0),
                                 seeds=range(3), threshold=0.01)
    assert hot.verdict == "differs", hot.format()
    assert "mean_token_logprob" in hot.details["flagged"]
    st = hot.details["stats"]["mean_token_logprob"]
    assert st["ci95_low"] < st["mean"] < st["ci95_high"]
    assert st["min"] <= st["mean"] <= st["max"] and st["std"] > 0


def test_seed_threshold_per_metric_and_metrics_that_compare_nothing(chat_llm):
    hot = SamplingParams(temperature=1.5, max_tokens=12, logprobs=0)
    strict = repro.seed_sensitivity(chat_llm, PROMPTS, hot, seeds=range(3),
                                    threshold={"mean_token_logprob": 0.0})
    assert "mean_token_logprob" in strict.details["flagged"]
    loose = repro.seed_sensitivity(chat_llm, PROMPTS, hot, seeds=range(3),
                                   threshold={"mean_token_logprob": 10.0, "mean_output_tokens": 10.0,
                                              "distinct_2": 10.0})
    assert loose.verdict == "same" and loose.details["flagged"] == [], loose.format()
    with pytest.raises(ValueError, match="share no metric over every seed"):
        repro.seed_sensitivity(chat_llm, PROMPTS, hot, seeds=range(2), metrics_fn=lambda outs, refs: {})


def test_summarize_numbers():
    s = repro.summarize([1.0, 2.0, 3.0])
    assert s["mean"] == 2.0 and s["std"] == 1.0 and s["min"] == 1.0 and s["max"] == 3.0
    assert s["ci95_high"] - s["mean"] == pytest.approx(4.303 / math.sqrt(3), rel=1e-3)


# ---- precision ---------------------------------------------------------------------------------------
def test_precision_drift_same_dtype_same_other_dtype_differs(chat_dir):
    args = {"kv_cache_memory_bytes": KV_BYTES, "device": "cpu"}
    same = repro.precision_drift(chat_dir, PROMPTS, dtypes=("float32", "float32"), max_tokens=8,
                                 engine_args=args)
    assert same.verdict == "same", same.format()
    assert same.metrics["float32#1.mean_kl"] < 1e-9 and same.metrics["float32#1.top1_agreement"] == 1.0
    drift = repro.precision_drift(chat_dir, PROMPTS, dtypes=("float32", "bfloat16"), max_tokens=8,
                                  engine_args=args)
    assert drift.verdict == "differs", drift.format()
    assert drift.metrics["bfloat16.mean_kl"] > 1e-4  # the exact KL (k = the vocabulary) is 4.4e-4
    # bfloat16 ties two tokens where float32 picked the higher id: greedy takes the lower, and so
    # must the teacher-forced top-1 (not the actual token listed first)
    assert drift.metrics["bfloat16.first_divergence"] == 0 and drift.metrics["bfloat16.top1_agreement"] < 1.0
    kl_blind = repro.precision_drift(chat_dir, PROMPTS, dtypes=("float32", "bfloat16"), max_tokens=8,
                                     kl_threshold=1.0, engine_args=args)
    assert kl_blind.metrics["bfloat16.mean_kl"] < 1.0 and kl_blind.verdict == "differs"  # greedy differs


def test_precision_settings_come_from_the_variants_alone(chat_dir):
    """An engine argument for a precision setting (--kv-cache-dtype fp8) must not reach the reference."""
    args = {"kv_cache_memory_bytes": KV_BYTES, "device": "cpu", "kv_cache_dtype": "fp8", "dtype": "bfloat16"}
    r = repro.precision_drift(chat_dir, PROMPTS[:2], dtypes=("float32", "kv-fp8"), max_tokens=2,
                              engine_args=args)
    ref, variant = r.details["engines"]
    assert (ref["dtype"], ref["kv_cache_dtype"]) == ("float32", "float32")
    assert variant["kv_cache_dtype"] == "float8_e4m3fn"


def test_a_nan_logprob_is_a_difference():
    from pagedlab.lab.repro.compare import compare_outputs, logprob_diff

    assert logprob_diff(float("-inf"), float("-inf")) == 0.0 and logprob_diff(-1.0, -1.5) == 0.5
    assert logprob_diff(float("nan"), -1.0) == math.inf == logprob_diff(-1.0, float("nan"))
    cmp = compare_outputs([[1, 2]], [[-0.1, -0.2]], [[1, 2]], [[-0.1, float("nan")]])
    assert cmp["prompts_differing"] == 0 and cmp["max_logprob_diff"] == math.inf


def test_top1_breaks_ties_as_greedy_argmax():
    from pagedlab.lab.repro.compare import top1

    assert top1({53: -2.9, 16: -2.9, 7: -3.5}) == 16
    assert top1({53: -1.0, 16: -2.9}) == 53


def test_topk_kl_equals_exact_kl_with_full_vocab_and_bounds_it_below():
    g = torch.Generator().manual_seed(0)
    p = torch.log_softmax(torch.randn(50, generator=g), -1)
    q = torch.log_softmax(torch.randn(50, generator=g), -1)
    exact = float((p.exp() * (p - q)).sum())
    full = repro.topk_kl(dict(enumerate(p.tolist())), dict(enumerate(q.tolist())))
    assert full == pytest.approx(exact, rel=1e-6)
    def top(lp, k):
        return {int(i): lp[i].item() for i in lp.topk(k).indices}

    for k in (1, 5, 10, 40):  # a lower bound at every k (the name's promise), reaching it at the whole vocab
        approx = repro.topk_kl(top(p, k), top(q, k))
        assert 0 <= approx <= exact + 1e-9, k
    assert 0.5 * exact < repro.topk_kl(top(p, 40), top(q, 40))


# ---- tokenizer ---------------------------------------------------------------------------------------
def test_tokenizer_drift_same_tokenizer_same(chat_dir, chat_llm):
    r = repro.tokenizer_drift(chat_dir, chat_dir, PROMPTS, llm=chat_llm, max_tokens=8)
    assert r.verdict == "same", r.format()
    assert r.metrics["fraction_tokenized_differently"] == 0 and r.metrics["output_exact_match"] == 1.0


def test_tokenizer_drift_detects_removed_merge(chat_dir, merge_removed_dir, chat_llm):
    refs = ["fox", "blue", "blocks", "four", "fine"]
    r = repro.tokenizer_drift(chat_dir, merge_removed_dir, PROMPTS, llm=chat_llm, references=refs,
                              max_tokens=8)
    assert r.verdict == "differs", r.format()
    assert r.metrics["fraction_tokenized_differently"] > 0
    ex = r.details["examples"][0]
    assert ex["a_ids"] != ex["b_ids"] and ex["a_tokens"] and ex["b_tokens"]
    assert {"bleu_a", "bleu_b", "bleu_delta", "exact_match_a", "exact_match_b"} <= set(r.metrics)


def test_reference_scores_count_only_prompts_with_a_reference():
    from pagedlab.lab.repro.common import corpus_bleu, reference_scores

    scores = reference_scores(["Paris", " four ", "blue"], ["paris", ["4", "four"], None])
    assert scores["exact_match"] == 0.5  # case counts; any listed answer matches; no reference, no score
    if "bleu" in scores:
        assert scores["bleu"] == corpus_bleu(["Paris", " four "], ["paris", "4"])
    assert reference_scores(["x"], [None]) == {}


def test_tokenizer_drift_references_follow_their_text_prompts(chat_dir, chat_llm):
    text = chat_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4),
                             use_tqdm=False)[0].outputs[0].text
    r = repro.tokenizer_drift(chat_dir, chat_dir, [[5, 6, 7], PROMPTS[0]], llm=chat_llm, max_tokens=4,
                              references=["not it", text])
    assert r.metrics["num_prompts"] == 1 and r.metrics["exact_match_a"] == 1.0 == r.metrics["exact_match_b"]


def test_tokenizer_drift_sees_outputs_decoded_differently(chat_dir, chat_llm, tmp_path):
    """Tokenizer B encodes as A but has lost its ByteLevel decoder: same ids, other output text."""
    b = tmp_path / "b"
    shutil.copytree(chat_dir, b, ignore=shutil.ignore_patterns("*.safetensors"))
    tok = json.loads((b / "tokenizer.json").read_text())
    tok["decoder"] = None
    (b / "tokenizer.json").write_text(json.dumps(tok))
    r = repro.tokenizer_drift(chat_dir, str(b), PROMPTS, llm=chat_llm, max_tokens=8)
    assert r.metrics["fraction_tokenized_differently"] == 0 and r.metrics["output_exact_match"] < 1.0
    assert r.verdict == "differs", r.format()


def test_tokenizer_that_does_not_load_is_named(chat_dir):
    with pytest.raises(ValueError, match="tokenizer '/no/such/tokenizer' could not be loaded"):
        repro.tokenizer_drift(chat_dir, "/no/such/tokenizer", PROMPTS)


# ---- padding -----------------------------------------------------------------------------------------
def test_padding_correct_mask_same_broken_mask_differs(chat_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(chat_dir, dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()
    ok = repro.padding_check(hf, PROMPTS, max_tokens=8)
    assert ok.verdict == "same", ok.format()
    assert ok.metrics["padded_prompts"] > 0
    broken = repro.padding_check(hf, PROMPTS, max_tokens=8, attention_mask="ones")
    assert broken.verdict == "differs", broken.format()
    assert broken.metrics["prompts_differing"] > 0 or broken.metrics["max_logprob_diff"] > 1e-3
    # float32 SDPA with and without padding rounds differently: a tolerance below that differs
    assert ok.metrics["max_logprob_diff"] > 0
    tight = repro.padding_check(hf, PROMPTS, max_tokens=8,
                                logprob_tolerance=ok.metrics["max_logprob_diff"] / 2)
    assert tight.metrics["prompts_differing"] == 0 and tight.verdict == "differs", tight.format()


# ---- HF parity ---------------------------------------------------------------------------------------
def test_hf_parity_same_weights_same_other_dtype_differs(chat_llm):
    r = repro.hf_parity(chat_llm, PROMPTS, max_tokens=8)
    assert r.verdict == "same", r.format()
    assert r.metrics["greedy_match_rate"] == 1.0 and r.metrics["top1_agreement"] == 1.0
    assert r.metrics["max_abs_logprob_diff"] < 1e-3
    bf = repro.hf_parity(chat_llm, PROMPTS, max_tokens=8, hf_dtype="bfloat16")
    assert bf.verdict == "differs", bf.format()
    assert bf.metrics["max_abs_logprob_diff"] > 1e-3
    firsts = [next((i for i, (a, b) in enumerate(zip(h, q)) if a != b), min(len(h), len(q)))
              for h, q in zip(bf.details["hf"], bf.details["pagedlab"]) if h != q]
    assert bf.metrics["first_divergence"] == min(firsts)
    # float32 agrees to ~1e-6, not bitwise: a tolerance below that differs on logprobs alone
    tight = repro.hf_parity(chat_llm, PROMPTS, max_tokens=8,
                            logprob_tolerance=r.metrics["max_abs_logprob_diff"] / 2)
    assert tight.metrics["greedy_match_rate"] == 1.0 and tight.metrics["top1_agreement"] == 1.0
    assert tight.verdict == "differs", tight.format()


def test_hf_parity_is_plain_greedy_whatever_generation_config_json_says(chat_dir, tmp_path):
    """HF's generate applies generation_config.json's repetition_penalty and n-gram ban; the
    engine's greedy does not, so the parity check must turn them off on the HF side."""
    model = tmp_path / "m"
    shutil.copytree(chat_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "repetition_penalty": 5.0,
                                                              "no_repeat_ngram_size": 1}))
    with LLM(str(model), kv_cache_memory_bytes=KV_BYTES, device="cpu") as llm:
        r = repro.hf_parity(llm, PROMPTS, max_tokens=8)
        assert r.verdict == "same", r.format()
        repeats = [t for t in r.details["pagedlab"] if len(set(t)) < len(t)]
        assert repeats  # the penalty and the ban would have changed these outputs


def test_hf_parity_differs_on_top1_alone(chat_llm, monkeypatch):
    """Greedy outputs equal and logprob tolerance out of the way: a teacher-forced position whose
    top-1 differs from HF's argmax still makes the check differ."""
    from pagedlab.lab.repro import hf as hf_check

    real = hf_check.teacher_forced

    def first_top1_swapped(llm, seqs, k):
        tf = real(llm, seqs, k)
        first = tf[0][0]
        (a, logprob_a), (b, logprob_b) = sorted(first.items(), key=lambda item: -item[1])[:2]
        first[a], first[b] = logprob_b, logprob_a
        return tf

    loose = {"max_tokens": 8, "logprob_tolerance": 1e9}
    assert repro.hf_parity(chat_llm, PROMPTS, **loose).verdict == "same"
    monkeypatch.setattr(hf_check, "teacher_forced", first_top1_swapped)
    r = repro.hf_parity(chat_llm, PROMPTS, **loose)
    assert r.metrics["greedy_match_rate"] == 1.0 and r.metrics["top1_agreement"] < 1.0
    assert r.verdict == "differs", r.format()


def test_hf_dtype_is_checked(chat_llm):
    with pytest.raises(ValueError, match=r"HF dtype 'bf17' is invalid: give one of \[.*'bf16'"):
        repro.hf_parity(chat_llm, PROMPTS, hf_dtype="bf17")
    from pagedlab.lab.repro.hf import hf_torch_dtype

    assert hf_torch_dtype("bf16") is torch.bfloat16 and hf_torch_dtype("float32") is torch.float32


def test_hf_parity_of_longrope_prompts_crossing_the_switch(tiny_models):
    """Phi-3 LongRoPE switching at 32 tokens, prompts of 20-30 tokens generating past it: HF's
    reference recomputes the whole sequence with the long factors there (as pagedlab does), so the
    check finds them the same, whatever ``generate`` does at the switch in the installed release."""
    from conftest import random_prompts

    tiny = tiny_models("phi3_longrope")
    prompts = random_prompts(3, min_len=20, max_len=30, seed=12)
    with LLM(tiny.path, dtype="float32", kv_cache_memory_bytes=KV_BYTES) as llm:
        r = repro.hf_parity(llm, prompts, hf_model=tiny.hf_model, max_tokens=16)
    assert r.verdict == "same", r.format()
    assert r.metrics["greedy_match_rate"] == 1.0 and r.metrics["top1_agreement"] == 1.0
    assert all(len(p) + len(t) > 33 for p, t in zip(prompts, r.details["hf"]))


# ---- storing and the CLI -----------------------------------------------------------------------------
def test_store_result_with_manifest(chat_llm, tmp_path):
    pytest.importorskip("sqlalchemy")
    from pagedlab.lab.store import ResultStore

    r = repro.CheckResult("batch", "differs", "x", {"max_logprob_diff": 0.5, "first_divergence": None},
                          {"k": [1]}, {"max_tokens": 4})
    url = f"sqlite:///{tmp_path / 'r.db'}"
    run_id = repro.store_result(r, url, llm=chat_llm)
    with ResultStore(url) as store:
        run = store.get_run(run_id)
    assert run["experiment"] == "repro"
    assert run["metrics"]["differs"] == 1 and run["metrics"]["max_logprob_diff"] == 0.5
    assert run["params"]["repro.check"] == "batch" and run["params"]["repro.verdict"] == "differs"
    assert run["manifest"]["repro"]["details"] == {"k": [1]} and "versions" in run["manifest"]
    assert run["manifest"]["engine"]["dtype"] == "float32"
    # a check that loads the model itself (precision, padding) still records the model's checksums
    run_id = repro.store_result(r, url, model=chat_llm.llm_engine.config.model)
    with ResultStore(url) as store:
        model = store.get_run(run_id)["manifest"]["model"]
    assert model["config_hash"].startswith("sha256:") and model["weight_checksum"].startswith("sha256:")


def test_cli_repro_check(chat_dir, merge_removed_dir, tmp_path, capsys):
    pytest.importorskip("sqlalchemy")
    from pagedlab.lab.repro_cli import main
    from pagedlab.lab.store import ResultStore

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:3]))
    db, out = tmp_path / "r.db", tmp_path / "report.json"
    rc = main(["repro", "check", "--model", chat_dir, "--device", "cpu", "--kv-cache-memory-bytes", "16MiB",
               "--prompts", str(prompts), "--checks", "batch,tokenizer", "--tokenizer-b", merge_removed_dir,
               "--max-tokens", "4", "--db", str(db), "--out", str(out), "--strict"])
    captured = capsys.readouterr()
    text = captured.out
    assert rc == 1  # --strict: the tokenizer check differs
    assert "[batch] SAME" in text and "[tokenizer] DIFFERS" in text
    # each check is named as it starts and advances its own progress bar to the end
    assert text.index("[1/2] batch: greedy at batch 1") < text.index("[batch] SAME") < text.index(
        "[2/2] tokenizer: two tokenizers") < text.index("[tokenizer] DIFFERS")
    assert re.search(r"batch: 100%.* (\d+)/\1 ", captured.err)
    assert re.search(r"tokenizer: 100%.* 2/2 ", captured.err)
    from pagedlab.lab.cli import main as lab_main

    assert lab_main(["results", "list", "--db", str(db)]) == 0
    listing = capsys.readouterr().out
    assert "check=batch" in listing and "verdict=same" in listing
    assert "check=tokenizer" in listing and "verdict=differs" in listing
    report = json.loads(out.read_text())
    assert [c["check"] for c in report["checks"]] == ["batch", "tokenizer"]
    with ResultStore(f"sqlite:///{db}") as store:
        assert len(store.runs(experiment="repro")) == 2
    with pytest.raises(SystemExit):
        main(["repro", "check", "--model", chat_dir, "--checks", "nope"])


def test_cli_repro_other_checks(chat_dir, tmp_path, capsys):
    from pagedlab.lab.repro_cli import main

    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS[:3]))
    out = tmp_path / "report.json"
    rc = main(["repro", "check", "--model", chat_dir, "--device", "cpu", "--kv-cache-memory-bytes", "16MiB",
               "--prompts", str(prompts), "--checks", "seeds,precision,padding,hf", "--max-tokens", "4",
               "--num-seeds", "2", "--sampling", '{"temperature": 0.0, "max_tokens": 4, "logprobs": 0}',
               "--dtypes", "float32,float32", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    for check in ("seeds", "precision", "padding", "hf"):
        assert f"[{check}] SAME" in text, text
    # the checks sharing one model run first; the headings count in run order
    headings = [line.split(":")[0] for line in text.splitlines() if re.match(r"\[\d/4\] ", line)]
    assert headings == ["[1/4] seeds", "[2/4] hf", "[3/4] precision", "[4/4] padding"]
    assert len(json.loads(out.read_text())["checks"]) == 4
    assert main(["repro", "check", "--model", chat_dir, "--checks", "seeds", "--sampling", "{oops"]) == 2


def test_cli_seeds_check_takes_an_experiments_sampling_params(chat_dir, tmp_path, capsys):
    from pagedlab.lab.repro_cli import main

    experiment = tmp_path / "exp.yaml"
    experiment.write_text(f"name: hot\nmodel: {chat_dir}\nsampling: {{temperature: 1.5, max_tokens: 6}}\n"
                          "dataset:\n  prompts: [{prompt: hello}]\nmetrics: [output_length]\n")
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS[:3]))
    args = ["repro", "check", "--model", chat_dir, "--device", "cpu", "--kv-cache-memory-bytes", "16MiB",
            "--prompts", str(prompts), "--checks", "seeds", "--num-seeds", "3", "--seed-threshold", "0.01",
            "--experiment", str(experiment)]
    assert main(args) == 0
    assert "[seeds] DIFFERS" in capsys.readouterr().out
    assert main(args + ["--sampling", '{"temperature": 0.0}']) == 0
    assert "[seeds] SAME" in capsys.readouterr().out


def test_load_prompts_files_and_their_mistakes(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "reference": "x"}\n\n{"prompt_token_ids": [3, 4]}\n')
    assert repro.load_prompts(f) == (["a", [3, 4]], ["x", None])
    f.write_text('{"prompt": "a"}\n')
    assert repro.load_prompts(f) == (["a"], None)
    bad = {"e.jsonl": ("", "holds no prompts"), "e.json": ("[]", "holds no prompts"),
           "d.json": ('{"prompt": "hi"}', "holds no prompts: give a non-empty list"),
           "n.jsonl": ('{"prompt": 5}', "item 0: 'prompt' is 5, not text"),
           "t.jsonl": ('{"prompt_token_ids": "12"}',
                       "item 0: 'prompt_token_ids' is '12', not a non-empty list"),
           "k.jsonl": ('{"text": "hi"}', "item 0 has no 'prompt' or 'prompt_token_ids'")}
    for name, (text, message) in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=re.escape(message)):
            repro.load_prompts(tmp_path / name)


def test_cli_default_checks_need_no_extra_arguments():
    from pagedlab.lab.repro_cli import default_checks

    assert default_checks(None, None) == ["batch", "seeds", "precision", "padding", "hf"]
    assert default_checks("tok_b/", "adapter/") == [c for c in repro.ALL_CHECKS if c != "spec"]
    assert default_checks("tok_b/", "adapter/", {"num_speculative_tokens": 2}) == list(repro.ALL_CHECKS)


def test_cli_refuses_bad_options_before_loading_a_model(chat_dir, capsys):
    from pagedlab.lab.repro_cli import main

    base = ["repro", "check", "--model", chat_dir, "--device", "cpu", "--kv-cache-memory-bytes", "16MiB"]
    cases = [(["--checks", "batch,precision", "--dtypes", "float32,bfloat61"], "--dtypes: precision variant "
              "'bfloat61': 'bfloat61' is neither a dtype"),
             (["--checks", "batch,precision", "--dtypes", "float32"], "give at least two precision variants"),
             (["--checks", "batch,hf", "--hf-dtype", "bf17"], "--hf-dtype: HF dtype 'bf17' is invalid"),
             (["--checks", "batch,tokenizer", "--tokenizer-b", "/no/such/tok"],
              "tokenizer '/no/such/tok' could not be loaded")]
    for extra, message in cases:
        assert main(base + extra) == 2
        out, err = capsys.readouterr()
        assert message in err and "loading" not in out, (extra, out, err)


def test_cli_keeps_finished_checks_when_a_later_one_fails(chat_dir, tmp_path, monkeypatch, capsys):
    from pagedlab.lab import repro_cli

    def fails(args, prompts, bar):
        raise ValueError("padding broke")

    monkeypatch.setattr(repro_cli, "_padding_check", fails)
    out = tmp_path / "report.json"
    rc = repro_cli.main(["repro", "check", "--model", chat_dir, "--device", "cpu", "--kv-cache-memory-bytes",
                         "16MiB", "--checks", "batch,padding", "--max-tokens", "2", "--out", str(out)])
    assert rc == 2 and "error: padding broke" in capsys.readouterr().err
    report = json.loads(out.read_text())
    assert [c["check"] for c in report["checks"]] == ["batch"]
    assert report["error"] == "ValueError: padding broke"


# ---- SmolLM2 -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_hf_parity_and_padding(smollm2_dir, smollm2_hf):
    hf, tok = smollm2_hf
    prompts = ["The capital of France is a city that", "2 + 2 ="]  # different lengths: one is padded
    with LLM(smollm2_dir, dtype="float32", max_model_len=128, kv_cache_memory_bytes=KV_BYTES,
             device="cpu") as llm:
        r = repro.hf_parity(llm, prompts, hf_model=hf, max_tokens=4, k=5)
    assert r.verdict == "same", r.format()
    ids = [tok(p).input_ids for p in prompts]
    assert len(ids[0]) != len(ids[1])
    assert repro.padding_check(hf, ids, max_tokens=4).verdict == "same"
    broken = repro.padding_check(hf, ids, max_tokens=4, attention_mask="ones")
    assert broken.verdict == "differs", broken.format()


@pytest.mark.slow
def test_smollm2_batch_seeds_precision_tokenizer(smollm2_dir, tmp_path):
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    args = {"kv_cache_memory_bytes": KV_BYTES, "device": "cpu", "max_model_len": 128}
    with LLM(smollm2_dir, dtype="float32", **args) as llm:
        batch = repro.batch_consistency(llm, prompts, max_tokens=6)
        assert batch.verdict == "same", batch.format()
        greedy = repro.seed_sensitivity(llm, prompts,
                                        SamplingParams(temperature=0.0, max_tokens=6, logprobs=0),
                                        seeds=range(2))
        assert greedy.verdict == "same", greedy.format()
        hot = repro.seed_sensitivity(llm, prompts, SamplingParams(temperature=1.5, max_tokens=6, logprobs=0),
                                     seeds=range(3), threshold=0.01)
        assert hot.verdict == "differs", hot.format()
        broken = tmp_path / "tok"
        shutil.copytree(smollm2_dir, broken, ignore=shutil.ignore_patterns("*.safetensors"))
        tok = json.loads((broken / "tokenizer.json").read_text())
        tok["model"]["merges"].pop(0)  # "Ġ t": a merge almost every English text uses
        (broken / "tokenizer.json").write_text(json.dumps(tok))
        assert repro.tokenizer_drift(smollm2_dir, smollm2_dir, prompts, llm=llm,
                                     max_tokens=6).verdict == "same"
        drift = repro.tokenizer_drift(smollm2_dir, str(broken), prompts, llm=llm, max_tokens=6)
        assert drift.verdict == "differs", drift.format()
    same = repro.precision_drift(smollm2_dir, prompts[:2], dtypes=("float32", "float32"), max_tokens=4,
                                 engine_args=args)
    assert same.verdict == "same", same.format()
    drift = repro.precision_drift(smollm2_dir, prompts[:2], dtypes=("float32", "bfloat16"), max_tokens=4,
                                  engine_args=args)
    assert drift.verdict == "differs", drift.format()
