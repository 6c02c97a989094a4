"""Structured outputs (issue 18): every output parses and validates against its JSON schema, regex,
choice or grammar; greedy tokens are the same with synchronous and asynchronous steps, offline
and through the server; a request without a grammar is unchanged beside ones with; without
xgrammar a structured request is a clear error and nothing else breaks. A tiny random Llama
with a real tokenizer (test_server_support); SmolLM2 is in test_server_smollm2."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from pagedlab import LLM, SamplingParams
from pagedlab.engine.async_engine import AsyncEngine
from pagedlab.engine.structured_output import GrammarCompiler, grammar_bitmask
from pagedlab.layers.sampler import apply_token_bitmask
from pagedlab.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from test_server_support import TINY_KV_BYTES, build_tiny_chat_model


# Finite languages, so even a random model ends each output within max_tokens.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "count", "ok"],
          "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}}}
REGEX = r"(cat|dog)-[0-9]{2}"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'root ::= "(" item ("," item)? ")"\nitem ::= "x" | "yy"'
PROMPTS = ["Why is the sky blue? Because", "Question: what is two plus two?"]
MAX_TOKENS = 48


def _specs() -> list[StructuredOutputsParams]:
    return [StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
            StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(choice=CHOICES),
            StructuredOutputsParams(grammar=GRAMMAR)]


def check_output(spec: StructuredOutputsParams, text: str) -> None:
    """``text`` is a sentence of ``spec``'s language."""
    if spec.json is not None:
        import jsonschema

        jsonschema.validate(json.loads(text), spec.json)
    elif spec.json_object:
        assert isinstance(json.loads(text), dict)
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice
    else:
        assert re.fullmatch(r"\((x|yy)(,(x|yy))?\)", text), text


def test_token_bitmask_matches_a_boolean_mask():
    g = torch.Generator().manual_seed(0)
    vocab, rows = 77, torch.tensor([0, 2])
    allowed = torch.rand(2, vocab, generator=g) < 0.3
    words = []
    for row in allowed.tolist():  # pack by hand: bit t % 32 of word t // 32
        packed = [sum(1 << b for b in range(32) if w * 32 + b < vocab and row[w * 32 + b]) for w in range(3)]
        words.append([p - (1 << 32) if p >= 1 << 31 else p for p in packed])  # as int32
    logits = torch.randn(3, vocab, generator=g)
    want = logits.clone()
    want[rows] = want[rows].masked_fill(~allowed, float("-inf"))
    got = apply_token_bitmask(logits.clone(), rows, torch.tensor(words, dtype=torch.int32))
    assert torch.equal(got, want)
    short = apply_token_bitmask(logits.clone(), rows, torch.tensor(words, dtype=torch.int32)[:, :2])
    assert torch.isinf(short[rows, 64:]).all()  # ids past the packed width are not allowed


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    pytest.importorskip("xgrammar")
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module")
def compiler(tiny_dir) -> GrammarCompiler:
    """The tiny tokenizer's grammars, ending on EOS (2) or a second stop id, 7 (say, a chat's end-of-turn)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    return GrammarCompiler(tokenizer, len(tokenizer), (2, 7))


def _accepts(compiler: GrammarCompiler, spec: StructuredOutputsParams, text: str) -> bool:
    """Whether ``text`` is a whole sentence of ``spec``'s language."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiler.compile(spec))
    return matcher.accept_string(text) and matcher.is_completed()


def test_choice_grammar_is_exactly_its_choices(compiler):
    choices = ['say "hi"', "a\\b", "caf\u00e9", "ab", "abc"]  # JSON escapes, non-ASCII, a prefix of another
    spec = StructuredOutputsParams(choice=choices)
    assert all(_accepts(compiler, spec, c) for c in choices)
    assert not any(_accepts(compiler, spec, t) for t in ("say hi", "a", "abd", "sayhi", "ab abc", "abcab"))


