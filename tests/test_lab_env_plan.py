"""``pagedlab plan`` against arithmetic done by hand here, and ``pagedlab env`` against a fake
NVML that shows each condition a warning is for."""

from __future__ import annotations

import json
import types

import pytest
import transformers

from pagedlab.cli.main import main
from pagedlab.lab import env as env_module
from pagedlab.lab.env import compare_environment, env_report
from pagedlab.lab.plan import GIB, gpu_memory_bytes, plan_memory, size_class, suggestions
from pagedlab.workloads import model_shape

H200 = 143771 << 20
# Llama-3-8B: one layer's linears are q 4096x4096, k and v 4096x1024 each, o 4096x4096 and
# gate, up, down 4096x14336 each.
LAYER_8B = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336
VOCAB_8B = 2 * 128256 * 4096  # embedding and (untied) LM head
NORMS_8B = 65 * 4096


def test_llama3_8b_weights_and_kv_by_hand():
    config = model_shape("llama3-8b")
    bf16 = plan_memory(config, H200, max_model_len=8192)
    assert bf16.parameters == 32 * LAYER_8B + VOCAB_8B + NORMS_8B  # 8.03 B
    assert bf16.weight_bytes == 2 * bf16.parameters  # about 15 GiB
    assert bf16.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads of 128, bf16
    awq = plan_memory(config, H200, quantization="awq", max_model_len=8192)
    # half a byte a weight, 2.5 bytes (scale + zero) per output and group of 128 inputs; vocab in bf16
    assert awq.weight_bytes == int(32 * (LAYER_8B / 2 + LAYER_8B / 128 * 2.5) + 2 * (VOCAB_8B + NORMS_8B))
    assert awq.weight_bytes < 5.8 * GIB  # the target for the engine's AWQ weights
    fp8 = plan_memory(config, H200, quantization="fp8", max_model_len=8192)
    outputs = 4096 + 2 * 1024 + 4096 + 2 * 14336 + 4096  # one float32 scale per output channel
    assert fp8.weight_bytes == 32 * (LAYER_8B + 4 * outputs) + 2 * (VOCAB_8B + NORMS_8B)
    assert fp8.weight_bytes < 8.5 * GIB
    assert plan_memory(config, H200, kv_cache_dtype="fp8").kv_bytes_per_token == 2 * 32 * 8 * 128


def test_the_default_context_is_the_engines_rope_scaled_one():
    """Without max_model_len the plan sizes sequences as the engine would: max_position_embeddings
    times a linear RoPE factor (8,192 x 4 here), not the unscaled length."""
    config = model_shape("llama3-8b")
    config.max_position_embeddings = 8192
    config.rope_parameters = {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0}
    plan = plan_memory(config, H200)
    assert plan.max_model_len == 4 * config.max_position_embeddings == 32768
    assert plan.max_sequences == plan.kv_tokens // 32768


def test_kv_tokens_are_what_is_left_of_the_budget():
    config = model_shape("llama3-8b")
    plan = plan_memory(config, H200, max_model_len=8192, gpu_memory_utilization=0.9)
    # one 8,192-token step: residual and normed hidden, QKV, attention out, gate/up/act; 256 logit rows
    activations = 8192 * (2 * 4096 + 6144 + 4096 + 3 * 14336) * 2 + 256 * 128256 * (2 + 4)
    assert plan.activation_peak_bytes == activations
    left = int(H200 * 0.9) - (512 << 20) - plan.weight_bytes - activations
    assert plan.kv_tokens == left // (131072 * 16) * 16 and plan.max_sequences == plan.kv_tokens // 8192
    assert plan.fits


def test_a_step_longer_than_the_context_is_profiled_as_several_sequences():
    """The engine's memory profile runs the largest step (max_num_batched_tokens) as sequences of
    max_model_len, ceil(8192 / 3000) = 3 of them (9,000 tokens), with up to 256 logit rows each;
    the plan's activations are that step's, not one 3,000-token sequence's."""
    config = model_shape("llama3-8b")
    plan = plan_memory(config, H200, max_model_len=3000, max_num_batched_tokens=8192)
    per_token = (2 * 4096 + 6144 + 4096 + 3 * 14336) * 2
    assert plan.activation_peak_bytes == 9000 * per_token + 3 * 256 * 128256 * (2 + 4)


