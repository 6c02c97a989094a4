"""Turns a ScheduledBatch into flat tensors, runs the model over the paged KV cache, samples.

Owns the weights, the KV cache tensors, the decode CUDA graphs and the sampler; the engine gives
it a plan (``configure``) and one batch per step (``launch``). Logits are computed only for the
positions that sample, plus the prompt rows requests score (``prompt_logprobs`` and
``prompt_logprob_token_ids``: ``prompt_scores``).

``launch`` queues a step's work and returns without waiting for the GPU: the sampled ids stay on
the device (the next step may read its pending input ids from there) and are copied to pinned
host memory behind an event that ``LaunchedStep.result`` waits for.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from pagedlab.config import EngineConfig, model_max_len, resolve_dtype
from pagedlab.distributed.communication import tensor_parallel_broadcast, tensor_parallel_min
from pagedlab.engine import cuda_graph
from pagedlab.engine.cuda_graph import CudaGraphRunner, MixedGraphs, capture_all, capture_sizes
from pagedlab.engine.gpu_memory import (GIB, MemoryBaseline, cache_too_small, memory_added_outside_torch,
                                        requested_memory, take_memory_baseline)
from pagedlab.engine.request import Request
from pagedlab.engine.scheduler import ScheduledBatch
from pagedlab.engine.profiling import StepRanges
from pagedlab.engine.weight_update import WeightPairs, update_weights
from pagedlab.engine.prompt_scores import score_prompt_rows, top_to_host
from pagedlab.engine.step_outputs import LaunchedStep
from pagedlab.engine.step_inputs import (DeviceInputs, HostToDevice, StepInputs, build_sampling_metadata,
                                         prepare_step_inputs, stage_forward_inputs)
from pagedlab.layers.attention import (AttentionBackend, AttentionMetadata, BatchLayout, forward_context,
                                       get_attention_backend)
from pagedlab.layers.batch_invariant import batch_invariant_mode
from pagedlab.kernels.sampling import warm_up_sampling
from pagedlab.layers.sampler import Sampler, SamplingMetadata
from pagedlab.loader import ModelSource, load_model
from pagedlab.lora.manager import LoRAManager

logger = logging.getLogger(__name__)


@dataclass
class RunnerPlan:
    """What the engine's plan asks of the runner: the KV cache's shape and size, and graphs."""

    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int  # the largest step, for the GPU memory profile
    kv_cache_memory_bytes: int | None  # None: what gpu_memory_utilization leaves after a profile
    gpu_memory_utilization: float
    cascade_attention: bool  # decode batches attend a shared prefix once (if the backend can)
    cuda_graphs: bool  # decode steps replay CUDA graphs (if the backend supports them)
    kv_cache_dtype: torch.dtype  # the model's dtype, or torch.float8_e4m3fn (half the bytes of bf16)
    batch_invariant: bool = False  # every step runs in pagedlab.layers.batch_invariant's mode
    mixed_cuda_graphs: bool = False  # with cuda_graphs: steps with prefill tokens replay graphs too
    logprobs_mode: str = "raw_logprobs"  # what the sampler's logprobs hold (EngineConfig.logprobs_mode)
    extra_bytes_per_block: int = 0  # another cache on the same block ids (a draft model's) shares the memory
    extra_memory_bytes: int = 0  # what another model keeps beside both caches (a draft's graph pool)


def load_model_runner(config: EngineConfig, source: ModelSource, hf_config, device: torch.device,
                      memory_baseline: MemoryBaseline | None = None) -> ModelRunner:
    """This rank's shard of the model, loaded on ``device``, in a runner; ``memory_baseline`` is
    the GPU's memory as the engine started (taken now when not given: ``gpu_memory``)."""
    memory_baseline = memory_baseline or take_memory_baseline(device)
    dtype = resolve_dtype(config.dtype, hf_config, device)
    model = load_model(source, hf_config, dtype, device, model_max_len(hf_config), config.seed,
                       config.quantization)
    backend = get_attention_backend(config.attention_backend, device)
    runner = ModelRunner(model, hf_config, device, dtype, backend, config.seed)
    runner.memory_baseline = memory_baseline
    if config.enable_lora:
        runner.lora = LoRAManager(model, config.max_loras, config.max_lora_rank,
                                  config.max_cpu_loras or config.max_loras, dtype, device)
    fuse_into_consumers(model)  # after LoRA wraps its linears, which take unquantized inputs
    return runner