def test_disable_any_whitespace_leaves_json_compact(compiler):
    """vLLM's disable_any_whitespace: no whitespace of the model's choosing (the one compact form
    xgrammar writes), for a schema and for json_object; without it any whitespace is valid JSON."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    spaced = ['{ "a": 1 }', '{\n  "a": 1\n}', '{"a" :1}']
    for spec in (dict(json=schema), dict(json_object=True)):
        compact = StructuredOutputsParams(**spec, disable_any_whitespace=True)
        assert any(_accepts(compiler, compact, t) for t in ('{"a":1}', '{"a": 1}'))
        assert not any(_accepts(compiler, compact, t) for t in spaced)
        assert all(_accepts(compiler, StructuredOutputsParams(**spec), t) for t in spaced)


def test_json_object_is_any_object_and_a_schema_string_is_its_dict(compiler):
    anything = StructuredOutputsParams(json_object=True)
    assert all(_accepts(compiler, anything, t) for t in ("{}", '{"x": [1, {"y": null}]}'))
    assert not any(_accepts(compiler, anything, t) for t in ("[1]", "3", '"x"', "null"))
    as_text = StructuredOutputsParams(json=json.dumps(SCHEMA))
    assert _accepts(compiler, as_text, '{"answer": "yes", "count": 3, "ok": true}')
    assert not any(_accepts(compiler, as_text, t) for t in ('{"answer": "perhaps", "count": 3, "ok": true}',
                                                           '{"answer": "yes"}', '"text"'))


def _allowed(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1}


def test_bitmask_rows_follow_their_grammars_and_the_model_stop_ids(compiler):
    """Each row allows what its own grammar allows next; a finished sentence allows exactly the
    stop ids the compiler was given (EOS and 7); a batch larger than the first buffer gets a row
    each. A token the grammar does not allow is refused, and none once it has ended."""
    vocab, encode = compiler.vocab_size, compiler.tokenizer.convert_tokens_to_ids
    spec = StructuredOutputsParams(choice=["xy", "zw"])
    first = {encode("x"), encode("z")}
    one = grammar_bitmask([compiler.matcher(spec)])
    assert one.shape == (1, (vocab + 31) // 32) and _allowed(one, 0, vocab) == first
    grammars = [compiler.matcher(spec) for _ in range(70)]
    for i, g in enumerate(grammars):
        for token in ("xy", "z", "")[i % 3]:
            assert g.accept(encode(token))
    assert not grammars[2].accept(encode("y")) and not grammars[2].is_terminated
    bitmask = grammar_bitmask(grammars)
    assert bitmask.shape == (70, (vocab + 31) // 32)
    expected = [{2, 7}, {encode("w")}, first]
    assert all(_allowed(bitmask, i, vocab) == expected[i % 3] for i in range(70))
    assert grammars[0].accept(7) and grammars[0].is_terminated and not grammars[0].accept(2)


def test_a_lark_grammar_is_read_as_lark(compiler):
    """vLLM's rule: a grammar with no ``::=`` rule is Lark (xgrammar's compile_lark), else EBNF;
    the two spellings of GRAMMAR give the same language."""
    lark = '// the same language as GRAMMAR\nstart: "(" item ("," item)? ")"\nitem: "x" | "yy"'
    for grammar in (GRAMMAR, lark):
        spec = StructuredOutputsParams(grammar=grammar)
        assert all(_accepts(compiler, spec, t) for t in ("(x)", "(yy,x)"))
        assert not any(_accepts(compiler, spec, t) for t in ("()", "(x,x,x)", "x"))


def test_request_stop_ids_are_masked_until_the_grammar_is_complete(compiler):
    vocab, encode = compiler.vocab_size, compiler.tokenizer.convert_tokens_to_ids
    grammar = compiler.matcher(StructuredOutputsParams(choice=["xy", "zw"]), (31, encode("x"), 2))
    assert _allowed(grammar_bitmask([grammar]), 0, vocab) == {encode("z")}  # "x" is a stop id now
    assert grammar.accept(encode("z")) and grammar.accept(encode("w"))
    assert _allowed(grammar_bitmask([grammar]), 0, vocab) == {2, 7, 31, encode("x")}  # 31: the sign bit
    assert grammar.accept(31)


def test_compile_errors_name_the_field(compiler):
    for spec, field in ((StructuredOutputsParams(json={"type": "objectx"}), "json"),
                        (StructuredOutputsParams(regex="(ab"), "regex"),
                        (StructuredOutputsParams(grammar="root ::= item"), "grammar")):
        with pytest.raises(ValueError, match=rf"^{field}=.* is invalid: xgrammar could not compile it"):
            compiler.compile(spec)


# Schemas whose keyword xgrammar compiles without enforcing it (the first instance breaks the schema
# yet xgrammar accepts it): vLLM's xgrammar backend refuses them (has_xgrammar_unsupported_json_features).
UNENFORCED_SCHEMAS = [
    ({"type": "number", "multipleOf": 0.5}, "0.3", "multipleOf"),
    ({"type": "integer", "multipleOf": 2.5}, "3", "multipleOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", "uniqueItems"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}, "maxContains": 1}, "[3, 3]",
     "contains"),
    ({"type": "object", "properties": {"re": {"type": "string", "format": "regex"}}}, '{"re": "("}',
     "format"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aaaa"', "maxLength"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}, "properties": {"b": {"type": "integer"}}},
     '{"b": 1}', "propertyNames"),
]


@pytest.mark.parametrize("schema, breaking, keyword", UNENFORCED_SCHEMAS)
def test_schemas_xgrammar_cannot_enforce_are_refused(compiler, schema, breaking, keyword):
    import jsonschema
    import xgrammar

    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(breaking), schema, format_checker=jsonschema.FormatChecker())
    compiled = compiler._xgrammar_compiler().compile_json_schema(json.dumps(schema))
    assert xgrammar.GrammarMatcher(compiled).accept_string(breaking)  # xgrammar alone lets it through
    for spec in (StructuredOutputsParams(json=schema), StructuredOutputsParams(json=json.dumps(schema))):
        with pytest.raises(ValueError, match=rf"^json=.* is invalid: .*{keyword}"):
            compiler.compile(spec)


def test_schema_keywords_xgrammar_enforces_are_kept(compiler):
    """An integral multipleOf of an integer, a supported format, a lone maxLength: all enforced."""
    for schema, breaking in (({"type": "integer", "multipleOf": 5}, "7"),
                             ({"type": "string", "format": "ipv4"}, '"host"'),
                             ({"type": "string", "maxLength": 2}, '"abc"')):
        assert not _accepts(compiler, StructuredOutputsParams(json=schema), breaking)


@pytest.fixture(scope="module")
def offline(tiny_dir):
    """Greedy outputs of each prompt under each grammar, with synchronous and asynchronous steps,
    plus a plain request run alone and beside the structured ones."""
    results = {}
    for async_scheduling in (False, True):
        with LLM(tiny_dir, kv_cache_memory_bytes=TINY_KV_BYTES, async_scheduling=async_scheduling) as llm:
            params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=s)
                      for s in _specs()]
            plain = SamplingParams(temperature=0, max_tokens=12)
            prompts = [p for p in PROMPTS for _ in params] + [PROMPTS[0]]
            outs = llm.generate(prompts, params * len(PROMPTS) + [plain], use_tqdm=False)
            alone = llm.generate(PROMPTS[0], plain, use_tqdm=False)[0]
            results[async_scheduling] = {"outs": outs, "alone": alone}
    return results


def test_outputs_validate_and_sync_equals_async(offline):
    specs = _specs() * len(PROMPTS)
    for async_scheduling in (False, True):
        outs = offline[async_scheduling]["outs"]
        for spec, out in zip(specs, outs):
            c = out.outputs[0]
            assert c.finish_reason == "stop", (spec.kind, c.text)
            check_output(spec, c.text)
        plain = outs[-1].outputs[0]
        assert plain.token_ids == offline[async_scheduling]["alone"].outputs[0].token_ids
    assert ([o.outputs[0].token_ids for o in offline[False]["outs"]]
            == [o.outputs[0].token_ids for o in offline[True]["outs"]])


def test_speculative_decoding_under_grammars_gives_plain_decodings_tokens(tiny_dir, offline):
    """Proposals (the model as its own draft, and n-gram prompt lookup) for grammar requests: each
    sampled row's bitmask reads the proposed tokens before it as accepted, so greedy and seeded
    outputs are plain decoding's, stop ids waiting for the grammar included; some proposals are
    accepted (the draft proposes unconstrained, so the grammar rejects others)."""
    import transformers

    digits = transformers.AutoTokenizer.from_pretrained(tiny_dir).convert_tokens_to_ids(list("01234"))
    specs = _specs()
    greedy = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=s) for s in specs]
    seeded = [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS, structured_outputs=s,
                             stop_token_ids=digits if s.regex else None) for i, s in enumerate(specs)]
    prompts = [p for p in PROMPTS for _ in specs]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    with LLM(tiny_dir, kv_cache_memory_bytes=TINY_KV_BYTES) as llm:
        plain = llm.generate(prompts, seeded * len(PROMPTS), use_tqdm=False)
        for config in ({"model": tiny_dir, "num_speculative_tokens": 3}, ngram):
            llm.set_model_args(speculative_config=config)
            llm.reset_stats()
            spec_greedy = llm.generate(prompts + [PROMPTS[0]], greedy * len(PROMPTS)
                                       + [SamplingParams(temperature=0, max_tokens=12)], use_tqdm=False)
            spec_seeded = llm.generate(prompts, seeded * len(PROMPTS), use_tqdm=False)
            assert ([o.outputs[0].token_ids for o in spec_greedy]
                    == [o.outputs[0].token_ids for o in offline[False]["outs"]]), config
            assert [o.outputs[0].token_ids for o in spec_seeded] == [o.outputs[0].token_ids for o in plain]
            for spec, out in zip(specs * len(PROMPTS), spec_seeded):
                check_output(spec, out.outputs[0].text)
            if "model" in config:
                assert llm.get_stats().spec_decode_num_accepted_tokens > 0


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 3)], ids=["greedy", "seeded"])
def test_speculative_rows_after_a_token_the_grammar_refused(tiny_dir, temperature, seed):
    """min_tokens bans EOS after a complete choice, so every token is banned and the row samples
    one the grammar refuses (its matcher stays put); n-gram proposals repeat that token: the rows
    after it get the mask plain decoding gives them, and the output is plain decoding's."""
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=24, min_tokens=5,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    with LLM(tiny_dir, kv_cache_memory_bytes=TINY_KV_BYTES) as llm:
        plain = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        llm.set_model_args(speculative_config=ngram)
        spec = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert llm.get_stats().spec_decode_num_accepted_tokens > 0
    assert [(c.token_ids, c.text) for c in spec] == [(c.token_ids, c.text) for c in plain]


