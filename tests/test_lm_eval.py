"""The lm-evaluation-harness model ``pagedlab`` against lm-eval's own ``hf`` model.

Local tasks only (YAML over JSONL files written here, no download): a multiple-choice task
(loglikelihood with is_greedy), a perplexity task (loglikelihood_rolling) and a generation task
(generate_until with stop sequences and max_gen_toks), on a tiny random Llama in float32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("lm_eval")

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_server_support import TINY_KV_BYTES, build_tiny_chat_model

# One pytest-xdist worker runs the module, so its lm-eval runs (the module fixtures, about a
# minute) happen once instead of once per worker.
pytestmark = pytest.mark.xdist_group("lm_eval")

TASKS = ["pagedlab_mc", "pagedlab_ppl", "pagedlab_gen", "pagedlab_gen_sampled"]


def _task_yaml(name: str, data: str, body: str) -> str:
    return textwrap.dedent(f"""\
        task: {name}
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        """) + textwrap.dedent(body)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from pagedlab import LLM, SamplingParams

    root = tmp_path_factory.mktemp("lm_eval")
    model_dir = build_tiny_chat_model(root / "model")
    # A continuation the model itself would pick greedily, so is_greedy is True at least once.
    # (One whose text re-tokenizes to the same ids after its context, as lm-eval encodes it.)
    with LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES) as llm:
        tok = llm.get_tokenizer()
        contexts = ["The quick brown", "Why is the sky", "Once upon a time", "hello world", "Paged attention",
                    "A server streams", "Question: what is", "The lazy dog"]
        outs = llm.generate(contexts, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        context, greedy = next((c, o.outputs[0].text) for c, o in zip(contexts, outs)
                               if tok(c + o.outputs[0].text).input_ids
                               == tok(c).input_ids + o.outputs[0].token_ids)
    mc = [
        {"question": "Why is the sky blue?", "choices": [" light", " dog", " four"], "answer": 0},
        {"question": "Question: what is two plus two?\nAnswer:", "choices": [" four", " fox"], "answer": 0},
        {"question": context, "choices": [greedy, " block", " fox"], "answer": 2},
        # empty context: prefix token
        {"question": "", "choices": ["Paged attention", "A server"], "answer": 0},
    ]
    ppl = [{"text": "The quick brown fox jumps over the lazy dog."},
           {"text": "A server streams tokens to many clients at once, one step at a time. " * 3}]
    gen = [{"question": "Question: what is two plus two?\nAnswer:", "answer": "four"},
           {"question": "Why is the sky", "answer": "blue"},
           {"question": "Once upon a time", "answer": "there"}]
    tasks = root / "tasks"
    tasks.mkdir()
    for name, rows in (("mc", mc), ("ppl", ppl), ("gen", gen)):
        (tasks / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tasks / "mc.yaml").write_text(_task_yaml("pagedlab_mc", tasks / "mc.jsonl", """\
        output_type: multiple_choice
        target_delimiter: ""
        doc_to_text: "{{question}}"
        doc_to_choice: "{{choices}}"
        doc_to_target: answer
        metric_list:
          - metric: acc
            aggregation: mean
            higher_is_better: true
        """))
    (tasks / "ppl.yaml").write_text(_task_yaml("pagedlab_ppl", tasks / "ppl.jsonl", """\
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{text}}"
        metric_list:
          - metric: word_perplexity
          - metric: byte_perplexity
          - metric: bits_per_byte
        """))
    gen_body = """\
        output_type: generate_until
        doc_to_text: "{{question}}"
        doc_to_target: "{{answer}}"
        generation_kwargs:
          until: ["\\n", "."]
          max_gen_toks: 10
          do_sample: false
        metric_list:
          - metric: exact_match
            aggregation: mean
            higher_is_better: true
        """
    (tasks / "gen.yaml").write_text(_task_yaml("pagedlab_gen", tasks / "gen.jsonl", gen_body))
    sampled = textwrap.dedent(gen_body).replace("do_sample: false", "do_sample: true\n  temperature: 1.0")
    (tasks / "gen_sampled.yaml").write_text(_task_yaml("pagedlab_gen_sampled", tasks / "gen.jsonl", sampled))
    return {"model": model_dir, "tasks": str(tasks), "greedy": greedy}


def _evaluate(setup, model: str, model_args: str, tasks=TASKS, batch_size=1):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import pagedlab.integrations.lm_eval  # noqa: F401 - registers "pagedlab"

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks),
                                   task_manager=TaskManager(include_path=setup["tasks"]), log_samples=True,
                                   device="cpu", batch_size=batch_size, random_seed=0, numpy_random_seed=0,
                                   torch_random_seed=0, fewshot_random_seed=0)


def _responses(results, task):
    return [s["filtered_resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.fixture(scope="module")
def both(setup):
    ours = _evaluate(setup, "pagedlab", f"pretrained={setup['model']},dtype=float32,"
                                        f"kv_cache_memory_bytes={TINY_KV_BYTES}")
    hf = _evaluate(setup, "hf", f"pretrained={setup['model']},dtype=float32", tasks=TASKS[:3])
    return ours, hf


def test_loglikelihood_matches_hf(both):
    ours, hf = both
    a, b = _responses(ours, "pagedlab_mc"), _responses(hf, "pagedlab_mc")
    assert len(a) == len(b) == 4
    for doc_a, doc_b in zip(a, b):
        assert len(doc_a) == len(doc_b)
        for (lp_a, greedy_a), (lp_b, greedy_b) in zip(doc_a, doc_b):
            assert lp_a == pytest.approx(lp_b, abs=1e-3)
            assert greedy_a == greedy_b
    assert a[2][0][1] is True  # the model's own greedy continuation
    assert ours["results"]["pagedlab_mc"]["acc,none"] == hf["results"]["pagedlab_mc"]["acc,none"]


def test_loglikelihood_rolling_matches_hf(both):
    ours, hf = both
    for x, y in zip(_responses(ours, "pagedlab_ppl"), _responses(hf, "pagedlab_ppl")):
        assert x[0] == pytest.approx(y[0], abs=1e-3)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["pagedlab_ppl"][metric] == pytest.approx(hf["results"]["pagedlab_ppl"][metric],
                                                                        rel=1e-4)


def test_generate_until_matches_hf(both):
    ours, hf = both
    a, b = _responses(ours, "pagedlab_gen"), _responses(hf, "pagedlab_gen")
    assert a == b
    assert all("\n" not in r[0] and "." not in r[0] for r in a)


def test_sampled_generation_is_reproducible(setup, both):
    ours, _ = both
    again = _evaluate(setup, "pagedlab", f"pretrained={setup['model']},dtype=float32,"
                                         f"kv_cache_memory_bytes={TINY_KV_BYTES}",
                      tasks=["pagedlab_gen_sampled"], batch_size=2)
    assert _responses(again, "pagedlab_gen_sampled") == _responses(ours, "pagedlab_gen_sampled")
    # and it samples: greedy decoding would be reproducible too
    assert _responses(ours, "pagedlab_gen_sampled") != _responses(ours, "pagedlab_gen")


def test_rolling_windows_longer_than_max_length(setup):
    """A text longer than max_length is scored in disjoint windows; every token counted once."""
    from lm_eval.api.instance import Instance

    from pagedlab.integrations.lm_eval import PagedLabLM

    lm = PagedLabLM(pretrained=setup["model"], dtype="float32", kv_cache_memory_bytes=TINY_KV_BYTES,
                    max_model_len=24, use_tqdm=False)
    text = "A server streams tokens to many clients at once, one step at a time. " * 4
    n_tokens = len(lm.tok_encode(text))
    assert n_tokens > 3 * 24
    req = Instance("loglikelihood_rolling", {}, (text,), 0)
    windowed = lm.loglikelihood_rolling([req])[0]
    full = PagedLabLM(pretrained=setup["model"], dtype="float32", kv_cache_memory_bytes=TINY_KV_BYTES,
                      use_tqdm=False)
    whole = full.loglikelihood_rolling([req])[0]
    assert windowed < 0 and whole < 0
    assert windowed != pytest.approx(whole, abs=1e-6)  # shorter contexts: a different (worse) score
    # lm-eval's hf model over the same windows (pagedlab windows at max_model_len - 2 tokens)
    from lm_eval.models.huggingface import HFLM

    reference = HFLM(pretrained=setup["model"], dtype="float32", max_length=22, device="cpu",
                     batch_size=1).loglikelihood_rolling([req], disable_tqdm=True)[0]
    assert windowed == pytest.approx(reference, abs=1e-3)
    # And the single-window score equals a direct loglikelihood of the text after the prefix token.
    direct = full._loglikelihood_tokens([(None, [full.prefix_token_id], full.tok_encode(text))])[0][0]
    assert whole == pytest.approx(direct, abs=1e-4)


def _model_without_bos(setup, directory) -> str:
    """The setup model with a tokenizer that adds no BOS of its own (as GPT-2's and Qwen's)."""
    import shutil

    shutil.copytree(setup["model"], directory)
    tokenizer_json = directory / "tokenizer.json"
    spec = json.loads(tokenizer_json.read_text())
    spec["post_processor"] = None
    tokenizer_json.write_text(json.dumps(spec))
    return str(directory)


def test_add_bos_token_on_a_tokenizer_without_bos(setup, tmp_path):
    """``add_bos_token=True`` makes a tokenizer that adds no BOS add one, as lm-eval's hf model
    (which builds its tokenizer with it) does: the same tokens and scores."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from pagedlab.integrations.lm_eval import PagedLabLM

    model = _model_without_bos(setup, tmp_path / "model")
    lm = PagedLabLM(pretrained=model, dtype="float32", kv_cache_memory_bytes=TINY_KV_BYTES,
                    add_bos_token=True, use_tqdm=False)
    hf = HFLM(pretrained=model, dtype="float32", device="cpu", batch_size=1, add_bos_token=True)
    assert lm.tok_encode("The quick brown") == hf.tok_encode("The quick brown")
    assert lm.tok_encode("The quick brown")[0] == lm.tokenizer.bos_token_id
    reqs = [Instance("loglikelihood", {}, ("The quick brown", " fox"), 0),
            Instance("loglikelihood", {}, ("Why is the sky ", "blue"), 1)]
    for (lp, greedy), (ref_lp, ref_greedy) in zip(lm.loglikelihood(reqs, disable_tqdm=True),
                                                  hf.loglikelihood(reqs, disable_tqdm=True)):
        assert lp == pytest.approx(ref_lp, abs=1e-3) and greedy == ref_greedy


