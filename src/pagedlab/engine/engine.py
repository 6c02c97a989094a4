"""The engine core: requests in, one scheduled forward pass per ``step()``, outputs out.

Shared by the offline ``LLM`` and the online server. Loading happens once; the plan (KV cache,
scheduler) can be rebuilt without touching the weights.

With ``async_scheduling`` (the default on CUDA) a step is launched before the previous one is
read back: the host schedules and prepares step N+1 while the GPU runs step N, and the ids
sampled in step N reach step N+1 on the device. A request that stops in step N has computed one
token in step N+1 for nothing; requests with penalties, which read every earlier token on the
host, make the loop wait for each step instead.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedlab.config import (EngineConfig, EngineInfo, cpu_kv_cache_bytes, model_max_len, resolve_device, resolve_dtype,
                             resolve_max_model_len, resolve_max_num_batched_tokens)
from pagedlab.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from pagedlab.engine.kv_cache import KVCacheManager
from pagedlab.engine.model_runner import LaunchedStep, ModelRunner, PromptLogprobsChunk, StepOutput
from pagedlab.engine.request import Request
from pagedlab.engine.scheduler import Scheduler
from pagedlab.layers.attention import get_attention_backend
from pagedlab.layers.sampler import TopLogprobs
from pagedlab.loader import load_model, resolve_model_source
from pagedlab.outputs import CompletionOutput, EngineStats, Logprob, PositionLogprobs, RequestOutput
from pagedlab.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _ParentRequest:
    """A user request: its ``n`` completions run as separate sequences sharing the prompt."""

    request_id: str
    prompt: str | None
    children: list[Request]

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)


def load_tokenizer(path, trust_remote_code: bool = False):
    """The tokenizer in ``path``, or None for a directory that holds only weights/config."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        logger.info("no tokenizer in %s (%s): prompts must be token ids", path, e)
        return None