def test_padded_vocabulary_outside_the_grammar(tiny_dir, tmp_path):
    """A model whose embedding has rows past its tokenizer (as Qwen's 151,936 over 151,665 ids):
    the grammar covers the tokenizer's ids only, and the padded ids are banned under it, however
    likely the model makes them."""
    import shutil

    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    config = transformers.AutoConfig.from_pretrained(tiny_dir)
    config.vocab_size = len(tokenizer) + 70
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight[len(tokenizer):] *= 50  # the padded ids would win every argmax
    model.save_pretrained(tmp_path)
    for source in Path(tiny_dir).glob("*token*"):
        shutil.copy(source, tmp_path / source.name)
    compiler = GrammarCompiler(tokenizer, config.vocab_size, (2,))
    assert compiler.vocab_size == len(tokenizer)
    with LLM(str(tmp_path), kv_cache_memory_bytes=TINY_KV_BYTES) as llm:
        params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec)
                  for spec in _specs()]
        outs = llm.generate([PROMPTS[0]] * len(params), params, use_tqdm=False)
        plain = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    for spec, out in zip(_specs(), outs):
        assert max(out.outputs[0].token_ids) < len(tokenizer)
        check_output(spec, out.outputs[0].text)
    assert min(plain.outputs[0].token_ids) >= len(tokenizer)  # the control: unconstrained, they win


