"""LoRA adapters through the OpenAI server: ``--lora-modules NAME=PATH``, a request's ``model``
selecting an adapter (or the base model), and the adapters listed by ``/v1/models``."""

from __future__ import annotations

import argparse
import asyncio
import shutil

import httpx
import pytest
import torch

from conftest import hf_greedy
from lora_fixtures import ALL_TARGETS, make_adapter
from pagedlab import LLM, LoRARequest, SamplingParams
from pagedlab.engine.async_engine import AsyncEngine
from test_server_support import TINY_KV_BYTES, build_tiny_chat_model

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("peft")

from fastapi.testclient import TestClient  # noqa: E402

from pagedlab.server.app import ServerThread, build_app  # noqa: E402  (needs the optional packages above)
from pagedlab.server.cli import lora_modules_from_args  # noqa: E402
from pagedlab.server.errors import APIError  # noqa: E402
from pagedlab.server.serving_models import (OpenAIServingModels, UnloadLoRAAdapterRequest,  # noqa: E402
                                            runtime_lora_updating_allowed)

MODEL = "tiny"
PROMPT = "the sky is blue and the fox"
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("lora_server")
    model_dir = build_tiny_chat_model(root / "model")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    adapters = {"sql": make_adapter(hf_model, root / "sql", 0, 8, 16, ALL_TARGETS),
                "poet": make_adapter(hf_model, root / "poet", 1, 4, 8, ["q_proj", "v_proj"], use_rslora=True)}
    modules = [LoRARequest("sql", 1, adapters["sql"].path),
               LoRARequest("poet", 2, adapters["poet"].path, base_model_name="tiny-base")]
    llm = LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES, enable_lora=True, max_loras=2, max_lora_rank=8)
    ids = llm.get_tokenizer()(PROMPT).input_ids
    expected = {}  # offline output per served name, checked against HF (+PEFT)
    for name, lora in [(MODEL, None), *((m.lora_name, m) for m in modules)]:
        out = llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=lora)[0].outputs[0]
        reference = adapters[name].peft_model if lora is not None else hf_model
        assert out.token_ids == hf_greedy(reference, ids, GREEDY.max_tokens)
        expected[name] = out
    engine = AsyncEngine.from_llm(llm)
    with ServerThread(build_app(engine, served_model_names=[MODEL], lora_modules=modules)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield {"client": client, "expected": expected, "modules": modules, "url": srv.url, "engine": engine,
               "adapters": adapters, "prompt_ids": ids}
    engine.shutdown()
    llm.close()


def test_models_lists_the_adapters(served):
    data = served["client"].models.list().data
    assert [m.id for m in data] == [MODEL, "sql", "poet"]
    assert data[1].parent == MODEL and data[1].root == served["modules"][0].lora_path
    assert data[2].parent == "tiny-base"  # a module's base_model_name, as vLLM lists it


@pytest.mark.parametrize("model", [MODEL, "sql", "poet"])
def test_the_model_field_selects_the_adapter(served, model):
    r = served["client"].completions.create(model=model, prompt=PROMPT, max_tokens=GREEDY.max_tokens,
                                            temperature=0, extra_body={"ignore_eos": True})
    want = served["expected"][model]
    assert r.model == model
    assert r.choices[0].text == want.text
    assert model == MODEL or want.token_ids != served["expected"][MODEL].token_ids  # the adapter matters
    chat = served["client"].chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=4, temperature=0)
    assert chat.model == model


def test_an_unknown_model_is_a_404_naming_the_adapters(served):
    with pytest.raises(openai.NotFoundError, match="'sql', 'poet'"):
        served["client"].completions.create(model="nope", prompt=PROMPT, max_tokens=2)


