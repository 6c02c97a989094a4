"""``LLM``: the offline entry point, with vLLM's names, so a vLLM script ports by changing the import."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from pagedlab.config import PLAN_FIELDS, WEIGHT_FIELDS, EngineConfig, EngineInfo
from pagedlab.engine.engine import LLMEngine
from pagedlab.engine.profiling import EngineProfiler, ProfileSummary
from pagedlab.inputs import (EncodedPrompt, PromptType, TokenizeOptions, as_conversation_list, as_prompt_list,
                             chat_prompt, encode_prompt, tokenize_options)
from pagedlab.lora.request import LoRARequest
from pagedlab.outputs import BeamSearchOutput, BeamSearchSequence, EngineStats, RequestOutput
from pagedlab.sampling_params import (BeamSearchParams, RequestOutputKind, SamplingParams,
                                      check_sampling_params)

if TYPE_CHECKING:
    import torch


class LLM:
    """Load a model once and generate over many prompts with continuous batching.

    ``model`` is a local HF directory (config.json, *.safetensors, tokenizer files), a .gguf file,
    a hub model id (``"HuggingFaceTB/SmolLM2-135M-Instruct"``: the HF cache, else downloaded;
    ``revision``, ``download_dir``, ``HF_TOKEN`` and ``HF_HUB_OFFLINE`` honoured) or the embedded
    ``"smollm2-135m-instruct"``. Every other keyword is an engine setting of
    ``pagedlab.config.EngineConfig``, with vLLM's names and defaults (``dtype``, ``seed``,
    ``max_model_len``, ``block_size``, ``gpu_memory_utilization``, ``kv_cache_memory_bytes``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``,
    ``enable_chunked_prefill``, ``enforce_eager``, ``async_scheduling``,
    ``enable_cascade_attention``, ``load_format``, ``device``, ``attention_backend``, ``tokenizer``,
    ``tokenizer_mode``, ``served_model_name``, ``disable_log_stats``, ``swap_space`` (unused),
    ``cpu_offload_gb`` (0 only), ...); a misspelled one is a ValueError that names the closest.
    On the CPU the KV cache takes ``kv_cache_memory_bytes`` (default 1 GiB); on a GPU,
    ``gpu_memory_utilization`` of it after a profiling pass. Cascade attention (a decode batch
    reads its shared cached prefix once) sums a row's keys in another order than alone: turn it
    off for bitwise batch invariance.
    ``enable_lora=True`` (with ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``) serves PEFT LoRA
    adapters named per prompt by ``lora_request`` (see docs/lora.md).
    Use it as a context manager to free every byte it took on exit.
    """

    def __init__(self, model: str, **engine_args):
        config = EngineConfig.from_kwargs(model=model, **engine_args)
        self._engine: LLMEngine | None = LLMEngine(config)
        self._profiler: EngineProfiler | None = None
        self._request_counter = itertools.count()
        # final outputs of unfinished generate calls, by request id, that another call's loop
        # stepped to completion (a generate inside a generate_as_completed loop)
        self._open_ids: set[str] = set()
        self._finished: dict[str, RequestOutput] = {}

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine core (vLLM's name); a closed LLM says so instead of failing deep inside."""
        if self._engine is None:
            raise ValueError("this LLM was closed: build a new LLM to generate again")
        return self._engine

    # ---- generation -----------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None,
                 tokenization_kwargs: dict | None = None) -> list[RequestOutput]:
        """Complete each prompt; returns one RequestOutput per prompt, in input order.

        A prompt is a string, a list of token ids, or a dict with "prompt" or "prompt_token_ids".
        Without ``sampling_params``: ``get_default_sampling_params()`` (the model's recommendation).
        ``lora_request`` (with ``enable_lora=True``): one LoRA adapter for every prompt, or a list
        of one per prompt (None: the base model); one batch serves them all. ``priority`` (with
        ``scheduling_policy="priority"``): one integer per prompt, lower admitted first and
        preempted last. ``tokenization_kwargs`` (vLLM's): ``{"truncate_prompt_tokens": k}`` keeps
        each prompt's last k tokens (-1: as many as fit), ``{"truncation": True, "max_length": k}``
        the same, ``max_length`` alone refuses longer prompts, ``add_special_tokens``, ``do_lower_case``
        (see ``pagedlab.inputs.tokenize_options``).
        """
        prepared = self._prepare(prompts, sampling_params, lora_request, priority, tokenization_kwargs)
        return self._run(*prepared, use_tqdm)

    def generate_as_completed(self, prompts: PromptType | Sequence[PromptType],
                              sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                              use_tqdm: bool = True,
                              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                              priority: Sequence[int] | None = None,
                              tokenization_kwargs: dict | None = None) -> Iterator[tuple[int, RequestOutput]]:
        """As ``generate`` (one batch, the same outputs), but yields ``(index, output)`` for each
        prompt as soon as it finishes, so a long run can save what is done as it goes; leaving
        the loop early aborts the prompts not finished. The loop's body may call ``generate`` or
        ``chat`` itself (a judge on each output): the outer prompts it finishes wait for this loop."""
        return self._as_completed(*self._prepare(prompts, sampling_params, lora_request, priority,
                                                 tokenization_kwargs), use_tqdm)

    def _prepare(self, prompts, sampling_params, lora_request, priority,
                 tokenization_kwargs=None) -> tuple[list, list, list, list]:
        """The encoded prompts (truncated as ``tokenization_kwargs`` and their SamplingParams ask),
        their SamplingParams, LoRA requests and priorities, each checked."""
        prompt_list = as_prompt_list(prompts)
        params = _params_per_prompt(sampling_params if sampling_params is not None
                                    else self.get_default_sampling_params(), len(prompt_list))
        loras = _loras_per_prompt(lora_request, len(prompt_list))
        if priority is not None and (isinstance(priority, str) or not isinstance(priority, Sequence)):
            raise ValueError(f"priority={priority!r} is invalid: give a list of one integer per prompt")
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts: give one per "
                             "prompt")
        for p in priorities:
            self.llm_engine.validate_priority(p)
        engine = self.llm_engine
        options = tokenize_options(tokenization_kwargs, engine.max_model_len)
        encoded = [self._encode(p, options) for p in prompt_list]
        for prompt, p in zip(encoded, params):
            prompt.token_ids = options.apply(prompt.token_ids, p, engine.max_model_len)
            engine.validate_prompt(prompt.token_ids)
        for lora in dict.fromkeys(loras):
            self.llm_engine.validate_lora_request(lora)
        return encoded, params, loras, priorities

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             tools: list[dict] | None = None, tokenization_kwargs: dict | None = None,
             chat_template_content_format: str = "auto") -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template (the
        tokenizer's, or ``chat_template``), with vLLM's arguments: ``continue_final_message``
        continues the last (assistant) message instead of starting a new turn (set
        ``add_generation_prompt=False`` with it); ``chat_template_kwargs`` are extra template
        variables (e.g. ``{"enable_thinking": False}``), which win over the arguments of the same
        name, as in vLLM; ``lora_request`` as in ``generate``; ``tools`` (OpenAI tool objects) go
        to the template's ``tools``, as vLLM's ``LLM.chat`` passes them (the reply is text: parse
        any tool calls in it yourself, or use the server's tool calling). A message's ``content`` is
        a string or OpenAI's list of text parts, joined by newlines as vLLM joins them.
        ``tokenization_kwargs`` as in ``generate``, on the rendered conversation (which gets no
        special tokens unless they set ``add_special_tokens``, as in vLLM).
        ``chat_template_content_format`` (vLLM's): "string" (content as one string), "openai"
        (content as a list of text parts, for templates that iterate over them) or "auto", which
        is "string" here (vLLM reads the template to choose)."""
        conversations = as_conversation_list(messages)
        engine = self.llm_engine
        prompts = [chat_prompt(engine.tokenizer, c, chat_template, add_generation_prompt, engine.config.model,
                               continue_final_message, chat_template_kwargs, tools,
                               content_format=chat_template_content_format) for c in conversations]
        special = tokenization_kwargs.get("add_special_tokens") if isinstance(tokenization_kwargs, Mapping) \
            else None
        if special is not None:  # the rendered template gets no special tokens unless asked
            for prompt in prompts:
                prompt["add_special_tokens"] = bool(special)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request,
                             tokenization_kwargs=tokenization_kwargs)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                    ) -> list[BeamSearchOutput]:
        """Beam search: each step expands every live beam by its top ``2 * beam_width`` tokens
        (one engine pass, prefix caching reusing the beams' shared KV) and keeps the best
        ``beam_width``; a beam that ends in EOS among the best is set aside as finished, and one
        that fills ``max_model_len`` ends there (finish_reason "length", as at ``max_tokens``).
        ``lora_request`` as in ``generate``: every beam of a prompt runs with the prompt's adapter.
        Beams are scored by the engine's logprobs: see ``_check_beam_logprobs``.
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params={params!r:.200} is invalid: beam_search takes a BeamSearchParams "
                             "(beam_width, max_tokens, ...)")
        _check_beam_logprobs(self.llm_engine.config.logprobs_mode)
        encoded = [self._encode(p).token_ids for p in as_prompt_list(prompts)]
        for ids in encoded:
            self.llm_engine.validate_prompt(ids)
        loras = _loras_per_prompt(lora_request, len(encoded))
        for lora in dict.fromkeys(loras):
            self.llm_engine.validate_lora_request(lora)
        eos = set(self.llm_engine.eos_token_ids) | set(params.stop_token_ids)
        step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * params.beam_width,
                                     detokenize=False, ignore_eos=True)
        width = params.beam_width
        live = [[BeamSearchSequence(tokens=list(ids))] for ids in encoded]
        done: list[list[BeamSearchSequence]] = [[] for _ in encoded]
        for _ in range(params.max_tokens):
            # a beam that fills the context (max_model_len) has no room for another token: it stays
            # live, unexpanded, and ends with finish_reason "length"
            flat = [(i, beam) for i, beams in enumerate(live) for beam in beams
                    if len(beam.tokens) < self.llm_engine.max_model_len]
            if not flat:
                break
            beams = [EncodedPrompt(beam.tokens) for _, beam in flat]
            outputs = self._run(beams, [step_params] * len(flat), [loras[i] for i, _ in flat], None, use_tqdm)
            candidates: list[list[BeamSearchSequence]] = [[] for _ in encoded]
            for (i, beam), out in zip(flat, outputs):
                for token, lp in out.outputs[0].logprobs[0].items():
                    candidates[i].append(BeamSearchSequence(
                        tokens=beam.tokens + [token], logprobs=beam.logprobs + [lp.logprob],
                        cum_logprob=beam.cum_logprob + lp.logprob))
            for i, cands in enumerate(candidates):
                if cands:
                    live[i] = _next_beams(cands, done[i], params, eos, len(encoded[i]))
        results = []
        for i, ids in enumerate(encoded):
            for beam in live[i]:
                beam.finish_reason = "length"
            beams = done[i] + live[i]
            for beam in beams:
                beam.score = _score(beam, params, len(ids))
                if self.llm_engine.tokenizer is not None:
                    beam.text = self.llm_engine.tokenizer.decode(beam.tokens, skip_special_tokens=True)
            beams.sort(key=lambda b: b.score, reverse=True)
            results.append(BeamSearchOutput(beams[:width]))
        return results

    # ---- helpers --------------------------------------------------------------------------
    def _encode(self, prompt: PromptType, options: TokenizeOptions | None = None) -> EncodedPrompt:
        return encode_prompt(prompt, self.llm_engine.tokenizer, self.llm_engine.config.model, options)

    def _run(self, encoded: list[EncodedPrompt], params: list[SamplingParams],
             loras: list[LoRARequest | None] | None, priorities: list[int] | None,
             use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(encoded)
        with contextlib.closing(self._as_completed(encoded, params, loras, priorities, use_tqdm)) as finished:
            for i, out in finished:
                results[i] = out
        return results

    def _as_completed(self, encoded: list[EncodedPrompt], params: list[SamplingParams],
                      loras: list[LoRARequest | None] | None, priorities: list[int] | None,
                      use_tqdm: bool) -> Iterator[tuple[int, RequestOutput]]:
        """Add every prompt, step the engine and yield (index, final output) as each finishes. Another
        call may step the engine while this one waits (a generate inside a generate_as_completed
        loop): the outputs it finishes for this call wait in ``_finished`` until this call takes them."""
        engine = self.llm_engine
        ids = [str(next(self._request_counter)) for _ in encoded]
        order = {rid: i for i, rid in enumerate(ids)}
        stats_log = None if engine.config.disable_log_stats else StatsLog(self.get_stats)
        progress = _progress(len(ids), use_tqdm)
        self._open_ids.update(ids)
        try:
            for rid, prompt, p, lora, priority in zip(ids, encoded, params, loras or [None] * len(ids),
                                                      priorities or [0] * len(ids)):
                if p.output_kind == RequestOutputKind.DELTA:  # as vLLM: offline returns whole final outputs
                    p = p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                engine.add_request(rid, prompt.token_ids, p, prompt=prompt.text, lora_request=lora,
                                   priority=priority)
            pending = set(ids)
            while pending:
                ready = [rid for rid in self._finished if rid in pending]
                if not ready and not engine.has_unfinished_requests():
                    break  # aborted through llm_engine: nothing more comes
                if stats_log is not None:
                    stats_log.maybe_log()
                if not ready:
                    self._step_open_calls()
                for rid in ready:
                    pending.discard(rid)
                    if progress is not None:
                        progress.update(1)
                    yield order[rid], self._finished.pop(rid)
        finally:
            if progress is not None:
                progress.close()
            if stats_log is not None:
                stats_log.log()
            for rid in ids:  # an interrupted run leaves nothing behind in the engine
                self._open_ids.discard(rid)
                self._finished.pop(rid, None)
                engine.abort_request(rid)

    def _step_open_calls(self) -> None:
        """One engine step; the final outputs of the open generate calls' requests go to ``_finished``."""
        for out in self.llm_engine.step(stream=False):
            if out.finished and out.request_id in self._open_ids:
                self._finished[out.request_id] = out

    def benchmark(self, batch_size: int | Sequence[int] = (4, 8, 16), input_len: int = 512,
                  output_len: int = 128, num_prompts: int | None = None, use_beam_search: bool = False,
                  warmup: int = 1, repeats: int = 1, **kwargs):
        """Throughput, latency percentiles, memory and GPU telemetry on random prompts, with the
        provenance manifest; see ``pagedlab.lab.bench.run_benchmark`` for the keyword arguments
        (``lora_requests=[...]`` spreads LoRA adapters round-robin over each run's prompts) and
        ``pagedlab.lab.bench.BenchmarkResult``."""
        from pagedlab.lab.bench import run_benchmark

        return run_benchmark(self, batch_size=batch_size, input_len=input_len, output_len=output_len,
                             num_prompts=num_prompts, use_beam_search=use_beam_search, warmup=warmup,
                             repeats=repeats, **kwargs)

    def set_model_args(self, **kwargs) -> None:
        """Change plan-level settings (``pagedlab.config.PLAN_FIELDS``: block_size, max_num_seqs,
        max_num_batched_tokens, enable_prefix_caching, ...) for the next call, keeping the loaded
        weights; a weight-level or unknown name is a ValueError."""
        for key in kwargs:
            if key in WEIGHT_FIELDS:
                raise ValueError(f"{key!r} changes the weights, which set_model_args keeps: build a new LLM "
                                 f"for a different {key}")
            if key not in PLAN_FIELDS:
                raise ValueError(f"unknown model arg {key!r}; set_model_args accepts {list(PLAN_FIELDS)}")
        self.llm_engine.update_plan(**kwargs)

    def start_profile(self, output_dir: str | None = None) -> None:
        """Start recording the engine's steps with the torch profiler (vLLM's name). The trace goes
        to ``output_dir`` (default: ``$PAGEDLAB_TORCH_PROFILER_DIR``, else vLLM's
        ``$VLLM_TORCH_PROFILER_DIR``, else ./pagedlab-profile)."""
        if self._profiler is not None:
            raise RuntimeError("a profile is already running: call stop_profile() first")
        directory = (output_dir or os.environ.get("PAGEDLAB_TORCH_PROFILER_DIR")
                     or os.environ.get("VLLM_TORCH_PROFILER_DIR", "pagedlab-profile"))
        self._profiler = EngineProfiler(self.llm_engine.ranges, directory)
        self._profiler.start()

    def stop_profile(self) -> ProfileSummary:
        """Stop the profile; returns its ``ProfileSummary`` (the trace file, kernels by kind, each
        step kind's wall and device time and host-gap share) and writes the trace."""
        if self._profiler is None:
            raise RuntimeError("no profile is running: call start_profile() first")
        profiler, self._profiler = self._profiler, None
        return profiler.stop()

    def get_stats(self) -> EngineStats:
        """Memory and counters: KV blocks (used, peak), prefix-cache hits, tokens computed."""
        return self.llm_engine.get_stats()

    def reset_stats(self) -> None:
        """Zero the counters ``get_stats`` reports (KV block peak, tokens run, preemptions, prefix
        cache hits); the prefix cache keeps its contents. Benchmarks call it before each run."""
        self.llm_engine.reset_stats()

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams of ``generate``/``chat`` without any: SamplingParams' defaults with the
        fields the model's generation_config.json recommends (``generation_config``), as vLLM."""
        return SamplingParams(**self.llm_engine.default_sampling_args)

    def get_engine_info(self) -> EngineInfo:
        """The resolved settings (dtype, device, max_model_len, attention backend, ...) and the
        model's identity (path, load format, HF config, tokenizer)."""
        return self.llm_engine.info

    def get_tokenizer(self):
        """The model's Hugging Face tokenizer (the one ``generate`` encodes prompts with)."""
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (later prompts are computed in full; blocks in use stay valid
        but are no longer shared) and zero the prefix-cache statistics. Returns True, as vLLM's."""
        self.llm_engine.reset_prefix_cache()
        return True

    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Update the model's weights in place, without rebuilding the engine (an RL loop's rollout
        engine taking the trainer's policy; vLLM's ``model.load_weights(state_dict.items())``).

        ``weights``: a state dict (``hf_model.state_dict()``, or part of one) or (name, tensor)
        pairs, under the checkpoint's (transformers') names, on any device and in any floating
        dtype (cast to the engine's, as a checkpoint is at load). Each tensor ends as a fresh load
        of it would leave it (fused q/k/v and gate/up parts, FP8 re-quantized); the tensors not
        given keep their values. Every name and shape is checked before anything is written: an
        unknown name or a wrong shape is a ValueError naming the tensor, and the model is
        unchanged. The prefix cache is reset (vLLM leaves that to the caller). Refused while a
        request is unfinished (``generate_as_completed`` mid-iteration), for AWQ and prequantized
        FP8 checkpoints; LoRA adapters are kept; every tensor-parallel rank loads its part."""
        self.llm_engine.load_weights(weights)

    def sleep(self, level: int = 1) -> None:
        """Give the engine's GPU memory back while it idles (vLLM's sleep mode, for a trainer that
        needs the GPU between rollouts): the KV cache and CUDA graphs are freed, and the weights'
        device memory with them. ``level=1`` keeps the weights in host memory for ``wake_up()``;
        ``level=2`` drops them (the caller then loads new ones, ``load_weights``). The prefix cache
        is reset. Requests are refused until ``wake_up()``; refused itself while a request is
        unfinished. No ``enable_sleep_mode`` is needed (it is accepted, as vLLM's)."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo ``sleep()``: ``tags`` ``["weights"]`` (then ``load_weights`` into them without a KV
        cache allocated, as verl does), ``["kv_cache"]`` (the weights must be awake: the KV cache is
        planned and the CUDA graphs captured again, a few seconds on a GPU), or None for both.
        After ``sleep(level=2)`` requests are refused until ``load_weights`` has run."""
        self.llm_engine.wake_up(tags)

    def close(self) -> None:
        """Free the weights, the KV cache and every request."""
        if self._engine is not None:
            device = self._engine.device
            self._engine.close()
            self._engine = None
            gc.collect()
            if device.type == "cuda":
                import torch

                torch.cuda.empty_cache()

    # vLLM's pooling and scoring calls: pagedlab serves generation only.
    def encode(self, *args, **kwargs):
        """Not served: pagedlab runs generative models (vLLM's ``encode`` pools hidden states)."""
        raise _not_served("encode")

    def embed(self, *args, **kwargs):
        """Not served: pagedlab runs generative models, not embedding models."""
        raise _not_served("embed")

    def classify(self, *args, **kwargs):
        """Not served: pagedlab runs generative models, not classifiers."""
        raise _not_served("classify")

    def score(self, *args, **kwargs):
        """Not served: pagedlab runs generative models, not cross-encoders or scorers."""
        raise _not_served("score")

    def reward(self, *args, **kwargs):
        """Not served: pagedlab runs generative models, not reward models."""
        raise _not_served("reward")

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _not_served(method: str) -> NotImplementedError:
    return NotImplementedError(
        f"LLM.{method}() is not supported: pagedlab serves text generation only (generate, chat, "
        "beam_search); pooling, embedding, classification, scoring and reward models are not served. For "
        "log-probabilities of a text use generate() with SamplingParams(prompt_logprobs=...) or logprobs=N")


def _next_beams(candidates: list[BeamSearchSequence], done: list[BeamSearchSequence],
                params: BeamSearchParams, eos: set[int], prompt_len: int) -> list[BeamSearchSequence]:
    """One prompt's beams after a step, from its candidates: the best ``beam_width`` that do not
    end in EOS; those that do and rank among the best ``beam_width`` join ``done``. None once
    ``beam_width`` are done and the best live beam scores no better than the worst of them."""
    width = params.beam_width
    candidates.sort(key=lambda b: b.cum_logprob, reverse=True)
    live = []
    for rank, cand in enumerate(candidates[:2 * width]):
        if not params.ignore_eos and cand.tokens[-1] in eos:
            if rank < width:
                cand.finish_reason = "stop"
                done.append(cand)
        elif len(live) < width:
            live.append(cand)
    if live and len(done) >= width and _score(live[0], params, prompt_len) <= min(
            _score(b, params, prompt_len) for b in done):
        return []
    return live


def _check_beam_logprobs(mode: str) -> None:
    """Beam search adds up the logprobs of its greedy steps, where the raw and processed ones
    agree; an engine whose ``logprobs_mode`` returns logits is refused (vLLM would add the logits
    up as if they were logprobs)."""
    if mode.endswith("_logits"):
        raise ValueError(f"logprobs_mode={mode!r} is invalid for beam_search: beams are scored by summed "
                         "log-probabilities, and this engine returns logits; start it with "
                         "logprobs_mode='raw_logprobs' or 'processed_logprobs'")


def _score(beam: BeamSearchSequence, params: BeamSearchParams, prompt_len: int) -> float:
    return beam.cum_logprob / max(1, len(beam.tokens) - prompt_len) ** params.length_penalty


def _params_per_prompt(sampling_params, count: int) -> list[SamplingParams]:
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if not isinstance(sampling_params, (list, tuple)):
        check_sampling_params(sampling_params, "sampling_params")
    params = list(sampling_params)
    for i, p in enumerate(params):
        check_sampling_params(p, f"sampling_params[{i}]")
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts: give one, or one per prompt")
    return params


def _loras_per_prompt(lora_request, count: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"got {len(loras)} LoRA requests for {count} prompts: give one, or one per prompt")
    return loras


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)


class StatsLog:
    """vLLM's periodic stats line (``disable_log_stats=False``): prompt and generation throughput
    since the last line, running and waiting requests, KV cache usage and prefix-cache hit rate (and
    with speculative decoding its acceptance since the last line), logged at INFO on
    ``pagedlab.stats`` (to stderr when logging is not configured)."""

    logger = logging.getLogger("pagedlab.stats")

    def __init__(self, get_stats, interval_s: float = 5.0):
        self.get_stats, self.interval_s = get_stats, interval_s
        if not self.logger.hasHandlers():
            self.logger.addHandler(logging.StreamHandler())
            self.logger.setLevel(logging.INFO)
        self._last = (time.perf_counter(), get_stats())

    def maybe_log(self) -> None:
        if time.perf_counter() - self._last[0] >= self.interval_s:
            self.log()

    def log(self) -> None:
        now, stats = time.perf_counter(), self.get_stats()
        then, last = self._last
        reset = stats.generation_tokens < last.generation_tokens  # the engine reset its counters
        # the counters' growth since the last line (all of them after a reset)
        since = dataclasses.replace(stats, **{f: getattr(stats, f) - (0 if reset else getattr(last, f))
                                              for f in _COUNTERS})
        elapsed = max(now - then, 1e-9)
        speculation = ""
        if since.spec_decode_num_drafts:  # vLLM's SpecDecoding line: since the line before
            speculation = (f", speculative acceptance rate {100 * since.spec_decode_acceptance_rate:.1f}%, "
                           f"mean acceptance length {since.spec_decode_mean_acceptance_length:.2f}")
        self.logger.info(
            "prompt throughput %.1f tok/s, generation throughput %.1f tok/s, running %d, waiting %d, "
            "KV cache usage %.1f%%, prefix cache hit rate %.1f%%%s",
            since.prompt_tokens_computed / elapsed, since.generation_tokens / elapsed, stats.num_running,
            stats.num_waiting, 100 * stats.kv_cache_usage, 100 * stats.prefix_cache_hit_rate, speculation)
        self._last = (now, stats)


_COUNTERS = ("prompt_tokens_computed", "generation_tokens", "spec_decode_num_drafts",
             "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
