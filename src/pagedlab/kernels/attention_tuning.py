"""The paged attention kernel's prefill launches, tuned on the GPU at first use and cached on disk.

A launch whose longest query is more than one token (prefill, chunked prefill, mixed steps) in
the default mode takes its query tile (``block_m`` rows), warps and pipeline stages from a
``PrefillTileTuner``: the first time a ``PrefillShape`` is met, the tuner times the candidate
launches (``prefill_candidates``) on that call's own inputs, keeps the fastest, and writes it to
``attention-prefill-tiles.json`` in the cache directory (``pagedlab.cache``) under the GPU's
name, Triton's version and the kernel's source hash, so a later process on the same machine and
code reuses it without timing. The search is two passes, to keep first-use compiles few: the
query tile and warps at the rule's stages, then the stages of the winner.

Every candidate keeps the key tile ``TILE_N``: each row's softmax runs over the same key tiles in
the same order whatever the query tile, so the choice never changes a result (the GPU tests
check every candidate bitwise against the untuned launch). Batch-invariant launches, decode
launches (``attention_configs``) and cascade halves are never tuned. Nothing is timed while a
stream is being captured into a CUDA graph: the mixed-step graphs' warm-up run, just before the
capture, meets each bucket's shape first. The candidates run on the call's inputs and write only
its output, so timing them leaves the result the chosen launch writes after.
"""

from __future__ import annotations

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

from pagedlab.kernels.attention_configs import TILE_N, AttentionLaunch, padded_head_dim

logger = logging.getLogger(__name__)

CACHE_FILE = "attention-prefill-tiles.json"
# Query lengths are bucketed by powers of two up to this; longer queries share its bucket.
MAX_QUERY_BUCKET = 8192
# Query tiles the tuner tries (rows = query tokens x the query heads of one KV head).
PREFILL_BLOCK_MS = (16, 32, 64, 128)


@dataclass(frozen=True)
class PrefillShape:
    """What a prefill launch is tuned for: the head layout, the dtypes, the kernel variant and
    the query length's bucket (``query_bucket``)."""

    head_dim: int
    group: int  # query heads per KV head
    num_kv_heads: int
    q_dtype: str
    kv_dtype_bits: int
    sliding: bool
    softcap: bool
    split: bool
    query_bucket: int

    def cache_key(self) -> str:
        """The shape as one string (the cache file's key)."""
        return ",".join(f"{name}={value}" for name, value in asdict(self).items())


def query_bucket(max_query_len: int) -> int:
    """``max_query_len`` rounded up to a power of two, at most ``MAX_QUERY_BUCKET``."""
    return min(MAX_QUERY_BUCKET, _next_power_of_2(max_query_len))


def _stage_choices(head_dim: int) -> tuple[int, int]:
    """(the rule's stages, the other one tried): three stages of head_dim-256 K and V tiles
    overflow the H200's shared memory."""
    return (2, 1) if padded_head_dim(head_dim) > 128 else (3, 2)


def prefill_candidates(shape: PrefillShape, num_stages: int | None = None) -> list[AttentionLaunch]:
    """The launches of the first pass (``num_stages`` None: at the rule's stages): each query
    tile of ``PREFILL_BLOCK_MS`` from the smallest that holds a token's query heads (at least 16
    rows, tl.dot's least) to the one the bucket fills, at two warp counts."""
    smallest = max(16, _next_power_of_2(shape.group))
    largest = min(PREFILL_BLOCK_MS[-1], _next_power_of_2(shape.query_bucket * shape.group))
    block_ms = [m for m in PREFILL_BLOCK_MS if smallest <= m <= largest] or [smallest]
    stages = _stage_choices(shape.head_dim)[0] if num_stages is None else num_stages
    return [AttentionLaunch(block_m, block_m // shape.group, TILE_N, warps, stages)
            for block_m in block_ms for warps in ((4, 8) if block_m >= 64 else (2, 4))]


def _next_power_of_2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def time_launch_on_gpu(run: Callable[[], None], rep_ms: float = 10.0) -> float:
    """Milliseconds one ``run()`` takes on the GPU, timed as replays of a CUDA graph of about
    ``rep_ms`` of runs (``triton.testing.do_bench_cudagraph``): host time does not count, so a
    short launch is not timed at the launcher's speed. Not ``do_bench``: its 256 MB cache-flush
    buffer would count in the start-up memory profile whose forward first meets a shape."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(run, rep=rep_ms, return_mode="median")


def kernel_fingerprint(kernel) -> str:
    """A hash of the kernel's code: Triton's cache key of a compiled kernel, else (the
    interpreter's function) of its source."""
    key = getattr(kernel, "cache_key", None)
    if key is None:
        key = hashlib.sha256(inspect.getsource(getattr(kernel, "fn", kernel)).encode()).hexdigest()
    return key[:16]


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
               run: Callable[[AttentionLaunch], None]) -> AttentionLaunch:
        """The launch for ``shape`` under ``fingerprint`` (``device_fingerprint`` and
        ``kernel_fingerprint``): known, or timed now with ``run(candidate)``; ``default`` (the
        rule's launch) while a CUDA graph is being captured."""
        key = f"{fingerprint}|{shape.cache_key()}"
        if not self._loaded:
            self.chosen.update(self._read_cache())
            self._loaded = True
        if key not in self.chosen:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return default
            self.chosen[key] = self._tune(shape, default, run)
            self._write_cache(key, self.chosen[key])
        return self.chosen[key]

    def _tune(self, shape: PrefillShape, default: AttentionLaunch,
              run: Callable[[AttentionLaunch], None]) -> AttentionLaunch:
        times: dict[AttentionLaunch, float] = {}
        for launch in prefill_candidates(shape):
            self._time(launch, run, times)
        best = min(times, key=times.get)
        self._time(AttentionLaunch(best.block_m, best.block_q, best.tile_n, best.num_warps,
                                   _stage_choices(shape.head_dim)[1]), run, times)
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
