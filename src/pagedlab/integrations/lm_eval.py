"""The lm-evaluation-harness model ``pagedlab``: evaluate through the offline ``LLM``.

    lm_eval --model pagedlab --model_args pretrained=DIR,dtype=float32 --tasks hellaswag

``pretrained`` is anything ``LLM(model=...)`` takes (an HF directory, a .gguf file, or the
embedded ``smollm2-135m-instruct``); the other model_args are ``LLM`` engine arguments
(``dtype``, ``revision``, ``max_model_len``, ``block_size``, ``kv_cache_memory_bytes``,
``gpu_memory_utilization``, ``max_num_seqs``, ``enable_prefix_caching``, ``seed``, ``load_format``,
``attention_backend`` ...)
plus lm-eval's own (``max_length``, ``max_gen_toks``, ``add_bos_token``, ``prefix_token_id``,
``batch_size``, ``device``).

- ``loglikelihood``: context + continuation go in as one prompt with ``prompt_logprobs``; the
  continuation's log-probability is the sum over its tokens, ``is_greedy`` whether each of them
  was the most likely token (rank 1).
- ``loglikelihood_rolling``: lm-eval's disjoint rolling windows, each scored the same way.
- ``generate_until``: greedy (or sampled, with ``do_sample``/``temperature``/``top_p``/``top_k``)
  generation with the ``until`` stop strings and ``max_gen_toks``. A sampled request without a
  ``seed`` gets one from ``seed`` (the model arg) and its own content, so it samples the same in
  any batch, task mix or order.

Tokenization follows lm-eval's ``hf`` model, so scores match it on the same weights.
All requests of a call go to the engine together (``batch_size=N`` submits N at a time), and the
engine's continuous batching schedules them.

Registration: an installed pagedlab declares the entry point ``lm_eval.models: pagedlab``, which
lm-eval versions with plugin support resolve on their own. Older lm-eval versions (0.4.x)
have no plugin discovery: run ``python -m pagedlab.integrations.lm_eval --model pagedlab ...``
(lm-eval's CLI with this model registered), or ``import pagedlab.integrations.lm_eval`` before
``lm_eval.simple_evaluate(model="pagedlab", ...)``.
"""

from __future__ import annotations

import logging
import sys
import zlib
from typing import Any

import lm_eval.models  # noqa: F401 - lm-eval's own models first: it fills an empty registry only
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from pagedlab.config import ENGINE_FIELDS
from pagedlab.engine.engine import load_tokenizer
from pagedlab.llm import LLM
from pagedlab.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# LLM's engine arguments: the EngineConfig fields (pretrained names the model; device is lm-eval's)
_ENGINE_ARGS = tuple(name for name in ENGINE_FIELDS if name not in ("model", "device"))
_SAMPLING_ARGS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "min_tokens", "ignore_eos")
# lm-eval's lm_eval_args / HF-only keys that mean nothing to the engine
_IGNORED_ARGS = ("max_batch_size", "parallelize", "trust_remote_code_tokenizer", "use_fast_tokenizer")


def _has_bos_prefix(text: str, bos: str | None) -> bool:
    return bool(bos) and text.startswith(bos)


def _parse_batch_size(batch_size: int | str | None) -> int | None:
    """Requests submitted at a time: None (all of them) for "auto", "auto:N" or 0, else the number."""
    text = str(batch_size).strip() if batch_size is not None else "auto"
    schedule = text.removeprefix("auto").removeprefix(":")
    if text.startswith("auto") and (not schedule or schedule.replace(".", "", 1).isdigit()):
        return None
    if text.isdigit():
        return int(text) or None
    raise ValueError(f"batch_size={batch_size!r} is invalid: give a number of requests >= 1, 'auto' or "
                     "'auto:N'")


