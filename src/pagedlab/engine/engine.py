"""The engine core: requests in, one scheduled forward pass per ``step()``, outputs out.

Shared by the offline ``LLM`` and the online server. Loading happens once; the plan (KV cache,
scheduler) can be rebuilt without touching the weights.

With ``async_scheduling`` (the default on CUDA) a step is launched before the previous one is
read back: the host schedules and prepares step N+1 while the GPU runs step N, and the ids
sampled in step N reach step N+1 on the device. A request that stops in step N has computed one
token in step N+1 for nothing; requests with penalties, which read every earlier token on the
host, and speculative decoding, whose proposals do, make the loop wait for each step instead
(speculation only around steps that propose: ``Scheduler.must_read_back``).
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import logging
import time
from collections.abc import Iterable

import torch

from pagedlab.config import (EngineConfig, EngineInfo, attention_windows, cpu_kv_cache_bytes,
                             kv_release_window, model_max_len, resolve_device, resolve_dtype,
                             resolve_kv_cache_dtype, resolve_max_model_len, resolve_max_num_batched_tokens,
                             resolve_quantization, resolve_speculative_config)
from pagedlab.distributed.parallel_state import destroy_tensor_parallel
from pagedlab.inputs import PromptType, encode_prompt
from pagedlab.layers.rotary import long_rope_switch
from pagedlab.engine.bad_words import bad_words_token_ids
from pagedlab.engine.draft_model import DraftModel
from pagedlab.engine.kv_cache import KVCacheManager
from pagedlab.engine.model_runner import ModelRunner, RunnerPlan, load_model_runner
from pagedlab.engine.step_outputs import LaunchedStep
from pagedlab.engine.output_processor import OutputProcessor
from pagedlab.engine.profiling import STEP_NAME, StepRanges
from pagedlab.engine.request import Request
from pagedlab.engine.routed_experts import check_prompt_start, plan_routed_experts
from pagedlab.engine.scheduler import ScheduledBatch, Scheduler, SchedulerStats
from pagedlab.engine.sleep_mode import (EngineAsleepError, RankSleep, SleepStateError, check_sleep_level,
                                        check_wake_up_tags)
from pagedlab.engine.structured_output import GrammarCompiler
from pagedlab.engine.thinking_budget import new_thinking_budget, thinking_markers
from pagedlab.engine.trace_replay import trace_replay_params
from pagedlab.engine.ray_executor import RayWorkers
from pagedlab.engine.weight_update import check_updatable, weight_pairs
from pagedlab.engine.tensor_parallel import (TensorParallelExecutor, TensorParallelWorkers,
                                             join_tensor_parallel, rank_device)
from pagedlab.loader import resolve_model_source, resolve_tokenizer_path
from pagedlab.loader.hf_config import load_hf_config
from pagedlab.lora.request import LoRARequest
from pagedlab.outputs import EngineStats, RequestOutput
from pagedlab.sampling_params import SamplingParams, generation_config_defaults

logger = logging.getLogger(__name__)


def start_tensor_parallel_workers(config: EngineConfig, hf_config,
                                  device: torch.device) -> TensorParallelExecutor:
    """Ranks 1..N-1 under ``config.distributed_executor_backend``: processes of this host ("mp",
    one GPU each, so this host must have N) or Ray actors ("ray", placed anywhere in the cluster),
    each building its shard from ``hf_config`` (rank 0's, ``hf_overrides`` applied)."""
    world_size = config.tensor_parallel_size
    if config.distributed_executor_backend == "ray":
        return RayWorkers(config, hf_config, world_size)
    if device.type == "cuda" and world_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={world_size} is invalid: only "
                         f"{torch.cuda.device_count()} GPUs are visible (distributed_executor_backend='ray' "
                         "can place ranks on other nodes)")
    return TensorParallelWorkers(config, hf_config, world_size)


