"""The provenance manifest: hashes that identify the model and tokenizer, git state, differences."""

import hashlib
import json
import subprocess

import pytest

from pagedlab import LLM, SamplingParams
from pagedlab.lab.manifest import (collect_manifest, config_hash, diff_manifests, files_checksum, flatten,
                                   git_info)
from pagedlab.lab.testing import CHAT_TEMPLATE, make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("manifest") / "tiny")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLAB_CACHE_DIR", str(tmp_path / "cache"))


def _sha256_file(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_manifest_fields(model_dir):
    with LLM(str(model_dir), device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 20, seed=7) as llm:
        m = collect_manifest(llm, sampling_params=SamplingParams(temperature=0.5, seed=3, max_tokens=4))
        tokenizer_class = type(llm.get_tokenizer()).__name__
    assert m["hardware"]["cpu_count"] >= 1 and m["hardware"]["cpu"]
    for lib in ("python", "pagedlab", "torch", "transformers", "tokenizers"):
        assert m["versions"][lib]
    model = m["model"]
    assert model["path"] == str(model_dir.resolve()) and model["architecture"] == "LlamaForCausalLM"
    # the weight checksum covers the safetensors file's name and bytes
    st = model_dir / "model.safetensors"
    outer = hashlib.sha256(st.name.encode() + b"\0" + _sha256_file(st).encode() + b"\0").hexdigest()
    assert model["weight_checksum"] == "sha256:" + outer
    assert model["config_hash"] == config_hash(model_dir)
    tok = m["tokenizer"]
    assert tok["class"] == tokenizer_class and tok["checksum"].startswith("sha256:")
    assert tok["chat_template_hash"] == "sha256:" + hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()
    eng = m["engine"]
    assert eng["dtype"] == "float32" and eng["device"] == "cpu" and eng["max_model_len"] == 512
    assert eng["max_num_batched_tokens"] > 0 and eng["num_kv_blocks"] > 0 and eng["block_size"] == 16
    assert eng["async_scheduling"] is False  # None resolved: off on the CPU
    assert eng["enable_cascade_attention"] is False  # asked for (the default), but the torch backend has none
    assert m["sampling"]["temperature"] == 0.5
    assert m["seeds"] == {"engine": 7, "sampling": [3]}
    json.dumps(m)  # JSON-able as is


def test_logits_processors_are_recorded_by_name(model_dir):
    """Code is no data: a processor (function or callable object) is recorded by its qualified name."""
    class Watermark:
        def __call__(self, output_ids, logits):
            return logits

    def favour(output_ids, logits):
        return logits

    params = SamplingParams(logits_processors=[favour, Watermark()])
    with LLM(str(model_dir), device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 20) as llm:
        m = collect_manifest(llm, sampling_params=[params, SamplingParams()])
    json.dumps(m)
    prefix = f"{__name__}.test_logits_processors_are_recorded_by_name.<locals>"
    assert m["sampling"][0]["logits_processors"] == [f"{prefix}.favour", f"{prefix}.Watermark"]
    assert m["sampling"][1]["logits_processors"] is None


def test_config_hash_ignores_key_order_but_not_values(tmp_path):
    a, b, c = (tmp_path / n for n in "abc")
    for d in (a, b, c):
        d.mkdir()
    (a / "config.json").write_text(json.dumps({"x": 1, "y": [1, 2]}))
    (b / "config.json").write_text(json.dumps({"y": [1, 2], "x": 1}, indent=4))
    (c / "config.json").write_text(json.dumps({"x": 2, "y": [1, 2]}))
    assert config_hash(a) == config_hash(b) != config_hash(c)


def test_weight_checksum_changes_with_weights_and_is_cached(tmp_path):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"a" * 1000)
    first = files_checksum([f])
    assert files_checksum([f]) == first
    cache = json.loads((tmp_path / "cache" / "lab" / "file-digests.json").read_text())
    assert list(cache.values()) == [_sha256_file(f)]
    f.write_bytes(b"b" * 1000)
    assert files_checksum([f]) != first


def test_dummy_weights_are_named_by_seed(tmp_path):
    (tmp_path / "shape").mkdir()
    make_tiny_model(tmp_path / "shape", tokenizer=False)
    with LLM(str(tmp_path / "shape"), device="cpu", load_format="dummy", seed=5,
             kv_cache_memory_bytes=1 << 20) as llm:
        m = collect_manifest(llm)
    assert m["model"]["weight_checksum"] == "dummy:seed=5"
    assert m["tokenizer"]["class"] is None


def test_git_commit_and_dirty_flag(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    def run(*args):
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)

    run("init", "-q")
    (repo / "f.txt").write_text("1")
    run("add", "f.txt")
    run("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x")
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    info = git_info(repo)
    assert info == {"commit": head, "dirty": False, "root": str(repo.resolve())}
    (repo / "f.txt").write_text("2")
    assert git_info(repo)["dirty"] is True
    monkeypatch.chdir(repo)
    assert collect_manifest()["git"]["commit"] == head
    outside = tmp_path / "nowhere" if (tmp_path / "nowhere").mkdir() is None else tmp_path
    assert git_info(outside)["commit"] is None


def test_diff_manifests():
    a = {"created_at": "1", "versions": {"torch": "2.11"}, "engine": {"block_size": 16, "dtype": "bf16"}}
    b = {"created_at": "2", "versions": {"torch": "2.12"}, "engine": {"block_size": 16, "dtype": "bf16"},
         "extra": 1}
    assert diff_manifests([a, b]) == ["versions.torch", "extra"]
    assert diff_manifests([a, a]) == []
    assert flatten({"a": {"b": {"c": 1}}, "d": []}) == {"a.b.c": 1, "d": []}


def test_generation_config_is_part_of_the_provenance(model_dir, tmp_path):
    """generation_config.json is loaded with the model: its eos_token_id ends sequences (whatever
    the SamplingParams) and it fills a request's unset fields. Two checkpoints that differ there
    give different manifests, and the manifest says which ids end a sequence."""
    import shutil

    from transformers import GenerationConfig

    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    gen = json.loads((other / "generation_config.json").read_text())
    (other / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 5],
                                                              "temperature": 0.7}))
    assert GenerationConfig.from_pretrained(other).eos_token_id != GenerationConfig.from_pretrained(
        model_dir).eos_token_id
    manifests = []
    for path in (model_dir, other):
        with LLM(str(path), device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 20) as llm:
            manifests.append(collect_manifest(llm, sampling_params=SamplingParams(max_tokens=4)))
    differ = diff_manifests(manifests)
    assert "model.generation_config_hash" in differ and "engine.eos_token_ids" in differ
    assert manifests[1]["engine"]["eos_token_ids"] == [2, 5]
    assert manifests[1]["engine"]["default_sampling_args"]["temperature"] == 0.7
