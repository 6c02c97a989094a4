"""The fixed benchmark workloads of docs/benchmarks.md, pagedlab and its HF transformers peer in one run.

``pagedlab bench throughput|latency`` and ``benchmarks/`` call ``run_bench``. Every row carries
output and total tok/s, TTFT and TPOT P50/P99, peak GPU memory, and the measured time over the
physical floor (``pagedlab.physical_floor``: weights and live KV read once per decode step at the
copy bandwidth, prefill FLOPs at the matmul peak).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import numbers
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedlab import hf_peer
from pagedlab.config import model_max_len
from pagedlab.family_shapes import FAMILY_SHAPES
from pagedlab.lab.monitor import THROTTLING_REASONS, GPUMonitor, telemetry_metrics
from pagedlab.lab.profile import profile_subdir, profiled
from pagedlab.loader.hf_config import load_hf_config
from pagedlab.llm import LLM
from pagedlab.lora import bench as lora_bench
from pagedlab.lora.request import LoRARequest
from pagedlab.physical_floor import decode_weight_bytes, physical_floor, tpot_floor
from pagedlab.sampling_params import SamplingParams
from pagedlab.stats import percentile_ms


def model_shape(name: str):
    """A transformers config of a benchmark shape, for dummy weights."""
    import transformers

    if name == "llama3-8b":
        return transformers.LlamaConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False, dtype="bfloat16",
            architectures=["LlamaForCausalLM"])
    if name == "llama3-70b":
        return transformers.LlamaConfig(
            vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
            num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192},
            bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False, dtype="bfloat16",
            architectures=["LlamaForCausalLM"])
    if name == "qwen3-0.6b":
        return transformers.Qwen3Config(
            vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
            rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, dtype="bfloat16",
            architectures=["Qwen3ForCausalLM"])
    if name in FAMILY_SHAPES:
        return FAMILY_SHAPES[name]()
    raise ValueError(f"shape {name!r} is unknown; known shapes: {', '.join(SHAPES)}")


SHAPES = ("llama3-8b", "llama3-70b", "qwen3-0.6b", *FAMILY_SHAPES)


def shape_dir(name: str) -> str:
    """A directory holding only config.json for the shape (prompts are then token ids)."""
    path = Path(tempfile.gettempdir()) / "pagedlab-shapes" / name
    if not (path / "config.json").is_file():
        model_shape(name).save_pretrained(path)
    return str(path)


@dataclass
class Workload:
    """Requests of one benchmark: prompt token ids, output lengths and sampling temperature."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    temperature: float = 0.0
    engine_args: dict = field(default_factory=dict)
    loras: list[LoRARequest] | None = None  # the LoRA adapter of each request (pagedlab.lora.bench)
    batch_size: int | None = None  # the most requests run at once (max_num_seqs); None: all of them

    def sampling_params(self) -> list[SamplingParams]:
        """Each request's parameters. No per-request seed: like vLLM's benchmarks, sampled rows
        draw from the engine's seeded generator in one batched call instead of one per request."""
        return [SamplingParams(temperature=self.temperature, max_tokens=n, ignore_eos=True, detokenize=False)
                for n in self.output_lens]


