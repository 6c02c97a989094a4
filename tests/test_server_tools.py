"""Tool calling in chat completions, against vLLM's semantics: request validation (vLLM's messages),
named and "required" tool_choice constrained by the tools' schemas (checked with jsonschema), the
hermes and llama3_json parsers on the texts vLLM's own parser tests use, "auto" end to end (a
regex forces the model's text), streams whose deltas add up to the full response, and the chat
template receiving the tools. A tiny random Llama with a real tokenizer, served live."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedlab import LLM
from pagedlab.engine.async_engine import AsyncEngine
from pagedlab.server.tool_parsers import HermesToolParser, Llama3JsonToolParser, tool_parser_named
from test_server_support import TINY_KV_BYTES, build_tiny_chat_model

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from pagedlab.server.app import ServerThread, build_app  # noqa: E402
from pagedlab.server.cli import add_serve_args, tool_calling_from_args  # noqa: E402
from pagedlab.server.errors import APIError  # noqa: E402
from pagedlab.server.protocol import ChatCompletionRequest, parse_request  # noqa: E402
from pagedlab.server.serving_tools import ToolCalling  # noqa: E402

# renders the tools as Qwen's template does: a JSON line per tool in the system turn
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</s>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}{{ c['function']['arguments']['city'] }}{% endfor %}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
WEATHER = {"type": "object",
           "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "days": {"enum": [1, 2, 3]}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
# TOOLS as vLLM hands them to the chat template: each whole, type, then function's name,
# description (null when absent) and parameters
TEMPLATE_TOOLS = [{"type": "function", "function": {"name": t["function"]["name"],
                                                     "description": t["function"].get("description"),
                                                     "parameters": t["function"]["parameters"]}}
                  for t in TOOLS]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Two servers on one engine: one without tool flags, one with --enable-auto-tool-choice hermes."""
    model_dir = build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"), max_position_embeddings=1024)
    llm = LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES)
    engine = AsyncEngine.from_llm(llm)
    plain = build_app(engine, served_model_names=["tiny"], chat_template=TOOLS_TEMPLATE, enable_metrics=False)
    auto = build_app(engine, served_model_names=["tiny"], chat_template=TOOLS_TEMPLATE, enable_metrics=False,
                     tool_calling={"tool_call_parser": "hermes", "enable_auto_tool_choice": True})
    with ServerThread(plain) as p, ServerThread(auto) as a:
        yield {"plain": p.url, "auto": a.url, "app": plain, "tokenizer": llm.get_tokenizer(),
               "engine": engine}
    engine.shutdown()
    llm.close()


def _chat(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, **body},
                      timeout=60)


def _request(**body) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"messages": MESSAGES, **body})


