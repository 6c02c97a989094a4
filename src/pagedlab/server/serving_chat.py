"""``POST /v1/chat/completions``: the conversation through the chat template, full responses and
server-sent-event streams."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from pagedlab import RequestOutput, SamplingParams
from pagedlab.engine.async_engine import AsyncEngine, RequestStream
from pagedlab.inputs import EncodedPrompt, chat_prompt
from pagedlab.outputs import Logprob, PositionLogprobs
from pagedlab.server.errors import bad_request
from pagedlab.server.protocol import (ChatCompletionLogprob, ChatCompletionLogprobs, ChatCompletionRequest,
                                      ChatCompletionResponse, ChatCompletionResponseChoice,
                                      ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse,
                                      ChatCompletionTopLogprob, ChatMessage, DeltaMessage, UsageInfo)
from pagedlab.server.protocol_tools import template_messages
from pagedlab.reasoning_parsers import ReasoningParser, ReasoningStream, reasoning_parser_named
from pagedlab.server.routed_experts import encode_routed_experts
from pagedlab.server.serving_engine import (Admission, EventStream, OpenAIServing, StreamedChoice,
                                            choice_usage, json_logprob, merge_streams, prompt_logprobs_body,
                                            sse_events, token_string, usage_info)
from pagedlab.server.serving_models import OpenAIServingModels
from pagedlab.server.serving_tools import ToolCalling, ToolStream
from pagedlab.server.tool_parsers import tool_parser_named


class OpenAIServingChat(OpenAIServing):
    """Serves chat completions. ``chat_template`` (Jinja) replaces the tokenizer's template; a
    request's own ``chat_template`` wins over both. ``tool_call_parser`` (a ``TOOL_PARSERS`` name)
    reads tool calls out of the text when ``enable_auto_tool_choice`` lets requests use
    tool_choice "auto"; ``exclude_tools_when_tool_choice_none`` keeps the tools of a tool_choice
    "none" request out of the chat template; ``reasoning_parser`` (a ``REASONING_PARSERS`` name)
    splits the text into reasoning and content, tool calls being read from the content;
    ``response_role`` is the reply's role when the request has ``add_generation_prompt`` (vLLM's
    flags)."""

    def __init__(self, engine: AsyncEngine, served_model_names: Sequence[str],
                 chat_template: str | None = None, admission: Admission | None = None,
                 models: OpenAIServingModels | None = None, *, tool_call_parser: str | None = None,
                 enable_auto_tool_choice: bool = False, exclude_tools_when_tool_choice_none: bool = False,
                 reasoning_parser: str | None = None, return_tokens_as_token_ids: bool = False,
                 response_role: str = "assistant"):
        super().__init__(engine, served_model_names, admission, models,
                         return_tokens_as_token_ids=return_tokens_as_token_ids)
        self.reasoning_parser = reasoning_parser_named(reasoning_parser)
        self.chat_template = chat_template
        self.tool_parser = tool_parser_named(tool_call_parser, enable_auto_tool_choice)
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        self.response_role = response_role

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     disconnected: asyncio.Future | None = None
                                     ) -> ChatCompletionResponse | EventStream:
        """The response, or its event stream when ``request.stream``. ``disconnected`` resolves
        when the client goes away (then the request is aborted)."""
        self.check_engine()
        model = self.check_model(request.model)
        if request.tool_choice == "auto" and self.tool_parser is None:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                              "to be set", param="tool_choice")
        params = request.to_sampling_params()
        keeps_markers = getattr(self.tool_parser, "keeps_special_tokens", False)
        if request.tools and request.tool_choice != "none" and keeps_markers:
            params = params.clone(skip_special_tokens=False)  # the call markers may be special tokens
        prompt = self.render(request)
        limit_param = "max_tokens" if request.max_completion_tokens is None else "max_completion_tokens"
        self.validate_prompt(prompt, params, "messages", limit_param)  # before any max_new_tokens
        params = self.with_model_defaults(request, params, prompt)
        self.check_request([prompt], [params])
        await self.compile_grammar(params)
        run = _ChatRun(f"chatcmpl-{uuid.uuid4().hex}", model, prompt, params, request, self.admission,
                       ToolCalling(request, self.tool_parser), self.reasoning_parser,
                       self.tokens_as_ids(request), request.reply_role(self.response_role))
        streams = self.add_requests([prompt], [params], run.request_id, request.stream, model,
                                    request.priority)
        if request.stream:
            return EventStream(sse_events(run.stream_chunks(streams[0]),
                                          f"streamed chat completion {run.request_id}"))
        outputs = await self.collect(streams, disconnected)
        return run.response(outputs[0])

    def render(self, request: ChatCompletionRequest) -> EncodedPrompt:
        """The conversation rendered through the chat template and tokenized (as ``LLM.chat`` does)."""
        tokenizer = self.require_tokenizer("chat completions")
        template = request.chat_template if request.chat_template is not None else self.chat_template
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model's tokenizer has no chat template: start the server with "
                              "--chat-template, or use /v1/completions", param="messages")
        try:
            prompt = chat_prompt(tokenizer, template_messages(request.conversation()), template,
                                 request.add_generation_prompt, self.served_model_names[0],
                                 continue_final_message=request.continue_final_message,
                                 chat_template_kwargs=request.chat_template_kwargs,
                                 tools=request.tool_dicts(self.exclude_tools_when_tool_choice_none))
        except Exception as e:  # jinja errors, raise_exception() in templates, bad kwargs
            raise bad_request(f"the chat template could not be applied: {e}", param="messages") from None
        return self.encode({**prompt, "add_special_tokens": request.add_special_tokens}, "messages")


class _ChatRun:
    """One chat request in flight: what its response or stream chunks are built from."""

    def __init__(self, request_id: str, model: str, prompt: EncodedPrompt, params: SamplingParams,
                 request: ChatCompletionRequest, admission: Admission, tools: ToolCalling,
                 reasoning: ReasoningParser | None, as_ids: bool, role: str):
        self.request_id, self.created, self.model = request_id, int(time.time()), model
        if reasoning is not None and params.structured_outputs is not None:
            reasoning = reasoning.explicit()  # a grammar wrote the text: thinking only in its tags
        self.admission, self.tools, self.reasoning = admission, tools, reasoning
        self.include_reasoning, self.role = request.include_reasoning, role
        self.wants_every_chunk = request.logprobs or request.return_token_ids
        self.prompt, self.params = prompt, params
        # with logprob_token_ids, the alternatives listed are the label ids (as vLLM)
        self.top_logprobs = None if request.logprob_token_ids else request.top_logprobs or 0
        self.return_token_ids, self.as_ids = request.return_token_ids, as_ids
        self.prompt_logprobs = request.prompt_logprobs is not None
        self.include_usage, self.continuous_usage = request.include_usage, request.continuous_usage

    def _logprobs(self, positions: Sequence[PositionLogprobs], token_ids: Sequence[int]
                  ) -> ChatCompletionLogprobs | None:
        if self.params.logprobs is None:
            return None
        content = []
        for token, pos in zip(token_ids, positions):
            ranked = sorted(pos.items(), key=lambda kv: kv[1].rank)[:self.top_logprobs]
            chosen = self._entry(token, pos[token])
            content.append(ChatCompletionLogprob(**chosen.model_dump(),
                                                 top_logprobs=[self._entry(tid, lp) for tid, lp in ranked]))
        return ChatCompletionLogprobs(content=content)

    def _entry(self, token_id: int, lp: Logprob) -> ChatCompletionTopLogprob:
        """A token's logprob entry: its text (or ``token_id:{id}``) and that text's UTF-8 bytes."""
        token = token_string(token_id, lp.decoded_token, self.as_ids)
        return ChatCompletionTopLogprob(token=token, logprob=json_logprob(lp.logprob),
                                        bytes=list(token.encode("utf-8")))

    def _split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, the rest) of a whole output; the reasoning None where not asked for."""
        if self.reasoning is None:
            return None, text
        reasoning, content = self.reasoning.split(text)
        return (reasoning if self.include_reasoning else None), content

    def response(self, out: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for c in out.outputs:
            reasoning, text = self._split(c.text)
            content, tool_calls, finish_reason = (self.tools.message(text, c.finish_reason)
                                                  if text is not None else (None, [], c.finish_reason))
            message = ChatMessage(role=self.role, content=content, tool_calls=tool_calls, reasoning=reasoning,
                                  reasoning_content=reasoning)
            choice = ChatCompletionResponseChoice(
                index=c.index, message=message,
                logprobs=self._logprobs(c.logprobs or [], c.token_ids), finish_reason=finish_reason,
                stop_reason=c.stop_reason, routed_experts=encode_routed_experts(c.routed_experts))
            if self.return_token_ids:
                choice.token_ids = c.token_ids
            choices.append(choice)
        return ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices,
            usage=usage_info([self.prompt], [out]),
            prompt_logprobs=prompt_logprobs_body(out.prompt_logprobs) if self.prompt_logprobs else None)

    def _chunk(self, choices: list[ChatCompletionResponseStreamChoice], usage: UsageInfo | None = None
               ) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.request_id, created=self.created, model=self.model,
                                            choices=choices, usage=usage)

    def _delta(self, c, text: str, finish: str | None, tool_stream: ToolStream,
               reasoning_stream: ReasoningStream | None) -> tuple[DeltaMessage, str | None]:
        """A choice's new text as a delta (reasoning, content, or tool-call parts) and its
        finish_reason."""
        reasoning, content_text = None, c.text
        if reasoning_stream is not None:
            reasoning, text, content_text = reasoning_stream.step(c.text, finish is not None)
            reasoning = reasoning if self.include_reasoning else None
        if not self.tools.active:
            return DeltaMessage(content=text, reasoning=reasoning, reasoning_content=reasoning), finish
        content, tool_calls = tool_stream.step(content_text, finish is not None)
        return (DeltaMessage(content=content, tool_calls=tool_calls, reasoning=reasoning,
                             reasoning_content=reasoning), tool_stream.finish_reason(finish))

    def _chunks(self, out: RequestOutput, states: list[StreamedChoice], tool_streams: list[ToolStream],
                reasoning_streams: list[ReasoningStream | None]) -> list[ChatCompletionStreamResponse]:
        """A chunk per choice with something new (text held back for tool calls is nothing new,
        unless logprobs or token ids come with it); a choice's first chunk says the role."""
        chunks = []
        for c in out.outputs:
            state = states[c.index]
            taken = state.take(c)
            if taken is None:
                continue
            text, new_ids, new_lps, finish = taken
            delta, finish = self._delta(c, text, finish, tool_streams[c.index], reasoning_streams[c.index])
            nothing_new = (delta.content is None and delta.tool_calls is None and delta.reasoning is None
                           and not finish)
            if nothing_new and not self.wants_every_chunk:
                continue
            delta.role = None if state.started else self.role
            state.started = True
            choice = ChatCompletionResponseStreamChoice(
                index=c.index, delta=delta, logprobs=self._logprobs(new_lps or [], new_ids),
                finish_reason=finish, stop_reason=c.stop_reason if finish else None)
            if self.return_token_ids:
                choice.token_ids = new_ids
            chunks.append(self._chunk([choice],
                                      choice_usage(self.prompt, state) if self.continuous_usage else None))
        return chunks

    async def stream_chunks(self, stream: RequestStream) -> AsyncIterator[list[ChatCompletionStreamResponse]]:
        """The chunks of each engine output as it comes; with ``include_usage`` a last chunk with
        the usage and no choices."""
        states = [StreamedChoice() for _ in range(self.params.n)]
        tool_streams = [ToolStream(self.tools) for _ in range(self.params.n)]
        reasoning_streams = [ReasoningStream(self.reasoning) if self.reasoning is not None else None
                             for _ in range(self.params.n)]
        async with contextlib.aclosing(merge_streams([stream])) as merged:
            async for _, out in merged:
                self.admission.check_not_cut(out)
                chunks = self._chunks(out, states, tool_streams, reasoning_streams)
                if out.finished and self.include_usage:
                    chunks.append(self._chunk([], usage_info([self.prompt], [out])))
                yield chunks