def test_generate_until_stops_at_a_special_token_stop_string(setup, tmp_path):
    """A stop string that is a special token's text (chat tasks' "<|im_end|>", "<|eot_id|>") stops
    generation, as in lm-eval's hf model (its stop check decodes special tokens) and vllm model."""
    import shutil

    import torch
    import transformers
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from safetensors.torch import load_file, save_file

    from pagedlab.integrations.lm_eval import PagedLabLM

    # The setup model with "<|user|>" where its greedy continuation has its second token.
    model = tmp_path / "model"
    shutil.copytree(setup["model"], model)
    tok = transformers.AutoTokenizer.from_pretrained(model)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    prompt = tok("Why is the sky", return_tensors="pt").input_ids
    second = hf_model.generate(prompt, max_new_tokens=2, do_sample=False)[0, -1].item()
    user = tok.convert_tokens_to_ids("<|user|>")
    weights = load_file(model / "model.safetensors")
    weights["lm_head.weight"][[second, user]] = weights["lm_head.weight"][[user, second]]
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})

    req = Instance("generate_until", {}, ("Why is the sky", {"until": ["<|user|>"], "max_gen_toks": 8,
                                                             "do_sample": False}), 0)
    lm = PagedLabLM(pretrained=str(model), dtype="float32", kv_cache_memory_bytes=TINY_KV_BYTES,
                    use_tqdm=False)
    hf = HFLM(pretrained=str(model), dtype="float32", device="cpu", batch_size=1)
    assert lm.generate_until([req], disable_tqdm=True) == hf.generate_until([req], disable_tqdm=True)


