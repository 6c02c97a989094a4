"""``POST /v1/completions``: full responses and server-sent-event streams."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from pagedlab import RequestOutput, SamplingParams
from pagedlab.engine.async_engine import RequestStream
from pagedlab.inputs import EncodedPrompt
from pagedlab.outputs import CompletionOutput, PositionLogprobs
from pagedlab.server.protocol import (CompletionLogprobs, CompletionRequest, CompletionResponse,
                                      CompletionResponseChoice, CompletionStreamResponse, UsageInfo)
from pagedlab.server.serving_engine import (EventStream, OpenAIServing, StreamedChoice, choice_usage,
                                            merge_streams, prompt_logprobs_body, sse_events, stop_holdback,
                                            usage_info)


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
        prompts = [self.encode(p, "prompt") for p in request.prompt_list()]
        for p in prompts:
            self.validate_prompt(p, params.max_tokens, "prompt")
        self.check_request(prompts, params)
        await self.compile_grammar(params)
        if request.echo:
            tokenizer = self.engine.tokenizer
            for p in prompts:
                if p.text is None:
                    p.text = tokenizer.decode(p.token_ids) if tokenizer is not None else ""
        run = _CompletionRun(self, f"cmpl-{uuid.uuid4().hex}", model, prompts, params, request)
        streams = self.add_requests(prompts, params, run.request_id, request.stream)
        if request.stream:
            return EventStream(sse_events(run.stream_chunks(streams),
                                          f"streamed completion {run.request_id}"))
        return run.response(await self.collect(streams, disconnected))


class _CompletionRun:
    """One completion request in flight: what its response or stream chunks are built from."""

    def __init__(self, serving: OpenAIServingCompletion, request_id: str, model: str,
                 prompts: list[EncodedPrompt], params: SamplingParams, request: CompletionRequest):
        self.tokenizer, self.admission = serving.engine.tokenizer, serving.admission
        self.request_id, self.created, self.model = request_id, int(time.time()), model
        self.prompts, self.params = prompts, params
        self.echo, self.return_token_ids = request.echo, request.return_token_ids
        self.prompt_logprobs = request.prompt_logprobs is not None
        self.include_usage, self.continuous_usage = request.include_usage, request.continuous_usage
        self.holdback = stop_holdback(params)

    def _logprobs(self, positions: Sequence[PositionLogprobs | None], token_ids: Sequence[int], offset: int,
                  first_token_text: str | None = None) -> CompletionLogprobs:
        logprobs = CompletionLogprobs()
        for token, pos in zip(token_ids, positions):
            if pos is None:  # the first prompt token has no logprob
                text = first_token_text if first_token_text is not None else ""
                logprobs.token_logprobs.append(None)
                logprobs.top_logprobs.append(None)
            else:
                chosen = pos[token]
                text = chosen.decoded_token or ""
                logprobs.token_logprobs.append(chosen.logprob)
                entries: dict[str, float] = {}
                for _, lp in sorted(pos.items(), key=lambda kv: kv[1].rank):
                    # tokens that decode alike share an entry: the best one's
                    entries.setdefault(lp.decoded_token or "", lp.logprob)
                logprobs.top_logprobs.append(entries)
            logprobs.tokens.append(text)
            logprobs.text_offset.append(offset)
            offset += len(text)
        return logprobs

    def _echo_logprobs(self, out: RequestOutput) -> CompletionLogprobs:
        first = self.tokenizer.decode([out.prompt_token_ids[0]]) if self.tokenizer is not None else ""
        positions = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        return self._logprobs(positions, out.prompt_token_ids, 0, first)

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
                logprobs = None
                if self.params.logprobs is not None:
                    offset = len(prompt.text or "") if self.echo else 0
                    logprobs = self._logprobs(c.logprobs or [], c.token_ids, offset)
                    if self.echo:
                        logprobs = self._echo_logprobs(out) + logprobs
                text = (prompt.text or "") + c.text if self.echo else c.text
                choice = self._choice(i * self.params.n + c.index, text, logprobs, c.finish_reason, c, prompt,
                                      c.token_ids)
                if self.prompt_logprobs:
                    choice.prompt_logprobs = prompt_logprobs_body(out.prompt_logprobs)
                choices.append(choice)
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                  usage=usage_info(self.prompts, outputs))

    def _chunk(self, choices: list[CompletionResponseChoice], usage: UsageInfo | None = None
               ) -> CompletionStreamResponse:
        return CompletionStreamResponse(id=self.request_id, created=self.created, model=self.model,
                                        choices=choices, usage=usage)

    def _chunks(self, i: int, out: RequestOutput, states: list[StreamedChoice]
                ) -> list[CompletionStreamResponse]:
        """A chunk per choice of prompt ``i`` with something new."""
        prompt, n = self.prompts[i], self.params.n
        chunks = []
        for c in out.outputs:
            state = states[c.index]
            taken = state.take(c, self.holdback)
            if taken is None:
                continue
            delta, new_ids, new_lps, finish = taken
            logprobs = None
            if self.params.logprobs is not None:
                offset = (len(prompt.text or "") if self.echo else 0) + state.sent_text - len(delta)
                logprobs = self._logprobs(new_lps or [], new_ids, offset)
            if not state.started:
                state.started = True
                if self.echo:
                    delta = (prompt.text or "") + delta
                    if logprobs is not None:
                        logprobs = self._echo_logprobs(out) + logprobs
            choice = self._choice(i * n + c.index, delta, logprobs, finish, c, prompt, new_ids)
            usage = choice_usage(prompt, state) if self.continuous_usage else None
            chunks.append(self._chunk([choice], usage))
        return chunks

    async def stream_chunks(self, streams: list[RequestStream]
                            ) -> AsyncIterator[list[CompletionStreamResponse]]:
        """The chunks of each engine output as it comes; with ``include_usage`` a last chunk with
        the usage and no choices."""
        states = [[StreamedChoice() for _ in range(self.params.n)] for _ in streams]
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
