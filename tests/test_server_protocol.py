"""The server's request and response bodies (``pagedlab.server.protocol``), without a server:
validation errors are OpenAI-shaped 400s naming the field, ``to_sampling_params`` maps every
field, and response bodies leave out what OpenAI's leave out."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("pydantic")

from pagedlab import SamplingParams
from pagedlab.sampling_params import RepetitionDetectionParams, StructuredOutputsParams
from pagedlab.server.errors import APIError
from pagedlab.server.protocol import (MAX_LOGPROBS, ChatCompletionRequest, CompletionRequest,
                                      CompletionResponseChoice, CompletionStreamResponse, DeltaMessage,
                                      PromptTokensDetails, UsageInfo, parse_request)

CHAT = [{"role": "user", "content": "hi"}]


def _error(request_type, body: dict) -> APIError:
    """The APIError a body raises, whether pydantic or SamplingParams finds the fault."""
    with pytest.raises(APIError) as e:
        parse_request(request_type, body).to_sampling_params()
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("body, param, says", [
    ({"prompt": "hi", "temperature": -1}, "temperature", "temperature must be a finite number >= 0"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "in (0, 1]"),
    ({"prompt": "hi", "n": 0}, "n", "0 is not valid for 'n': input should be greater than or equal to 1"),
    ({"prompt": "hi", "n": 2.5}, "n", "input should be a valid integer"),
    ({"prompt": "hi", "max_tokens": "x"}, "max_tokens",
     "'x' is not valid for 'max_tokens': input should be a valid integer"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens=0 needs echo=true"),
    ({"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens", "greater than or equal to 0"),
    ({"prompt": "hi", "logprobs": MAX_LOGPROBS + 1}, "logprobs", "logprobs=21 is invalid: it must be in"),
    ({"prompt": "hi", "logprobs": -1}, "logprobs", "needs -1 there"),
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", "in [0, 20] (the server's --max-logprobs"),
    ({"prompt": "hi", "stream": "yes"}, "stream", "valid boolean"),
    ({"prompt": "hi", "echo": 1}, "echo", "valid boolean"),
    ({"prompt": "hi", "stop": 3}, "stop", "expected a string or an array of strings"),
    # vLLM's SamplingParams: "stop cannot contain an empty string", a 400
    ({"prompt": "hi", "stop": ""}, "stop", "stop must be a non-empty string or a list of non-empty strings"),
    ({"prompt": "hi", "stop": ["a", ""]}, "stop", "stop=['a', ''] is invalid"),
    ({"prompt": "hi", "stop_token_ids": [1, "2"]}, "stop_token_ids", "expected an array of token ids"),
    ({"prompt": "hi", "best_of": 3}, "best_of", "set it equal to n (1)"),
    ({"prompt": "hi", "logit_bias": {"five": 1.0}}, "logit_bias", "keys must be token ids"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", "biases in [-100, 100]"),
    ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids", "non-empty list"),
    ({"prompt": "hi", "allowed_token_ids": [-1]}, "allowed_token_ids", "expected an array of token ids"),
    ({"prompt": "hi", "suffix": "x"}, "suffix", "not supported"),
    ({"prompt": "hi", "stream": True, "stream_interval": 0}, "stream_interval",
     "0 is not valid for 'stream_interval': input should be greater than or equal to 1"),
    ({"prompt": "hi", "use_beam_search": True}, "use_beam_search", "use_beam_search is not supported"),
    ({"prompt": "hi", "guided_json": 5}, "guided_json", "expected a JSON schema (an object or a string)"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options",
     "only be set when stream is true"),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": "y"}},
     "stream_options.include_usage", "valid boolean"),
    ({"prompt": "hi", "min_tokens": 20}, "min_tokens", "<= max_tokens (16)"),
    # vLLM's object: RepetitionDetectionParams' rules, the error naming the field
    ({"prompt": "hi", "repetition_detection": {"max_pattern_size": 4, "min_count": 1}},
     "repetition_detection",
     "repetition_detection={'max_pattern_size': 4, 'min_count': 1} is invalid: min_count=1 is invalid"),
    ({"prompt": "hi", "repetition_detection": {"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}},
     "repetition_detection", "min_pattern_size=3 is invalid: min_pattern_size must be in [0, max_pattern_"),
    ({"prompt": "hi", "repetition_detection": {"max_pattern_size": -1}}, "repetition_detection",
     "max_pattern_size=-1 is invalid"),
    ({"prompt": "hi", "repetition_detection": {"max_pattern_size": 4, "min_cout": 2}}, "repetition_detection",
     "unknown argument 'min_cout'; did you mean 'min_count'?"),
    ({"prompt": "hi", "repetition_detection": {"max_pattern_size": "4", "min_count": 2}},
     "repetition_detection.max_pattern_size", "valid integer"),
    ({"prompt": "hi", "repetition_detection": 4}, "repetition_detection", "valid dictionary"),
    ({}, "prompt", "'prompt' is required"),
    ({"prompt": []}, "prompt", "not empty"),
    ({"prompt": [[1], []]}, "prompt", "not empty"),
    ({"prompt": [1, "a"]}, "prompt", "expected a string, an array of strings"),
    ({"prompt": [True]}, "prompt", "expected a string"),
])
def test_bad_completion_bodies(body, param, says):
    error = _error(CompletionRequest, body).response().model_dump()
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["param"] == param and error["error"]["type"] == "invalid_request_error"
    assert says in error["error"]["message"]


@pytest.mark.parametrize("body, param, says", [
    ({}, "messages", "'messages' is required"),
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": "hi"}, "messages", "valid list"),
    ({"messages": [{"content": "no role"}]}, "messages[0]", "'role'"),
    ({"messages": [*CHAT, "hi"]}, "messages[1]", "'role'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "only text parts"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "a string or an array of text parts"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "needs logprobs set to true"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs=21 is invalid"),
    ({"messages": CHAT, "response_format": {"type": "xml"}}, "response_format", "must be one of"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0].function",
     "'tools[0].function' is required"),
    ({"messages": CHAT, "tool_choice": "auto"}, "tool_choice",
     "When using `tool_choice`, `tools` must be set."),
    ({"messages": CHAT, "tool_choice": 5}, "tool_choice",
     "5 is not valid for 'tool_choice': expected a string or an object"),
    ({"messages": CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
     "`tools` must be set"),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
    ({"messages": CHAT, "presence_penalty": 3}, "presence_penalty", "in [-2, 2]"),
    ({"messages": CHAT, "stop": [""]}, "stop", "stop=[''] is invalid"),
    ({"messages": CHAT, "chat_template_kwargs": []}, "chat_template_kwargs", "valid dictionary"),
    ({"messages": CHAT, "use_beam_search": True}, "use_beam_search", "use_beam_search is not supported"),
    ({"messages": CHAT, "echo": True}, "echo", "echo is not supported"),
    ({"messages": CHAT, "documents": [{"title": "t", "text": "x"}]}, "documents",
     "documents is not supported"),
])
def test_bad_chat_bodies(body, param, says):
    error = _error(ChatCompletionRequest, body)
    assert error.info.param == param and says in error.info.message


@pytest.mark.parametrize("cap", [50, -1])
def test_logprob_counts_follow_the_servers_max_logprobs(cap):
    """``parse_request``'s context carries the engine's ``max_logprobs`` (vLLM's cap): counts up to it
    parse, one more is a 400 naming the field and the cap; -1 (the whole vocabulary) only uncapped."""
    def parse(body):
        request_type = ChatCompletionRequest if "messages" in body else CompletionRequest
        return parse_request(request_type, body, {"max_logprobs": cap}).to_sampling_params()

    def refused(body):
        with pytest.raises(APIError) as raised:
            parse(body)
        return raised.value.info.param, raised.value.info.message

    most = 50 if cap == 50 else 100_000
    assert parse({"messages": CHAT, "logprobs": True, "top_logprobs": most}).logprobs == most
    text = parse({"prompt": "hi", "logprobs": most, "prompt_logprobs": most})
    assert (text.logprobs, text.prompt_logprobs) == (most, most)
    if cap == 50:
        for body, param in [({"messages": CHAT, "logprobs": True, "top_logprobs": 51}, "top_logprobs"),
                            ({"prompt": "hi", "prompt_logprobs": 51}, "prompt_logprobs")]:
            name, message = refused(body)
            assert name == param and "in [0, 50]" in message
    else:
        assert parse({"messages": CHAT, "logprobs": True, "top_logprobs": -1}).logprobs == -1
        name, message = refused({"prompt": "hi", "logprobs": -2})
        assert name == "logprobs" and "-1 (the whole vocabulary) or >= 0" in message
        # the whole vocabulary's prompt logprobs are not streamed either
        assert refused({"prompt": "hi", "stream": True, "prompt_logprobs": -1})[0] == "prompt_logprobs"


def test_tool_choice_none_needs_no_tools():
    request = parse_request(ChatCompletionRequest, {"messages": CHAT, "tool_choice": "none"})
    assert request.tool_choice == "none" and request.tool_json_schema() is None


def test_lenient_where_openai_is():
    """Integral floats are integers, null is the default (a completion's max_tokens too), unknown
    fields are ignored."""
    body = {"prompt": "hi", "n": 2.0, "max_tokens": 8.0, "temperature": None, "user": "someone",
            "no_such_field": [1, 2]}
    request = parse_request(CompletionRequest, body)
    assert (request.n, request.max_tokens, request.temperature) == (2, 8, 1.0)
    assert isinstance(request.n, int)
    assert request.to_sampling_params() == SamplingParams(n=2, max_tokens=8)
    assert parse_request(CompletionRequest, {"prompt": "hi", "temperature": 0}).temperature == 0.0
    tiny = parse_request(ChatCompletionRequest, {"messages": CHAT, "temperature": 0.001})
    assert tiny.to_sampling_params().temperature == 0.01  # vLLM's floor for a sampled temperature
    assert not parse_request(ChatCompletionRequest, {"messages": CHAT, "echo": False, "documents": None}).echo
    # a completion's max_tokens too: vLLM's normalize_null_max_tokens makes null its default, 16
    explicit_null = parse_request(CompletionRequest, {"prompt": "hi", "max_tokens": None})
    assert explicit_null.max_tokens == 16 and explicit_null.to_sampling_params().max_tokens == 16
    assert parse_request(CompletionRequest, {"prompt": "hi"}).max_tokens == 16
    # chat's limits stay None (no limit) left out or null, as vLLM's fields default to None
    chat = parse_request(ChatCompletionRequest, {"messages": CHAT, "max_tokens": None,
                                                 "max_completion_tokens": None})
    assert chat.completion_limit is None and chat.to_sampling_params().max_tokens is None
    chat = parse_request(ChatCompletionRequest, {"messages": CHAT, "max_completion_tokens": None,
                                                 "max_tokens": 5})
    assert chat.to_sampling_params().max_tokens == 5


def test_completion_to_sampling_params_maps_every_field():
    body = {"prompt": "hi", "n": 2, "best_of": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1,
            "presence_penalty": 0.3, "frequency_penalty": -0.4, "repetition_penalty": 1.2, "seed": 11,
            "stop": ["a", "bc"], "stop_token_ids": [3, 4], "ignore_eos": True, "max_tokens": 40,
            "min_tokens": 5, "logprobs": 3, "prompt_logprobs": 2, "include_stop_str_in_output": True,
            "skip_special_tokens": False, "spaces_between_special_tokens": False,
            "logit_bias": {"7": -2.5, "9": 1}, "allowed_token_ids": [7, 9, 11], "vllm_xargs": {"tag": "x"},
            "bad_words": ["no"], "logprob_token_ids": [5, 6], "guided_choice": ["a", "b"],
            "truncate_prompt_tokens": 30, "stream_interval": 4, "routed_experts_prompt_start": 1,
            "repetition_detection": {"max_pattern_size": 8, "min_pattern_size": 2, "min_count": 3.0}}
    want = SamplingParams(n=2, temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, presence_penalty=0.3,
                          frequency_penalty=-0.4, repetition_penalty=1.2, seed=11, stop=["a", "bc"],
                          stop_token_ids=[3, 4], ignore_eos=True, max_tokens=40, min_tokens=5, logprobs=3,
                          prompt_logprobs=2, include_stop_str_in_output=True, skip_special_tokens=False,
                          spaces_between_special_tokens=False, logit_bias={7: -2.5, 9: 1.0},
                          allowed_token_ids=[7, 9, 11], extra_args={"tag": "x"}, bad_words=["no"],
                          logprob_token_ids=[5, 6], truncate_prompt_tokens=30,
                          structured_outputs=StructuredOutputsParams(choice=["a", "b"]),
                          repetition_detection=RepetitionDetectionParams(8, 2, 3), stream_interval=4,
                          routed_experts_prompt_start=1)
    default = SamplingParams()
    # output_kind follows "stream"; logits processors are Python callables, which JSON cannot carry;
    # fixed-token prompt scoring is offline only, as vLLM's OpenAI endpoints leave it out (its
    # /inference/v1/generate takes it, an endpoint pagedlab does not serve); a thinking budget takes no
    # grammar (the grammar would cover the thinking too): it comes below; skip_reading_prefix_cache is
    # offline too (vLLM's CompletionRequest and ChatCompletionRequest have no such field), and so is
    # trace replay (vLLM's is for offline debugging and RL: no OpenAI request field), and so is
    # flat_logprobs (vLLM's requests have no such field: its responses are JSON either way)
    offline_only = ("prompt_logprob_token_ids", "prompt_logprob_start", "skip_reading_prefix_cache",
                    "trace_decode_token_ids", "flat_logprobs")
    not_request_fields = ("detokenize", "output_kind", "guided_decoding", "logits_processors",
                          "thinking_token_budget", *offline_only)
    unmapped = [f.name for f in dataclasses.fields(SamplingParams)
                if getattr(want, f.name) == getattr(default, f.name) and f.name not in not_request_fields]
    assert unmapped == []  # the body sets every field away from its default
    assert parse_request(CompletionRequest, body).to_sampling_params() == want
    # unknown to the server, so ignored as any unknown field (vLLM's server ignores them too)
    scoring = {"prompt_logprob_token_ids": [5, 6], "prompt_logprob_start": 1,
               "skip_reading_prefix_cache": False, "trace_decode_token_ids": [5], "flat_logprobs": True}
    assert parse_request(CompletionRequest, {**body, **scoring}).to_sampling_params() == want
    assert parse_request(ChatCompletionRequest, {"messages": CHAT, **scoring}).to_sampling_params() == \
        SamplingParams(max_tokens=None)
    budgeted = {**{k: v for k, v in body.items() if k != "guided_choice"}, "thinking_token_budget": 64}
    assert parse_request(CompletionRequest, budgeted).to_sampling_params() == dataclasses.replace(
        want, structured_outputs=None, thinking_token_budget=64)
    # echo with logprobs asks for the prompt's logprobs too, at least as many
    echoed = parse_request(CompletionRequest, {**body, "echo": True, "prompt_logprobs": None})
    assert echoed.to_sampling_params() == dataclasses.replace(want, prompt_logprobs=3)
    assert parse_request(CompletionRequest, {"prompt": "hi", "stop": "x"}).to_sampling_params().stop == ["x"]
    assert parse_request(CompletionRequest, {"prompt": "hi", "top_k": -1}).to_sampling_params().top_k == 0


def test_chat_to_sampling_params():
    body = {"messages": CHAT, "n": 3, "temperature": 0.7, "top_p": 0.8, "seed": 5, "stop": "x",
            "max_tokens": 50, "max_completion_tokens": 12, "logprobs": True, "top_logprobs": 4,
            "min_tokens": 2, "top_k": 9, "repetition_penalty": 1.1, "ignore_eos": True,
            "repetition_detection": {"max_pattern_size": 5, "min_count": 4}, "thinking_token_budget": 0}
    want = SamplingParams(n=3, temperature=0.7, top_p=0.8, seed=5, stop=["x"], max_tokens=12, logprobs=4,
                          min_tokens=2, top_k=9, repetition_penalty=1.1, ignore_eos=True,
                          repetition_detection=RepetitionDetectionParams(max_pattern_size=5, min_count=4),
                          thinking_token_budget=0)
    assert parse_request(ChatCompletionRequest, body).to_sampling_params() == want
    plain = parse_request(ChatCompletionRequest, {"messages": CHAT, "max_tokens": 50, "logprobs": True})
    assert plain.to_sampling_params() == SamplingParams(max_tokens=50, logprobs=0)
    unlimited = parse_request(ChatCompletionRequest, {"messages": CHAT}).to_sampling_params()
    assert unlimited.max_tokens is None and unlimited.logprobs is None
    # as vLLM: top_logprobs 0 asks for nothing, so it needs no logprobs flag
    no_alternatives = parse_request(ChatCompletionRequest, {"messages": CHAT, "top_logprobs": 0})
    assert no_alternatives.to_sampling_params().logprobs is None


def test_prompt_forms_and_conversation():
    assert parse_request(CompletionRequest, {"prompt": "a"}).prompt_list() == ["a"]
    assert parse_request(CompletionRequest, {"prompt": [1, 2]}).prompt_list() == [[1, 2]]
    assert parse_request(CompletionRequest, {"prompt": ["a", [1, 2]]}).prompt_list() == ["a", [1, 2]]
    assert parse_request(CompletionRequest, {"prompt": [[1], [2, 3]]}).prompt_list() == [[1], [2, 3]]
    request = parse_request(ChatCompletionRequest, {"messages": [
        {"role": "system", "content": None, "name": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]})
    assert request.conversation() == [{"role": "system", "name": "rules", "content": ""},
                                      {"role": "user", "content": "one\ntwo"}]


def test_response_bodies_leave_out_what_openai_leaves_out():
    choice = CompletionResponseChoice(index=0, text="x")
    assert choice.model_dump() == {"index": 0, "text": "x", "logprobs": None, "finish_reason": None,
                                   "stop_reason": None}
    choice.token_ids, choice.prompt_token_ids = [5], [1, 2]
    assert choice.model_dump()["token_ids"] == [5] and choice.model_dump()["prompt_token_ids"] == [1, 2]
    chunk = CompletionStreamResponse(id="c", created=1, model="m", choices=[choice])
    assert "usage" not in chunk.model_dump() and chunk.model_dump()["object"] == "text_completion"
    chunk.usage = UsageInfo(prompt_tokens=2, completion_tokens=1, total_tokens=3)
    assert chunk.model_dump()["usage"] == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    cached = UsageInfo(prompt_tokens=2, completion_tokens=1, total_tokens=3,
                       prompt_tokens_details=PromptTokensDetails(cached_tokens=2))
    assert '"prompt_tokens_details":{"cached_tokens":2}' in cached.model_dump_json()
    assert DeltaMessage(content="a").model_dump() == {"content": "a"}
    assert DeltaMessage(role="assistant", content="").model_dump() == {"role": "assistant", "content": ""}
    error = APIError(404, "no such model", param="model", code="model_not_found").response()
    assert error.model_dump() == {"error": {"message": "no such model", "type": "invalid_request_error",
                                            "param": "model", "code": "model_not_found"}}


def test_error_messages_quote_long_values_shortly():
    error = _error(CompletionRequest, {"prompt": "hi", "stop_token_ids": "x" * 10_000}).info
    assert error.param == "stop_token_ids" and len(error.message) < 200
    assert "... is not valid for 'stop_token_ids': expected an array of token ids" in error.message