def test_tensor_parallel_cuts_weights_and_replicates_kv_heads():
    config = model_shape("llama3-8b")
    two = plan_memory(config, H200, tensor_parallel_size=2, max_model_len=8192)
    assert two.kv_bytes_per_token == 2 * 32 * 4 * 128 * 2
    assert two.weight_bytes == 2 * (32 * LAYER_8B // 2 + VOCAB_8B // 2 + NORMS_8B)
    sixteen = plan_memory(config, H200, tensor_parallel_size=16, max_model_len=8192)
    assert sixteen.kv_bytes_per_token == 2 * 32 * 1 * 128 * 2  # 8 KV heads over 16 ranks: one each


def test_a_70b_model_is_sent_to_two_gpus_or_fp8():
    config = model_shape("llama3-70b")
    plan = plan_memory(config, H200, max_model_len=8192)
    assert not plan.fits and plan.weight_bytes > 130 * GIB
    found = suggestions(config, H200, max_model_len=8192)
    assert [(p.tensor_parallel_size, p.quantization) for p in found] == [(2, None), (1, "fp8")]
    assert all(p.fits for p in found)


def test_a_13b_model_on_one_24gb_card_needs_quantization():
    llama2_13b = transformers.LlamaConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                                          num_hidden_layers=40, num_attention_heads=40,
                                          num_key_value_heads=40, max_position_embeddings=4096)
    plan = plan_memory(llama2_13b, gpu_memory_bytes("RTX-4090"), dtype="float16")
    assert not plan.fits  # 26 GB of fp16 weights on a 24 GiB card
    found = suggestions(llama2_13b, gpu_memory_bytes("rtx4090"), dtype="float16")
    assert (found[0].tensor_parallel_size, found[-1].quantization) == (2, "fp8")


def test_bad_plan_settings_are_named():
    config = model_shape("llama3-8b")
    with pytest.raises(ValueError, match="gpu='B300' is unknown: known GPUs are"):
        gpu_memory_bytes("B300")
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide num_attention_heads=32"):
        plan_memory(config, H200, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="quantization='int8' is invalid"):
        plan_memory(config, H200, quantization="int8")


def test_a_context_beyond_the_models_is_refused_as_the_engine_refuses_it():
    """The engine refuses max_model_len above max_position_embeddings (times RoPE scaling); the
    plan of that setting must not say it fits."""
    config = model_shape("llama3-8b")
    limit = config.max_position_embeddings
    assert plan_memory(config, H200, max_model_len=limit).max_model_len == limit
    with pytest.raises(ValueError, match=f"max_model_len={limit + 1} is invalid: the model supports at most "
                                         f"{limit} positions"):
        plan_memory(config, H200, max_model_len=limit + 1)


def test_a_tensor_parallel_size_the_engine_cannot_split_the_kv_heads_over_is_refused():
    """12 query heads and 6 KV heads over 4 ranks: the heads divide, the KV heads neither divide
    nor are fewer than the ranks (vLLM's rule and the engine's, ``split_attention_heads``), so
    neither the plan nor its advice may offer TP=4."""
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=12288, intermediate_size=49152,
                                      num_hidden_layers=64, num_attention_heads=12, num_key_value_heads=6,
                                      max_position_embeddings=4096)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide num_key_value_heads=6"):
        plan_memory(config, H200, tensor_parallel_size=4)
    assert not plan_memory(config, H200, tensor_parallel_size=2).fits  # 145 B parameters: 4 GPUs or more
    assert all(p.tensor_parallel_size in (1, 2) for p in suggestions(config, H200))


