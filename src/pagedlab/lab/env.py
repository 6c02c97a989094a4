"""``pagedlab env``: the machine a benchmark is about to run on, and what on it can skew a number.

``env_report()`` gathers the software versions (and whether they fit together), every GPU's
state through NVML (ECC, clocks against their maxima, power, temperature, throttle reasons,
persistence, MIG, the PCIe link, peer-to-peer between GPUs), and the CPU and RAM; each finding
that can skew a benchmark becomes a warning that says how to fix it. ``compare_environment``
names what differs from the environment a stored result's manifest recorded.
"""

from __future__ import annotations

import json
from importlib import metadata
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pagedlab.lab.manifest import flatten, hardware_info, library_versions
from pagedlab.lab.monitor import THROTTLING_REASONS, throttle_reason_names

HOT_C = 85  # degrees at which GPUs start to slow down


@dataclass
class EnvironmentReport:
    """What ``pagedlab env`` prints: ``gpus`` is empty (with ``no_gpu_reason``) without a GPU."""

    versions: dict
    hardware: dict
    gpus: list[dict] = field(default_factory=list)
    peer_to_peer: list[dict] = field(default_factory=list)
    no_gpu_reason: str | None = None
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def env_report(nvml_module=None) -> EnvironmentReport:
    """The current machine's report; ``nvml_module`` stands in for ``pynvml`` (tests)."""
    report = EnvironmentReport(library_versions(), {k: v for k, v in hardware_info().items() if k != "gpus"})
    report.warnings += _version_warnings(report.versions, report.hardware)
    nv, reason = _nvml(nvml_module)
    if nv is None:
        report.no_gpu_reason = reason
        return report
    try:
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        report.hardware["driver"] = _text(_try(nv.nvmlSystemGetDriverVersion))
        report.hardware["driver_cuda"] = _cuda_version(_try(nv.nvmlSystemGetCudaDriverVersion))
        report.gpus = [_gpu_state(nv, i, h) for i, h in enumerate(handles)]
        report.peer_to_peer = _peer_to_peer(nv, handles)
    finally:
        _try(nv.nvmlShutdown)
    report.warnings += _driver_warnings(report.hardware)
    for gpu in report.gpus:
        report.warnings += gpu_warnings(gpu)
    report.warnings += [f"GPUs {p['gpus'][0]} and {p['gpus'][1]} cannot read each other's memory "
                        f"({p['status']}): tensor parallelism falls back to slower paths; check the "
                        "topology with `nvidia-smi topo -m`" for p in report.peer_to_peer if not p["ok"]]
    return report


def _nvml(nvml_module):
    """(initialised NVML module, None) or (None, why there is no GPU to report on)."""
    if nvml_module is None:
        try:
            import pynvml as nvml_module  # from nvidia-ml-py
        except ImportError:
            return None, "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        nvml_module.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None, f"no NVIDIA GPU found ({e})"
    return nvml_module, None