def random_prompts(count: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Ids drawn uniformly from [margin, vocab - margin), away from the special tokens that usually
    sit at either end; the margin is 100 (the benchmarks' prompts) or a quarter of a small vocabulary."""
    if vocab < 1:
        raise ValueError(f"vocab={vocab!r} is invalid: random prompts need a vocabulary of >= 1 token")
    margin = min(100, vocab // 4)
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(margin, vocab - margin, (n,), generator=g).tolist() for n in lengths[:count]]


W_PREFIX_SHARED = 2048  # the prompt tokens W-prefix's requests share
SIZED = ("W-seed", "W-lat", "custom")  # the workloads of --batch-size, --input-len and --output-len


def make_workload(name: str, vocab: int, batch_size: int = 1, input_len: int = 512, output_len: int = 128,
                  num_prompts: int | None = None) -> Workload:
    """W-seed / W-lat (random ids, fixed lengths), W-nano (uniform [100, 1024], seed 0), W-prefix
    (a shared 2,048-token prefix + 64 unique tokens), W-long (4 x 32,768), or "custom"."""
    if name in SIZED:
        n = num_prompts or batch_size
        lengths = (("batch_size or num_prompts", n), ("input_len", input_len), ("output_len", output_len))
        for what, value in lengths:
            if not isinstance(value, numbers.Integral) or value < 1:  # numpy ints from a sweep too
                raise ValueError(f"{name} needs {what} as a whole number >= 1, not {value!r}")
        return Workload(name, random_prompts(n, [input_len] * n, vocab), [output_len] * n,
                        batch_size=batch_size)
    if name == "W-nano":
        g = torch.Generator().manual_seed(0)
        n = num_prompts or 256
        in_lens = torch.randint(100, 1025, (n,), generator=g).tolist()
        out_lens = torch.randint(100, 1025, (n,), generator=g).tolist()
        return Workload(name, random_prompts(n, in_lens, vocab), out_lens, temperature=0.6)
    if name == "W-prefix":
        n = num_prompts or 256
        prefix = random_prompts(1, [W_PREFIX_SHARED], vocab, seed=1)[0]
        return Workload(name, [prefix + p for p in random_prompts(n, [64] * n, vocab, seed=2)], [64] * n)
    if name == "W-long":
        n = num_prompts or 4
        return Workload(name, random_prompts(n, [32768] * n, vocab), [128] * n,
                        engine_args={"max_num_batched_tokens": 2048})
    raise ValueError(f"workload {name!r} is unknown; known: W-seed, W-nano, W-lat, W-prefix, W-long, custom")


@dataclass
class WorkloadResult:
    workload: str
    backend: str
    label: str
    num_requests: int
    input_tokens: int
    output_tokens: int
    elapsed_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    peak_memory_gib: float | None
    floor_s: float | None
    extra: dict = field(default_factory=dict)
    tpot_floor_ms: float | None = None  # a decode step's floor (``physical_floor.tpot_floor``)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.elapsed_s

    @property
    def over_floor(self) -> float | None:
        """The whole run's time over its floor (prefill, TTFT and every step included)."""
        return self.elapsed_s / self.floor_s if self.floor_s else None

    @property
    def tpot_over_floor(self) -> float | None:
        """TPOT p50 over a decode step's floor (issue targets such as "batch 1 TPOT at most 1.6x
        its floor" read this one)."""
        if self.tpot_p50_ms is None or not self.tpot_floor_ms:
            return None
        return self.tpot_p50_ms / self.tpot_floor_ms

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(output_tok_s=self.output_tok_s, total_tok_s=self.total_tok_s, over_floor=self.over_floor,
                 tpot_over_floor=self.tpot_over_floor)
        return d


# GPU telemetry sampling period over each row (``LLM.benchmark``'s default too); NVML's calls
# release the GIL and the host's figures take microseconds, so the engine's host loop hardly
# notices the sampler (W-seed batch 1 and 64 unchanged on an H100, BENCHMARKS.md).
TELEMETRY_INTERVAL_S = 0.2


@contextlib.contextmanager
def gpu_telemetry():
    """A dict that, once the block ends, holds what ``GPUMonitor`` saw during it
    (``telemetry_metrics``: the GPU's mean SM clock and power, the share of samples it throttled
    and why, and the host's CPU and memory; the host's only where NVML sees no GPU)."""
    metrics: dict = {}
    with GPUMonitor(interval=TELEMETRY_INTERVAL_S) as monitor:
        yield metrics
    metrics.update(telemetry_metrics(monitor.summary()))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def run_pagedlab(llm, workload: Workload, label: str, floor: float | None,
                 per_token_times: bool = False) -> WorkloadResult:
    """Submit every request at once and drive the engine to the end. TTFT and TPOT come from each
    request's metrics; ``per_token_times`` also stamps every token (for ITL), at some host cost."""
    engine = llm.llm_engine  # driven step by step, to stamp each token
    llm.reset_prefix_cache()
    llm.reset_stats()
    _sync()
    _reset_peak()
    stamps: dict[str, list[float]] = {}
    finished = []
    start = time.perf_counter()
    for i, (prompt, params) in enumerate(zip(workload.prompts, workload.sampling_params())):
        engine.add_request(f"bench-{i}", prompt, params,
                           lora_request=workload.loras[i] if workload.loras else None)
        stamps[f"bench-{i}"] = []
    while engine.has_unfinished_requests():
        outputs = engine.step(stream=per_token_times)
        now = time.perf_counter()
        for out in outputs:
            if per_token_times and len(out.outputs[0].token_ids) > len(stamps[out.request_id]):
                stamps[out.request_id].append(now)
            if out.finished:
                finished.append(out)
    _sync()
    elapsed = time.perf_counter() - start
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in finished]
    tpot = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in finished if len(o.outputs[0].token_ids) > 1]
    itl = [b - a for s in stamps.values() for a, b in itertools.pairwise(s)]
    stats = llm.get_stats()
    finished.sort(key=lambda o: int(o.request_id.removeprefix("bench-")))
    return WorkloadResult(
        workload.name, "pagedlab", label, len(workload.prompts), sum(map(len, workload.prompts)),
        sum(len(o.outputs[0].token_ids) for o in finished), elapsed, percentile_ms(ttft, 50),
        percentile_ms(ttft, 99), percentile_ms(tpot, 50), percentile_ms(tpot, 99), _peak_gib(), floor,
        extra={**lora_bench.row_record(workload.loras, max_loras=llm.get_engine_info().config.max_loras),
               "output_tokens_sha256": tokens_sha256([o.outputs[0].token_ids for o in finished]),
               "itl_p50_ms": percentile_ms(itl, 50), "itl_p99_ms": percentile_ms(itl, 99),
               "prefix_cache_hit_rate": stats.prefix_cache_hit_rate, "num_preemptions": stats.num_preemptions,
               "peak_kv_blocks_used": stats.peak_kv_blocks_used, "num_kv_blocks": stats.num_kv_blocks,
               "kv_cache_gib": stats.kv_cache_bytes / 2**30, "weight_gib": stats.weight_bytes / 2**30,
               "block_size": stats.block_size,
               "kv_fragmentation_at_peak": stats.fragmentation_at_peak,
               **({"spec_decode_acceptance_rate": stats.spec_decode_acceptance_rate,
                   "spec_decode_mean_acceptance_length": stats.spec_decode_mean_acceptance_length}
                  if stats.spec_decode_num_drafts else {})})


