"""``LLM``: the offline entry point, with vLLM's names, so a vLLM script ports by changing the import."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pagedlab.config import PLAN_FIELDS, EngineConfig
from pagedlab.engine.engine import EngineStats, LLMEngine
from pagedlab.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from pagedlab.sampling_params import BeamSearchParams, SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """Load a model once and generate over many prompts with continuous batching.

    ``model`` is a local HF directory (config.json, *.safetensors, tokenizer files), a .gguf file,
    or the embedded ``"smollm2-135m-instruct"``. On the CPU the KV cache takes
    ``kv_cache_memory_bytes`` (default 1 GiB); on a GPU, ``gpu_memory_utilization`` of it after a
    profiling pass. ``attention_backend`` is "auto" (Triton on CUDA, torch on CPU), "torch" or "triton".
    ``async_scheduling`` (default: on CUDA) prepares each step while the GPU runs the one before.
    ``enable_cascade_attention`` lets a decode batch whose sequences share a long cached prefix
    read that prefix once for all of them (Triton backend, in the decode CUDA graphs too; a row's
    keys are then summed in another order than alone: turn it off for bitwise batch invariance).
    Use it as a context manager to free every byte it took on exit.
    """

    def __init__(self, model: str, tokenizer: str | None = None, dtype: str = "auto", seed: int = 0,
                 max_model_len: int | None = None, block_size: int = 16, gpu_memory_utilization: float = 0.9,
                 kv_cache_memory_bytes: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, enforce_eager: bool = False,
                 async_scheduling: bool | None = None, enable_cascade_attention: bool = True,
                 load_format: str = "auto",
                 trust_remote_code: bool = False, device: str = "auto", tensor_parallel_size: int = 1,
                 quantization: str | None = None, attention_backend: str = "auto"):
        config = EngineConfig(
            model=model, tokenizer=tokenizer, dtype=dtype, seed=seed, max_model_len=max_model_len,
            block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill, enforce_eager=enforce_eager,
            async_scheduling=async_scheduling, enable_cascade_attention=enable_cascade_attention,
            load_format=load_format, trust_remote_code=trust_remote_code, device=device,
            tensor_parallel_size=tensor_parallel_size, quantization=quantization)
        self._engine: LLMEngine | None = LLMEngine(config, attention_backend=attention_backend)
        self._request_counter = itertools.count()

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine core (vLLM's name); a closed LLM says so instead of failing deep inside."""
        if self._engine is None:
            raise ValueError("this LLM was closed: build a new LLM to generate again")
        return self._engine

    # ---- generation -----------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete each prompt; returns one RequestOutput per prompt, in input order.

        A prompt is a string, a list of token ids, or a dict with "prompt" or "prompt_token_ids".
        """
        prompt_list = _as_prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompt_list))
        encoded = [self._encode(p) for p in prompt_list]
        for token_ids, _ in encoded:
            self.llm_engine.validate_prompt(token_ids)
        return self._run(encoded, params, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        tokenizer = self._require_tokenizer("chat()")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": text, "add_special_tokens": False})
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search: each step expands every live beam by its top ``2 * beam_width`` tokens
        (one engine pass, prefix caching reusing the beams' shared KV) and keeps the best
        ``beam_width``; a beam that ends in EOS among the best is set aside as finished.
        """
        encoded = [self._encode(p) for p in _as_prompt_list(prompts)]
        eos = set(self.llm_engine.eos_token_ids) | set(params.stop_token_ids)
        step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * params.beam_width,
                                     detokenize=False, ignore_eos=True)
        width = params.beam_width
        live = [[BeamSearchSequence(tokens=list(ids))] for ids, _ in encoded]
        done: list[list[BeamSearchSequence]] = [[] for _ in encoded]
        for _ in range(params.max_tokens):
            flat = [(i, beam) for i, beams in enumerate(live) for beam in beams]
            if not flat:
                break
            outputs = self._run([(beam.tokens, None) for _, beam in flat], [step_params] * len(flat), use_tqdm)
            candidates: list[list[BeamSearchSequence]] = [[] for _ in encoded]
            for (i, beam), out in zip(flat, outputs):
                for token, lp in out.outputs[0].logprobs[0].items():
                    candidates[i].append(BeamSearchSequence(
                        tokens=beam.tokens + [token], logprobs=beam.logprobs + [lp.logprob],
                        cum_logprob=beam.cum_logprob + lp.logprob))
            for i, cands in enumerate(candidates):
                cands.sort(key=lambda b: b.cum_logprob, reverse=True)
                live[i] = []
                for rank, cand in enumerate(cands[:2 * width]):
                    if not params.ignore_eos and cand.tokens[-1] in eos:
                        if rank < width:
                            cand.finish_reason = "stop"
                            done[i].append(cand)
                    elif len(live[i]) < width:
                        live[i].append(cand)
                if len(done[i]) >= width and _score(live[i][0], params, len(encoded[i][0])) <= min(
                        _score(b, params, len(encoded[i][0])) for b in done[i]):
                    live[i] = []
        results = []
        for i, (ids, _) in enumerate(encoded):
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
    def _encode(self, prompt: PromptType) -> tuple[list[int], str | None]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            text, add_special = prompt["prompt"], prompt.get("add_special_tokens", True)
        elif isinstance(prompt, str):
            text, add_special = prompt, True
        else:
            return list(prompt), None
        tokenizer = self._require_tokenizer("text prompts")
        return tokenizer(text, add_special_tokens=add_special).input_ids, text

    def _require_tokenizer(self, what: str):
        tokenizer = self.llm_engine.tokenizer
        if tokenizer is None:
            raise ValueError(f"{what} need a tokenizer, and the model {self.llm_engine.config.model!r} has none: "
                             "pass prompts as token-id lists, or tokenizer=PATH")
        return tokenizer

    def _run(self, encoded: list[tuple[list[int], str | None]], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [str(next(self._request_counter)) for _ in encoded]
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        progress = _progress(len(ids), use_tqdm)
        try:
            for rid, (token_ids, text), p in zip(ids, encoded, params):
                engine.add_request(rid, token_ids, p, prompt=text)
            while engine.has_unfinished_requests():
                for out in engine.step(stream=False):
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        if progress is not None:
                            progress.update(1)
        finally:
            if progress is not None:
                progress.close()
            for rid in ids:  # an interrupted run leaves nothing behind in the engine
                engine.abort_request(rid)
        return results

    def benchmark(self, batch_size: int | Sequence[int] = (4, 8, 16), input_len: int = 512, output_len: int = 128,
                  num_prompts: int | None = None, use_beam_search: bool = False, warmup: int = 1,
                  repeats: int = 1, **kwargs):
        """Throughput, latency percentiles, memory and GPU telemetry on random prompts, with the
        provenance manifest; see ``pagedlab.lab.bench.BenchmarkResult``."""
        from pagedlab.lab.bench import run_benchmark

        return run_benchmark(self, batch_size=batch_size, input_len=input_len, output_len=output_len,
                             num_prompts=num_prompts, use_beam_search=use_beam_search, warmup=warmup,
                             repeats=repeats, **kwargs)

    def set_model_args(self, **kwargs) -> None:
        """Change plan-level settings (block_size, max_num_seqs, max_num_batched_tokens,
        enable_prefix_caching, enable_chunked_prefill, enforce_eager, gpu_memory_utilization,
        kv_cache_memory_bytes, max_model_len) for the next call, keeping the loaded weights."""
        weight_level = {"model", "tokenizer", "dtype", "quantization", "tensor_parallel_size", "load_format",
                        "trust_remote_code", "device", "seed"}
        for key in kwargs:
            if key in weight_level:
                raise ValueError(f"{key!r} changes the weights, which set_model_args keeps: build a new LLM "
                                 f"for a different {key}")
            if key not in PLAN_FIELDS:
                raise ValueError(f"unknown model arg {key!r}; set_model_args accepts {list(PLAN_FIELDS)}")
        self.llm_engine.update_plan(**kwargs)

    def get_stats(self) -> EngineStats:
        """Memory and counters: KV blocks (used, peak), prefix-cache hits, tokens computed."""
        return self.llm_engine.get_stats()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        self.llm_engine.reset_prefix_cache()
        return True

    def close(self) -> None:
        """Free the weights, the KV cache and every request."""
        if self._engine is not None:
            device = self._engine.device
            self._engine.close()
            self._engine = None
            import gc

            gc.collect()
            if device.type == "cuda":
                import torch

                torch.cuda.empty_cache()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _score(beam: BeamSearchSequence, params: BeamSearchParams, prompt_len: int) -> float:
    return beam.cum_logprob / max(1, len(beam.tokens) - prompt_len) ** params.length_penalty


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    for p in prompts:
        if not isinstance(p, (str, dict, list, tuple)):
            raise ValueError(f"prompt {p!r} is invalid: a prompt is a string, a list of token ids, or a dict "
                             "with 'prompt' or 'prompt_token_ids'")
    return prompts


def _params_per_prompt(sampling_params, count: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts: give one, or one per prompt")
    return params


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