def fuse_into_consumers(model: torch.nn.Module) -> tuple[int, int]:
    """Let the Llama-family norms and activations emit their FP8 linears' quantized inputs
    (``LlamaForCausalLM.emit_fp8_inputs``), unless ``PAGEDLAB_FP8_FUSED_INPUTS=0``, then fold the
    other RMSNorms into their consumers' GEMVs (``fold_norms``), unless ``PAGEDLAB_FOLD_NORMS=0``;
    returns how many producers do each (0 for other model families)."""
    counts = []
    switches = {"emit_fp8_inputs": "PAGEDLAB_FP8_FUSED_INPUTS", "fold_norms": "PAGEDLAB_FOLD_NORMS"}
    for method, switch in switches.items():
        fuse = getattr(model, method, None)
        counts.append(0 if fuse is None or os.environ.get(switch, "1") == "0" else fuse())
    return tuple(counts)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, hf_config, device: torch.device, dtype: torch.dtype,
                 backend: AttentionBackend, seed: int = 0):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.backend = backend
        self.vocab_size = hf_config.vocab_size
        self.hidden_size = hf_config.hidden_size
        attn = model.attention_layers()[0]
        self.num_layers = len(model.attention_layers())
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.plan: RunnerPlan | None = None
        self.kv_cache: torch.Tensor | None = None
        self.extra_kv_storage: torch.Tensor | None = None  # RunnerPlan.extra_bytes_per_block's bytes
        self.cuda_graphs: CudaGraphRunner | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self._profiled_peaks: dict[tuple, tuple[int, int]] = {}
        self.sampler: Sampler | None = None  # the plan's (its logprobs_mode), set by configure
        # one seed per sampling step for the rows of requests without their own (step_inputs.row_seeds)
        self.step_seeds = np.random.Generator(np.random.PCG64(seed % (1 << 64)))
        self.to_device = HostToDevice(device)
        self.workers = None  # rank 0 of a tensor-parallel model: the other ranks' processes
        self.memory_baseline: MemoryBaseline | None = None  # on a GPU, set by load_model_runner
        self.lora: LoRAManager | None = None  # with enable_lora
        self.routes = None  # enable_return_routed_experts: the plan's RoutedExpertsCapture (routed_experts)
        self.ranges = StepRanges()  # the engine's, once it owns this runner
        # the last step's block table and each request's (row, block count, preemptions) in it
        self._block_table = np.zeros((0, 0), dtype=np.int32)
        self._block_table_rows: dict[Request, tuple[int, int, int]] = {}

    def configure(self, plan: RunnerPlan, kv_storage: torch.Tensor | None = None) -> int:
        """Take a new plan: size and allocate the KV cache (in ``kv_storage`` where given: bytes
        another runner allocated), capture the decode graphs. Returns the number of KV blocks; a
        cache too small for one ``max_model_len`` sequence is a ValueError."""
        if self.workers is not None:
            self.workers.send("configure", plan)
        try:
            return self._configure(plan, kv_storage)
        finally:
            if self.workers is not None:
                self.workers.collect()

    def _configure(self, plan: RunnerPlan, kv_storage: torch.Tensor | None) -> int:
        self.free_kv_cache()
        self.plan = plan
        self.sampler = Sampler(plan.logprobs_mode)
        if self.lora is not None:  # before the memory profile, whose forward runs without adapters
            self.lora.allocate_mapping(max(plan.max_num_batched_tokens, capture_sizes(plan.max_num_seqs)[-1]))
        with self.numerics():  # the memory profile and the graphs run what the steps will
            return self._allocate_and_capture(plan, kv_storage)

    def numerics(self):
        """The batch-invariant mode of the plan (``pagedlab.layers.batch_invariant``): the one
        switch, entered around everything the runner runs on the model."""
        return batch_invariant_mode(self.plan is not None and self.plan.batch_invariant)

    def _allocate_and_capture(self, plan: RunnerPlan, kv_storage: torch.Tensor | None) -> int:
        num_blocks = tensor_parallel_min(self._num_kv_blocks(plan), self.device)  # ranks agree
        min_blocks = -(-plan.max_model_len // plan.block_size)
        if num_blocks < min_blocks:
            raise ValueError(cache_too_small(plan, self.bytes_per_block + plan.extra_bytes_per_block,
                                             num_blocks, min_blocks))
        self.allocate_kv_cache(num_blocks, plan.extra_bytes_per_block, kv_storage)
        if self.uses_cuda_graphs or cuda_graph.PAD_WITHOUT_CAPTURE:
            self._build_graphs(plan, capture=self.uses_cuda_graphs)
        self._warm_up_lm_head_and_sampler(plan.max_num_seqs)
        return num_blocks

    @torch.inference_mode()
    def _warm_up_lm_head_and_sampler(self, max_rows: int) -> None:
        """The LM head at every row count from 1 to ``max_rows`` and every sampler kernel variant
        (``warm_up_sampling``), on zero hidden states, now rather than in the steps: the eager LM
        head's first use of a row count made the host wait for cuBLAS to choose and load that
        shape's kernel (on an H200, 0.2 s of a fresh engine's W-seed batch 256 TTFT p50)."""
        if self.device.type == "cuda":
            hidden = torch.zeros(max_rows, self.hidden_size, dtype=self.dtype, device=self.device)
            for rows in range(1, max_rows):
                self.model.compute_logits(hidden[:rows])
            warm_up_sampling(self.model.compute_logits(hidden))

    def _build_graphs(self, plan: RunnerPlan, capture: bool) -> None:
        """The decode graphs, and the mixed-step graphs where the plan asks for them; captured, or
        (``cuda_graph.PAD_WITHOUT_CAPTURE``) left to run their padded inputs eagerly."""
        self.cuda_graphs = CudaGraphRunner(self.model, self.backend, self.device, plan.max_num_seqs,
                                           plan.max_model_len, plan.block_size, plan.cascade_attention)
        if plan.mixed_cuda_graphs:
            self.mixed_graphs = MixedGraphs(self.model, self.backend, self.device, plan.max_num_seqs,
                                            plan.max_model_len, plan.block_size, plan.max_num_batched_tokens)
        if capture:
            if self.lora is not None:
                self.lora.prepare_capture()
            capture_all(self.cuda_graphs, self.mixed_graphs, self.device)

    @property
    def uses_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs: asked for, and the backend can be captured (the torch
        backend syncs with the host inside attention, so it always runs eagerly)."""
        return self.plan is not None and self.plan.cuda_graphs and self.backend.supports_cuda_graphs

    @property
    def uses_mixed_cuda_graphs(self) -> bool:
        """Steps with prefill tokens replay CUDA graphs too (``cuda_graph_mixed_steps``)."""
        return self.uses_cuda_graphs and self.plan.mixed_cuda_graphs

    @property
    def block_size(self) -> int:
        return self.plan.block_size

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size() if self.kv_cache is not None else 0

    def _num_kv_blocks(self, plan: RunnerPlan) -> int:
        per_block = self.bytes_per_block + plan.extra_bytes_per_block
        # Never more than every sequence slot at full length could use.
        ceiling = plan.max_num_seqs * -(-plan.max_model_len // plan.block_size) + 1
        if plan.kv_cache_memory_bytes is not None:
            return min(plan.kv_cache_memory_bytes // per_block, ceiling)
        blocks = self.profile_gpu_kv_blocks(plan.max_num_batched_tokens, plan.max_model_len,
                                            plan.gpu_memory_utilization, plan.extra_bytes_per_block,
                                            plan.extra_memory_bytes)
        return min(blocks, ceiling)

    def load_weights(self, pairs: WeightPairs) -> None:
        """Copy new checkpoint tensors into the weights in place (``weight_update``): this rank's
        part first (every name and shape checked before a value is written, so a bad tensor
        reaches no rank), then every other rank's, from the same full tensors."""
        update_weights(self.model, pairs)
        if self.workers is not None:
            self.workers.send("load_weights", [(name, tensor.detach().cpu()) for name, tensor in pairs])
            self.workers.collect()

    def close(self) -> None:
        """Free the KV cache, the graphs and the weights (and stop the other ranks' workers)."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None
        self.free_kv_cache()
        self.model = self.routes = None

    def _build_block_table(self, requests: list[Request]) -> np.ndarray:
        """``[num_seqs, max_blocks]`` block ids. A request's ids only grow until it is preempted
        (which gives it new ones, perhaps as many, and may come in a step that runs nothing), so a
        row whose request, block count and preemption count match the last step's is copied from
        it: refilling every row from Python lists cost ~0.7 ms per step at 256 sequences of 2k
        tokens."""
        counts = [len(r.block_ids) for r in requests]
        table = np.zeros((len(requests), max(counts)), dtype=np.int32)
        previous, previous_rows = self._block_table, self._block_table_rows
        kept_rows, kept_sources = [], []
        for row, (request, count) in enumerate(zip(requests, counts)):
            source = previous_rows.get(request)
            if source is not None and source[1:] == (count, request.num_preemptions):
                kept_rows.append(row)
                kept_sources.append(source[0])
            else:
                table[row, :count] = request.block_ids
        width = min(table.shape[1], previous.shape[1])
        table[kept_rows, :width] = previous[kept_sources, :width]
        self._block_table = table
        self._block_table_rows = {request: (row, count, request.num_preemptions)
                                  for row, (request, count) in enumerate(zip(requests, counts))}
        return table

    # ---- KV cache -------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        return self.kv_bytes_per_block(self.block_size, self.plan.kv_cache_dtype)

    def kv_bytes_per_block(self, block_size: int, kv_cache_dtype: torch.dtype) -> int:
        itemsize = torch.empty(0, dtype=kv_cache_dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize

    def allocate_kv_cache(self, num_blocks: int, extra_bytes_per_block: int = 0,
                          storage: torch.Tensor | None = None) -> None:
        """One tensor ``[2, layers, blocks, block_size, kv_heads, head_dim]`` (in ``storage``'s bytes
        where given); each layer gets views. ``extra_kv_storage``: ``extra_bytes_per_block`` more
        bytes a block, allocated with it, for a draft model's cache (before graphs take memory)."""
        self.free_kv_cache()
        own = num_blocks * self.bytes_per_block
        if storage is None:
            storage = torch.zeros(own + num_blocks * extra_bytes_per_block, dtype=torch.uint8,
                                  device=self.device)
        self.kv_cache = storage[:own].view(self.plan.kv_cache_dtype).view(
            2, self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.extra_kv_storage = storage[own:] if extra_bytes_per_block else None
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def free_kv_cache(self) -> None:
        for graphs in (self.cuda_graphs, self.mixed_graphs):
            if graphs is not None:
                graphs.close()
        self.cuda_graphs = self.mixed_graphs = None
        self._block_table_rows.clear()
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = torch.empty(0)
        self.kv_cache = self.extra_kv_storage = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def profile_gpu_kv_blocks(self, num_tokens: int, max_model_len: int, gpu_memory_utilization: float,
                              extra_bytes_per_block: int = 0, extra_memory_bytes: int = 0) -> int:
        """Blocks that fit in ``gpu_memory_utilization`` of the GPU's total (this engine's share, as
        in vLLM: ``gpu_memory``) beside the weights, the activations' peak of the largest step
        (``num_tokens`` tokens), what this process added outside torch since it started and, with
        mixed-step CUDA graphs, their pool: it keeps the largest bucket's forward activations for
        itself, apart from the memory the eager LM head and sampler allocate. Each block also
        holds ``extra_bytes_per_block`` of another cache (a draft model's, whose weights count in
        the peak), and ``extra_memory_bytes`` stay free for that model (its graph pool)."""
        requested = requested_memory(self.memory_baseline, gpu_memory_utilization)
        forward_activations, peak = self._profiled_peak(num_tokens, max_model_len)
        graph_pool = forward_activations if self.uses_mixed_cuda_graphs else 0
        outside_torch = memory_added_outside_torch(self.device, self.memory_baseline)
        available = requested - outside_torch - peak - graph_pool - extra_memory_bytes
        draft = f" + {extra_memory_bytes / GIB:.2f} GiB for a draft's graphs" if extra_memory_bytes else ""
        logger.info("KV cache: %.2f GiB available (weights + activation peak %.2f GiB for %d tokens + "
                    "mixed-step graph pool %.2f GiB + %.2f GiB outside torch%s)", available / GIB, peak / GIB,
                    num_tokens, graph_pool / GIB, outside_torch / GIB, draft)
        return int(available // (self.bytes_per_block + extra_bytes_per_block))

    def graph_pool_bytes(self, plan: RunnerPlan) -> int:
        """What this runner's mixed-step graphs would keep for themselves under ``plan`` (its
        forward's activations at the largest step, profiled; 0 without those graphs): a draft
        model's share of its target's memory profile. Call with the KV cache freed."""
        self.plan = plan
        if not self.uses_mixed_cuda_graphs:
            return 0
        with self.numerics():
            return self._profiled_peak(plan.max_num_batched_tokens, plan.max_model_len)[0]

    def _profiled_peak(self, num_tokens: int, max_model_len: int) -> tuple[int, int]:
        """``_profile_peak_memory`` of the largest step, measured once per step size and numerics
        (re-planning with the same ones reuses it)."""
        step = (num_tokens, min(num_tokens, max_model_len))
        key = (*step, self.plan.batch_invariant, self.plan.kv_cache_dtype)
        if key not in self._profiled_peaks:
            self._profiled_peaks[key] = self._profile_peak_memory(*step)
        return self._profiled_peaks[key]

    def reset_memory_profile(self) -> None:
        """Measure again at the next plan (another model's weights came or went since)."""
        self._profiled_peaks.clear()

    def _profile_peak_memory(self, num_tokens: int, seq_len: int) -> tuple[int, int]:
        """Bytes a forward over ``num_tokens`` tokens allocates at its peak (its activations), and
        bytes allocated at the peak of it and its logits (the weights included, the KV cache not)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_seqs = -(-num_tokens // seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        self.allocate_kv_cache(num_seqs * blocks_per_seq)
        block_tables = torch.arange(num_seqs * blocks_per_seq, device=self.device,
                                    dtype=torch.int32).view(num_seqs, blocks_per_seq)
        lens = [seq_len] * num_seqs
        positions = torch.arange(seq_len, device=self.device).repeat(num_seqs)
        slot_mapping = (block_tables[:, :, None] * self.block_size
                        + torch.arange(self.block_size, device=self.device, dtype=torch.int32)).flatten(1)
        slot_mapping = slot_mapping[:, :seq_len].flatten().long()
        layout = BatchLayout(lens, lens, block_tables.cpu().numpy(), self.block_size, self.plan.max_model_len,
                             allow_cascade=False)
        metadata = self._metadata(slot_mapping, layout, block_tables)
        kv_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        before_forward = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode(), forward_context(metadata, self.backend):
            hidden = self.model(torch.zeros_like(positions), positions)
            torch.cuda.synchronize(self.device)
            forward_activations = torch.cuda.max_memory_allocated(self.device) - before_forward
            self.model.compute_logits(hidden[-min(num_seqs * 256, len(hidden)):])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - kv_bytes
        self.free_kv_cache()
        return forward_activations, peak

    # ---- one step -------------------------------------------------------------------------
    def _metadata(self, slot_mapping: torch.Tensor, layout: BatchLayout, block_tables: torch.Tensor,
                  seq_order: torch.Tensor | None = None) -> AttentionMetadata:
        """The step's device-side description, planned by the backend."""
        starts = [0]
        for n in layout.query_lens:
            starts.append(starts[-1] + n)
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=self.to_device(starts, torch.int32),
            seq_lens=self.to_device(layout.seq_lens, torch.int32), block_tables=block_tables,
            max_query_len=max(layout.query_lens), max_seq_len=layout.max_seq_len, seq_order=seq_order)
        self.backend.plan(metadata, layout)
        return metadata

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Device data to the host; on CUDA an asynchronous copy into pinned memory, valid once the
        step's ``done`` event has passed."""
        if self.device.type != "cuda":
            return tensor.cpu()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)

    def launch(self, batch: ScheduledBatch, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step's forward pass and sampling (when a request's sampling needs its pending
        tokens, ``Request.samples_after_read_back``, it waits for ``finish_sampling`` and then this
        method's next call). A request whose input token is still pending takes it from
        ``previous``'s sampled ids on the device, without a round trip to the host."""
        try:
            return self._launch(batch, previous)
        except RuntimeError as e:
            if self.workers is None:
                raise
            raise self.workers.explain(e) from e

    @torch.inference_mode()
    def _launch(self, batch: ScheduledBatch, previous: LaunchedStep | None) -> LaunchedStep:
        with self.numerics():
            return self._launch_step(batch, previous)

    def _launch_step(self, batch: ScheduledBatch, previous: LaunchedStep | None) -> LaunchedStep:
        with self.ranges.range("prepare"):
            self.to_device.begin_step()
            inputs = prepare_step_inputs(batch, previous.sample_rows() if previous is not None else {},
                                         self.block_size)
            table = self._build_block_table(batch.requests)
            staged = stage_forward_inputs(inputs, table, self.to_device)
            if self.lora is not None:
                self.lora.prepare_step([r.lora_request for r in batch.requests], batch.num_new_tokens,
                                       self.to_device)
            if self.workers is not None:
                self.workers.send_step(inputs, table, batch.num_new_tokens)
        if previous is not None:
            previous.queue_sampler()  # its ids feed this step's inputs on the device
        with self.ranges.range("forward"), self.ranges.kind_range(batch):
            ids = self._input_ids(staged, previous)
            hidden = self._run_model(ids, staged, inputs, table, batch.num_new_tokens)
            rows = inputs.logit_rows
            if rows:
                logits = self.model.compute_logits(self._logit_hidden(hidden, staged, len(rows)))
        step = LaunchedStep(batch, inputs.sampled)
        if self.routes is not None:  # the forward's experts, to the host behind the step's event
            step.routes = self.routes.read_step(len(inputs.input_ids), inputs.slots, self._to_host)
        if rows:
            step.prompt_logprobs = score_prompt_rows(logits[len(inputs.sample_rows):], batch.requests,
                                                     inputs.prompt_chunks, self.to_device, self._to_host)
        step.unsampled = (inputs, logits if rows else None)
        if not any(r.samples_after_read_back for r in inputs.sampled):
            self.finish_sampling(step)
            step.queue_sampler()
        return step

    @torch.inference_mode()
    def finish_sampling(self, step: LaunchedStep) -> None:
        """Sample a launched step that ``launch`` left unsampled (a batch with grammar rows, whose
        bitmask needs the tokens of the step before, just read back; or a row a thinking budget may
        force, depending on them). Its sampling inputs are built and staged now, while the device
        runs its forward pass; the sampler itself is queued by the next ``launch``, after that
        step's host preparation, so the device does not wait for it (or by ``result()``,
        whichever comes first)."""
        if step.unsampled is None:
            return
        (inputs, logits), step.unsampled = step.unsampled, None
        with self.ranges.range("sample"), self.to_device.deferred():  # the sampler is queued later
            meta = build_sampling_metadata(
                inputs.sampled, self.to_device, self.vocab_size, inputs.sample_positions,
                int(self.step_seeds.integers(1 << 64, dtype=np.uint64)), inputs.sample_proposed
            ) if inputs.sampled else None
        if self.device.type == "cuda":
            staged = torch.cuda.Event()
            staged.record()
            self.to_device.end_step(staged)
        step.pending_sampler = functools.partial(self._queue_sampler, step, inputs, logits, meta)

    @torch.inference_mode()
    def _queue_sampler(self, step: LaunchedStep, inputs: StepInputs, logits: torch.Tensor | None,
                       meta: SamplingMetadata | None) -> None:
        """Queue the sampling of the step's sampled rows; the token ids go to the host
        asynchronously, and ``step.done`` marks the end of it all."""
        with self.numerics(), self.ranges.range("sample"):
            if inputs.sampled:
                out = self.sampler(logits[:len(inputs.sample_rows)], meta)
                step.sampled_token_ids = out.token_ids
                step.host_token_ids = self._to_host(out.token_ids)
                step.logprobs = top_to_host(out.logprobs, self._to_host) if out.logprobs is not None else None
            if self.device.type == "cuda":
                step.done = torch.cuda.Event()
                step.done.record()

    @torch.inference_mode()
    def forward_greedy(self, inputs: StepInputs, requests: list[Request], query_lens: list[int],
                       input_ids: torch.Tensor | None = None, logits: bool = True) -> torch.Tensor | None:
        """The argmax token at each of ``inputs.sample_rows`` (None with ``logits=False``: only the
        KV cache is written) of a forward over ``inputs``; ``input_ids`` (on the device) replace
        ``inputs.input_ids``. A draft model's pass: no sampler, nothing read back, no wait."""
        with self.numerics():
            self.to_device.begin_step()
            table = self._build_block_table(requests)
            staged = stage_forward_inputs(inputs, table, self.to_device)
            hidden = self._run_model(staged.input_ids if input_ids is None else input_ids, staged, inputs,
                                     table, query_lens)
            rows = len(inputs.sample_rows)
            tokens = None
            if logits and rows:
                tokens = self.model.compute_logits(self._logit_hidden(hidden, staged, rows)).argmax(-1)
            if self.device.type == "cuda":
                done = torch.cuda.Event()
                done.record()
                self.to_device.end_step(done)
            return tokens

    @staticmethod
    def _input_ids(staged: DeviceInputs, previous: LaunchedStep | None) -> torch.Tensor:
        """The step's input ids on the device; those the previous step sampled are taken from its
        device tensor. Every rank of a tensor-parallel model gets rank 0's (a broadcast)."""
        if staged.input_ids is None:
            return tensor_parallel_broadcast(previous.sampled_token_ids[:staged.num_tokens])
        ids = staged.input_ids
        if staged.pending_rows is not None:
            ids[staged.pending_rows] = previous.sampled_token_ids[staged.pending_sources]
        return tensor_parallel_broadcast(ids)

    @staticmethod
    def _logit_hidden(hidden: torch.Tensor, staged: DeviceInputs, num_rows: int) -> torch.Tensor:
        """The hidden states the LM head runs on (a slice where they are the first rows in order)."""
        return hidden[:num_rows] if staged.logit_rows is None else hidden[staged.logit_rows]

    def _run_model(self, ids: torch.Tensor, staged: DeviceInputs, inputs: StepInputs, table: np.ndarray,
                   query_lens: list[int]) -> torch.Tensor:
        """The model over the step's tokens: a decode batch replays a decode CUDA graph where one
        fits, any other step a mixed-step graph where one fits (``cuda_graph_mixed_steps``)."""
        positions, slot_mapping, block_tables = staged.positions, staged.slot_mapping, staged.block_tables
        layout = BatchLayout(query_lens, inputs.seq_lens, table, self.block_size,
                             self.plan.max_model_len, self.plan.cascade_attention)
        graphs, mixed = self.cuda_graphs, self.mixed_graphs
        if inputs.decode_only and graphs is not None and graphs.can_run(len(inputs.input_ids)):
            return graphs.run(ids, positions, slot_mapping, staged.seq_lens, block_tables, layout,
                              staged.seq_order)
        if mixed is not None and mixed.can_run(len(inputs.input_ids), len(query_lens)):
            return mixed.run(ids, positions, slot_mapping, block_tables, query_lens, inputs.seq_lens,
                             self.to_device)
        metadata = self._metadata(slot_mapping, layout, block_tables, staged.seq_order)
        with forward_context(metadata, self.backend):
            return self.model(ids, positions)

    @torch.inference_mode()
    def run_worker_step(self, inputs: StepInputs, table: np.ndarray, query_lens: list[int]) -> None:
        """Rank r > 0 of a tensor-parallel model: the forward rank 0 runs (on this rank's shard),
        with the input ids rank 0 broadcasts, and the LM head's part of the logits gather."""
        self.to_device.begin_step()
        staged = stage_forward_inputs(inputs, table, self.to_device)
        ids = torch.empty(len(inputs.input_ids), dtype=torch.int64, device=self.device)
        tensor_parallel_broadcast(ids)
        with self.numerics():
            hidden = self._run_model(ids, staged, inputs, table, query_lens)
            if inputs.logit_rows:
                self.model.compute_logits(self._logit_hidden(hidden, staged, len(inputs.logit_rows)))
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            self.to_device.end_step(done)