def test_plan_command(capsys):
    assert main(["plan", "--model", "llama3-70b", "--gpu", "H200", "--max-model-len", "8192"]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "would fit: TP=2" in out
    assert main(["plan", "--model", "llama3-8b", "--gpu-memory", "80GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["gpu_memory_bytes"] == 80 * GIB and plan["fits"]
    assert main(["plan", "--model", "llama3-8b", "--gpu-memory", "lots"]) == 2
    assert "--gpu-memory 'lots' is invalid" in capsys.readouterr().err


def _fake_nvml(name="NVIDIA GeForce RTX 4090", ecc=1, uncorrected=0, reasons=0x0, width=(16, 16), p2p=0,
               fail=False):
    nv = types.ModuleType("pynvml")
    nv.NVML_CLOCK_SM, nv.NVML_CLOCK_MEM, nv.NVML_TEMPERATURE_GPU = 0, 1, 0
    nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC = 0, 1, 0
    nv.NVML_P2P_CAPS_INDEX_READ, nv.NVML_P2P_STATUS_OK = 0, 0

    def init():
        if fail:
            raise RuntimeError("NVML Shared Library Not Found")

    nv.nvmlInit, nv.nvmlShutdown = init, lambda: None
    nv.nvmlDeviceGetCount = lambda: 2
    nv.nvmlDeviceGetHandleByIndex = lambda i: i
    nv.nvmlSystemGetDriverVersion = lambda: b"580.159.04"
    nv.nvmlSystemGetCudaDriverVersion = lambda: 13000
    nv.nvmlDeviceGetName = lambda h: name.encode()
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=24 << 30)
    nv.nvmlDeviceGetEccMode = lambda h: (ecc, ecc)
    nv.nvmlDeviceGetTotalEccErrors = lambda h, kind, counter: uncorrected if kind == 1 else 3
    nv.nvmlDeviceGetClockInfo = lambda h, kind: 1500
    nv.nvmlDeviceGetMaxClockInfo = lambda h, kind: 2500
    nv.nvmlDeviceGetEnforcedPowerLimit = nv.nvmlDeviceGetPowerManagementDefaultLimit = lambda h: 450_000
    nv.nvmlDeviceGetTemperature = lambda h, sensor: 60
    nv.nvmlDeviceGetCurrentClocksEventReasons = lambda h: reasons
    nv.nvmlDeviceGetPersistenceMode = lambda h: 1
    nv.nvmlDeviceGetMigMode = lambda h: (0, 0)
    nv.nvmlDeviceGetCurrPcieLinkGeneration = nv.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 4
    nv.nvmlDeviceGetCurrPcieLinkWidth = lambda h: width[0]
    nv.nvmlDeviceGetMaxPcieLinkWidth = lambda h: width[1]
    nv.nvmlDeviceGetP2PStatus = lambda a, b, index: p2p
    return nv


@pytest.mark.parametrize(("nvml", "expected"), [
    (dict(ecc=1), "ECC is on; consumer cards lose about 15%"),
    (dict(uncorrected=2), "2 uncorrected ECC errors"),
    (dict(reasons=0x8 | 0x40), "clocks held down (hw_slowdown, hw_thermal)"),
    (dict(width=(8, 16)), "PCIe link x8 of x16"),
    (dict(p2p=2), "GPUs 0 and 1 cannot read each other's memory"),
])
def test_env_warns_with_a_fix(nvml, expected):
    settings = {"ecc": 0, **nvml}
    report = env_report(_fake_nvml(**settings))
    assert any(expected in w for w in report.warnings), report.warnings
    clean = env_report(_fake_nvml(ecc=0))
    assert not [w for w in clean.warnings if w.startswith("GPU")]
    assert report.gpus[0]["sm_clock_mhz"] == {"now": 1500, "max": 2500}


def test_env_without_a_gpu_says_so(capsys, monkeypatch):
    report = env_report(_fake_nvml(fail=True))
    assert report.gpus == [] and "NVML Shared Library Not Found" in report.no_gpu_reason
    monkeypatch.setattr(env_module, "env_report", lambda: report)
    assert main(["env"]) == 0
    assert "GPUs: none (no NVIDIA GPU found" in capsys.readouterr().out


def test_env_compare_names_a_changed_version(tmp_path, capsys):
    report = env_report(_fake_nvml(ecc=0))
    stored = {"run_id": 7, "manifest": {"versions": {**report.versions, "torch": "2.0.0"},
                                        "hardware": {**report.hardware, "gpus": [{"name": g["name"]}
                                                                                for g in report.gpus]}}}
    now = report.versions["torch"]
    assert compare_environment(report, stored) == [f"versions.torch: '2.0.0' then, {now!r} now"]
    path = tmp_path / "result.json"
    path.write_text(json.dumps(stored))
    assert main(["env", "--compare", str(path)]) == 0
    assert "versions.torch: '2.0.0' then" in capsys.readouterr().out
    (tmp_path / "empty.json").write_text("{}")
    assert main(["env", "--compare", str(tmp_path / "empty.json")]) == 2


def test_a_size_class_rounds_up_into_the_next_unit_without_e_notation():
    """Formatting with "g" wrote a count that rounds up to 1000 of its unit in e-notation (999,600
    parameters "1e+03K", 999.6e9 "1e+03B") and a count of 100 billion or more to two digits
    (175e9 "1.8e+02B"); the size class now moves up a unit where the rounded number reaches it
    and writes whole billions in full. Counts near a published size keep its name."""
    assert size_class(999_600) == "1M" and size_class(999_999) == "1M"
    assert size_class(999_600_000_000) == "1000B"
    assert size_class(175_000_000_000) == "175B" and size_class(150_000_000_000) == "150B"
    assert size_class(99_940_000) == "99.9M" and size_class(1_234_567) == "1.23M"
    assert size_class(140_000) == "140K" and size_class(999) == "999"
    assert size_class(999_600_000) == "1B" and size_class(6_740_000_000) == "7B"
    assert all("e" not in size_class(n) for n in range(995_000, 1_000_000_000, 999_983))


def test_env_compare_reads_a_pagedlab_bench_json_file(tmp_path, capsys):
    """docs/lab.md: --compare takes a benchmark file, and `pagedlab bench --json` writes its
    environment (versions, CUDA, the GPU's name) without a manifest: those fields are compared."""
    report = env_report(_fake_nvml(ecc=0))
    gpu = report.gpus[0]["name"]
    environment = {"date": "2026-12-01", "python": report.versions["python"], "torch": "2.0.0",
                   "transformers": report.versions["transformers"], "gpu": gpu,
                   "cuda": report.hardware.get("cuda"), "triton": report.versions["triton"],
                   "pagedlab": report.versions["pagedlab"]}
    stored = {"environment": environment, "command": "pagedlab bench throughput", "results": []}
    now = report.versions["torch"]
    assert compare_environment(report, stored) == [f"versions.torch: '2.0.0' then, {now!r} now"]
    moved = {**stored, "environment": {**environment, "torch": now, "gpu": "NVIDIA A100"}}
    assert compare_environment(report, moved) == [f"hardware.gpu: 'NVIDIA A100' then, {gpu!r} now"]
    path = tmp_path / "w_seed.json"
    path.write_text(json.dumps(stored))
    assert main(["env", "--compare", str(path)]) == 0
    assert "versions.torch: '2.0.0' then" in capsys.readouterr().out