def test_revision_reaches_the_engine(setup):
    """``revision=`` (lm-eval's hf model passes it to from_pretrained) picks the model's revision as
    ``LLM(revision=...)`` does, rather than being dropped."""
    from pagedlab.integrations.lm_eval import PagedLabLM

    lm = PagedLabLM(pretrained=setup["model"], revision="v2", kv_cache_memory_bytes=TINY_KV_BYTES,
                    use_tqdm=False)
    assert lm.engine.config.revision == "v2"


def test_bad_model_args(setup):
    from pagedlab.integrations.lm_eval import PagedLabLM

    with pytest.raises(ValueError, match="unknown model_args"):
        PagedLabLM(pretrained=setup["model"], not_an_arg=1)
    for batch_size in (-1, "abc", "auto:x"):  # -1 once ran no request at all and returned no results
        with pytest.raises(ValueError, match=f"batch_size={batch_size!r}"):
            PagedLabLM(pretrained=setup["model"], kv_cache_memory_bytes=TINY_KV_BYTES, batch_size=batch_size)
    with pytest.raises(ValueError, match="max_length"):
        PagedLabLM(pretrained=setup["model"], kv_cache_memory_bytes=TINY_KV_BYTES, max_model_len=64,
                   max_length=100)


@pytest.mark.parametrize("entry", [["pagedlab.integrations.lm_eval"], ["pagedlab.cli", "eval"]],
                         ids=["module", "pagedlab-eval"])
def test_cli_entry_runs_lm_eval(setup, tmp_path, entry):
    """`pagedlab eval run --model pagedlab ...` and `python -m pagedlab.integrations.lm_eval run ...`
    (lm-eval's CLI with the model registered)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", *entry, "run", "--model", "pagedlab", "--model_args",
           f"pretrained={setup['model']},dtype=float32,kv_cache_memory_bytes={TINY_KV_BYTES}",
           "--tasks", "pagedlab_mc", "--include_path", setup["tasks"], "--device", "cpu",
           "--output_path", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pagedlab_mc" in proc.stdout and "acc" in proc.stdout
    assert list(out.rglob("results_*.json"))


def test_seed_none_takes_the_seed_the_engine_drew(setup):
    """``seed=None`` (vLLM's "draw one") reaches the lm-eval model as the engine's recorded seed."""
    from pagedlab.integrations.lm_eval import PagedLabLM

    lm = PagedLabLM(pretrained=setup["model"], dtype="float32", kv_cache_memory_bytes=TINY_KV_BYTES,
                    seed=None, use_tqdm=False)
    drawn = lm.engine.config.seed
    assert isinstance(drawn, int) and lm.seed == drawn