def _streamed(url: str, **body) -> tuple[str, dict[int, dict], str, list[dict]]:
    """(content, calls by index with id/name/arguments, finish_reason, the tool-call deltas) of a stream;
    the finish_reason comes with the choice's last chunk only."""
    content, calls, finish, deltas = "", {}, None, []
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                      json={"messages": MESSAGES, "tools": TOOLS, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            assert finish is None, "a chunk after the one with the finish_reason"  # OpenAI's: the last only
            choice = json.loads(line[6:])["choices"][0]
            content += choice["delta"].get("content") or ""
            for d in choice["delta"].get("tool_calls") or []:
                deltas.append(d)
                call = calls.setdefault(d["index"], {"id": d.get("id"), "name": "", "arguments": ""})
                call["name"] += d.get("function", {}).get("name") or ""
                call["arguments"] += d.get("function", {}).get("arguments") or ""
            finish = choice["finish_reason"]
    return content, calls, finish, deltas


def _assert_stream_equals(url: str, **body) -> dict:
    """The streamed deltas add up to the full response (content, calls, and their ids' form)."""
    body.setdefault("temperature", 0)
    full = _chat(url, **body)
    assert full.status_code == 200, full.text
    choice = full.json()["choices"][0]
    content, calls, _, deltas = _streamed(url, **body)
    assert content == (choice["message"]["content"] or "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (t["function"]["name"], t["function"]["arguments"]) for t in choice["message"]["tool_calls"]]
    for call in calls.values():  # the first delta of a call carries its id and type, the later ones not
        assert call["id"].startswith("chatcmpl-tool-")
    assert all(d.get("type") == "function" for d in deltas if "id" in d)
    return choice


# ---- request validation (vLLM's messages) --------------------------------------------------------
@pytest.mark.parametrize("body, says", [
    ({"tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set."),
    ({"tools": TOOLS, "tool_choice": "any"},
     'Invalid value for `tool_choice`: any! Only named tools, "none"'),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "Invalid value for `function`: `None`"),
    # vLLM's named tool choice is {"type": "function", ...}: another type is no named choice
    ({"tools": TOOLS, "tool_choice": {"type": "retrieval", "function": {"name": "get_weather"}}},
     "Invalid value for `function`"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
     "Expected field `name` in `function` in `tool_choice`!"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": ""}}}, "Invalid `name`"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "The tool specified in `tool_choice` does not match any of the specified `tools`"),
    ({"tools": []}, "`tools` must not be an empty array."),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "'tools[0].function.name'"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"functions": [{"name": "f"}]}, "functions (OpenAI's deprecated form of tools) are not supported"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "not both"),
])
def test_bad_tool_requests_are_400s(body, says):
    with pytest.raises(APIError) as e:
        _request(**body).to_sampling_params()
    assert e.value.status == 400 and says in e.value.info.message


def test_tool_choice_defaults_as_vllm():
    with_tools = _request(tools=TOOLS)
    assert with_tools.tool_choice == "auto" and with_tools.parallel_tool_calls is True
    assert _request().tool_choice == "none"
    assert _request(tool_choice="none").tools is None


def test_auto_needs_the_server_flags(served):
    r = _chat(served["plain"], max_tokens=2)  # tools without tool_choice: "auto"
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ('"auto" tool choice requires --enable-auto-tool-choice and '
                                            "--tool-call-parser to be set")
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        tool_parser_named(None, True)
    with pytest.raises(ValueError, match="--tool-call-parser 'mistral' is invalid"):
        tool_parser_named("mistral", True)
    # vLLM reads calls out of the text only with both flags: a parser alone leaves "auto" refused
    assert tool_parser_named("hermes", False) is None


# ---- named and "required" ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_tool_choice_returns_schema_valid_arguments(served, name):
    # seeded sampling: greedy, the random weights would pad JSON with whitespace up to max_tokens
    named = {"type": "function", "function": {"name": name}}
    seeded = {"max_tokens": 120, "temperature": 1.0, "seed": 1}
    choice = _assert_stream_equals(served["plain"], tool_choice=named, **seeded)
    message = choice["message"]
    assert message["content"] == "" and choice["finish_reason"] == "stop"  # vLLM's, for a named choice
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == name
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
    *_, finish, deltas = _streamed(served["plain"], tool_choice=named, **seeded)
    assert finish == "tool_calls" and deltas[0]["function"]["name"] == name
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in deltas[1:])


def test_named_tool_without_parameters_gets_an_object_of_arguments(served):
    """A tool without ``parameters`` takes none: its call's arguments are still a JSON object (the
    OpenAI SDK's ``json.loads(arguments)``), as a "required" call's are in vLLM."""
    tools = [TOOLS[0], {"type": "function", "function": {"name": "now"}}]
    named = {"type": "function", "function": {"name": "now"}}
    r = _chat(served["plain"], tools=tools, tool_choice=named, max_tokens=60, temperature=1.0, seed=1)
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "now" and isinstance(json.loads(call["function"]["arguments"]), dict)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_returns_calls_of_the_given_tools(served, parallel):
    choice = _assert_stream_equals(served["plain"], tool_choice="required", max_tokens=300, seed=5,
                                   temperature=1.0, parallel_tool_calls=parallel)
    calls = choice["message"]["tool_calls"]
    assert calls and choice["message"]["content"] == "" and choice["finish_reason"] == "stop"
    # seed 5 makes two calls; without parallel_tool_calls, only the first is returned
    assert len(calls) == (2 if parallel else 1)
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def _tool_schema(tools: list[dict], tool_choice) -> dict:
    return _request(tools=tools, tool_choice=tool_choice).to_sampling_params().structured_outputs.json