def load_tokenizer(path, tokenizer_mode: str = "auto", **overrides):
    """The tokenizer in ``path`` (``tokenizer_mode="slow"``: the Python one), or None for a
    directory that holds only weights/config. Never a tokenizer class from the repository's code.
    ``overrides`` go to ``from_pretrained`` (e.g. ``add_bos_token``)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False,
                                                  use_fast=tokenizer_mode != "slow", **overrides)
    except (OSError, ValueError, TypeError) as e:
        logger.info("no tokenizer in %s (%s): prompts must be token ids", path, e)
        return None
    if len(tokenizer) <= len(tokenizer.all_special_ids):
        # transformers builds some classes (Qwen2's) without files: a vocabulary of special tokens only
        logger.info("no tokenizer files in %s: prompts must be token ids", path)
        return None
    return tokenizer


class LLMEngine:
    """Owns the model runner, the KV cache manager, the scheduler and the output processor;
    ``step()`` advances every request."""

    def __init__(self, config: EngineConfig):
        from transformers import GenerationConfig

        config.validate()
        self.config = config
        self.device = resolve_device(config.device)
        if config.tensor_parallel_size > 1:
            self.device = rank_device(config.device, 0)
        self.source = resolve_model_source(config.model, config.load_format, config.revision,
                                           config.download_dir)
        self.hf_config = load_hf_config(self.source.path, config.hf_overrides)  # before all derived from it
        self.quantization = resolve_quantization(config.quantization, self.hf_config)  # fails before loading
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        self.max_model_len = resolve_max_model_len(config.max_model_len, self.hf_config)
        self.tokenizer_path = resolve_tokenizer_path(config.tokenizer, self.source.path, config.download_dir)
        self.tokenizer = load_tokenizer(self.tokenizer_path, config.tokenizer_mode)
        self.thinking_markers = thinking_markers(config.reasoning_config, self.tokenizer,
                                                 self.hf_config.vocab_size)
        try:
            generation_config = GenerationConfig.from_pretrained(str(self.source.path))
        except OSError:
            generation_config = None
        self.eos_token_ids = _eos_token_ids(self.hf_config, generation_config, self.tokenizer)
        self.model_eos_token_id = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        self.default_sampling_args = generation_config_defaults(config.generation_config, self.source.path,
                                                                config.override_generation_config)
        self.ranges = StepRanges()  # named step phases for the profiler and Nsight
        self.runner = self._load_runner()
        self.runner.ranges = self.ranges
        self.output_processor = OutputProcessor(self.tokenizer)
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids)
        self._in_flight: LaunchedStep | None = None  # launched, not yet read back
        self._sleep = RankSleep()  # this rank's weights while asleep (sleep mode)
        self._kv_cache_asleep = False
        self._weights_discarded = False  # woken from level 2, not yet loaded
        self.scheduler: Scheduler | None = None
        self.kv_cache: KVCacheManager | None = None
        self.draft: DraftModel | None = None  # speculative_config's draft model
        self.routes = None  # enable_return_routed_experts: the plan's RoutedExperts (routed_experts)
        self.build_plan()

    def _load_runner(self) -> ModelRunner:
        """This process's model shard in a runner; with tensor parallelism, the worker processes of
        the other ranks too (started first: they meet this process, rank 0, in the group)."""
        world_size = self.config.tensor_parallel_size
        if world_size == 1:
            return load_model_runner(self.config, self.source, self.hf_config, self.device)
        workers = start_tensor_parallel_workers(self.config, self.hf_config, self.device)
        try:
            baseline = join_tensor_parallel(world_size, 0, self.device, workers.init_method,
                                            not self.config.disable_custom_all_reduce, workers)
            runner = load_model_runner(self.config, self.source, self.hf_config, self.device, baseline)
            workers.collect()
        except BaseException:
            workers.close()
            destroy_tensor_parallel()
            raise
        runner.workers = workers
        return runner

    def update_plan(self, **changes) -> None:
        """Change plan-level settings (see ``config.PLAN_FIELDS``) and rebuild the KV cache and
        scheduler; the weights stay where they are. On error the previous plan is restored."""
        if self.is_sleeping():
            raise RuntimeError("cannot re-plan while the engine is asleep (sleep()): wake_up() first")
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
        if cfg.batch_invariant and self.quantization is not None:
            raise ValueError(f"batch_invariant=True with quantization={self.quantization!r}: batch-invariant "
                             "mode runs dense weights only (its fixed-order matmul has no quantized form)")
        self.max_model_len = resolve_max_model_len(cfg.max_model_len, self.hf_config)
        self.max_num_batched_tokens = resolve_max_num_batched_tokens(cfg, self.max_model_len)
        speculative = resolve_speculative_config(cfg.speculative_config)
        self._load_draft_model(speculative)
        # speculation reads each step back but where a schedule proposes nothing (K=0), and a
        # lockstep draft runs over every token of every step, all of them needed on the host
        sync = speculative is not None and (not speculative.has_steps_without_proposals
                                            or (self.draft is not None and self.draft.lockstep))
        self.async_scheduling = (self.device.type == "cuda" if cfg.async_scheduling is None
                                 else cfg.async_scheduling) and not sync
        plan = RunnerPlan(
            block_size=cfg.block_size, max_model_len=self.max_model_len, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes or (
                cpu_kv_cache_bytes(cfg) if self.device.type == "cpu" else None),
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            cascade_attention=self.cascade_attention,
            cuda_graphs=self.device.type == "cuda" and not cfg.enforce_eager,
            mixed_cuda_graphs=cfg.cuda_graph_mixed_steps,
            kv_cache_dtype=resolve_kv_cache_dtype(cfg.kv_cache_dtype, self.dtype),
            batch_invariant=cfg.batch_invariant, logprobs_mode=cfg.logprobs_mode)
        if self.draft is not None:
            plan = self.draft.share_of_target_plan(plan)
        self.routes = plan_routed_experts(cfg.enable_return_routed_experts, self.runner,
                                          self.max_num_batched_tokens, cfg.max_num_seqs)
        num_blocks = self.runner.configure(plan)
        window = kv_release_window(self.hf_config) if self.routes is None else None  # routes stay in blocks
        if self.draft is not None:
            self.draft.configure(plan, num_blocks, self.runner.extra_kv_storage)
            window = self.draft.release_window(window)
        self.kv_cache = KVCacheManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching, window)
        switch = long_rope_switch(self.hf_config)
        self.scheduler = Scheduler(self.kv_cache, cfg.max_num_seqs, self.max_num_batched_tokens,
                                   self.max_model_len, cfg.enable_chunked_prefill,
                                   None if switch is None else (switch, model_max_len(self.hf_config)),
                                   max_loras=cfg.max_loras if cfg.enable_lora else None,
                                   policy=cfg.scheduling_policy, speculative=speculative, routes=self.routes)
        _freeze_heap()

    def _load_draft_model(self, speculative) -> None:
        """Keep, load or drop the draft model the plan's ``speculative_config`` names, both KV caches
        freed first: the memory profiles must not count them, and on a GPU a target cache freed
        after a draft had loaded stayed reserved by torch's allocator (empty_cache did not return
        it), so the larger cache of both models ran out of memory beside it."""
        self.runner.free_kv_cache()
        if self.draft is not None:
            self.draft.runner.free_kv_cache()
        wanted = speculative.model if speculative is not None else None
        if self.draft is not None and self.draft.model != wanted:
            self.draft.close()
            self.draft = None
            gc.unfreeze()  # the draft sits in the heap _freeze_heap froze: collect its cycles now
            gc.collect()
            self.runner.reset_memory_profile()  # its weights no longer count
        if self.draft is None and wanted is not None:
            self.draft = DraftModel.load(self.config, speculative, self.hf_config, self.device, self.dtype)
            self.runner.reset_memory_profile()  # its weights count in the profile's peak

    def reset_stats(self) -> None:
        """Zero the peak and token counters (the prefix cache keeps its contents)."""
        self.scheduler.stats = SchedulerStats()
        self.kv_cache.stats.queried_tokens = self.kv_cache.stats.hit_tokens = 0

    def get_stats(self) -> EngineStats:
        kv, counters = self.kv_cache, self.scheduler.stats
        return EngineStats(
            num_kv_blocks=kv.num_blocks, block_size=kv.block_size, kv_cache_bytes=self.kv_cache_bytes,
            weight_bytes=self.weight_bytes,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=kv.num_blocks - kv.num_free_blocks, peak_kv_blocks_used=counters.peak_blocks,
            kv_tokens_at_peak=counters.tokens_at_peak, prefix_cache_queried_tokens=kv.stats.queried_tokens,
            prefix_cache_hit_tokens=kv.stats.hit_tokens, num_preemptions=counters.num_preemptions,
            prompt_tokens_computed=counters.prompt_tokens, generation_tokens=counters.generation_tokens,
            num_long_rope_recomputes=counters.num_long_rope_recomputes,
            spec_decode_num_drafts=counters.num_drafts,
            spec_decode_num_draft_tokens=counters.num_draft_tokens,
            spec_decode_num_accepted_tokens=counters.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(counters.num_accepted_per_position))

    @property
    def weight_bytes(self) -> int:
        """The weights' bytes, a draft model's included (``get_stats()``; ``EngineInfo`` keeps the
        target's, which the physical floor reads, and ``EngineInfo.draft_model`` the draft's)."""
        return self.runner.weight_bytes + (self.draft.runner.weight_bytes if self.draft else 0)

    @property
    def kv_cache_bytes(self) -> int:
        """The KV cache's bytes, a draft model's included (its blocks are the target's)."""
        return self.runner.kv_cache_bytes + (self.draft.runner.kv_cache_bytes if self.draft else 0)

    @property
    def cascade_attention(self) -> bool:
        """Cascade attention asked for, not in batch-invariant mode (it sums a shared prefix apart),
        and the model has no sliding-window layer (a window leaves no shared prefix that every
        query sees)."""
        return (self.config.enable_cascade_attention and not self.config.batch_invariant
                and not any(attention_windows(self.hf_config)))

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @property
    def info(self) -> EngineInfo:
        """The resolved settings and the model's identity (see ``EngineInfo``)."""
        backend = self.runner.backend
        return EngineInfo(
            config=self.config, model_name=self.source.name, model_path=self.source.path,
            original_file=self.source.original_file, load_format=self.source.load_format,
            hf_config=self.hf_config, tokenizer=self.tokenizer,
            tokenizer_path=self.tokenizer_path if self.tokenizer is not None else None,
            dtype=self.dtype, device=self.device, max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens, async_scheduling=self.async_scheduling,
            attention_backend=backend.name,
            cascade_attention=self.cascade_attention and backend.shares_prefixes,
            cuda_graphs=self.runner.uses_cuda_graphs, num_kv_blocks=self.kv_cache.num_blocks,
            kv_cache_dtype=self.runner.plan.kv_cache_dtype, eos_token_ids=self.eos_token_ids,
            quantization=self.quantization, weight_bytes=self.runner.weight_bytes,
            mixed_cuda_graphs=self.runner.uses_mixed_cuda_graphs,
            default_sampling_args=self.default_sampling_args,
            draft_model=self.draft.info(self.config) if self.draft is not None else None)

    @classmethod
    def from_engine_args(cls, engine_args: EngineConfig) -> LLMEngine:
        """vLLM's constructor: an engine of ``pagedlab.EngineArgs(...)`` (any ``EngineConfig``)."""
        return cls(engine_args)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: PromptType, params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None, priority: int = 0) -> None:
        """Queue a request (with ``lora_request``: under that LoRA adapter, read now if it is not
        cached; ``priority``: its place under ``scheduling_policy="priority"``, lower first); bad
        input raises ValueError and leaves the engine unchanged. ``prompt_token_ids`` may also be
        any prompt of vLLM's ``add_request`` (text, ``TextPrompt``, ``TokensPrompt``)."""
        self.check_awake()
        self.validate_priority(priority)
        if not isinstance(prompt_token_ids, list):  # text, a prompt dict, a tuple or a 1-D array of ids
            encoded = encode_prompt(prompt_token_ids, self.tokenizer, self.config.model)
            prompt_token_ids, prompt = encoded.token_ids, encoded.text if encoded.text is not None else prompt
        prompt_token_ids = params.truncate_prompt(prompt_token_ids, self.max_model_len)
        self.validate_prompt(prompt_token_ids)
        check_prompt_start(params, len(prompt_token_ids))
        self.validate_lora_request(lora_request)
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        params.verify_vocabulary(self.hf_config.vocab_size, self.config.max_logprobs)
        params = params.for_vocabulary(self.hf_config.vocab_size)
        params = trace_replay_params(params, self.config.enable_trace_replay, self.scheduler.speculative)
        for name in ("stop", "bad_words"):
            if getattr(params, name) and self.tokenizer is None:
                raise ValueError(f"{name}={getattr(params, name)!r} needs a tokenizer, and this model has "
                                 "none; use stop_token_ids / allowed_token_ids")
        bad_words = (bad_words_token_ids(self.tokenizer, params.bad_words, self.hf_config.vocab_size)
                     if params.bad_words else [])
        if params.structured_outputs is not None:
            self.grammar_compiler.compile(params.structured_outputs)  # a bad grammar fails before queueing
        arrival_time = arrival_time or time.time()
        children = [
            Request(f"{request_id}#{index}" if params.n > 1 else request_id, list(prompt_token_ids), params,
                    eos_token_ids=self.eos_token_ids, model_eos_token_id=self.model_eos_token_id,
                    index=index, parent_id=request_id,
                    arrival_time=arrival_time, priority=priority, lora_request=lora_request,
                    bad_words_token_ids=bad_words,
                    thinking=new_thinking_budget(params, self.thinking_markers, len(prompt_token_ids)),
                    grammar=(self.grammar_compiler.matcher(params.structured_outputs, params.stop_token_ids)
                             if params.structured_outputs is not None else None),
                    seed=params.seed + index if params.seed is not None else None)
            for index in range(params.n)]
        self.output_processor.add_request(request_id, prompt, children, self.config.stream_interval)
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
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            what = "is out of range" if isinstance(bad, int) else "is not an integer"
            raise ValueError(f"prompt token id {bad!r} {what}: ids must be integers in [0, {vocab})")

    def validate_priority(self, priority) -> None:
        """A ValueError unless ``priority`` is an integer, and 0 unless ``scheduling_policy="priority"``."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority={priority!r} is invalid: a priority is an integer (lower runs first)")
        policy = self.config.scheduling_policy
        if priority and policy != "priority":
            raise ValueError(f"priority={priority} is invalid: priorities other than 0 need "
                             f"scheduling_policy='priority' (this engine's is {policy!r})")

    def validate_lora_request(self, lora_request: LoRARequest | None) -> None:
        """Read (or find cached) the adapter of ``lora_request``; a bad one is a ValueError."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request={lora_request!r} is invalid: give a pagedlab.LoRARequest or None")
        if self.runner.lora is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r} needs LoRA enabled: build the LLM "
                             "with enable_lora=True (and max_lora_rank >= the adapters' rank)")
        self.runner.lora.get_adapter(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop adapter ``lora_int_id``'s CPU copy and GPU slot (vLLM's ``remove_lora``); False if
        it held neither. A request still running on it reads it again from its directory."""
        return self.runner.lora is not None and self.runner.lora.remove_lora(lora_int_id)

    def abort_request(self, request_id: str | Iterable[str]) -> RequestOutput | list[RequestOutput] | None:
        """Stop a request now and free its blocks; returns its final output (None for an id not
        running). As vLLM's, it also takes a list of ids: each is aborted, and the final outputs of
        those that were running are returned."""
        if not isinstance(request_id, str):
            outputs = [self.abort_request(one) for one in request_id]
            return [output for output in outputs if output is not None]
        if not self.output_processor.has_request(request_id):
            return None
        for child in self.output_processor.children(request_id):
            self.scheduler.finish_request(child, "abort")
        return self.output_processor.make_output(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request is unfinished (a launched step whose requests have all finished
        since is read back and dropped by the next ``step()``, re-plan or close)."""
        return self.output_processor.num_unfinished > 0

    @property
    def num_unfinished_requests(self) -> int:
        return self.output_processor.num_unfinished

    # ---- the step loop --------------------------------------------------------------------
    def step(self, stream: bool = True) -> list[RequestOutput]:
        """Launch one forward pass and read back the one before it (with asynchronous scheduling) or
        this one; return the current output of every request that changed (as its stream interval
        allows), or with ``stream=False`` only of those that finished (cheaper when nobody watches)."""
        with self.ranges.range(STEP_NAME):
            changed: list[Request] = []
            previous, self._in_flight = self._in_flight, None
            if previous is not None and self.scheduler.must_read_back(previous.batch):
                changed += self._process_output(previous)  # penalties and proposals read host tokens
                previous = None
            with self.ranges.range("schedule"):
                batch = self.scheduler.schedule()
            progress = {}
            if self.draft is not None:
                with self.ranges.range("propose"):
                    progress = self.draft.propose(batch)  # fills in the scheduler's placeholders
            changed += batch.preempted
            launched = self._launch(batch, previous)
            self.scheduler.record_draft_pass(progress)
            if previous is not None:
                changed += self._process_output(previous)
            if launched is not None:
                # a batch with grammars builds its sampling inputs only now (its bitmask needs the
                # tokens just read back); the next launch or its read-back queues the sampler
                self.runner.finish_sampling(launched)
                if self.async_scheduling:
                    self._in_flight = launched
                else:
                    changed += self._process_output(launched)
            return self.output_processor.make_outputs(changed, finished_only=not stream)

    def _launch(self, batch: ScheduledBatch, previous: LaunchedStep | None) -> LaunchedStep | None:
        if batch.is_empty():
            return None
        try:
            launched = self.runner.launch(batch, previous)
        except BaseException:
            self._in_flight = previous  # nothing of this step happened; the next one reads it back
            raise
        self.scheduler.update_after_launch(batch)
        return launched

    def _process_output(self, step: LaunchedStep) -> list[Request]:
        """Wait for a launched step and apply what it sampled; returns the requests it ran."""
        with self.ranges.range("process_output"):
            output = step.result()
            if self.routes is not None:
                self.routes.record(step.routes)
            batch = step.batch
            drafts = batch.drafts_by_request() if self.scheduler.speculative is not None else {}
            appended = self.scheduler.update_from_output(output.sampled_requests, output.sampled_token_ids,
                                                         drafts)
            for hit in self.output_processor.process(batch.requests, output, appended, bool(drafts)):
                # tokens kept after the stop string's in the same step go, and so does a finish they caused
                self.scheduler.drop_last_tokens(hit.request, hit.num_after)
                self.scheduler.finish_request(hit.request, "stop", stop_reason=hit.stop,
                                              replace=hit.num_after > 0)
        return step.batch.requests

    def _finish_in_flight(self) -> None:
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            self._process_output(step)

    def reset_prefix_cache(self) -> None:
        self.kv_cache.reset_prefix_cache()

    def load_weights(self, weights) -> None:
        """Copy new weights into the model in place, between steps, and reset the prefix cache (no
        KV computed with the old weights is reused); see ``LLM.load_weights``. Refused while a
        request is unfinished: its KV and tokens so far come from the old weights."""
        pairs = weight_pairs(weights)
        if self.has_unfinished_requests():
            raise RuntimeError(f"load_weights while {self.num_unfinished_requests} requests are unfinished: "
                               "their KV cache holds the old weights' keys and values; let them finish or "
                               "abort them first")
        check_updatable(self.model, self.quantization)
        if self._sleep.weights is not None:
            raise SleepStateError("load_weights while the weights are asleep (sleep()): "
                                  "wake_up(tags=['weights']) first")
        self._finish_in_flight()  # a step launched for requests that have finished since
        self.runner.load_weights(pairs)
        self._weights_discarded = False
        self.reset_prefix_cache()

    # ---- sleep mode (vLLM's) ------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Give back the GPU memory of the KV cache, the CUDA graphs and the weights on every rank
        (``sleep_mode``): level 1 keeps the weights in host memory, level 2 drops them. Refused
        while requests are unfinished; a part already asleep stays so. Waking plans the KV cache
        afresh (empty, with the memory free then), so nothing cached before is reused."""
        check_sleep_level(level)
        if self.draft is not None:
            raise SleepStateError("sleep() with a draft model (speculative_config's 'model') is unsupported: "
                                  "re-plan without it first, set_model_args(speculative_config=None)")
        if level == 2:
            try:
                check_updatable(self.model, self.quantization)
            except ValueError as e:
                raise ValueError(f"level=2 is invalid here: it drops the weights, and {e}; sleep(level=1) "
                                 "keeps them") from None
        self._finish_in_flight()
        if self.has_unfinished_requests():
            raise SleepStateError(f"sleep while {self.num_unfinished_requests} requests are unfinished: let "
                                  "them finish or abort them first")
        self._kv_cache_asleep = True  # first: freeing the KV cache is the first thing every rank does
        self._on_every_rank("sleep", level, lambda: self._sleep.sleep(self.runner, level))

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Wake ``tags`` (``"weights"``, ``"kv_cache"``; None: both), the weights first: they come
        back as they were (level 1) or uninitialised until ``load_weights`` (level 2); the KV cache
        is planned and its graphs captured again. The KV cache needs the weights awake."""
        tags = check_wake_up_tags(tags)
        if "weights" in tags and self._sleep.weights is not None:
            self._weights_discarded |= not self._sleep.weights.kept
            self._on_every_rank("wake_weights", None, self._sleep.wake_weights)
        if "kv_cache" in tags and self._kv_cache_asleep:
            if self._sleep.weights is not None:
                raise SleepStateError("wake_up(tags=['kv_cache']) while the weights sleep: the KV cache's "
                                      "memory profile and CUDA graphs run the model; wake the weights first")
            self.build_plan()
            self._kv_cache_asleep = False

    def is_sleeping(self) -> bool:
        """Whether any part of the engine (weights, KV cache) is asleep."""
        return self._kv_cache_asleep or self._sleep.weights is not None

    def check_awake(self) -> None:
        """An ``EngineAsleepError`` while any part sleeps or level-2 weights wait for ``load_weights``."""
        if self.is_sleeping():
            raise EngineAsleepError("the engine is asleep (sleep()): call wake_up() before adding requests")
        if self._weights_discarded:
            raise EngineAsleepError("the weights were dropped by sleep(level=2): load_weights() before "
                                    "adding requests")

    def _on_every_rank(self, command: str, payload, run_here) -> None:
        """``run_here`` on this rank and ``command`` on every other rank's worker."""
        workers = self.runner.workers
        if workers is not None:
            workers.send(command, payload)
        try:
            run_here()
        finally:
            if workers is not None:
                workers.collect()

    def close(self) -> None:
        """Drop every request, the KV cache and the weights."""
        self._finish_in_flight()
        self.output_processor.clear()
        self.scheduler = self.kv_cache = self.routes = None
        if self.draft is not None:
            self.draft.close()
        self.runner.close()
        destroy_tensor_parallel()
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