def test_lora_modules_flag_parses_name_path_pairs():
    args = argparse.Namespace(lora_modules=["a=/x", "b=/y/z"])
    assert lora_modules_from_args(args) == [LoRARequest("a", 1, "/x"), LoRARequest("b", 2, "/y/z")]
    for bad in (["a"], ["=/x"], ["a=/x", "a=/y"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            lora_modules_from_args(argparse.Namespace(lora_modules=bad))


def test_lora_modules_flag_takes_vllms_json_form():
    """vLLM's other form: a JSON object with name, path and optionally base_model_name (the
    parent /v1/models lists); also what a path holding '=' or a comma needs."""
    specs = ['{"name": "a", "path": "/x=1"}', '{"name": "b", "path": "/y", "base_model_name": "base"}',
             "c=/z"]
    assert lora_modules_from_args(argparse.Namespace(lora_modules=specs)) == [
        LoRARequest("a", 1, "/x=1"), LoRARequest("b", 2, "/y", base_model_name="base"),
        LoRARequest("c", 3, "/z")]
    for bad, why in (('{"name": "a"', "not valid JSON"), ('{"name": "a", "path": "/x", "rank": 8}', "rank"),
                     ('{"path": "/x"}', "name"), ('["a", "/x"]', "JSON object")):
        with pytest.raises(ValueError, match=f"--lora-modules.*{why}"):
            lora_modules_from_args(argparse.Namespace(lora_modules=[bad]))


# ---- runtime loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING) ----------------------------------------
@pytest.fixture(scope="module")
def runtime(served):
    """A second app on the same engine, with runtime LoRA updating beside the same --lora-modules
    (one engine takes one app's adapter ids: runtime loads number theirs after these)."""
    app = build_app(served["engine"], served_model_names=[MODEL], enable_metrics=False,
                    lora_modules=served["modules"], allow_runtime_lora_updating=True)
    with ServerThread(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield {**served, "client": client, "url": srv.url}


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json=body, timeout=60)


def complete(client, model: str, max_tokens: int = GREEDY.max_tokens) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_runtime_lora_routes_exist_only_when_allowed(served, monkeypatch):
    """vLLM adds the routes only under VLLM_ALLOW_RUNTIME_LORA_UPDATING=1/true (read its way)."""
    body = {"lora_name": "x", "lora_path": served["modules"][0].lora_path}
    assert post(served["url"], "load_lora_adapter", body).status_code == 404
    assert post(served["url"], "unload_lora_adapter", {"lora_name": "sql"}).status_code == 404
    assert [m.id for m in served["client"].models.list().data] == [MODEL, "sql", "poet"]
    for value, allowed in (("1", True), ("True", True), (" true ", True), ("0", False), ("yes", False),
                           ("", False)):
        assert runtime_lora_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}) is allowed, value
    assert not runtime_lora_updating_allowed({})
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    app = build_app(served["engine"], [MODEL], enable_metrics=False)
    r = TestClient(app).post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"  # the route answered


def test_load_serve_and_unload_an_adapter_at_runtime(runtime):
    """vLLM's answers: a loaded adapter is listed and serves its name (PEFT's tokens, checked in
    the fixture); loading a name twice is a 400, unloading an unknown one a 404; once unloaded,
    requests naming it get 404 and /v1/models drops it; the name can be loaded again."""
    client, url, path = runtime["client"], runtime["url"], runtime["modules"][0].lora_path
    static = [MODEL, "sql", "poet"]
    assert [m.id for m in client.models.list().data] == static
    for _ in range(2):  # loaded, unloaded, and loaded again under the same name
        r = post(url, "load_lora_adapter", {"lora_name": "sql-rt", "lora_path": path})
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql-rt' added successfully.")
        cards = client.models.list().data
        assert [m.id for m in cards] == [*static, "sql-rt"]
        assert cards[-1].root == path and cards[-1].parent == MODEL
        assert complete(client, "sql-rt") == runtime["expected"]["sql"].text
        again = post(url, "load_lora_adapter", {"lora_name": "sql-rt", "lora_path": path})
        assert again.status_code == 400
        assert again.json()["error"]["message"] == "The lora adapter 'sql-rt' has already been loaded."
        r = post(url, "unload_lora_adapter", {"lora_name": "sql-rt"})
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql-rt' removed successfully.")
        assert [m.id for m in client.models.list().data] == static
        with pytest.raises(openai.NotFoundError, match="sql-rt"):
            complete(client, "sql-rt")
    gone = post(url, "unload_lora_adapter", {"lora_name": "sql-rt"})
    assert gone.status_code == 404
    assert gone.json()["error"] == {"message": "The lora adapter 'sql-rt' cannot be found.",
                                    "type": "NotFoundError", "param": None, "code": 404}


