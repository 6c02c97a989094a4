"""``POST /v1/completions``: full responses and server-sent-event streams."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from pagedlab import RequestOutput, SamplingParams
from pagedlab.engine.async_engine import RequestStream
from pagedlab.inputs import EncodedPrompt
from pagedlab.outputs import CompletionOutput, PositionLogprobs
from pagedlab.server.protocol import (CompletionLogprobs, CompletionRequest, CompletionResponse,
                                      CompletionResponseChoice, CompletionStreamResponse, PromptLogprobs,
                                      UsageInfo)
from pagedlab.server.routed_experts import encode_routed_experts
from pagedlab.server.serving_engine import (EventStream, OpenAIServing, StreamedChoice, choice_usage,
                                            json_logprob, merge_streams, prompt_logprobs_body, sse_events,
                                            token_string, usage_info)


class OpenAIServingCompletion(OpenAIServing):
    """Serves text completions: one engine request per prompt, ``n`` choices each (choice index =
    prompt index * n + completion index)."""

    async def create_completion(self, request: CompletionRequest, disconnected: asyncio.Future | None = None
                                ) -> CompletionResponse | EventStream:
        """The response, or its event stream when ``request.stream``. ``disconnected`` resolves
        when the client goes away (then the requests are aborted)."""
        self.check_engine()
        model = self.check_model(request.model)
        params = request.to_sampling_params()
        if params.logprobs is not None or params.stop or params.bad_words:
            self.require_tokenizer("logprobs, stop strings and bad_words")
        special = {"add_special_tokens": request.add_special_tokens}
        prompts = [self.encode({"prompt": p, **special} if isinstance(p, str) else p, "prompt")
                   for p in request.prompt_list()]
        for p in prompts:
            self.validate_prompt(p, params, "prompt")  # before any max_new_tokens, as vLLM
        prompt_params = [self.with_model_defaults(request, params, p) for p in prompts]
        self.check_request(prompts, prompt_params)
        await self.compile_grammar(params)
        if request.echo:
            tokenizer = self.engine.tokenizer
            for p in prompts:
                if p.text is None:
                    p.text = tokenizer.decode(p.token_ids) if tokenizer is not None else ""
        run = _CompletionRun(self, f"cmpl-{uuid.uuid4().hex}", model, prompts, params, request)
        streams = self.add_requests(prompts, prompt_params, run.request_id, request.stream, model,
                                    request.priority)
        if request.stream:
            return EventStream(sse_events(run.stream_chunks(streams),
                                          f"streamed completion {run.request_id}"))
        return run.response(await self.collect(streams, disconnected))


def _cut(pos: PositionLogprobs, token: int, num: int) -> PositionLogprobs:
    """``pos`` cut to the chosen token and the ``num`` most likely: a prompt position holds as many
    as the larger of ``prompt_logprobs`` and ``logprobs`` asked for."""
    return {tid: lp for tid, lp in pos.items() if tid == token or lp.rank <= num}


def _add_positions(logprobs: CompletionLogprobs, positions: Sequence[PositionLogprobs | None],
                   token_ids: Sequence[int], as_ids: bool, first_token_text: str = "",
                   num: int | None = None) -> None:
    """Appends each token's text (``token_id:{id}`` when ``as_ids``), logprob and top alternatives
    (at most ``num`` and the chosen token when ``num`` is given) to ``logprobs``; ``text_offset`` is
    left to the caller."""
    for token, pos in zip(token_ids, positions):
        if pos is None:  # the first prompt token has no logprob
            text = token_string(token, first_token_text, as_ids)
            logprobs.token_logprobs.append(None)
            logprobs.top_logprobs.append(None)
        else:
            chosen = pos[token]
            text = token_string(token, chosen.decoded_token, as_ids)
            logprobs.token_logprobs.append(json_logprob(chosen.logprob))
            entries: dict[str, float] = {}
            if num is not None:
                pos = _cut(pos, token, num)
            for tid, lp in sorted(pos.items(), key=lambda kv: kv[1].rank):
                # tokens that decode alike share an entry (the best one's) unless as_ids
                entries.setdefault(token_string(tid, lp.decoded_token, as_ids), json_logprob(lp.logprob))
            logprobs.top_logprobs.append(entries)
        logprobs.tokens.append(text)


class _StreamedCompletion(StreamedChoice):
    """A streamed choice that also knows where its next token's ``text_offset`` is."""

    __slots__ = ("text_offset",)

    def __init__(self):
        super().__init__()
        self.text_offset = 0


