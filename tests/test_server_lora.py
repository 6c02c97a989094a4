"""LoRA adapters through the OpenAI server: ``--lora-modules NAME=PATH``, a request's ``model``
selecting an adapter (or the base model), and the adapters listed by ``/v1/models``."""

from __future__ import annotations

import argparse

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

from pagedlab.server.app import ServerThread, build_app  # noqa: E402  (needs the optional packages above)
from pagedlab.server.cli import lora_modules_from_args  # noqa: E402

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
        yield {"client": client, "expected": expected, "modules": modules}
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