def run_hf_generate(model, workload: Workload, label: str, floor: float | None) -> WorkloadResult:
    """HF static-batch ``generate`` (prompts of equal length, so no padding), greedy, per-step timing;
    with ``workload.loras``, ``model`` is ``lora_bench.peft_peer``'s and each row runs its adapter."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class StepClock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            _sync()
            stamps.append(time.perf_counter())
            return scores

    lengths = {len(p) for p in workload.prompts}
    if len(lengths) != 1:
        raise ValueError("HF static generate needs prompts of one length; use generate_batch for mixed "
                         "lengths")
    out_len = max(workload.output_lens)
    ids = torch.tensor(workload.prompts, device=model.device)
    peft_kwargs = lora_bench.peft_generate_kwargs(model, workload.loras) if workload.loras else {}
    _sync()
    _reset_peak()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                             min_new_tokens=out_len,
                             do_sample=False, logits_processor=LogitsProcessorList([StepClock()]),
                             pad_token_id=0, **peft_kwargs)
    _sync()
    elapsed = time.perf_counter() - start
    produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    ttft = stamps[0] - start
    itl = [b - a for a, b in itertools.pairwise(stamps)]
    # every row of a static batch gets its tokens at the same steps: one TPOT, the mean gap, is
    # each request's (last - first) / (tokens - 1), so its P50 and P99 over the requests
    tpot_ms = statistics.fmean(itl) * 1000 if itl else None
    return WorkloadResult(
        workload.name, "hf", label, len(workload.prompts), ids.numel(), produced, elapsed, ttft * 1000,
        ttft * 1000, tpot_ms, tpot_ms, _peak_gib(), floor,
        extra={**lora_bench.row_record(workload.loras, peft_mixed_batch="adapter_names" in peft_kwargs),
               "output_tokens_sha256": tokens_sha256(out[:, ids.shape[1]:].tolist()),
               "itl_p50_ms": percentile_ms(itl, 50), "itl_p99_ms": percentile_ms(itl, 99)})


def tokens_sha256(outputs: list[list[int]]) -> str:
    """A fingerprint of every request's output token ids, in request order: rows with equal values
    generated the same tokens."""
    return hashlib.sha256(json.dumps([[int(t) for t in ids] for ids in outputs]).encode()).hexdigest()


def run_hf_generate_batch(model, workload: Workload, label: str, output_len: int,
                          floor: float | None) -> WorkloadResult:
    """HF continuous batching (``generate_batch``, paged|sdpa) with a fixed output length."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len,
                              do_sample=workload.temperature > 0,
                              temperature=workload.temperature or None, eos_token_id=None, pad_token_id=0)
    _sync()
    _reset_peak()
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=workload.prompts, generation_config=config, progress_bar=False)
    _sync()
    elapsed = time.perf_counter() - start
    produced = sum(len(o.generated_tokens) for o in outputs.values())
    return WorkloadResult(workload.name, "hf-generate_batch", label, len(workload.prompts),
                          sum(map(len, workload.prompts)), produced, elapsed, None, None, None, None,
                          _peak_gib(), floor)