class LLMEngine:
    """Owns the model, the KV cache and the scheduler; ``step()`` advances every request."""

    def __init__(self, config: EngineConfig):
        from transformers import AutoConfig, GenerationConfig

        config.validate()
        self.config = config
        self.device = resolve_device(config.device)
        self.source = resolve_model_source(config.model, config.load_format)
        try:
            self.hf_config = AutoConfig.from_pretrained(str(self.source.path),
                                                        trust_remote_code=config.trust_remote_code)
        except (OSError, ValueError) as e:
            raise ValueError(f"config.json in {self.source.path} could not be read: {e}") from None
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        self.max_model_len = resolve_max_model_len(config.max_model_len, self.hf_config)
        self.tokenizer = load_tokenizer(config.tokenizer or self.source.path, config.trust_remote_code)
        try:
            generation_config = GenerationConfig.from_pretrained(str(self.source.path))
        except OSError:
            generation_config = None
        self.eos_token_ids = _eos_token_ids(self.hf_config, generation_config, self.tokenizer)
        self.model = load_model(self.source, self.hf_config, self.dtype, self.device,
                                model_max_len(self.hf_config), config.seed)
        self.runner = ModelRunner(self.model, self.hf_config, self.device, self.dtype, config.block_size,
                                  get_attention_backend(config.attention_backend, self.device), config.seed)
        self._parents: dict[str, _ParentRequest] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._in_flight: LaunchedStep | None = None  # launched, not yet read back
        self._num_penalized_requests = 0  # unfinished requests whose sampling reads earlier tokens
        self.scheduler: Scheduler | None = None
        self.kv_cache: KVCacheManager | None = None
        self.build_plan()

    def update_plan(self, **changes) -> None:
        """Change plan-level settings (see ``config.PLAN_FIELDS``) and rebuild the KV cache and
        scheduler; the weights stay where they are. On error the previous plan is restored."""
        previous = self.config
        self.config = dataclasses.replace(previous, **changes)
        try:
            self.config.validate()
            self.build_plan()
        except Exception:
            self.config = previous
            self.build_plan()
            raise

    # ---- planning -------------------------------------------------------------------------
    def build_plan(self) -> None:
        """(Re)create the KV cache and the scheduler from ``self.config``; the weights stay."""
        self._finish_in_flight()
        if self.scheduler is not None and self.scheduler.num_unfinished:
            raise RuntimeError("cannot re-plan while requests are unfinished")
        cfg = self.config
        self.max_model_len = resolve_max_model_len(cfg.max_model_len, self.hf_config)
        self.max_num_batched_tokens = resolve_max_num_batched_tokens(cfg, self.max_model_len)
        self.async_scheduling = self.device.type == "cuda" if cfg.async_scheduling is None else cfg.async_scheduling
        self.runner.block_size = cfg.block_size
        self.runner.max_model_len = self.max_model_len
        self.runner.cascade_attention = cfg.enable_cascade_attention
        self.runner.free_kv_cache()
        num_blocks = self._num_kv_blocks()
        min_blocks = -(-self.max_model_len // cfg.block_size)
        if num_blocks < min_blocks:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {cfg.block_size} tokens, fewer than one "
                f"max_model_len ({self.max_model_len}) sequence needs ({min_blocks}); raise "
                "kv_cache_memory_bytes / gpu_memory_utilization or lower max_model_len")
        self.runner.allocate_kv_cache(num_blocks)
        if self.uses_cuda_graphs:
            self.runner.capture_cuda_graphs(cfg.max_num_seqs)
        self.kv_cache = KVCacheManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_cache, cfg.max_num_seqs, self.max_num_batched_tokens,
                                   cfg.enable_chunked_prefill)
        self.reset_stats()
        _freeze_heap()

    def reset_stats(self) -> None:
        """Zero the peak and token counters (the prefix cache keeps its contents)."""
        self._peak_blocks = self._tokens_at_peak = self._num_preemptions = 0
        self._prompt_tokens = self._generation_tokens = 0
        self.kv_cache.stats.queried_tokens = self.kv_cache.stats.hit_tokens = 0

    def get_stats(self) -> EngineStats:
        kv = self.kv_cache
        return EngineStats(
            num_kv_blocks=kv.num_blocks, block_size=kv.block_size,
            kv_cache_bytes=self.runner.kv_cache.numel() * self.runner.kv_cache.element_size(),
            weight_bytes=sum(p.numel() * p.element_size() for p in self.model.parameters()),
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=kv.num_blocks - kv.num_free_blocks, peak_kv_blocks_used=self._peak_blocks,
            kv_tokens_at_peak=self._tokens_at_peak, prefix_cache_queried_tokens=kv.stats.queried_tokens,
            prefix_cache_hit_tokens=kv.stats.hit_tokens, num_preemptions=self._num_preemptions,
            prompt_tokens_computed=self._prompt_tokens, generation_tokens=self._generation_tokens)

    @property
    def info(self) -> EngineInfo:
        """The resolved settings and the model's identity (see ``EngineInfo``)."""
        backend = self.runner.backend
        return EngineInfo(
            config=self.config, model_name=self.source.name, model_path=self.source.path,
            original_file=self.source.original_file, load_format=self.source.load_format,
            hf_config=self.hf_config, tokenizer=self.tokenizer,
            tokenizer_path=Path(self.config.tokenizer or self.source.path) if self.tokenizer is not None else None,
            dtype=self.dtype, device=self.device, max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens, async_scheduling=self.async_scheduling,
            attention_backend=backend.name,
            cascade_attention=self.config.enable_cascade_attention and backend.shares_prefixes,
            cuda_graphs=self.uses_cuda_graphs, num_kv_blocks=self.kv_cache.num_blocks,
            eos_token_ids=tuple(self.eos_token_ids))

    @property
    def uses_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs unless enforce_eager (the torch backend syncs with the
        host inside attention, so it always runs eagerly)."""
        return self.device.type == "cuda" and not self.config.enforce_eager and self.runner.backend.name != "torch"

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        per_block = self.runner.bytes_per_block
        # Never more than every sequence slot at full length could use.
        ceiling = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size) + 1
        if cfg.kv_cache_memory_bytes is not None:
            return min(cfg.kv_cache_memory_bytes // per_block, ceiling)
        if self.device.type == "cpu":
            return min(cpu_kv_cache_bytes(cfg) // per_block, ceiling)
        blocks = self.runner.profile_gpu_kv_blocks(self.max_num_batched_tokens, self.max_model_len,
                                                   cfg.gpu_memory_utilization)
        return min(blocks, ceiling)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None) -> None:
        """Queue a request; bad input raises ValueError and leaves the engine unchanged."""
        self.validate_prompt(prompt_token_ids)
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop={params.stop!r} needs a tokenizer, and this model has none; use stop_token_ids")
        arrival_time = arrival_time or time.time()
        children = []
        for index in range(params.n):
            child = Request(f"{request_id}#{index}" if params.n > 1 else request_id, list(prompt_token_ids),
                            params, eos_token_ids=self.eos_token_ids, prompt=prompt, index=index,
                            parent_id=request_id, arrival_time=arrival_time)
            if params.seed is not None:
                child.generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
            if params.detokenize and self.tokenizer is not None:
                self._detokenizers[child.request_id] = IncrementalDetokenizer(
                    self.tokenizer, params.skip_special_tokens)
            children.append(child)
        if params.has_penalties:
            self._num_penalized_requests += len(children)
        self._parents[request_id] = _ParentRequest(request_id, prompt, children)
        for child in children:
            self.scheduler.add_request(child)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens, but max_model_len is {self.max_model_len}: "
                "prompts must be shorter than max_model_len so at least one token can be generated")
        vocab = self.hf_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is out of range: ids must be integers in [0, {vocab})")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            if not child.is_finished:
                self._finish(child, "abort")
        return self._make_output(parent)

    def has_unfinished_requests(self) -> bool:
        """True while any request is unfinished (a launched step whose requests have all finished
        since is read back and dropped by the next ``step()``, re-plan or close)."""
        return bool(self._parents)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ---- the step loop --------------------------------------------------------------------
    def step(self, stream: bool = True) -> list[RequestOutput]:
        """Launch one forward pass and read back the one before it (with asynchronous scheduling)
        or this one; return the current output of every request that changed, or with
        ``stream=False`` only of those that finished (cheaper when nobody watches tokens arrive)."""
        changed: list[Request] = []
        previous, self._in_flight = self._in_flight, None
        if previous is not None and self._num_penalized_requests:
            changed += self._read_back(previous)  # penalties need every earlier token on the host
            previous = None
        batch = self.scheduler.schedule()
        if not batch.is_empty():
            self._record_batch_stats(batch)
            try:
                launched = self.runner.launch(batch, previous)
            except BaseException:
                self._in_flight = previous  # nothing of this step happened; the next one reads it back
                raise
            for request, n in zip(batch.requests, batch.num_new_tokens):
                request.num_computed_tokens += n
            for request in launched.sampled_requests:
                request.num_pending_tokens += 1
            changed += batch.preempted
            if self.async_scheduling:
                self._in_flight = launched
            else:
                changed += self._read_back(launched)
        if previous is not None:
            changed += self._read_back(previous)
        outputs = []
        for parent_id in dict.fromkeys(r.parent_id for r in changed):
            parent = self._parents.get(parent_id)
            if parent is not None and (stream or parent.finished):
                outputs.append(self._make_output(parent))
        return outputs

    def _read_back(self, step: LaunchedStep) -> list[Request]:
        """Wait for a launched step and apply its tokens; returns the requests it ran."""
        result = step.result()
        for request in result.sampled_requests:
            request.num_pending_tokens -= 1
        self._record_prompt_logprobs(step.batch.requests, result.prompt_logprobs)
        self._append_tokens(result)
        return step.batch.requests

    def _finish_in_flight(self) -> None:
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            self._read_back(step)

    def _record_batch_stats(self, batch) -> None:
        used = self.kv_cache.num_blocks - self.kv_cache.num_free_blocks
        if used > self._peak_blocks:
            self._peak_blocks = used
            # Empty slots sit only in each sequence's last block (shared prefix blocks are full),
            # so counting them per sequence stays right when blocks are shared.
            held = {r: r.num_computed_tokens for r in self.scheduler.running}
            held.update((r, r.num_computed_tokens + n) for r, n in zip(batch.requests, batch.num_new_tokens))
            empty = sum(len(r.block_ids) * self.kv_cache.block_size - tokens for r, tokens in held.items())
            self._tokens_at_peak = used * self.kv_cache.block_size - empty
        self._num_preemptions += len(batch.preempted)
        self._prompt_tokens += batch.total_tokens - sum(
            1 for r, n in zip(batch.requests, batch.num_new_tokens) if r.num_computed_tokens >= r.num_prompt_tokens)

    def _append_tokens(self, result: StepOutput) -> None:
        now = time.time()
        for row, (request, token) in enumerate(zip(result.sampled_requests, result.sampled_token_ids)):
            if request.is_finished:  # stopped (or aborted) while this step was in flight
                continue
            request.append_token(token)
            self._generation_tokens += 1
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            metrics.num_generated_tokens = request.num_output_tokens
            if request.logprobs is not None:
                request.logprobs.append(self._position_logprobs(result.logprobs, row, token,
                                                                request.sampling_params.logprobs,
                                                                request.sampling_params.detokenize))
                request.cumulative_logprob += float(result.logprobs.token_logprob[row])
            new_text = ""
            detok = self._detokenizers.get(request.request_id)
            if detok is not None:
                new_text = detok.append(token)
                request.text = detok.text
            self._check_stop(request, token, len(new_text))

    def _check_stop(self, request: Request, token: int, new_text_len: int) -> None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return self._finish(request, "stop")
            if token in params.stop_token_ids:
                return self._finish(request, "stop", stop_reason=token)
            if params.stop and new_text_len:
                hit = find_stop_string(request.text, new_text_len, params.stop)
                if hit is not None:
                    stop, idx = hit
                    request.text = request.text[:idx + (len(stop) if params.include_stop_str_in_output else 0)]
                    return self._finish(request, "stop", stop_reason=stop)
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return self._finish(request, "length")
        if request.num_tokens >= self.max_model_len:
            return self._finish(request, "length")

    def _finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        request.finish_reason, request.stop_reason = reason, stop_reason
        request.metrics.finished_time = time.time()
        if request.sampling_params.has_penalties:
            self._num_penalized_requests -= 1
        self.scheduler.finish(request)
        self._detokenizers.pop(request.request_id, None)

    def _record_prompt_logprobs(self, requests: list[Request], chunks: dict[str, PromptLogprobsChunk]) -> None:
        for request in requests:
            chunk = chunks.get(request.request_id)
            if chunk is None:
                continue
            params = request.sampling_params
            for j, token in enumerate(chunk.token_ids):
                request.prompt_logprobs[chunk.start + j] = self._position_logprobs(
                    chunk.logprobs, j, token, params.prompt_logprobs, params.detokenize)

    def _position_logprobs(self, top: TopLogprobs, row: int, token: int, num: int, decode: bool) -> PositionLogprobs:
        entries = {token: (float(top.token_logprob[row]), int(top.token_rank[row]))}
        for rank, (tid, lp) in enumerate(zip(top.top_ids[row, :num].tolist(), top.top_logprobs[row, :num].tolist()), 1):
            entries.setdefault(tid, (lp, rank))
        decode = decode and self.tokenizer is not None
        return {tid: Logprob(lp, rank, self.tokenizer.decode([tid]) if decode else None)
                for tid, (lp, rank) in entries.items()}

    def _make_output(self, parent: _ParentRequest) -> RequestOutput:
        finished = parent.finished
        if finished:
            del self._parents[parent.request_id]
        first = parent.children[0]
        completions = [
            CompletionOutput(
                index=c.index, text=c.text, token_ids=c.output_token_ids,
                cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
                logprobs=list(c.logprobs) if c.logprobs is not None else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            for c in parent.children]
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
            outputs=completions, finished=finished, metrics=first.metrics,
            num_cached_tokens=first.num_cached_prompt_tokens)

    def reset_prefix_cache(self) -> None:
        self.kv_cache.reset_prefix_cache()

    def close(self) -> None:
        """Drop every request, the KV cache and the weights."""
        self._finish_in_flight()
        self._parents.clear()
        self._detokenizers.clear()
        self.scheduler = None
        self.kv_cache = None
        self.runner.free_kv_cache()
        self.runner.model = None
        self.model = None
        gc.unfreeze()  # what this engine held may sit in reference cycles: let the collector see it


def _freeze_heap() -> None:
    """Move every object that exists now (weights, captured graphs, compiled code, transformers'
    modules: millions of objects that live as long as the engine) out of the collector's sight:
    a full collection walked them all and stalled a step by 0.16-0.45 s on the H200 host (a
    W-prefix run takes 0.5 s). ``close()`` and interpreter exit unfreeze, so nothing leaks."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)


def _eos_token_ids(hf_config, generation_config, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (generation_config, hf_config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids.extend(value if isinstance(value, (list, tuple)) else [value])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))
