"""LoRA adapters in lab experiments: ``lora: [null, DIR, DIR]`` sweeps adapters over one loaded
model, each run's outputs are the HF+PEFT greedy tokens of its adapter, and the manifest records
the adapter's config and weights checksum."""

from __future__ import annotations

import hashlib
import json
import os
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import hf_greedy
from lora_fixtures import ALL_TARGETS, make_adapter
from pagedlab import LLM

pytest.importorskip("yaml")
pytest.importorskip("sqlalchemy")
pytest.importorskip("peft")

from pagedlab.lab.experiments import ExperimentError, load_experiment, run_experiment
from pagedlab.lab.store import ResultStore
from pagedlab.lab.testing import make_tiny_model

PROMPTS = ["the quick brown fox", "two plus two is"]
EXPERIMENT = """
name: lora-sweep
model: model
engine: {device: cpu, dtype: float32, kv_cache_memory_bytes: 4194304}
sampling: {max_tokens: 6, temperature: 0, ignore_eos: true}
dataset:
  prompts:
    - {prompt: "the quick brown fox"}
    - {prompt: "two plus two is"}
metrics: [output_length]
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("lab_lora")
    model_dir = make_tiny_model(root / "tiny")
    os.symlink(model_dir, root / "model")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    adapters = {"sql": make_adapter(hf_model, root / "adapters" / "sql", 0, 8, 16, ALL_TARGETS),
                "poet": make_adapter(hf_model, root / "adapters" / "poet", 1, 4, 8, ["q_proj", "v_proj"],
                                     use_rslora=True)}
    return root, hf_model, adapters


class CountingLLM:
    """``LLM`` that counts the loads."""

    def __init__(self):
        self.loads = []

    def __call__(self, model, **kwargs):
        self.loads.append(kwargs)
        return LLM(model, **kwargs)


def test_a_lora_sweep_loads_the_model_once_and_records_each_adapter(workdir):
    root, hf_model, adapters = workdir
    path = root / "exp.yaml"
    path.write_text(textwrap.dedent(EXPERIMENT).lstrip() + "lora: [null, adapters/sql, adapters/poet]\n")
    spec = load_experiment(path)
    factory = CountingLLM()
    db = f"sqlite:///{root / 'r.db'}"
    report = run_experiment(spec, db=db, quiet=True, llm_factory=factory)
    assert report.ok and len(report.finished) == 3
    assert len(factory.loads) == 1
    assert factory.loads[0]["enable_lora"] and factory.loads[0]["max_lora_rank"] == 8  # fits both adapters
    tokenizer = LLM(str(root / "model"), device="cpu", kv_cache_memory_bytes=1 << 20).get_tokenizer()
    seen = {}
    with ResultStore(db) as store:
        for run in store.runs(experiment="lora-sweep"):
            lora = run["params"].get("lora")
            name = Path(lora).name if lora else None
            reference = adapters[name].peft_model if name else hf_model
            outputs = [o["token_ids"] for o in store.outputs(run["run_id"])]
            assert outputs == [hf_greedy(reference, tokenizer(p).input_ids, 6) for p in PROMPTS], name
            manifest = run["manifest"]
            if name is None:
                assert "lora" not in manifest
            else:
                weights = Path(lora) / "adapter_model.safetensors"
                assert manifest["lora"]["weights_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
                config = json.loads((Path(lora) / "adapter_config.json").read_text())
                assert manifest["lora"]["config"]["r"] == config["r"]
                assert manifest["lora"]["path"] == lora
            seen[name] = outputs
    assert set(seen) == {None, "sql", "poet"}
    assert seen["sql"] != seen[None] and seen["poet"] != seen[None]  # each run really used its adapter


def test_bad_lora_entries_name_the_line(workdir):
    root, _, _ = workdir
    path = root / "bad.yaml"
    path.write_text(textwrap.dedent(EXPERIMENT).lstrip() + "lora: [adapters/sql, adapters/nope]\n")
    with pytest.raises(ExperimentError, match=r"bad\.yaml:\d+: grid\.lora\[1\].*does not exist"):
        load_experiment(path)
    head = textwrap.dedent(EXPERIMENT).lstrip().split("dataset:")[0]
    bench = "\n".join(line for line in head.splitlines() if not line.startswith("sampling")) + "\n"
    path.write_text(bench + "benchmark: {batch_size: 1, input_len: 8, output_len: 4}\nlora: [adapters/sql]\n")
    with pytest.raises(ExperimentError, match="dataset workload"):
        load_experiment(path)


def test_repro_lora_check_against_peft(workdir, capsys):
    from pagedlab.lab.repro_cli import main

    root, _, adapters = workdir
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    rc = main(["repro", "check", "--model", str(root / "model"), "--device", "cpu", "--kv-cache-memory-bytes",
               "16MiB", "--prompts", str(prompts), "--checks", "lora", "--lora", adapters["sql"].path,
               "--max-tokens", "6", "--strict", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "[lora] SAME" in out and "changes the output of" in out
    assert main(["repro", "check", "--model", str(root / "model"), "--checks", "lora"]) == 2  # no --lora


def test_repro_lora_check_sees_a_different_adapter(workdir, tmp_path):
    """pagedlab keeps the adapter it read; PEFT then reads other weights from the same directory."""
    import shutil

    from pagedlab.lab import repro
    from pagedlab.lab.lora import lora_request

    root, _, adapters = workdir
    adapter = tmp_path / "swapped"
    shutil.copytree(adapters["sql"].path, adapter)
    with LLM(str(root / "model"), device="cpu", kv_cache_memory_bytes=1 << 24, enable_lora=True,
             max_lora_rank=8) as llm:
        llm.generate(PROMPTS, use_tqdm=False, lora_request=lora_request(str(adapter.resolve())))
        shutil.copy(Path(adapters["poet"].path) / "adapter_model.safetensors", adapter)
        shutil.copy(Path(adapters["poet"].path) / "adapter_config.json", adapter)
        result = repro.lora_parity(llm, str(adapter), PROMPTS, max_tokens=6)
    assert result.verdict == "differs" and result.metrics["greedy_match_rate"] < 1
