"""GPU telemetry: an NVML (nvidia-ml-py) sampler in a background thread, with a host CPU/RAM fallback.

``GPUMonitor`` records, per NVIDIA GPU, utilization, memory, temperature, SM and memory clocks,
power and clock-throttle reasons, plus the host's CPU and RAM, every ``interval`` seconds::

    with GPUMonitor(interval=0.5) as mon:
        llm.generate(...)
    mon.summary()   # max temperature, mean SM clock, power, throttling, ...

Without an NVIDIA GPU (or without nvidia-ml-py) it says so once per process and records the CPU
and RAM only. ``pagedlab monitor`` prints gpustat-like lines from the same sampler.
"""

from __future__ import annotations

import itertools
import logging
import os
import statistics
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import TextIO

logger = logging.getLogger(__name__)

# NVML clock-event ("throttle") reason bits and our names for them.
_REASONS = (
    (0x1, "gpu_idle"), (0x2, "applications_clocks"), (0x4, "sw_power_cap"), (0x8, "hw_slowdown"),
    (0x10, "sync_boost"), (0x20, "sw_thermal"), (0x40, "hw_thermal"), (0x80, "hw_power_brake"),
    (0x100, "display_clocks"),
)
# The reasons that mean the GPU ran slower than it could (idle and user-set clocks do not).
THROTTLING_REASONS = frozenset({"sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"})

_no_gpu_reported = False
# How long ``pagedlab monitor`` measures the CPU before its first line (at most one interval).
_CPU_WARMUP_S = 0.5


def _report_no_gpu(reason: str) -> None:
    """Say once per process that there is no GPU to watch."""
    global _no_gpu_reported
    if not _no_gpu_reported:
        _no_gpu_reported = True
        logger.warning("GPU monitor: %s; recording CPU and RAM only", reason)


def throttle_reason_names(mask: int) -> list[str]:
    return [name for bit, name in _REASONS if mask & bit]


