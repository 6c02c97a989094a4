"""Ray Data batch inference (examples/ray_batch_inference.py on a tiny model, two CPU actors):
every input row comes back in the Parquet output with the completion one LLM gives it, and the
manifest lies alongside."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pq = pytest.importorskip("pyarrow.parquet")

from pagedlab import LLM, SamplingParams  # noqa: E402
from pagedlab.lab.testing import make_tiny_model  # noqa: E402

# Under pytest-xdist (CI: -n 2 --dist loadgroup) the modules that start Ray or share the
# PostgreSQL database run on one worker, one after another.
pytestmark = pytest.mark.xdist_group("ray-and-postgres")
ROOT = Path(__file__).resolve().parents[1]
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "a", "cat", "sat", "on"]
ENGINE = {"device": "cpu", "dtype": "float32", "kv_cache_memory_bytes": 4 << 20}


@pytest.fixture(scope="module")
def local_ray():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's unix socket paths live under it
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=temp,  # 2 actors + read and write tasks
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT / "src")}})
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def _example():
    path = ROOT / "examples" / "ray_batch_inference.py"
    spec = importlib.util.spec_from_file_location("ray_batch_inference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_row_gets_its_completion_in_parquet_with_the_manifest(local_ray, tmp_path):
    model = make_tiny_model(tmp_path / "tiny")
    rows = [{"id": i, "prompt": " ".join(WORDS[i % 5:i % 5 + 3 + i % 4])} for i in range(12)]
    for row in rows[::4]:  # a per-row override; the other rows lack the field (null in Arrow)
        row["sampling_params"] = {"max_tokens": 2}
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    _example().main([str(source), str(out), "--model", str(model), "--num-gpus", "0", "--concurrency", "2",
                     "--batch-size", "5", "--max-tokens", "5"]  # 12 rows: batches of 5, 5 and 2
                    + [f"--engine={k}={v}" for k, v in ENGINE.items()])
    table = [row for part in sorted(out.glob("*.parquet")) for row in pq.read_table(part).to_pylist()]
    with LLM(str(model), **ENGINE) as llm:
        params = [SamplingParams(temperature=0, max_tokens=2 if "sampling_params" in r else 5) for r in rows]
        expected = [o.outputs[0] for o in llm.generate([r["prompt"] for r in rows], params, use_tqdm=False)]
    by_id = {r["id"]: r for r in table}
    assert len(table) == len(rows) and sorted(by_id) == [r["id"] for r in rows]
    for row, want in zip(rows, expected):
        got = by_id[row["id"]]
        assert got["prompt"] == row["prompt"]
        assert (got["generated_text"], got["num_output_tokens"], got["finish_reason"]) == (
            want.text, len(want.token_ids), want.finish_reason)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["ray_data"]["input_rows"] == len(rows) and manifest["ray_data"]["concurrency"] == 2
    assert manifest["sampling"]["max_tokens"] == 5


# ---- the predictor itself, on numpy batches as map_batches gives them (no Ray needed) ----------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def offline(tiny_dir):
    """The single-process reference: one LLM, ``generate`` over the same prompts."""
    with LLM(str(tiny_dir), **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def predictor(tiny_dir):
    from pagedlab.integrations.ray import PagedLabPredictor

    return PagedLabPredictor(str(tiny_dir), {"temperature": 0.8, "seed": 3, "max_tokens": 4}, **ENGINE)


def _batch(**columns) -> dict:
    return {k: np.array(v, dtype=object) for k, v in columns.items()}


def test_a_row_without_a_prompt_is_refused_naming_the_row(predictor):
    with pytest.raises(ValueError, match=r"row 1 of the batch: prompt=None .* text or a list of token ids"):
        predictor(_batch(prompt=["the quick", None]))


def test_token_id_prompts_are_generated_as_token_ids(predictor, offline):
    ids = [[5, 6, 7], [8, 9]]
    got = predictor(_batch(prompt=[np.array(i) for i in ids]))
    want = offline.generate(ids, predictor.sampling_params, use_tqdm=False)
    assert list(got["generated_text"]) == [o.outputs[0].text for o in want]


def test_several_completions_per_row_are_refused_not_cut_to_the_first(tiny_dir):
    from pagedlab.integrations.ray import PagedLabPredictor

    with pytest.raises(ValueError, match=r"n=2: .* one completion per row"):
        PagedLabPredictor(str(tiny_dir), {"n": 2}, **ENGINE)


def test_an_input_column_the_outputs_would_overwrite_is_refused(predictor):
    with pytest.raises(ValueError, match=r"column\(s\) 'finish_reason', which .* would overwrite"):
        predictor(_batch(prompt=["the quick"], finish_reason=["from an earlier pass"]))


def test_without_sampling_params_rows_get_what_generate_gives_without_them(tiny_dir, offline):
    from pagedlab.integrations.ray import PagedLabPredictor

    recommended = {"max_new_tokens": 2, "temperature": 0.0}  # as the model's generation_config.json
    plain = PagedLabPredictor(str(tiny_dir), **ENGINE, override_generation_config=recommended)
    prompts = ["the quick brown", "a cat sat"]
    got = plain(_batch(prompt=prompts))
    want = offline.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert list(got["generated_text"]) == [o.outputs[0].text for o in want]
    assert list(got["num_output_tokens"]) == [2, 2]


def test_a_sampling_params_column_sets_each_rows_params_over_the_actors(predictor, offline):
    prompts = ["the quick brown", "a cat sat", "over the lazy"]
    # as Ray Data gives a struct column: a field a row lacks is null (NaN when numeric), and an
    # integer field with nulls arrives as floats
    rows = [{"max_tokens": 1.0, "temperature": np.nan}, None, {"max_tokens": 2.0, "temperature": 0.0}]
    got = predictor(_batch(prompt=prompts, sampling_params=rows))
    want = offline.generate(prompts, [SamplingParams(temperature=0.8, seed=3, max_tokens=1),
                                      SamplingParams(temperature=0.8, seed=3, max_tokens=4),
                                      SamplingParams(temperature=0.0, seed=3, max_tokens=2)], use_tqdm=False)
    assert list(got["generated_text"]) == [o.outputs[0].text for o in want]
    assert list(got["num_output_tokens"]) == [1, 4, 2] and list(got["sampling_params"]) == rows
    with pytest.raises(ValueError, match=r"row 0 of the batch: sampling_params: .*n=3"):
        predictor(_batch(prompt=prompts[:1], sampling_params=[{"n": 3}]))


class _PlannedDataset:
    """A stand-in for the Dataset ``ray.data.read_json`` returns: it records the map_batches call."""

    def __init__(self):
        self.map_batches_kwargs = None

    def map_batches(self, fn, **kwargs):
        self.map_batches_kwargs = kwargs
        return self

    def write_parquet(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)


def _plan(monkeypatch, tmp_path, text="", **kwargs):
    from pagedlab.integrations.ray import run_batch_inference

    planned = _PlannedDataset()
    monkeypatch.setattr(ray.data, "read_json", lambda path: planned)
    source = tmp_path / "prompts.jsonl"
    source.write_text(text)
    manifest = run_batch_inference(source, tmp_path / "out", "m", {"max_tokens": 2}, **kwargs)
    return planned.map_batches_kwargs, manifest


def test_each_actor_asks_for_a_gpu_per_tensor_parallel_rank(monkeypatch, tmp_path):
    planned, _ = _plan(monkeypatch, tmp_path, tensor_parallel_size=2)
    assert (planned["num_gpus"], planned["fn_constructor_kwargs"]["tensor_parallel_size"]) == (2, 2)
    planned, _ = _plan(monkeypatch, tmp_path, num_gpus=0, tensor_parallel_size=2, device="cpu")
    assert planned["num_cpus"] == 2 and not planned.get("num_gpus")
    with pytest.raises(ValueError, match=r"num_gpus=1 .* tensor_parallel_size=2"):
        _plan(monkeypatch, tmp_path, num_gpus=1, tensor_parallel_size=2)


def test_the_manifest_counts_the_rows_ray_data_reads(monkeypatch, tmp_path):
    from pyarrow import json as pa_json  # the reader under ray.data.read_json

    rows = '{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}'
    for text in (rows, rows + "\n\n"):  # no final newline; a blank line at the end
        _, manifest = _plan(monkeypatch, tmp_path, text=text, num_gpus=0)
        assert manifest["ray_data"]["input_rows"] == pa_json.read_json(tmp_path / "prompts.jsonl").num_rows