def format_row(r: WorkloadResult) -> str:
    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    return (f"{r.workload:9} {r.backend:18} {r.label:22} out {r.output_tok_s:9.1f} tok/s  total "
            f"{r.total_tok_s:9.1f} tok/s  "
            f"TTFT p50/p99 {f(r.ttft_p50_ms)}/{f(r.ttft_p99_ms)} ms  TPOT p50/p99 {f(r.tpot_p50_ms, '.2f')}/"
            f"{f(r.tpot_p99_ms, '.2f')} ms"
            + (f" (p50 {r.tpot_over_floor:.2f}x a step's floor)" if r.tpot_over_floor is not None else "")
            + f"  peak {f(r.peak_memory_gib)} GiB  {r.elapsed_s:.2f} s"
            + (f" = {r.over_floor:.2f}x floor" if r.over_floor is not None else "")
            + format_telemetry(r.extra))


def format_telemetry(extra: dict) -> str:
    """The end of a row's line from its ``extra`` (``gpu_telemetry``): "  GPU <mean SM clock> MHz
    <mean power>/<power limit> W", then ", throttled <share> (<reasons>)" where the GPU ran slower
    than it could; "" where no GPU was watched."""
    clock, power = extra.get("gpu_mean_sm_clock_mhz"), extra.get("gpu_mean_power_w")
    if clock is None:
        return ""
    text = f"  GPU {clock:,.0f} MHz"
    if power is not None:
        limit = extra.get("gpu_power_limit_w")
        text += f" {power:.0f}" + (f"/{limit:.0f}" if limit is not None else "") + " W"
    share = extra.get("gpu_throttled_share")
    if share:
        seen = (extra.get("gpu_throttle_reasons") or "").split(",")
        text += f", throttled {f'{share:.0%}' if share >= 0.01 else '<1%'} " \
            f"({','.join(r for r in seen if r in THROTTLING_REASONS)})"
    return text


DEFAULT_SHAPES = {"W-seed": "llama3-8b", "W-lat": "llama3-8b", "W-long": "llama3-8b", "W-nano": "qwen3-0.6b",
                  "W-prefix": "qwen3-0.6b", "custom": "llama3-8b"}