class _Nvml:
    """The NVIDIA GPUs this process can see, through NVML."""

    def __init__(self):
        import pynvml  # from nvidia-ml-py

        self.nv = pynvml
        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            indices = _visible_indices(count, pynvml)
            if not indices:
                raise RuntimeError("NVML sees no GPU")
            self.devices = []
            for i in indices:
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(handle)
                self.devices.append((i, name.decode() if isinstance(name, bytes) else name, handle))
            driver = pynvml.nvmlSystemGetDriverVersion()
            self.driver = driver.decode() if isinstance(driver, bytes) else driver
        except Exception:
            pynvml.nvmlShutdown()
            raise

    def sample(self, now: float) -> list[dict]:
        nv = self.nv
        out = []
        for index, name, h in self.devices:
            s = {"t": now, "kind": "gpu", "index": index, "name": name}
            s["util_gpu"], s["util_mem"] = _try(_util, nv, h, default=(None, None))
            mem = _try(nv.nvmlDeviceGetMemoryInfo, h)
            s["mem_used"] = int(mem.used) if mem is not None else None
            s["mem_total"] = int(mem.total) if mem is not None else None
            s["temperature_c"] = _try(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
            s["sm_clock_mhz"] = _try(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
            s["mem_clock_mhz"] = _try(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)
            power = _try(nv.nvmlDeviceGetPowerUsage, h)
            s["power_w"] = power / 1000.0 if power is not None else None
            limit = _try(nv.nvmlDeviceGetEnforcedPowerLimit, h)
            s["power_limit_w"] = limit / 1000.0 if limit is not None else None
            getter = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                nv.nvmlDeviceGetCurrentClocksThrottleReasons
            mask = _try(getter, h)
            s["throttle"] = throttle_reason_names(int(mask)) if mask is not None else []
            out.append(s)
        return out

    def close(self) -> None:
        _try(self.nv.nvmlShutdown)


def _util(nv, handle) -> tuple[int, int]:
    u = nv.nvmlDeviceGetUtilizationRates(handle)
    return int(u.gpu), int(u.memory)


def _try(fn, *args, default=None):
    """``fn(*args)``, or ``default`` when NVML raises."""
    try:
        return fn(*args)
    except Exception:  # a field this GPU or driver does not support
        return default


def _device_uuid(nv, index: int):
    return nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(index))


def _visible_indices(count: int, nv) -> list[int]:
    """NVML indices of the GPUs in CUDA_VISIBLE_DEVICES (NVML itself ignores that variable)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    wanted = [v.strip() for v in visible.split(",") if v.strip()]
    if all(v.isdigit() for v in wanted):
        return [int(v) for v in wanted if int(v) < count]
    by_uuid = {}
    for i in range(count):
        uuid = _try(_device_uuid, nv, i, default="")
        by_uuid[uuid.decode() if isinstance(uuid, bytes) else uuid] = i
    return [i for v in wanted for uuid, i in by_uuid.items() if uuid and uuid.startswith(v)]


def open_nvml() -> tuple[_Nvml | None, str | None]:
    """(NVML handle, None) or (None, why there is no GPU to watch)."""
    try:
        import pynvml  # noqa: F401
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        return _Nvml(), None
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, no device, ...
        return None, f"no NVIDIA GPU found ({e})"


class CpuMeter:
    """The host's CPU busy percentage since the previous ``read()``, from psutil's CPU times; None
    for the first read (no interval yet), for two reads within one clock tick, and without psutil.

    Each sampler keeps its own reference: psutil.cpu_percent(interval=None) keeps one per thread,
    shared with any other caller, and its first reading after priming covers no time."""

    def __init__(self):
        self._lock = threading.Lock()
        self._last = None

    def read(self) -> float | None:
        try:
            import psutil
        except ImportError:
            return None
        now = psutil.cpu_times()
        with self._lock:
            last, self._last = self._last, now
        return None if last is None else _busy_percent(last, now)


def _busy_percent(before, after) -> float | None:
    """psutil.cpu_percent's formula: the share of the CPU time between two ``cpu_times()`` that
    was not idle (Linux counts guest time in user time too, so it is left out of the total)."""
    delta = {f: max(0.0, getattr(after, f) - getattr(before, f)) for f in after._fields}
    total = sum(delta.values()) - delta.get("guest", 0.0) - delta.get("guest_nice", 0.0)
    busy = total - delta["idle"] - delta.get("iowait", 0.0)
    return round(100.0 * busy / total, 1) if total > 0 else None


def host_sample(now: float, cpu: CpuMeter) -> dict:
    """CPU (busy share since ``cpu``'s previous read) and RAM of the host, and this process's
    resident memory."""
    s: dict = {"t": now, "kind": "cpu", "cpu_count": os.cpu_count(), "cpu_percent": cpu.read()}
    try:
        import psutil

        vm = psutil.virtual_memory()
        s["ram_used"], s["ram_total"] = int(vm.total - vm.available), int(vm.total)
        s["rss"] = int(psutil.Process().memory_info().rss)
    except ImportError:  # /proc fallback
        s["ram_used"], s["ram_total"] = _proc_meminfo()
        s["rss"] = _proc_rss()
    s["load1"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return s


def _proc_meminfo() -> tuple[int | None, int | None]:
    try:
        fields = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0]) * 1024
        return fields["MemTotal"] - fields["MemAvailable"], fields["MemTotal"]
    except (OSError, KeyError, ValueError):
        return None, None


def _proc_rss() -> int | None:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class GPUMonitor:
    """Sample GPU (NVML) and host telemetry every ``interval`` seconds in a daemon thread.

    ``samples`` holds dicts with ``kind`` "gpu" (one per GPU per tick) or "cpu" (one per tick);
    a sample is also taken at ``start()`` and ``stop()`` so short runs have at least two. A "cpu"
    sample's ``cpu_percent`` covers the time since the previous sample: None in the one at ``start()``.
    """

    def __init__(self, interval: float = 1.0, max_samples: int = 100_000):
        if interval <= 0:
            raise ValueError(f"interval={interval!r} is invalid: the sampling interval must be > 0 seconds")
        self.interval = interval
        self.max_samples = max_samples
        self.samples: list[dict] = []
        self._nvml, self.no_gpu_reason = open_nvml()
        if self._nvml is None:
            _report_no_gpu(self.no_gpu_reason)
        self.backend = "nvml" if self._nvml is not None else "cpu"
        self.driver_version = self._nvml.driver if self._nvml is not None else None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = self._t1 = None
        self._cpu = CpuMeter()

    def sample_once(self) -> list[dict]:
        """Take one sample of every GPU and of the host now (and keep it)."""
        now = time.time()
        batch = self._nvml.sample(now) if self._nvml is not None else []
        batch.append(host_sample(now, self._cpu))
        with self._lock:
            if len(self.samples) + len(batch) <= self.max_samples:
                self.samples.extend(batch)
        return batch

    def start(self) -> GPUMonitor:
        if self._thread is not None:
            raise RuntimeError("this GPUMonitor is already running")
        self._stop.clear()
        self._cpu = CpuMeter()
        self._t0 = time.time()
        self.sample_once()
        self._thread = threading.Thread(target=self._loop, name="pagedlab-gpu-monitor", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample_once()

    def stop(self) -> dict:
        """Stop sampling (one last sample) and return ``summary()``."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.sample_once()
            self._t1 = time.time()
        return self.summary()

    def close(self) -> None:
        self.stop()
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None

    def __enter__(self) -> GPUMonitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def summary(self) -> dict:
        with self._lock:
            samples = list(self.samples)
        return summarize(samples, self.backend, self.no_gpu_reason)


def _values(samples, key):
    return [s[key] for s in samples if s.get(key) is not None]


def _mean(values):
    return statistics.fmean(values) if values else None


def _time_mean(samples, key):
    """The time average of a reading taken at instants: trapezoids between the samples that have
    it, over the time they span (a sample a moment after the previous one weighs that moment);
    the plain mean when they span no time."""
    points = sorted((s["t"], s[key]) for s in samples if s.get(key) is not None)
    if not points:
        return None
    span = points[-1][0] - points[0][0]
    if span <= 0:
        return statistics.fmean(v for _, v in points)
    return sum((t1 - t0) * (v0 + v1) / 2 for (t0, v0), (t1, v1) in itertools.pairwise(points)) / span


def _interval_mean(samples, key):
    """The time average of a reading that covers the time since the previous sample (the CPU
    share): each weighs the interval it covers."""
    ordered = sorted(samples, key=lambda s: s["t"])
    pairs = [(s1["t"] - s0["t"], s1[key]) for s0, s1 in itertools.pairwise(ordered)
             if s1.get(key) is not None]
    total = sum(dt for dt, _ in pairs)
    if total <= 0:
        return _mean(_values(samples, key))
    return sum(dt * v for dt, v in pairs) / total


def summarize(samples: list[dict], backend: str, no_gpu_reason: str | None = None) -> dict:
    """The figures a benchmark reports from a list of samples (see ``GPUMonitor``); the means are
    averages over time, however unevenly the samples fall."""
    times = [s["t"] for s in samples]
    summary: dict = {"backend": backend, "num_samples": len(samples),
                     "duration_s": (max(times) - min(times)) if times else 0.0}
    if no_gpu_reason:
        summary["no_gpu_reason"] = no_gpu_reason
    gpu = [s for s in samples if s["kind"] == "gpu"]
    per_gpu = []
    for index in sorted({s["index"] for s in gpu}):
        mine = [s for s in gpu if s["index"] == index]
        reasons = sorted({r for s in mine for r in s.get("throttle") or []})
        per_gpu.append({
            "index": index, "name": mine[0]["name"],
            "max_temperature_c": max(_values(mine, "temperature_c"), default=None),
            "mean_sm_clock_mhz": _time_mean(mine, "sm_clock_mhz"),
            "min_sm_clock_mhz": min(_values(mine, "sm_clock_mhz"), default=None),
            "mean_mem_clock_mhz": _time_mean(mine, "mem_clock_mhz"),
            "mean_power_w": _time_mean(mine, "power_w"),
            "max_power_w": max(_values(mine, "power_w"), default=None),
            "power_limit_w": max(_values(mine, "power_limit_w"), default=None),
            "mean_util_gpu": _time_mean(mine, "util_gpu"),
            "max_mem_used_bytes": max(_values(mine, "mem_used"), default=None),
            "mem_total_bytes": max(_values(mine, "mem_total"), default=None),
            "throttle_reasons": reasons,
            "throttled_samples": sum(1 for s in mine if THROTTLING_REASONS & set(s.get("throttle") or [])),
        })
    summary["gpus"] = per_gpu
    if per_gpu:
        def over(key, fn):
            vals = [g[key] for g in per_gpu if g[key] is not None]
            return fn(vals) if vals else None

        summary.update({
            "max_temperature_c": over("max_temperature_c", max),
            "mean_sm_clock_mhz": over("mean_sm_clock_mhz", statistics.fmean),
            "mean_power_w": over("mean_power_w", statistics.fmean),
            "max_power_w": over("max_power_w", max),
            "power_limit_w": over("power_limit_w", max),
            "mean_util_gpu": over("mean_util_gpu", statistics.fmean),
            "max_gpu_memory_used_bytes": over("max_mem_used_bytes", max),
            "gpu_memory_total_bytes": over("mem_total_bytes", max),
            "throttle_reasons": sorted({r for g in per_gpu for r in g["throttle_reasons"]}),
        })
        summary["throttled"] = any(g["throttled_samples"] for g in per_gpu)
        summary["throttled_share"] = sum(g["throttled_samples"] for g in per_gpu) / len(gpu)
    host = [s for s in samples if s["kind"] == "cpu"]
    summary["cpu"] = {
        "mean_cpu_percent": _interval_mean(host, "cpu_percent"),
        "max_cpu_percent": max(_values(host, "cpu_percent"), default=None),
        "max_ram_used_bytes": max(_values(host, "ram_used"), default=None),
        "ram_total_bytes": max(_values(host, "ram_total"), default=None),
        "max_rss_bytes": max(_values(host, "rss"), default=None),
    }
    return summary


def telemetry_metrics(summary: dict) -> dict:
    """The scalar figures of a ``GPUMonitor.summary()``, prefixed ``gpu_`` / ``host_``."""
    if not summary:
        return {}
    out = {}
    for key in ("max_temperature_c", "mean_sm_clock_mhz", "mean_power_w", "max_power_w", "power_limit_w",
                "mean_util_gpu", "max_gpu_memory_used_bytes", "gpu_memory_total_bytes", "throttled",
                "throttled_share"):
        if key in summary:
            out[f"gpu_{key.removeprefix('gpu_')}"] = summary[key]
    if "throttle_reasons" in summary:
        out["gpu_throttle_reasons"] = ",".join(summary["throttle_reasons"]) or None
    for key, value in (summary.get("cpu") or {}).items():
        out[f"host_{key}"] = value
    return out


# ---- gpustat-like lines (``pagedlab monitor``) --------------------------------------------------
def format_sample(s: dict) -> str:
    """One sample as a gpustat-like line, without the timestamp."""
    def num(v, fmt="{:.0f}", missing="?"):
        return fmt.format(v) if v is not None else missing

    if s["kind"] == "gpu":
        mb = 1 << 20
        used = num(s["mem_used"] / mb if s["mem_used"] is not None else None, "{:6.0f}")
        total = num(s["mem_total"] / mb if s["mem_total"] is not None else None)
        throttle = ",".join(s["throttle"]) if s.get("throttle") else "none"
        return (f"[{s['index']}] {s['name']} | {num(s['temperature_c'], '{:3.0f}')}°C, "
                f"{num(s['util_gpu'], '{:3.0f}')} % | {used} / {total} MB | "
                f"{num(s['power_w'], '{:4.0f}')} / {num(s['power_limit_w'])} W | "
                f"SM {num(s['sm_clock_mhz'])} MHz, MEM {num(s['mem_clock_mhz'])} MHz | throttle: {throttle}")
    gb = 1 << 30
    ram_used = num(s["ram_used"] / gb if s.get("ram_used") is not None else None, "{:.1f}")
    ram_total = num(s["ram_total"] / gb if s.get("ram_total") is not None else None, "{:.1f}")
    rss = num(s["rss"] / gb if s.get("rss") is not None else None, "{:.2f}")
    return (f"cpu ({s['cpu_count']} cores) | {num(s.get('cpu_percent'), '{:5.1f}')} % | "
            f"RAM {ram_used} / {ram_total} GB | load {num(s.get('load1'), '{:.2f}')} | monitor rss {rss} GB")


def run_monitor(interval: float = 60.0, log: str | None = None, count: int | None = None,
                stream: TextIO | None = sys.stdout, gpu_only: bool = False) -> int:
    """Print (and append to ``log``) one line per GPU, and one for the host, every ``interval``
    seconds, ``count`` times or until interrupted. Returns the number of ticks taken."""
    if interval <= 0:
        raise ValueError(f"--interval {interval!r} is invalid: give a number of seconds > 0")
    if count is not None and count < 1:
        raise ValueError(f"--count {count!r} is invalid: give a number of samples >= 1")
    nvml, reason = open_nvml()
    show_host = nvml is None or not gpu_only
    log_file = open(log, "a", encoding="utf-8") if log else None  # noqa: SIM115 (closed in the finally below)
    ticks = 0

    def emit(line: str) -> None:
        if stream is not None:
            print(line, file=stream, flush=True)
        if log_file is not None:
            log_file.write(line + "\n")
            log_file.flush()

    try:
        if nvml is None:
            emit(f"# no NVIDIA GPU to monitor: {reason}; recording CPU and RAM")
        else:
            emit(f"# NVIDIA driver {nvml.driver}, {len(nvml.devices)} GPU(s)")
        cpu = CpuMeter()
        if show_host:  # so that the first line's CPU % covers a real interval
            cpu.read()
            time.sleep(min(interval, _CPU_WARMUP_S))
        next_tick = time.monotonic()
        while count is None or ticks < count:
            now = time.time()
            stamp = datetime.fromtimestamp(now).strftime("%Y-%m-%d %H:%M:%S")
            samples = nvml.sample(now) if nvml is not None else []
            if show_host:
                samples.append(host_sample(now, cpu))
            for s in samples:
                emit(f"{stamp}  {format_sample(s)}")
            ticks += 1
            if count is not None and ticks >= count:
                break
            next_tick += interval
            time.sleep(max(0.0, next_tick - time.monotonic()))
    except KeyboardInterrupt:
        pass
    finally:
        if log_file is not None:
            log_file.close()
        if nvml is not None:
            nvml.close()
    return ticks