def test_required_schema_takes_one_or_more_calls_of_the_given_tools():
    """vLLM's "required" schema: an array of at least one ``{"name", "parameters"}`` object, the
    name one of the tools' and the parameters that tool's."""
    schema = _tool_schema(TOOLS, "required")
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "UTC"}},
                         {"name": "get_weather", "parameters": {"city": "Tokyo", "days": 1}}], schema)
    for bad in ([], [{"name": "get_time"}], [{"name": "get_date", "parameters": {"zone": "UTC"}}],
                [{"name": "get_time", "parameters": {"city": "Tokyo", "days": 1}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_schema_gathers_the_tools_defs_at_its_root():
    """A tool's ``$ref`` to its ``$defs`` resolves in the array schema, as vLLM moves the tools'
    definitions to its root; one definition name with two schemas is vLLM's 400."""
    city = {"enum": ["Paris", "Tokyo"]}
    weather = {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"],
               "$defs": {"City": city}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}, TOOLS[1]]
    schema = _tool_schema(tools, "required")
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Rome"}}], schema)
    clash = {"type": "object", "properties": {"town": {"$ref": "#/$defs/City"}},
             "$defs": {"City": {"type": "string"}}}
    tools.append({"type": "function", "function": {"name": "get_town", "parameters": clash}})
    with pytest.raises(APIError) as e:
        _tool_schema(tools, "required")
    assert e.value.status == 400 and "Tool definition 'City' has multiple schemas" in e.value.info.message


def test_non_ascii_arguments_are_kept_as_is():
    """vLLM writes arguments with ``json.dumps(..., ensure_ascii=False)``: "Zürich", not "Z\\u00fcrich"."""
    args = {"city": "Zürich"}
    required = ToolCalling(_request(tools=TOOLS, tool_choice="required"), None)
    _, calls, _ = required.message(json.dumps([{"name": "get_weather", "parameters": args}]), "stop")
    hermes = HermesToolParser().extract(f"<tool_call>{json.dumps({'name': 'f', 'arguments': args})}")
    llama = Llama3JsonToolParser().extract(json.dumps({"name": "f", "parameters": args}))
    for call in (calls[0].function, hermes.calls[0], llama.calls[0]):
        assert call.arguments == json.dumps(args, ensure_ascii=False)


# ---- "auto" ----------------------------------------------------------------------------------------
HERMES_CASES = [  # vLLM's hermes parser tests' outputs
    ("<tool_call>\n" + CALL + "\n</tool_call>", None, [("get_weather", {"city": "Paris", "days": 2})]),
    ("I'll check. <tool_call>" + CALL + "</tool_call>\n<tool_call>"
     '{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>', "I'll check. ",
     [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "UTC"})]),
    ("<tool_call>" + CALL, None, [("get_weather", {"city": "Paris", "days": 2})]),  # unclosed last block
    ("This is a test", "This is a test", []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', None, []),  # malformed JSON
    ('<tool_call>{"arguments": {}}</tool_call>', None, []),  # no name
]
LLAMA_CASES = [  # vLLM's llama3_json parser tests' outputs
    ('Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} Would you like to know more?',
     "Here is the result: ", [("getOpenIncidentsTool", {})]),
    ('{"name": "searchTool", "parameters": {"query": "test1"}} ; {"name": "getOpenIncidentsTool", '
     '"parameters": {}} ; {"name": "searchTool", "arguments": {"query": "test2"}}', None,
     [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}), ("searchTool", {"query": "test2"})]),
    ('{"name": "complexTool", "parameters": '
     '{"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}}}',
     None, [("complexTool", {"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}})]),
    ('<|python_tag|>{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}', None,
     [("parserTool", {"text": 'He said "Hello {world}"'})]),
    ("This is just some text without any tool calls", "This is just some text without any tool calls", []),
    ('{"name": "invalidTool", "parameters": {invalid json}', None, []),
    ('{"parameters": {}}', None, []),
    ('{"name": "toolWithoutParams"}', None, []),
    # a ';' that no call follows ends the calls (vLLM's regex matches up to the last object)
    ('{"name": "searchTool", "parameters": {"query": "a"}};', None, [("searchTool", {"query": "a"})]),
    ('{"name": "searchTool", "parameters": {"query": "a"}} ; done', None, [("searchTool", {"query": "a"})]),
    # both keys: vLLM takes "arguments"
    ('{"name": "f", "parameters": {"p": 1}, "arguments": {"a": 2}}', None, [("f", {"a": 2})]),
]


@pytest.mark.parametrize("parser, text, content, calls", [
    *[(HermesToolParser(), *case) for case in HERMES_CASES],
    *[(Llama3JsonToolParser(), *case) for case in LLAMA_CASES]])
def test_parsers_on_vllm_examples(parser, text, content, calls):
    found = parser.extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == calls
    assert found.content == (content if calls else text)  # no calls: the text, whole, is the content


def test_parser_holds_back_a_marker_split_across_deltas():
    hermes = HermesToolParser()
    assert hermes.hold_from("Sure <tool") == 5 and hermes.hold_from("Sure <tool_call>{") == 5
    assert hermes.hold_from("a < b") == 5
    assert Llama3JsonToolParser().hold_from('ok {"name"') == 3
    # the first marker: the full response drops the tag before the call, so the stream holds it too
    assert Llama3JsonToolParser().hold_from('<|python_tag|>{"name"') == 0
    assert hermes.hold_from("Sure <tool_call") == 5  # all but the marker's last character


@pytest.mark.parametrize("prefix", ["", "Sure. "])
def test_auto_hermes_end_to_end(served, prefix):
    forced = {"guided_regex": prefix.replace(".", r"\.") + r"<tool_call>" + CALL.replace("{", r"\{").replace(
        "}", r"\}") + r"</tool_call>", "max_tokens": 120}
    choice = _assert_stream_equals(served["auto"], **forced)
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == (prefix or None)
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}


def test_auto_without_calls_is_plain_content(served):
    choice = _assert_stream_equals(served["auto"], guided_regex="plain answer", max_tokens=40)
    assert choice["message"] == {"role": "assistant", "content": "plain answer", "tool_calls": []}
    assert choice["finish_reason"] == "stop"


def test_tool_choice_none_is_never_parsed_for_calls(served):
    """vLLM's tool_choice "none" returns the text as content, even on a server whose parser would
    read a call out of it."""
    text = "<tool_call>" + CALL + "</tool_call>"
    forced = text.replace("{", r"\{").replace("}", r"\}")
    choice = _assert_stream_equals(served["auto"], tool_choice="none", guided_regex=forced, max_tokens=120)
    assert choice["message"] == {"role": "assistant", "content": text, "tool_calls": []}
    assert choice["finish_reason"] == "stop"


def test_hermes_keeps_special_tokens_in_the_text(served):
    """vLLM's hermes parser turns ``skip_special_tokens`` off when the request has tools (and
    tool_choice is not "none"): its call markers are special tokens in some tokenizers. A special
    token the model writes then stays in the text, as transformers decodes it."""
    tokenizer = served["tokenizer"]
    special = tokenizer.convert_tokens_to_ids("<|system|>")
    only_special = {"allowed_token_ids": [special], "max_tokens": 2, "temperature": 0}
    kept = _chat(served["auto"], **only_special).json()["choices"][0]["message"]
    assert kept["content"] == tokenizer.decode([special] * 2, skip_special_tokens=False)
    skipped = _chat(served["auto"], tool_choice="none", **only_special).json()["choices"][0]["message"]
    assert skipped["content"] == tokenizer.decode([special] * 2, skip_special_tokens=True) == ""


# ---- the chat template gets the tools -------------------------------------------------------------
def test_chat_template_receives_tools_and_earlier_calls(served):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Tokyo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    serving = served["app"].state.serving_chat
    tokenizer = served["tokenizer"]
    for choice in ("none", "required"):
        request = _request(messages=history, tools=TOOLS, tool_choice=choice)
        template_history = [{**m, "content": m["content"] or ""} for m in json.loads(json.dumps(history))]
        template_history[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Tokyo", "days": 1}
        want = tokenizer.apply_chat_template(template_history, tools=TEMPLATE_TOOLS,
                                             chat_template=TOOLS_TEMPLATE, add_generation_prompt=True,
                                             tokenize=False)
        assert '"name": "get_time"' in want and "Tokyo</s>" in want
        assert serving.render(request).token_ids == tokenizer.encode(want, add_special_tokens=False)
    # /tokenize renders the tools too, as vLLM's, on a server without auto tool choice
    tokenized = httpx.post(served["plain"] + "/tokenize", json={"messages": history, "tools": TOOLS},
                           timeout=60)
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == tokenizer.encode(want, add_special_tokens=False)


def test_exclude_tools_when_tool_choice_none_flag(served):
    """vLLM's --exclude-tools-when-tool-choice-none: a tool_choice "none" request's tools stay out
    of the template (what transformers renders without ``tools``); other tool choices keep them."""
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    flags = parser.parse_args(["--model", "m", "--exclude-tools-when-tool-choice-none"])
    app = build_app(served["engine"], served_model_names=["tiny"], chat_template=TOOLS_TEMPLATE,
                    enable_metrics=False, tool_calling=tool_calling_from_args(flags))
    tokenizer = served["tokenizer"]
    for choice, tools in (("none", None), ("required", TEMPLATE_TOOLS)):
        rendered = app.state.serving_chat.render(_request(tools=TOOLS, tool_choice=choice))
        want = tokenizer.apply_chat_template(MESSAGES, tools=tools, chat_template=TOOLS_TEMPLATE,
                                             add_generation_prompt=True, tokenize=False)
        assert ("get_time" in want) is (tools is not None)
        assert rendered.token_ids == tokenizer.encode(want, add_special_tokens=False)


# Llama 3.1's check: an assistant message with a 'tool_calls' key must hold exactly one call
LLAMA31_CALLS_TEMPLATE = (
    "{% for m in messages %}{% if 'tool_calls' in m %}{% if not m.tool_calls | length == 1 %}"
    "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m.tool_calls[0].function.name }}"
    "{{ m.tool_calls[0].function.arguments | tojson }}"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endif %}</s>\n{% endfor %}<|assistant|>\n")


def _rendered(served, messages: list[dict]) -> list[int]:
    request = parse_request(ChatCompletionRequest,
                            {"messages": messages, "chat_template": LLAMA31_CALLS_TEMPLATE})
    return served["app"].state.serving_chat.render(request).token_ids


def _rendered_by_transformers(served, messages: list[dict]) -> list[int]:
    text = served["tokenizer"].apply_chat_template(messages, chat_template=LLAMA31_CALLS_TEMPLATE,
                                                   add_generation_prompt=True, tokenize=False)
    return served["tokenizer"].encode(text, add_special_tokens=False)


@pytest.mark.parametrize("arguments", ["", None])
def test_earlier_calls_without_arguments_reach_the_template_as_empty_objects(served, arguments):
    """vLLM hands a call whose arguments are "" or null (a tool without parameters, as agents
    replay it) to the template as {}, rather than refusing the conversation."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": arguments}}
    history = MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    template_history = json.loads(json.dumps(history))
    template_history[1]["tool_calls"][0]["function"]["arguments"] = {}
    assert _rendered(served, history) == _rendered_by_transformers(served, template_history)


def test_assistant_messages_without_calls_reach_the_template_without_tool_calls(served):
    """A replayed assistant answer with ``tool_calls: []`` (as this server's own responses carry
    it) reaches the template without the key, as vLLM hands it over: templates such as Llama
    3.1's take any message with the key for a tool call."""
    history = MESSAGES + [{"role": "assistant", "content": "It is sunny.", "tool_calls": []},
                          {"role": "user", "content": "Thanks"}]
    without = [{k: v for k, v in m.items() if k != "tool_calls"} for m in history]
    assert _rendered(served, history) == _rendered_by_transformers(served, without)