@register_model("pagedlab")
class PagedLabLM(TemplateLM):
    """lm-eval ``LM`` over ``pagedlab.LLM``."""

    def __init__(self, pretrained: str = "smollm2-135m-instruct", *, max_length: int | None = None,
                 max_gen_toks: int = 256, add_bos_token: bool | None = None,
                 prefix_token_id: int | None = None, batch_size: int | str | None = "auto",
                 device: str | None = None, use_tqdm: bool = True,
                 chat_template_args: dict | None = None, llm=None, **kwargs: Any):
        super().__init__()
        for key in _IGNORED_ARGS:
            kwargs.pop(key, None)
        engine_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in _ENGINE_ARGS}
        if kwargs:
            raise ValueError(f"unknown model_args {sorted(kwargs)} for --model pagedlab: it takes "
                             f"pretrained, {', '.join(_ENGINE_ARGS)}, max_length, max_gen_toks, "
                             "add_bos_token, prefix_token_id, batch_size, device")
        if device is not None:
            engine_kwargs["device"] = device
        if llm is None:
            llm = LLM(model=str(pretrained), **engine_kwargs)
        self.llm = llm
        self.engine = llm.llm_engine
        self.tokenizer = self.engine.tokenizer
        if self.tokenizer is None:
            raise ValueError(f"--model pagedlab needs a tokenizer, and {pretrained!r} has none: "
                             "pass tokenizer=DIR")
        if add_bos_token is not None:
            # As lm-eval's hf and vllm models: the tokenizer is built with it, so that one that adds
            # no BOS of its own adds it (add_special_tokens alone would not).
            self.tokenizer = load_tokenizer(self.engine.tokenizer_path, self.engine.config.tokenizer_mode,
                                            add_bos_token=add_bos_token)
        self.pretrained = str(pretrained)
        self._max_length = int(max_length) if max_length else None
        if self._max_length is not None and self._max_length > self.engine.max_model_len:
            raise ValueError(f"max_length={self._max_length} exceeds the engine's max_model_len "
                             f"({self.engine.max_model_len}): raise max_model_len")
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.batch_size = _parse_batch_size(batch_size)
        self.use_tqdm = use_tqdm
        self.chat_template_args = chat_template_args or {}
        self.seed = int(llm.get_engine_info().config.seed)  # seed=None: the one the engine drew
        self._device = str(self.engine.device)
        self._rank, self._world_size = 0, 1

    # ---- lm-eval plumbing -----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        """Tokens one sequence may hold (prompt plus generation)."""
        return self._max_length or self.engine.max_model_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs) -> list[int]:
        """As lm-eval's ``hf`` model tokenizes: the tokenizer's default special tokens unless told
        otherwise, and none added to a string that already starts with BOS."""
        if add_special_tokens is not None:
            special = {"add_special_tokens": add_special_tokens}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        else:
            special = {}
        if (add_special_tokens is None
                and _has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id))):
            special["add_special_tokens"] = False
        encoding = self.tokenizer.encode(string, **special)
        if left_truncate_len:
            encoding = encoding[-left_truncate_len:]
        return encoding

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        import jinja2

        def render(history):
            return self.tokenizer.apply_chat_template(
                history, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt, **self.chat_template_args)

        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            logger.warning("the chat template failed; retrying without the system message")
            return render([m for m in chat_history if m["role"] != "system"])

    def get_model_info(self) -> dict:
        engine = self.engine
        return {"model_name": self.pretrained, "model_path": str(engine.source.path),
                "dtype": str(engine.dtype).removeprefix("torch."), "max_model_len": engine.max_model_len,
                "engine_config": engine.config.to_dict()}

    # ---- running requests through the engine ----------------------------------------------
    def _run(self, prompts: list[list[int]], params: list[SamplingParams], desc: str, disable_tqdm: bool):
        """Outputs in input order; ``batch_size`` requests go to the engine at a time (all by default)."""
        step = self.batch_size or max(1, len(prompts))
        show = self.use_tqdm and not disable_tqdm
        outputs = []
        progress = None
        if show and len(prompts) > step:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(prompts), desc=desc)
        for start in range(0, len(prompts), step):
            chunk = [{"prompt_token_ids": p} for p in prompts[start:start + step]]
            outputs.extend(self.llm.generate(chunk, params[start:start + step],
                                             use_tqdm=show and progress is None))
            if progress is not None:
                progress.update(len(chunk))
        if progress is not None:
            progress.close()
        return outputs

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              **kwargs) -> list[tuple[float, bool]]:
        """Score each (context tokens, continuation tokens) pair; the context is cut from the left
        to fit (the engine needs room for one generated token)."""
        limit = self.max_length - 1
        inputs, ctx_lens = [], []
        for _, context_enc, continuation_enc in requests:
            tokens = list(context_enc) + list(continuation_enc)
            if len(tokens) > limit:
                logger.warning("context + continuation has %d tokens, more than %d: cutting the context",
                               len(tokens), limit)
            inputs.append(tokens[-limit:])
            ctx_lens.append(len(context_enc) - max(0, len(tokens) - limit))
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False)
        outputs = self._run(inputs, [params] * len(inputs), "Running loglikelihood requests", disable_tqdm)
        results = []
        for (cache_key, _, _), tokens, ctx_len, out in zip(requests, inputs, ctx_lens, outputs):
            total, greedy = 0.0, True
            for pos in range(max(ctx_len, 1), len(tokens)):
                position = out.prompt_logprobs[pos]
                entry = position[tokens[pos]]
                total += entry.logprob
                # as lm-eval's vllm model: greedy where no token is more likely (a tie for the top counts)
                greedy = greedy and entry.logprob >= max(lp.logprob for lp in position.values())
            answer = (total, greedy)
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
            results.append(answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for window in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length - 2, context_len=1)):
                windows.append((None,) + window)
                owners.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, scores):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def _sampling_params(self, gen_kwargs: dict, seed_key: int) -> tuple[SamplingParams, list[str], int]:
        """lm-eval's generation kwargs as SamplingParams, with lm-eval's rules: ``until`` plus the
        EOS text; ``max_gen_toks`` (or max_new_tokens / max_tokens / max_completion_tokens);
        greedy unless ``do_sample`` (or, with no ``do_sample``, a temperature above 0)."""
        if not isinstance(gen_kwargs, dict):
            raise ValueError(f"generation kwargs must be a dict, got {gen_kwargs!r}")
        kwargs = dict(gen_kwargs)
        until = kwargs.pop("until", None)
        if isinstance(until, str):
            until = [until]
        elif until is None:
            until = []
        elif not isinstance(until, (list, tuple)):
            raise ValueError(f"'until' must be a string or a list of strings, got {until!r}")
        until = list(until)
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        if eos and eos not in until:
            until.append(eos)
        max_gen_toks = self.max_gen_toks
        for alias in ("max_completion_tokens", "max_tokens", "max_new_tokens", "max_gen_toks"):  # last wins
            value = kwargs.pop(alias, None)
            if value is not None:
                max_gen_toks = int(value)
        do_sample = kwargs.pop("do_sample", None)
        if do_sample is None:
            do_sample = float(kwargs.get("temperature") or 0.0) > 0.0
        if not do_sample:
            kwargs["temperature"] = 0.0
        params = {k: kwargs.pop(k) for k in list(kwargs) if k in _SAMPLING_ARGS}
        if params.get("top_k") is None:
            params.pop("top_k", None)
        if kwargs:
            logger.warning("generation kwargs %s mean nothing to pagedlab and are ignored", sorted(kwargs))
        if do_sample and params.get("seed") is None:
            params["seed"] = (self.seed + seed_key) % (1 << 63)
        stops = [s for s in until if s]
        # The stop check sees special tokens' text (lm-eval's hf model decodes them there too), so that
        # a stop string such as "<|im_end|>" stops; the result is decoded without them.
        return (SamplingParams(max_tokens=max_gen_toks, stop=stops, skip_special_tokens=False, **params),
                until, max_gen_toks)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params, untils = [], [], []
        seen: dict[int, int] = {}
        for req in requests:
            context, gen_kwargs = req.args
            # A sampled request's seed comes from its content (and how many identical requests came
            # before it), so it samples the same whatever the batch, task mix or order.
            key = zlib.crc32(repr((context, sorted(gen_kwargs.items()) if isinstance(gen_kwargs, dict)
                                   else gen_kwargs)).encode())
            seen[key] = seen.get(key, -1) + 1
            sp, until, max_gen_toks = self._sampling_params(gen_kwargs, key + (seen[key] << 32))
            # Room for max_gen_toks new tokens: cut the context from the left (as lm-eval's hf model).
            room = self.max_length - max_gen_toks
            if room <= 0:
                raise ValueError(f"max_gen_toks={max_gen_toks} leaves no room for the context in max_length "
                                 f"{self.max_length}")
            tokens = self.tok_encode(context, left_truncate_len=room)
            prompts.append(tokens)
            params.append(sp)
            untils.append(until)
        outputs = self._run(prompts, params, "Running generate_until requests", disable_tqdm)
        results = []
        for req, out, until in zip(requests, outputs, untils):
            # Decode the tokens at once, as lm-eval's hf model does (a trailing partial character
            # becomes U+FFFD there), then cut at the first stop sequence.
            text = self.tok_decode(out.outputs[0].token_ids)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", req.args, text)
            results.append(text)
        return results


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with ``--model pagedlab`` available (for lm-eval without plugin discovery)."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