def test_bad_runtime_loads_are_refused_and_nothing_is_listed(runtime, tmp_path):
    """vLLM answers any adapter that fails to load with a 400 (404 when none is found): also an
    unreadable weights file or config, here naming the file."""
    url = runtime["url"]
    (tmp_path / "head").mkdir()
    head = make_adapter(runtime["adapters"]["sql"].peft_model.get_base_model(), tmp_path / "head", 0, 4, 8,
                        ["lm_head"])
    truncated, listed = tmp_path / "truncated", tmp_path / "listed"  # a cut copy; a config not an object
    shutil.copytree(runtime["modules"][0].lora_path, truncated)
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    shutil.copytree(runtime["modules"][0].lora_path, listed)
    (listed / "adapter_config.json").write_text("[8]")
    for body, status, message in (
            ({"lora_name": "a"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
            ({"lora_name": "a", "lora_path": str(tmp_path / "nope")}, 404, "No adapter found for"),
            ({"lora_name": "a", "lora_path": head.path}, 400, "targets module 'lm_head'"),
            ({"lora_name": MODEL, "lora_path": head.path}, 400, "name of the base model"),
            ({"lora_name": "a", "lora_path": str(truncated)}, 400,
             "adapter_model.safetensors' could not be read"),
            ({"lora_name": "a", "lora_path": str(listed)}, 400, "adapter_config.json' is not a JSON object"),
            ({"lora_name": 5, "lora_path": head.path}, 400, "lora_name")):
        r = post(url, "load_lora_adapter", body)
        assert r.status_code == status and message in r.json()["error"]["message"], (body, r.text)
    assert post(url, "unload_lora_adapter", {}).status_code == 400
    assert [m.id for m in runtime["client"].models.list().data] == [MODEL, "sql", "poet"]


def test_unloading_an_adapter_mid_request_lets_the_request_finish(runtime):
    """As in vLLM, unloading drops the engine's copies of the adapter, and a request already
    running on it reads it again from its directory and finishes with it: PEFT's tokens."""
    client, url, engine = runtime["client"], runtime["url"], runtime["engine"]
    max_tokens = 48
    want = hf_greedy(runtime["adapters"]["poet"].peft_model, runtime["prompt_ids"], max_tokens)
    r = post(url, "load_lora_adapter", {"lora_name": "poet-rt", "lora_path": runtime["modules"][1].lora_path})
    assert r.status_code == 200
    loads = engine.call(lambda e: e.runner.lora.num_loads).result()
    stream = client.completions.create(model="poet-rt", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = [next(iter(stream))]
    assert post(url, "unload_lora_adapter", {"lora_name": "poet-rt"}).status_code == 200
    assert engine.call(lambda e: e.num_unfinished_requests).result() == 1  # it was unloaded mid-request
    chunks.extend(stream)
    token_ids = [t for c in chunks for t in (c.choices[0].token_ids or [])]
    assert token_ids == want
    assert engine.call(lambda e: e.runner.lora.num_loads).result() == loads + 1  # read again from disk


def test_adapters_loaded_together_each_serve_their_own_weights(runtime):
    """Each runtime load gets an adapter id of its own (the engine caches weights by id): two
    adapters loaded side by side serve PEFT's tokens of each, not the first one's."""
    client, url = runtime["client"], runtime["url"]
    loads = {"sql-2": ("sql", 0), "poet-2": ("poet", 1)}
    for name, (_, module) in loads.items():
        assert post(url, "load_lora_adapter",
                    {"lora_name": name, "lora_path": runtime["modules"][module].lora_path}).status_code == 200
    try:
        for name, (served_as, _) in loads.items():
            assert complete(client, name) == runtime["expected"][served_as].text
    finally:
        for name in loads:
            post(url, "unload_lora_adapter", {"lora_name": name})


def test_a_request_whose_adapter_was_unloaded_after_its_checks_is_a_404(runtime):
    """A request checked while its adapter was served, then unloaded before it reaches the
    engine (its grammar compiling), is refused with vLLM's 404, never run on the base model."""
    models = OpenAIServingModels(runtime["engine"], [MODEL], runtime["modules"])
    assert models.check_model("poet") == "poet"
    asyncio.run(models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name="poet")))
    with pytest.raises(APIError) as e:
        models.lora_request("poet")
    assert e.value.status == 404 and "poet" in e.value.info.message


def test_every_served_name_is_the_base_model(served):
    """vLLM's --served-model-name with several names: /v1/models lists each, a request may name
    any (its response carries that name; one naming none, the first), and no adapter may take one."""
    app = build_app(served["engine"], served_model_names=[MODEL, "tiny-alias"], enable_metrics=False,
                    allow_runtime_lora_updating=True)
    client = TestClient(app)
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL, "tiny-alias"]
    for model, answered in (("tiny-alias", "tiny-alias"), (None, MODEL)):
        body = {"prompt": PROMPT, "max_tokens": 2, **({"model": model} if model else {})}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == answered, r.text
    r = client.post("/v1/load_lora_adapter",
                    json={"lora_name": "tiny-alias", "lora_path": served["modules"][0].lora_path})
    assert r.status_code == 400 and "name of the base model" in r.json()["error"]["message"]