def run_bench(workload_name: str, batch_sizes: list[int], input_len: int, output_len: int,
              num_prompts: int | None, backends: list[str], model: str | None = None,
              shape: str | None = None,
              repeats: int = 1, engine_args: dict | None = None, latency: bool = False,
              progress=print, profile_dir: str | None = None,
              lora: lora_bench.LoRABench | None = None,
              results: list[WorkloadResult] | None = None) -> list[WorkloadResult]:
    """Run one workload on pagedlab (and, if asked, on its HF peer) and return every row (each
    appended to ``results`` as it finishes, so a caller keeps them when a later row fails);
    ``latency`` stamps every token too (ITL percentiles); ``profile_dir`` profiles each pagedlab
    row into a directory of its own there (``pagedlab.lab.profile``; the row's ``extra["profile"]``);
    ``lora`` writes random adapters for the model and spreads them over each batch's requests
    (the row's ``extra["lora"]``; on HF through PEFT, unmerged)."""
    unknown = set(backends) - {"pagedlab", "hf"}
    if unknown:
        raise ValueError(f"backend {sorted(unknown)} is unknown; choose from pagedlab, hf")
    quantization = (engine_args or {}).get("quantization")
    if "hf" in backends:
        hf_peer.check_hf_quantization(quantization, with_lora=lora is not None)
    if lora is not None and "hf" in backends:
        lora_bench.check_hf_peer(workload_name)
    sizes = batch_sizes if workload_name in SIZED else [None]
    over = [b for b in sizes if b is not None and num_prompts is not None and num_prompts > b]
    if "hf" in backends and over:
        raise ValueError(f"--num-prompts {num_prompts} is above --batch-size {over[0]}: the HF peer runs a "
                         "row's prompts in one static batch; give --num-prompts at most the smallest batch "
                         "size, or --backend pagedlab alone")
    if model is None:
        model = shape_dir(shape or DEFAULT_SHAPES[workload_name])
        engine_args = {"load_format": "dummy", **(engine_args or {})}
    hf_config = load_hf_config(model, (engine_args or {}).get("hf_overrides"))  # the HF peer's too
    workloads = [make_workload(workload_name, hf_config.vocab_size, bs or 1, input_len, output_len,
                               num_prompts)
                 for bs in sizes]
    args = {"dtype": "bfloat16", "max_model_len": _max_model_len(workloads, engine_args, hf_config),
            "max_num_seqs": max(256, max(len(w.prompts) for w in workloads))}
    args.update(workloads[0].engine_args)
    args.update(lora.engine_args() if lora is not None else {})
    args.update(engine_args or {})
    results = [] if results is None else results
    with tempfile.TemporaryDirectory(prefix="pagedlab-lora-") as lora_root:
        if lora is not None:
            workloads = lora.spread_over(workloads, lora_root, hf_config, args)
        if "pagedlab" in backends:
            with LLM(model, **args) as llm:
                _bench_pagedlab(llm, workload_name, workloads, hf_config, repeats, latency, results, progress,
                                profile_dir)
        if "hf" in backends:
            _bench_hf(workload_name, workloads, hf_config, repeats, results, progress, quantization)
    return results


