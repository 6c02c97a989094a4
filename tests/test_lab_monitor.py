"""GPU monitor: the NVML sampler (against a fake NVML on the CPU, the real one on a GPU), the
CPU/RAM fallback, the summary figures, and ``pagedlab monitor`` lines."""

import argparse
import io
import logging
import sys
import time
import types

import pytest

from pagedlab.lab import cli as lab_cli
from pagedlab.lab import monitor
from pagedlab.lab.monitor import GPUMonitor, run_monitor, summarize, throttle_reason_names


def _fake_pynvml(temps=(50, 60), power_mw=(300_000, 350_000), reasons=(0x1, 0x4)):
    """A stand-in for nvidia-ml-py with two GPUs and changing readings."""
    nv = types.ModuleType("pynvml")
    state = {"tick": 0, "shutdown": 0}
    nv.NVML_TEMPERATURE_GPU, nv.NVML_CLOCK_SM, nv.NVML_CLOCK_MEM = 0, 1, 2
    nv.nvmlInit = lambda: None

    def shutdown():
        state["shutdown"] += 1

    nv.nvmlShutdown = shutdown
    nv.nvmlDeviceGetCount = lambda: 2
    nv.nvmlDeviceGetHandleByIndex = lambda i: i
    nv.nvmlDeviceGetName = lambda h: f"Fake GPU {h}".encode()
    nv.nvmlDeviceGetUUID = lambda h: f"GPU-{h}"
    nv.nvmlSystemGetDriverVersion = lambda: "999.1"
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=90 + h, memory=40)
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=(h + 1) << 30, total=80 << 30)

    def temperature(h, sensor):
        state["tick"] += 1
        return temps[(state["tick"] // 2) % len(temps)]

    nv.nvmlDeviceGetTemperature = temperature
    nv.nvmlDeviceGetClockInfo = lambda h, kind: 1980 if kind == 1 else 2619
    nv.nvmlDeviceGetPowerUsage = lambda h: power_mw[state["tick"] % len(power_mw)]
    nv.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000
    nv.nvmlDeviceGetCurrentClocksEventReasons = lambda h: reasons[state["tick"] % len(reasons)]
    nv.state = state
    return nv


@pytest.fixture
def no_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    monkeypatch.setattr(monitor, "_no_gpu_reported", False)


def test_cpu_fallback_says_so_once_and_records_host(no_nvml, caplog):
    caplog.set_level(logging.WARNING, logger="pagedlab.lab.monitor")
    with GPUMonitor(interval=0.02) as mon:
        time.sleep(0.15)
    GPUMonitor(interval=0.02).close()
    assert mon.backend == "cpu" and "nvidia-ml-py" in mon.no_gpu_reason
    warnings = [r for r in caplog.records if "recording CPU and RAM only" in r.getMessage()]
    assert len(warnings) == 1
    assert len(mon.samples) >= 3 and all(s["kind"] == "cpu" for s in mon.samples)
    s = mon.summary()
    assert s["backend"] == "cpu" and s["gpus"] == [] and s["num_samples"] == len(mon.samples)
    assert s["cpu"]["ram_total_bytes"] > s["cpu"]["max_ram_used_bytes"] > 0
    assert s["cpu"]["max_rss_bytes"] > 0 and s["duration_s"] >= 0.1


@pytest.fixture
def cpu_clock(monkeypatch):
    """psutil's CPU times, advanced only by hand: 3 s busy per 1 s idle, a 75 % load."""
    psutil = pytest.importorskip("psutil")
    fields = psutil.cpu_times()._fields
    times = {"now": psutil.cpu_times()._make([0.0] * len(fields))}

    def advance(seconds):
        t = times["now"]
        times["now"] = t._replace(user=t.user + 3 * seconds, idle=t.idle + seconds)

    monkeypatch.setattr(psutil, "cpu_times", lambda percpu=False: times["now"])
    return advance


def test_cpu_percent_covers_the_time_since_the_previous_sample(no_nvml, cpu_clock):
    mon = GPUMonitor(interval=60).start()  # the thread never ticks: start() and stop() sample
    cpu_clock(2.0)
    s = mon.stop()
    assert [x["cpu_percent"] for x in mon.samples] == [None, 75.0]  # nothing measured at start()
    assert s["cpu"]["mean_cpu_percent"] == 75.0 and s["cpu"]["max_cpu_percent"] == 75.0
    mon.start()  # a restart measures from itself, not from the previous stop
    cpu_clock(1.0)
    mon.close()
    assert [x["cpu_percent"] for x in mon.samples[2:]] == [None, 75.0]


def test_first_monitor_line_measures_the_cpu_over_a_wait(no_nvml, cpu_clock, monkeypatch):
    monkeypatch.setattr(monitor, "time", types.SimpleNamespace(time=time.time, monotonic=time.monotonic,
                                                               sleep=cpu_clock))
    out = io.StringIO()
    assert run_monitor(interval=5, count=2, stream=out) == 2
    lines = out.getvalue().splitlines()[1:]
    assert len(lines) == 2 and all("cpu (" in line and "|  75.0 % |" in line for line in lines)


def test_nvml_sampler_with_fake_driver(monkeypatch):
    nv = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    mon = GPUMonitor(interval=0.01)
    assert mon.backend == "nvml" and mon.driver_version == "999.1"
    with mon:
        time.sleep(0.1)
    assert nv.state["shutdown"] == 1
    gpu = [s for s in mon.samples if s["kind"] == "gpu"]
    assert {s["index"] for s in gpu} == {0, 1} and gpu[0]["name"] == "Fake GPU 0"
    assert gpu[0]["mem_total"] == 80 << 30 and gpu[0]["sm_clock_mhz"] == 1980
    s = mon.summary()
    assert s["backend"] == "nvml" and s["max_temperature_c"] == 60
    assert s["mean_sm_clock_mhz"] == 1980 and 300 <= s["mean_power_w"] <= 350 and s["max_power_w"] <= 350
    assert s["max_gpu_memory_used_bytes"] == 2 << 30 and s["gpu_memory_total_bytes"] == 80 << 30
    assert s["throttled"] is True and "sw_power_cap" in s["throttle_reasons"]
    capped = sum("sw_power_cap" in g["throttle"] for g in gpu)
    assert 0 < capped < len(gpu) and s["throttled_share"] == capped / len(gpu)
    assert s["gpus"][1]["mean_util_gpu"] == 91


def test_cuda_visible_devices_selects_gpus(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    mon = GPUMonitor(interval=1)
    assert [s["index"] for s in mon.sample_once() if s["kind"] == "gpu"] == [1]
    mon.close()


def test_idle_is_not_throttling():
    assert throttle_reason_names(0x1 | 0x40) == ["gpu_idle", "hw_thermal"]
    samples = [{"t": 0.0, "kind": "gpu", "index": 0, "name": "g", "throttle": ["gpu_idle"],
                "temperature_c": 30, "sm_clock_mhz": 300, "power_w": 60.0}]
    s = summarize(samples, "nvml")
    assert s["throttled"] is False and s["throttle_reasons"] == ["gpu_idle"] and s["max_temperature_c"] == 30
    assert s["throttled_share"] == 0.0


def test_monitor_lines_and_log(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    log = tmp_path / "exp.log"
    log.write_text("earlier line\n")
    assert run_monitor(interval=0.01, log=str(log), count=2, stream=None, gpu_only=True) == 2
    lines = log.read_text().splitlines()
    assert lines[0] == "earlier line" and lines[1].startswith("# NVIDIA driver 999.1, 2 GPU(s)")
    gpu_lines = lines[2:]
    assert len(gpu_lines) == 4  # 2 ticks x 2 GPUs
    assert "[0] Fake GPU 0 |" in gpu_lines[0] and "°C" in gpu_lines[0] and "/ 81920 MB" in gpu_lines[0]
    assert "SM 1980 MHz" in gpu_lines[0] and "throttle:" in gpu_lines[0]


def test_monitor_cli_without_gpu(no_nvml, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    lab_cli.register(parser.add_subparsers())
    log = tmp_path / "m.log"
    for _ in range(2):  # appends
        args = parser.parse_args(["monitor", "--interval", "0.01", "--count", "3", "--log", str(log)])
        assert args.func(args) == 0
    lines = log.read_text().splitlines()
    assert len(lines) == 8
    assert sum(line.startswith("# no NVIDIA GPU to monitor") for line in lines) == 2  # once per invocation
    cpu_lines = [line for line in lines if not line.startswith("#")]
    assert all(" cpu (" in line and "RAM" in line for line in cpu_lines)
    assert capsys.readouterr().out.count("cpu (") == 6
    args = parser.parse_args(["monitor", "--interval", "0", "--count", "1"])
    assert args.func(args) == 2
    assert "--interval" in capsys.readouterr().err


@pytest.mark.gpu
def test_real_nvml():
    pytest.importorskip("pynvml")
    mon = GPUMonitor(interval=0.05)
    if mon.backend != "nvml":
        pytest.skip(mon.no_gpu_reason)
    import torch

    with mon:
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(50):
            a = a @ a
            a = a / a.norm()
        torch.cuda.synchronize()
    s = mon.summary()
    assert s["max_temperature_c"] > 0 and s["mean_sm_clock_mhz"] > 0 and s["max_power_w"] > 0
    assert s["max_gpu_memory_used_bytes"] > 64 << 20 and s["gpus"][0]["name"]
    print(s)


def test_means_are_weighted_by_time_not_by_sample_count():
    """The stop() sample can come a moment after the last tick: it stands for that moment, not for
    a whole interval. GPU readings are averaged over time (trapezoids between samples, numpy's
    trapezoid rule); a CPU share covers the time since the previous sample, so it weighs that long."""
    np = pytest.importorskip("numpy")
    t = [0.0, 1.0, 2.0, 2.05]
    power, clock, cpu = [60.0, 700.0, 690.0, 100.0], [210, 1980, 1980, 600], [None, 100.0, 90.0, 0.0]
    samples = []
    for i, now in enumerate(t):
        samples.append({"t": now, "kind": "gpu", "index": 0, "name": "g", "power_w": power[i],
                        "sm_clock_mhz": clock[i], "util_gpu": 50, "throttle": []})
        samples.append({"t": now, "kind": "cpu", "cpu_percent": cpu[i]})
    s = summarize(samples, "nvml")
    span = t[-1] - t[0]
    assert s["mean_power_w"] == pytest.approx(np.trapezoid(power, t) / span)
    assert s["gpus"][0]["mean_sm_clock_mhz"] == pytest.approx(np.trapezoid(clock, t) / span)
    assert s["mean_util_gpu"] == pytest.approx(50)
    assert s["cpu"]["mean_cpu_percent"] == pytest.approx(np.average(cpu[1:], weights=np.diff(t)))
    # a reading missing from some samples is averaged over the samples that have it
    del samples[2]["power_w"]
    assert summarize(samples, "nvml")["mean_power_w"] == pytest.approx(
        np.trapezoid([power[0], power[2], power[3]], [t[0], t[2], t[3]]) / span)
    # one sample, or samples at one instant: the plain mean
    assert summarize(samples[:2], "nvml")["mean_power_w"] == 60.0