class _CompletionRun:
    """One completion request in flight: what its response or stream chunks are built from."""

    def __init__(self, serving: OpenAIServingCompletion, request_id: str, model: str,
                 prompts: list[EncodedPrompt], params: SamplingParams, request: CompletionRequest):
        self.tokenizer, self.admission = serving.engine.tokenizer, serving.admission
        self.request_id, self.created, self.model = request_id, int(time.time()), model
        self.prompts, self.params = prompts, params
        self.echo, self.return_token_ids = request.echo, request.return_token_ids
        self.as_ids = serving.tokens_as_ids(request)
        self.prompt_only = request.scores_prompt_only
        self.prompt_logprobs = request.prompt_logprobs
        self.include_usage, self.continuous_usage = request.include_usage, request.continuous_usage

    def _logprobs(self, out: RequestOutput, positions: Sequence[PositionLogprobs | None],
                  token_ids: Sequence[int], start: int, echo: bool) -> CompletionLogprobs:
        """OpenAI's logprobs of ``token_ids``, after those of the prompt when ``echo``. As in vLLM,
        ``text_offset`` is the running length of the token strings from ``start``, so the chunks
        of a stream carry the offsets of the full response."""
        logprobs = CompletionLogprobs()
        if echo:
            prompt_ids = out.prompt_token_ids
            first = self.tokenizer.decode([prompt_ids[0]]) if self.tokenizer is not None else ""
            prompt_positions = out.prompt_logprobs or [None] * len(prompt_ids)
            _add_positions(logprobs, prompt_positions, prompt_ids, self.as_ids, first, self.params.logprobs)
        _add_positions(logprobs, positions, token_ids, self.as_ids)
        lengths = [len(token) for token in logprobs.tokens]
        logprobs.text_offset = list(itertools.accumulate(lengths, initial=start))[:-1]
        return logprobs

    def _choice(self, index: int, text: str, logprobs: CompletionLogprobs | None, finish_reason: str | None,
                c: CompletionOutput, prompt: EncodedPrompt, token_ids: list[int]) -> CompletionResponseChoice:
        choice = CompletionResponseChoice(index=index, text=text, logprobs=logprobs,
                                          finish_reason=finish_reason,
                                          stop_reason=c.stop_reason if finish_reason else None)
        if self.return_token_ids:
            choice.token_ids, choice.prompt_token_ids = token_ids, prompt.token_ids
        return choice

    def response(self, outputs: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for i, (prompt, out) in enumerate(zip(self.prompts, outputs)):
            for c in out.outputs:
                text, token_ids, positions = ("", [], []) if self.prompt_only else (
                    c.text, c.token_ids, c.logprobs or [])
                logprobs = None
                if self.params.logprobs is not None:
                    logprobs = self._logprobs(out, positions, token_ids, 0, self.echo)
                text = (prompt.text or "") + text if self.echo else text
                choice = self._choice(i * self.params.n + c.index, text, logprobs, c.finish_reason, c, prompt,
                                      token_ids)
                if self.prompt_logprobs is not None:
                    choice.prompt_logprobs = self._prompt_logprobs(out)
                choice.routed_experts = encode_routed_experts(c.routed_experts)
                choices.append(choice)
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                  usage=usage_info(self.prompts, outputs))

    def _prompt_logprobs(self, out: RequestOutput) -> PromptLogprobs | None:
        """vLLM's ``prompt_logprobs`` field: the number asked for, though echo may have asked the
        engine for more."""
        positions = out.prompt_logprobs
        if positions is not None:
            positions = [pos if pos is None else _cut(pos, token, self.prompt_logprobs)
                         for pos, token in zip(positions, out.prompt_token_ids)]
        return prompt_logprobs_body(positions)

    def _chunk(self, choices: list[CompletionResponseChoice], usage: UsageInfo | None = None
               ) -> CompletionStreamResponse:
        return CompletionStreamResponse(id=self.request_id, created=self.created, model=self.model,
                                        choices=choices, usage=usage)

    def _chunks(self, i: int, out: RequestOutput, states: list[_StreamedCompletion]
                ) -> list[CompletionStreamResponse]:
        """A chunk per choice of prompt ``i`` with something new."""
        prompt, n = self.prompts[i], self.params.n
        chunks = []
        for c in out.outputs:
            state = states[c.index]
            taken = state.take(c)
            if taken is None:
                continue
            delta, new_ids, new_lps, finish = ("", [], [], taken[3]) if self.prompt_only else taken
            first, state.started = not state.started, True
            echo = self.echo and first
            if echo:
                delta = (prompt.text or "") + delta
            logprobs = None
            if self.params.logprobs is not None:
                logprobs = self._logprobs(out, new_lps or [], new_ids, state.text_offset, echo)
                state.text_offset += sum(len(token) for token in logprobs.tokens)
            choice = self._choice(i * n + c.index, delta, logprobs, finish, c, prompt, new_ids)
            if not first:  # as vLLM, a choice's prompt token ids go out on its first chunk only
                choice.prompt_token_ids = None
            usage = choice_usage(prompt, state) if self.continuous_usage else None
            chunks.append(self._chunk([choice], usage))
        return chunks

    async def stream_chunks(self, streams: list[RequestStream]
                            ) -> AsyncIterator[list[CompletionStreamResponse]]:
        """The chunks of each engine output as it comes; with ``include_usage`` a last chunk with
        the usage and no choices."""
        states = [[_StreamedCompletion() for _ in range(self.params.n)] for _ in streams]
        finals: list[RequestOutput | None] = [None] * len(streams)
        async with contextlib.aclosing(merge_streams(streams)) as merged:
            async for i, out in merged:
                self.admission.check_not_cut(out)
                if out.finished:
                    finals[i] = out
                chunks = self._chunks(i, out, states[i])
                if self.include_usage and all(f is not None for f in finals):
                    chunks.append(self._chunk([], usage_info(self.prompts, finals)))
                yield chunks