def _max_model_len(workloads: list[Workload], engine_args: dict | None, hf_config) -> int:
    """--max-model-len, else the longest request rounded up to 64 tokens within the model's positions;
    a ValueError naming the sizes when a request does not fit."""
    given, name = (engine_args or {}).get("max_model_len"), workloads[0].name
    room = given or model_max_len(hf_config)
    prompt, out = max(((len(p), o) for w in workloads for p, o in zip(w.prompts, w.output_lens)), key=sum)
    if prompt + out > room:
        sizes = f"--input-len {prompt} + --output-len {out}" if name in SIZED else f"{name}'s longest request"
        where = f"--max-model-len {given}" if given else f"the {room} positions the model supports"
        raise ValueError(f"{sizes} = {prompt + out} tokens is over {where}: such requests cannot run whole")
    return given or min(-(-(prompt + out) // 64) * 64, room)


def _bench_pagedlab(llm, workload_name: str, workloads: list[Workload], hf_config, repeats: int,
                    latency: bool, results: list[WorkloadResult], progress, profile_dir: str | None) -> None:
    """Every workload under every plan variant of ``workload_name``, each warmed up first; a
    workload of more requests than its batch size runs at most that many at once (max_num_seqs)."""
    max_seqs = llm.get_engine_info().config.max_num_seqs
    for w in workloads:
        capped = w.batch_size is not None and len(w.prompts) > w.batch_size
        seqs = min(max_seqs, w.batch_size) if capped else max_seqs
        if llm.get_engine_info().config.max_num_seqs != seqs:
            llm.set_model_args(max_num_seqs=seqs)
        for variant, changes in _variants(workload_name):
            if changes:
                llm.set_model_args(**changes)
            _warm_up(llm, w)
            # the floor is the H200's: a ratio to it means nothing on a CPU
            on_gpu = llm.get_engine_info().device.type == "cuda"
            floor, step_floor = _floors(hf_config, w, engine_floor_args(llm, workload_name)) if on_gpu \
                else (None, None)
            for r in range(repeats):
                label = repeat_label(f"{_size_label(w)}{lora_bench.label(w.loras)} {variant}".strip(), r,
                                     repeats)
                profiling = contextlib.nullcontext() if profile_dir is None else \
                    profiled(llm, profile_subdir(profile_dir, label))
                with profiling as record, gpu_telemetry() as telemetry:  # not the profiler's own work
                    results.append(run_pagedlab(llm, w, label, floor, per_token_times=latency))
                results[-1].extra.update(telemetry)
                if record is not None:
                    results[-1].extra["profile"] = record
                results[-1].tpot_floor_ms = step_floor * 1e3 if step_floor else None
                progress(format_row(results[-1]))


def repeat_label(label: str, repeat: int, repeats: int) -> str:
    """The label of the ``repeat``-th (from 0) of ``repeats`` timed runs of one configuration:
    ``label`` and, where there are several, " #N" (``configuration_label`` takes it off)."""
    return label + (f" #{repeat + 1}" if repeats > 1 else "")


def configuration_label(label: str) -> str:
    """A row's label less its repeat number (``repeat_label``'s " #N")."""
    return re.sub(r" #\d+(?= |$)", "", label)


def _size_label(w: Workload) -> str:
    """"bs=N" for N requests at once; "bs=B prompts=N" for N requests at most B at once."""
    n = len(w.prompts)
    return f"bs={n}" if w.batch_size is None or w.batch_size >= n else f"bs={w.batch_size} prompts={n}"


def _floors(hf_config, w: Workload, args: dict) -> tuple[float, float | None]:
    """The run's floor and a decode step's: with at most ``w.batch_size`` requests at once, its
    batches one after the other (``physical_floor``'s ``args``)."""
    lens, b = list(map(len, w.prompts)), w.batch_size or len(w.prompts)
    batches = [(lens[i:i + b], w.output_lens[i:i + b]) for i in range(0, len(lens), b)]
    floors = [physical_floor(hf_config, p, o, **args) for p, o in batches]
    return sum(floors), tpot_floor(hf_config, *batches[0], floors[0], **args)


def _warm_up(llm, workload: Workload) -> None:
    """``workload`` itself, once, untimed: every prefill chunk, mixed step and decode batch of the
    timed run compiles, allocates and reads its adapters here, not in the timing (on an H200 four
    tokens a request left W-seed batch 256's first timed run 320 ms of TTFT p50 and 3.5% of its
    tok/s behind the next ones). ``run_pagedlab`` resets the prefix cache, so the timed run
    recomputes every prompt."""
    llm.generate(workload.prompts, workload.sampling_params(), use_tqdm=False, lora_request=workload.loras)


def _bench_hf(workload_name: str, workloads: list[Workload], hf_config, repeats: int,
              results: list[WorkloadResult], progress, quantization: str | None = None) -> None:
    """Every workload on the HF transformers peer (static batches; generate_batch for W-nano),
    ``quantization`` "fp8" through transformers' FineGrainedFP8Config (``pagedlab.hf_peer``); each
    workload runs once untimed first, as pagedlab's do (``_warm_up``)."""
    peer = hf_peer.load_hf_peer(hf_config, quantization=quantization)
    weights, tag = (hf_peer.decode_weight_bytes(peer), f" {quantization}") if quantization else (None, "")
    loras = lora_bench.distinct(w.loras for w in workloads)
    if loras:
        peer = lora_bench.peft_peer(peer, loras)
    for w in workloads:
        on_gpu = torch.cuda.is_available()
        fixed = w  # W-nano's peer generates 256 tokens a request (``run_hf_generate_batch``)
        if workload_name == "W-nano":
            fixed = Workload(w.name, w.prompts, [256] * len(w.prompts), w.temperature)
        lens = list(map(len, w.prompts))
        floor = physical_floor(hf_config, lens, fixed.output_lens, decode_weight_bytes=weights) \
            if on_gpu else None
        step_floor = tpot_floor(hf_config, lens, w.output_lens, floor, decode_weight_bytes=weights) \
            if on_gpu and fixed is w else None
        if workload_name == "W-prefix":
            break  # the peer of W-prefix is pagedlab with prefix caching off
        _hf_row(peer, fixed, "warm-up", floor)  # untimed: CUDA, cuBLAS and allocator start-up
        for r in range(repeats):
            label = repeat_label(f"bs={len(w.prompts)}{lora_bench.label(w.loras)}{tag}", r, repeats)
            with gpu_telemetry() as telemetry:
                results.append(_hf_row(peer, fixed, label, floor))
            results[-1].extra.update(telemetry)
            results[-1].tpot_floor_ms = step_floor * 1e3 if step_floor else None
            results[-1].extra.update(hf_peer.row_record(peer, quantization))
            progress(format_row(results[-1]))
    del peer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _hf_row(peer, workload: Workload, label: str, floor: float | None) -> WorkloadResult:
    """One HF row: W-nano on ``generate_batch`` (256 tokens a request), the others on ``generate``."""
    if workload.name == "W-nano":
        return run_hf_generate_batch(peer, workload, label + " out=256", 256, floor)
    return run_hf_generate(peer, workload, label, floor)


def engine_floor_args(llm, workload_name: str) -> dict:
    """``physical_floor``'s arguments for ``llm`` as it is set now: its tensor parallelism, KV
    cache dtype and stored weight bytes, and W-prefix's shared prefix cached where prefix caching
    is on."""
    info = llm.get_engine_info()
    caching = workload_name == "W-prefix" and info.config.enable_prefix_caching
    return dict(cached_prefix=W_PREFIX_SHARED if caching else 0,
                tensor_parallel_size=info.config.tensor_parallel_size,
                kv_dtype_bytes=info.kv_cache_dtype.itemsize, decode_weight_bytes=decode_weight_bytes(info))


def engine_floor(llm, hf_config, workload_name: str, workload: Workload,
                 output_lens: list[int] | None = None) -> float:
    """``physical_floor`` of ``workload`` (its own output lengths unless ``output_lens``) on
    ``llm`` as it is set now (``engine_floor_args``)."""
    return physical_floor(hf_config, list(map(len, workload.prompts)), output_lens or workload.output_lens,
                          **engine_floor_args(llm, workload_name))


def _variants(workload_name: str) -> list[tuple[str, dict]]:
    """(label, set_model_args changes) to run per workload."""
    if workload_name == "W-prefix":
        return [("prefix-cache on", {"enable_prefix_caching": True}),
                ("prefix-cache off", {"enable_prefix_caching": False})]
    if workload_name == "W-long":
        return [("block_size=16", {"block_size": 16}), ("block_size=64", {"block_size": 64})]
    return [("", {})]