def _gpu_state(nv, index: int, h) -> dict:
    def clock(kind):
        return {"now": _try(nv.nvmlDeviceGetClockInfo, h, kind),
                "max": _try(nv.nvmlDeviceGetMaxClockInfo, h, kind)}

    memory = _try(nv.nvmlDeviceGetMemoryInfo, h)
    ecc = _try(nv.nvmlDeviceGetEccMode, h)
    getter = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        getattr(nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
    mask = _try(getter, h) if getter else None
    power_limit, default_limit = _try(nv.nvmlDeviceGetEnforcedPowerLimit, h), \
        _try(nv.nvmlDeviceGetPowerManagementDefaultLimit, h)
    mig = _try(nv.nvmlDeviceGetMigMode, h)
    return {
        "index": index, "name": _text(_try(nv.nvmlDeviceGetName, h)),
        "memory_bytes": getattr(memory, "total", None),
        "ecc_enabled": None if ecc is None else bool(ecc[0]),
        "ecc_errors": {"corrected": _ecc_count(nv, h, "NVML_MEMORY_ERROR_TYPE_CORRECTED"),
                       "uncorrected": _ecc_count(nv, h, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED")},
        "sm_clock_mhz": clock(nv.NVML_CLOCK_SM), "mem_clock_mhz": clock(nv.NVML_CLOCK_MEM),
        "power_limit_w": None if power_limit is None else power_limit / 1000,
        "default_power_limit_w": None if default_limit is None else default_limit / 1000,
        "temperature_c": _try(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
        "throttle_reasons": [] if mask is None else throttle_reason_names(mask),
        "persistence_mode": _on(_try(nv.nvmlDeviceGetPersistenceMode, h)),
        "mig_enabled": None if mig is None else bool(mig[0]),
        "pcie": {"gen": _try(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
                 "max_gen": _try(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
                 "width": _try(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
                 "max_width": _try(nv.nvmlDeviceGetMaxPcieLinkWidth, h)},
    }


def gpu_warnings(gpu: dict) -> list[str]:
    """Each finding in one GPU's state that can skew a benchmark, with its fix."""
    name, warnings = f"GPU {gpu['index']} ({gpu['name']})", []
    consumer = any(tag in (gpu["name"] or "") for tag in ("GeForce", "RTX", "TITAN"))
    if gpu["ecc_enabled"] and consumer:
        warnings.append(f"{name}: ECC is on; consumer cards lose about 15% of memory bandwidth with it: "
                        "`sudo nvidia-smi -i {i} -e 0` and reboot".replace("{i}", str(gpu["index"])))
    if (gpu["ecc_errors"]["uncorrected"] or 0) > 0:
        warnings.append(f"{name}: {gpu['ecc_errors']['uncorrected']} uncorrected ECC errors: results may be "
                        "wrong; reset the GPU (`nvidia-smi -r`) or have it replaced")
    slowdowns = sorted(THROTTLING_REASONS.intersection(gpu["throttle_reasons"]))
    if slowdowns:
        warnings.append(f"{name}: clocks held down ({', '.join(slowdowns)}): check cooling and power, "
                        "`nvidia-smi -q -d PERFORMANCE`")
    if (gpu["temperature_c"] or 0) >= HOT_C:
        warnings.append(f"{name}: {gpu['temperature_c']} C, hot enough to throttle: improve cooling or wait")
    limit, default = gpu["power_limit_w"], gpu["default_power_limit_w"]
    if limit and default and limit < 0.95 * default:
        warnings.append(f"{name}: power limit {limit:.0f} W below its default {default:.0f} W: "
                        f"`sudo nvidia-smi -i {gpu['index']} -pl {default:.0f}`")
    pcie = gpu["pcie"]
    if pcie["width"] and pcie["max_width"] and pcie["width"] < pcie["max_width"]:
        warnings.append(f"{name}: PCIe link x{pcie['width']} of x{pcie['max_width']}: reseat the card or "
                        "check the slot (host-to-device copies slow down)")
    if gpu["persistence_mode"] is False:
        warnings.append(f"{name}: persistence mode off, so the first CUDA call pays driver start-up: "
                        f"`sudo nvidia-smi -i {gpu['index']} -pm 1`")
    if gpu["mig_enabled"]:
        warnings.append(f"{name}: MIG is on; a benchmark sees one slice, not the whole GPU")
    return warnings


def _version_warnings(versions: dict, hardware: dict) -> list[str]:
    warnings = []
    torch_version, triton_version = versions.get("torch"), versions.get("triton")
    wanted = _torch_pinned_triton()
    if wanted and triton_version and triton_version != wanted:
        warnings.append(f"triton {triton_version} is installed but torch {torch_version} was built against "
                        f"triton {wanted}: `pip install triton=={wanted}`")
    if torch_version and not hardware.get("cuda"):
        warnings.append(f"torch {torch_version} is a CPU build: GPU runs need a CUDA build of torch")
    return warnings


def _driver_warnings(hardware: dict) -> list[str]:
    runtime, driver = hardware.get("cuda"), hardware.get("driver_cuda")
    if runtime and driver and _major_minor(driver) < _major_minor(runtime):
        return [f"the driver supports CUDA {driver} but torch was built for CUDA {runtime}: update the "
                "NVIDIA driver or install a torch built for an older CUDA"]
    return []


def _torch_pinned_triton() -> str | None:
    try:
        requirements = metadata.requires("torch") or []
    except metadata.PackageNotFoundError:
        return None
    for line in requirements:
        if line.startswith(("triton==", "pytorch-triton==")):
            return line.split("==", 1)[1].split(";")[0].strip()
    return None


def _peer_to_peer(nv, handles) -> list[dict]:
    status_read = getattr(nv, "NVML_P2P_CAPS_INDEX_READ", None)
    if status_read is None or len(handles) < 2:
        return []
    pairs = []
    for i in range(len(handles)):
        for j in range(i + 1, len(handles)):
            status = _try(nv.nvmlDeviceGetP2PStatus, handles[i], handles[j], status_read)
            pairs.append({"gpus": [i, j], "ok": status == getattr(nv, "NVML_P2P_STATUS_OK", 0),
                          "status": status})
    return pairs


def compare_environment(report: EnvironmentReport, stored: dict) -> list[str]:
    """What differs between this machine and the ``versions``/``hardware`` of a stored manifest
    (found anywhere inside ``stored``: a manifest, a stored run, ``LLM.benchmark``'s saved file), or
    the ``environment`` of a ``pagedlab bench --json`` file (versions, CUDA and the GPU's name: only
    those are compared)."""
    now_gpus = _gpu_names(report)
    now = flatten({"versions": report.versions, "hardware": {**report.hardware, "gpus": now_gpus}})
    manifest = find_manifest(stored)
    if manifest is not None:
        then = flatten({"versions": manifest.get("versions", {}),
                        "hardware": {k: v for k, v in manifest.get("hardware", {}).items() if k != "gpus"}
                        | {"gpus": [g.get("name") for g in manifest.get("hardware", {}).get("gpus", [])]}})
        keys = set(now) | set(then)
    else:
        then = _bench_file_environment(stored)
        if then is None:
            raise ValueError("no manifest (a dict with 'versions' and 'hardware') nor a pagedlab bench "
                             "--json file's 'environment' found in the given results")
        now["hardware.gpu"] = now_gpus[0] if now_gpus else None
        keys = set(then)
    return [f"{key}: {then.get(key)!r} then, {now.get(key)!r} now"
            for key in sorted(keys) if now.get(key) != then.get(key)]


def _bench_file_environment(stored) -> dict | None:
    """A ``pagedlab bench --json`` file's ``environment`` under a manifest's flattened names, the
    GPU it ran on (``torch.cuda.get_device_name()``) as ``hardware.gpu``; None for other JSON."""
    env = stored.get("environment") if isinstance(stored, dict) else None
    if not isinstance(env, dict) or "pagedlab" not in env or "torch" not in env:
        return None
    then = {f"versions.{name}": env.get(name) for name in ("python", "pagedlab", "torch", "triton",
                                                            "transformers") if name in env}
    return then | {"hardware.cuda": env.get("cuda"), "hardware.gpu": env.get("gpu")}


def find_manifest(obj):
    """The first dict holding both 'versions' and 'hardware', searched depth-first."""
    if isinstance(obj, dict):
        if "versions" in obj and "hardware" in obj:
            return obj
        children = obj.values()
    elif isinstance(obj, list):
        children = obj
    else:
        return None
    for child in children:
        found = find_manifest(child)
        if found is not None:
            return found
    return None


def load_results_file(path: str) -> dict | list:
    """A JSON file, or JSON lines (one object per line)."""
    text = Path(path).read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def _gpu_names(report: EnvironmentReport) -> list:
    return [g["name"] for g in report.gpus]


def _ecc_count(nv, h, kind: str):
    return _try(nv.nvmlDeviceGetTotalEccErrors, h, getattr(nv, kind, 0), getattr(nv, "NVML_VOLATILE_ECC", 0))


def _cuda_version(value) -> str | None:
    return None if value is None else f"{value // 1000}.{value % 1000 // 10}"


def _major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:2])


def _on(value) -> bool | None:
    return None if value is None else bool(value)


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception:  # NVML raises its own error types for "not supported" on many fields
        return None