def test_guided_decoding_is_the_older_name(tiny_dir):
    assert GuidedDecodingParams is StructuredOutputsParams
    with LLM(tiny_dir, kv_cache_memory_bytes=TINY_KV_BYTES) as llm:
        spec = GuidedDecodingParams(choice=CHOICES)
        out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.9, seed=3, n=3, max_tokens=8,
                                                      guided_decoding=spec), use_tqdm=False)[0]
        assert all(c.text in CHOICES for c in out.outputs)
        json_any = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, structured_outputs=(
            StructuredOutputsParams(json_object=True))), use_tqdm=False)[0].outputs[0]
        assert json_any.text.startswith("{")  # any JSON object: it need not end within 8 tokens
        with pytest.raises(ValueError, match="regex"):
            llm.generate(PROMPTS[0], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")),
                         use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()


def test_stop_token_ids_wait_for_the_grammar(tiny_dir):
    """vLLM (issue 42403): a request's stop_token_ids join the grammar's stop tokens, so one that is
    also text the grammar allows (here the digits 0-4) cannot end the completion mid-sentence; once
    the sentence is complete it may stop it."""
    import transformers

    digits = transformers.AutoTokenizer.from_pretrained(tiny_dir).convert_tokens_to_ids(list("01234"))
    with LLM(tiny_dir, kv_cache_memory_bytes=TINY_KV_BYTES) as llm:
        out = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=0, n=8, max_tokens=16,
                                                      stop_token_ids=digits,
                                                      structured_outputs=StructuredOutputsParams(regex=REGEX)),
                           use_tqdm=False)[0]
    for c in out.outputs:
        assert c.finish_reason == "stop" and re.fullmatch(REGEX, c.text), (c.text, c.stop_reason)
        assert c.stop_reason is None or (c.stop_reason in digits and c.token_ids[-1] == c.stop_reason)


