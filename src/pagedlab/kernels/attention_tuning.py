"""The paged attention kernel's prefill launches, tuned on the GPU at first use and cached on disk.

A default-mode unsplit launch whose longest query is more than one token (prefill, chunked
prefill, mixed steps) takes its query tile (``block_m`` rows), warps and pipeline stages from a
``PrefillTileTuner``. The first time a ``PrefillShape`` is met, the tuner times the candidate
launches (``prefill_candidates``) as CUDA-graph replays on the shape's tuning batch (a full
prefill step of fresh prompts as long as the bucket, at most ``TUNING_PROMPT_LEN``, random values
in the call's dtypes and head layout: the same work whichever call meets the shape first, be it
the start-up memory profile or a CUDA-graph warm-up), keeps the fastest, and writes it to
``attention-prefill-tiles.json`` in the cache directory (``pagedlab.cache``) under the GPU's
name, Triton's version and the kernel's source hash, so a later process on the same machine and
code reuses it without timing.

No candidate changes a result: the key tile stays ``TILE_N``, so every row's softmax runs over
the same key tiles in the same order, and the query tile stays in the rule's tensor-core class
(``WGMMA_BLOCK_MS`` or ``SMALL_BLOCK_MS``), within which the H200 sums a row's dot products in
one order (the GPU test checks every candidate bitwise against the untuned launch). Batch-
invariant launches, decode launches (``attention_configs``), split launches and cascade halves
are never tuned. Nothing is timed while a stream is being captured into a CUDA graph (the
rule's launch then): the mixed-step graphs' warm-up run, just before each capture, meets each
bucket's shape first.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pagedlab.kernels.attention_configs import TILE_N, AttentionLaunch, next_power_of_2, padded_head_dim

logger = logging.getLogger(__name__)

CACHE_FILE = "attention-prefill-tiles.json"
# Query lengths are bucketed by powers of two up to this; longer queries share its bucket.
MAX_QUERY_BUCKET = 8192
# The tuning batch: a full prefill step of this many tokens, in prompts of the bucket's length up
# to TUNING_PROMPT_LEN (W-seed's step: 16 x 512). A batch of one short prompt leaves most SMs
# idle and favours small tiles that lose on full steps (H200: Gemma-2's 512-token bucket timed on
# one prompt chose 64 rows, 1.68x slower than 128 on 16 prompts).
TUNING_BATCH_TOKENS = 8192
TUNING_PROMPT_LEN = 512
TUNING_MAX_PROMPTS = 256  # the engine's default max_num_seqs
# Query tiles (rows = query tokens x the query heads of one KV head) by the tensor-core
# instruction Triton gives them on Hopper: wgmma from 64 rows, mma.sync below. A row's dot
# products are summed in one order within a class and in another across it (H200, BENCHMARKS.md).
SMALL_BLOCK_MS, WGMMA_BLOCK_MS = (16, 32), (64, 128)


@dataclass(frozen=True)
class PrefillShape:
    """What a prefill launch is tuned for: the head layout, the dtypes, the kernel variant, the
    query length's bucket (``query_bucket``) and the rule's query tile (``rule_block_m``), whose
    instruction class the candidates keep."""

    head_dim: int
    group: int  # query heads per KV head
    num_kv_heads: int
    q_dtype: str
    kv_dtype_bits: int
    sliding: bool
    softcap: bool
    query_bucket: int
    rule_block_m: int

    def cache_key(self) -> str:
        """The shape as one string (the cache file's key; built on every prefill launch, so
        without ``asdict``'s copies)."""
        return ",".join(f"{name}={value}" for name, value in vars(self).items())


def query_bucket(max_query_len: int) -> int:
    """``max_query_len`` rounded up to a power of two, at most ``MAX_QUERY_BUCKET``."""
    return min(MAX_QUERY_BUCKET, next_power_of_2(max_query_len))


def tuning_prompts(bucket: int) -> list[int]:
    """The query lengths of the tuning batch of a bucket (``TUNING_BATCH_TOKENS`` in at most
    ``TUNING_MAX_PROMPTS`` prompts)."""
    prompt_len = min(bucket, TUNING_PROMPT_LEN)
    return [prompt_len] * max(1, min(TUNING_MAX_PROMPTS, TUNING_BATCH_TOKENS // prompt_len))


def prefill_candidates(shape: PrefillShape) -> list[AttentionLaunch]:
    """The launches timed for ``shape``: the query tiles of the rule's class (``WGMMA_BLOCK_MS``
    or ``SMALL_BLOCK_MS``, those at least one token's query heads tall) x two warp counts x two
    stage counts (1 or 2 at head_dim over 128, whose three stages overflow shared memory; else 2
    or 3), so that no candidate changes a result."""
    block_ms = WGMMA_BLOCK_MS if shape.rule_block_m >= WGMMA_BLOCK_MS[0] else SMALL_BLOCK_MS
    block_ms = [m for m in block_ms if m >= shape.group] or [shape.rule_block_m]
    warps = (4, 8) if block_ms[0] >= WGMMA_BLOCK_MS[0] else (2, 4)
    stages = (1, 2) if padded_head_dim(shape.head_dim) > 128 else (2, 3)
    return [AttentionLaunch(block_m, block_m // shape.group, TILE_N, num_warps, num_stages)
            for block_m in block_ms for num_warps in warps for num_stages in stages]


def time_launch_on_gpu(run: Callable[[], None], rep_ms: float = 10.0) -> float:
    """Milliseconds one ``run()`` takes on the GPU, timed as replays of a CUDA graph of about
    ``rep_ms`` of runs (``triton.testing.do_bench_cudagraph``): host time does not count, so a
    short launch is not timed at the launcher's speed. Not ``do_bench``: its 256 MB cache-flush
    buffer would count in the start-up memory profile whose forward first meets a shape."""
    from triton.testing import do_bench_cudagraph

    torch.cuda.current_stream().synchronize()  # it times on a stream of its own: let the inputs land
    return do_bench_cudagraph(run, rep=rep_ms, return_mode="median")


def kernel_fingerprint(kernel) -> str:
    """A hash of the kernel's code: Triton's cache key of a compiled kernel, else (the
    interpreter's function) of its source."""
    key = getattr(kernel, "cache_key", None)
    if key is None:
        key = hashlib.sha256(inspect.getsource(getattr(kernel, "fn", kernel)).encode()).hexdigest()
    return key[:16]


@functools.cache
def device_fingerprint(device: torch.device) -> str:
    """The GPU's name (or the CPU's) and Triton's version."""
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{name}|triton {triton.__version__}"


class PrefillTileTuner:
    """Chooses prefill launches (see the module doc): in memory first, then from the cache file
    ``cache_path`` (None: memory only), then by timing with ``timer(run) -> milliseconds``."""

    def __init__(self, cache_path: Path | None,
                 timer: Callable[[Callable[[], None]], float] = time_launch_on_gpu):
        self.cache_path = cache_path
        self.timer = timer
        self.chosen: dict[str, AttentionLaunch] = {}
        self._loaded = False

    def launch(self, shape: PrefillShape, fingerprint: str, default: AttentionLaunch,
               make_run: Callable[[], Callable[[AttentionLaunch], None]]) -> AttentionLaunch:
        """The launch for ``shape`` under ``fingerprint`` (``device_fingerprint`` and
        ``kernel_fingerprint``): known, or timed now with the ``run(candidate)`` that
        ``make_run()`` builds (its tuning batch); ``default`` (the rule's launch) while a CUDA
        graph is being captured, and for the rest of the process where the GPU had no memory
        left for the tuning batch (a full KV cache mid-run must not fail a step)."""
        key = f"{fingerprint}|{shape.cache_key()}"
        if not self._loaded:
            self.chosen.update(self._read_cache())
            self._loaded = True
        if key not in self.chosen:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return default
            try:
                self.chosen[key] = self._tune(shape, default, make_run())
            except torch.cuda.OutOfMemoryError:
                logger.warning("no GPU memory to tune prefill attention %s: the rule's %s", shape, default)
                self.chosen[key] = default  # in memory only: a later process tunes it
                return default
            self._write_cache(key, self.chosen[key])
        return self.chosen[key]

    def _tune(self, shape: PrefillShape, default: AttentionLaunch,
              run: Callable[[AttentionLaunch], None]) -> AttentionLaunch:
        times: dict[AttentionLaunch, float] = {}
        for launch in prefill_candidates(shape):
            self._time(launch, run, times)
        best = min(times, key=times.get)
        rule = f"{times[default]:.3f} ms" if default in times else "not a candidate"
        logger.info("prefill attention %s: %s in %.3f ms (the rule's %s: %s) of %d launches timed", shape,
                    best, times[best], default, rule, len(times))
        return best

    def _time(self, launch: AttentionLaunch, run: Callable[[AttentionLaunch], None],
              times: dict[AttentionLaunch, float]) -> None:
        """Time one candidate into ``times``; one that does not fit the GPU (shared memory,
        registers) is left out."""
        from triton.runtime.errors import OutOfResources

        try:
            times[launch] = self.timer(lambda: run(launch))
        except OutOfResources as error:
            logger.info("prefill attention candidate %s does not fit: %s", launch, error)

    def _read_cache(self) -> dict[str, AttentionLaunch]:
        if self.cache_path is None or not self.cache_path.is_file():
            return {}
        try:
            entries = json.loads(self.cache_path.read_text())
            return {key: AttentionLaunch(**fields) for key, fields in entries.items()}
        except (OSError, ValueError, TypeError, AttributeError) as error:
            logger.warning("ignoring the prefill tile cache %s (%s): tiles are tuned again", self.cache_path,
                           error)
            return {}

    def _write_cache(self, key: str, launch: AttentionLaunch) -> None:
        """Add one entry to the file, merged with what other processes wrote meanwhile, replaced
        atomically; a cache that cannot be written only costs a later process the timing."""
        if self.cache_path is None:
            return
        try:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            entries = {k: asdict(v) for k, v in self._read_cache().items()}
            entries[key] = asdict(launch)
            handle, temporary = tempfile.mkstemp(dir=self.cache_path.parent, suffix=".tmp")
            with os.fdopen(handle, "w") as file:
                json.dump(entries, file, indent=1, sort_keys=True)
            os.replace(temporary, self.cache_path)
        except OSError as error:
            logger.warning("could not write the prefill tile cache %s: %s", self.cache_path, error)