@pytest.mark.parametrize("kwargs", [{}, {"json": SCHEMA, "regex": REGEX}, {"choice": []}, {"regex": ""},
                                    {"json": 3}, {"choice": ["a", ""]}, {"json_object": False}])
def test_bad_structured_outputs_params(kwargs):
    with pytest.raises(ValueError):
        StructuredOutputsParams(**kwargs)


def _bodies() -> list[dict]:
    """The four grammars in the request spellings vLLM's clients use."""
    return [{"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
            {"guided_regex": REGEX}, {"guided_choice": CHOICES}, {"guided_grammar": GRAMMAR}]


@pytest.fixture(scope="module")
def served(tiny_dir):
    """The tiny model behind the OpenAI server (the server's extra dependencies, or a skip: the
    offline and GPU tests above need none of them)."""
    for name in ("httpx", "fastapi", "uvicorn"):
        pytest.importorskip(name)
    from pagedlab.server.app import ServerThread, build_app

    llm = LLM(tiny_dir, kv_cache_memory_bytes=TINY_KV_BYTES, async_scheduling=True)
    engine = AsyncEngine.from_llm(llm)
    with ServerThread(build_app(engine, served_model_names=["tiny"])) as srv:
        yield srv.url
    engine.shutdown()
    llm.close()


def _post(url: str, path: str, body: dict):
    import httpx

    return httpx.post(url + path, json=body, timeout=60)


def test_online_equals_offline(served, offline):
    outs = offline[True]["outs"]
    for i, prompt in enumerate(PROMPTS):
        for j, extra in enumerate(_bodies()):
            want = outs[i * 4 + j].outputs[0]
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
            r = _post(served, "/v1/completions", {**body, **extra})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["token_ids"] == want.token_ids and choice["text"] == want.text
    events = _post(served, "/v1/completions", {
        "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, **_bodies()[1]})
    chunks = [json.loads(line[6:]) for line in events.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == outs[1].outputs[0].text


def test_chat_response_format(served):
    schema_format = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    r = _post(served, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 64, "temperature": 0.7,
        "seed": 1, "n": 2, "response_format": schema_format})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        if choice["finish_reason"] == "stop":  # any whitespace is allowed here, so it may run long
            check_output(StructuredOutputsParams(json=SCHEMA), choice["message"]["content"])
        else:
            assert choice["message"]["content"].startswith("{")


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "("}, "regex"), ({"guided_json": {"type": "objectx"}}, "json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"), ({"guided_choice": []}, "guided_choice")])
def test_bad_structured_requests_are_400(served, extra, param):
    r = _post(served, "/v1/completions", {"prompt": "hi", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_without_xgrammar_structured_requests_fail_clearly(served, tiny_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    r = _post(served, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "guided_choice": CHOICES})
    assert r.status_code == 400 and "xgrammar" in r.json()["error"]["message"]
    r = _post(served, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200
    with LLM(tiny_dir, kv_cache_memory_bytes=TINY_KV_BYTES) as llm:
        with pytest.raises(ValueError, match="pip install"):
            llm.generate("hi", SamplingParams(structured_outputs=StructuredOutputsParams(choice=CHOICES)),
                         use_tqdm=False)
        assert llm.generate("hi", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_structured_outputs_on_gpu(tiny_dir):
    """Asynchronous steps with CUDA graphs: the bitmask is filled while the forward runs and
    applied on the device; synchronous steps give the same tokens."""
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=s) for s in _specs()]
    prompts = [p for p in PROMPTS for _ in params]
    tokens = {}
    for async_scheduling in (False, True):
        with LLM(tiny_dir, dtype="float32", device="cuda", kv_cache_memory_bytes=TINY_KV_BYTES,
                 async_scheduling=async_scheduling) as llm:
            outs = llm.generate(prompts, params * len(PROMPTS), use_tqdm=False)
        for spec, out in zip(_specs() * len(PROMPTS), outs):
            check_output(spec, out.outputs[0].text)
        tokens[async_scheduling] = [o.outputs[0].token_ids for o in outs]
    assert tokens[False] == tokens[True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_speculative_grammars_on_gpu(tiny_dir):
    """Float32 on the GPU: proposals (the model as its own draft, whose passes replay its graphs,
    and n-gram lookup; speculation runs synchronous steps) verified in mixed-step graphs under the
    grammars' bitmasks give the greedy and seeded tokens of plain decoding's asynchronous steps."""
    specs = _specs()
    params = ([SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=s) for s in specs]
              + [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS, structured_outputs=s)
                 for i, s in enumerate(specs)])
    # the draft proposes unconstrained, so the grammars may refuse all its tokens: one request without
    # a grammar shows the proposals being accepted
    prompts = [p for p in PROMPTS for _ in params] + [PROMPTS[0]]
    params = params * len(PROMPTS) + [SamplingParams(temperature=0, max_tokens=12)]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    with LLM(tiny_dir, dtype="float32", device="cuda", kv_cache_memory_bytes=TINY_KV_BYTES,
             async_scheduling=True) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        for config in ({"model": tiny_dir, "num_speculative_tokens": 3}, ngram):
            llm.set_model_args(speculative_config=config)
            llm.reset_stats()
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == plain, config
            assert llm.get_stats().spec_decode_num_accepted_tokens > 0, config
    for spec, out in zip(specs * 2 * len(PROMPTS), outs):
        check_output(spec, out.outputs[0].text)


def test_async_engine_streams_structured_deltas(tiny_dir, offline):
    """AsyncEngine.generate compiles the grammar off the engine thread; DELTA outputs of a
    structured request add up to the offline text."""
    import asyncio

    from pagedlab.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=_specs()[1],
                            output_kind=RequestOutputKind.DELTA)

    async def deltas(engine):
        return [out.outputs[0].text async for out in engine.generate(PROMPTS[0], params)]

    with LLM(tiny_dir, kv_cache_memory_bytes=TINY_KV_BYTES) as llm:
        engine = AsyncEngine.from_llm(llm)
        try:
            texts = asyncio.run(deltas(engine))
        finally:
            engine.shutdown()
    assert "".join(texts) == offline[False]["outs"][1].outputs[0].text and len(texts) > 1
