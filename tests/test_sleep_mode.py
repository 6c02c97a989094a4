"""Sleep mode (vLLM's ``LLM.sleep`` / ``wake_up``): asleep, the weights' storages and the KV cache
hold no memory and requests are refused; level 1 wakes to HF transformers' float32 tokens and
logprobs; level 2 drops the weights, keeps the buffers no checkpoint holds (rotary tables), and
wakes to whatever ``load_weights`` puts in (another model's, checked against that model in HF);
bad levels, tags and orders are errors saying what is allowed; tensor-parallel ranks sleep and
wake together; LoRA adapters in their slots survive it; on a GPU the memory goes back to the
driver and the re-captured CUDA graphs replay the woken weights."""

from __future__ import annotations

import asyncio

import pytest
import torch

from conftest import (KV_BYTES, assert_hf_tokens_and_logprobs, build_tiny_model, hf_greedy, random_prompts,
                      run_on_async_engine)
from pagedlab import LLM, SamplingParams
from pagedlab.engine.async_engine import AsyncEngine

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def _engine(path, **engine_args) -> LLM:
    return LLM(path, dtype="float32", kv_cache_memory_bytes=KV_BYTES, **engine_args)


def _parameter_bytes(llm) -> int:
    return sum(p.untyped_storage().nbytes() for p in llm.llm_engine.model.parameters())


def _generate(llm, prompts):
    return llm.generate(prompts, GREEDY, use_tqdm=False)


def test_level_1_frees_the_weights_and_kv_cache_and_wakes_to_hf_tokens(tiny_llama):
    prompts = random_prompts(3, max_len=40, seed=21)
    with _engine(tiny_llama.path) as llm:
        weights = _parameter_bytes(llm)
        assert weights > 0 and llm.get_stats().kv_cache_bytes > 0
        _generate(llm, prompts)  # its prefix cache would serve the same prompts after waking
        llm.sleep(level=1)
        assert llm.llm_engine.is_sleeping()
        assert _parameter_bytes(llm) == 0 and llm.get_stats().kv_cache_bytes == 0
        with pytest.raises(RuntimeError, match=r"asleep.*wake_up\(\)"):
            _generate(llm, prompts)
        llm.wake_up()
        assert not llm.llm_engine.is_sleeping() and _parameter_bytes(llm) == weights
        assert llm.get_stats().kv_cache_bytes > 0
        outs = _generate(llm, prompts)
        assert llm.get_stats().prefix_cache_hit_tokens == 0  # the woken KV cache holds nothing from before
    assert_hf_tokens_and_logprobs(tiny_llama.hf_model, prompts, outs, MAX_TOKENS)


@pytest.mark.parametrize("arch", ["qwen3", "mixtral"])
def test_level_2_wakes_to_the_weights_loaded_into_it(tmp_path, arch):
    """Verl's order: wake the weights, load the trainer's, then wake the KV cache. Qwen3 ties the
    LM head; Mixtral's experts are fused tensors; both keep their rotary tables (buffers)."""
    a = build_tiny_model(tmp_path / "a", arch, seed=1)
    b = build_tiny_model(tmp_path / "b", arch, seed=2)
    prompts = random_prompts(3, max_len=40, seed=22)
    with _engine(a.path) as llm:
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        assert llm.llm_engine.is_sleeping()  # the KV cache still is
        llm.load_weights(b.hf_model.state_dict())
        llm.wake_up(tags=["kv_cache"])
        outs = _generate(llm, prompts)
    assert_hf_tokens_and_logprobs(b.hf_model, prompts, outs, MAX_TOKENS)


def test_level_2_refuses_requests_until_weights_are_loaded(tiny_llama):
    with _engine(tiny_llama.path) as llm:
        llm.sleep(level=2)
        llm.wake_up()
        assert not llm.llm_engine.is_sleeping()
        with pytest.raises(RuntimeError, match=r"sleep\(level=2\): load_weights\(\)"):
            _generate(llm, [[1, 2, 3]])
        llm.load_weights(tiny_llama.hf_model.state_dict())
        outs = _generate(llm, [[1, 2, 3]])
    assert_hf_tokens_and_logprobs(tiny_llama.hf_model, [[1, 2, 3]], outs, MAX_TOKENS)


def test_bad_levels_tags_and_orders_are_errors_saying_what_is_allowed(tiny_llama):
    with _engine(tiny_llama.path) as llm:
        for level in (0, 3, True, "1"):
            with pytest.raises(ValueError, match=rf"level={level!r} is invalid: sleep levels are 1"):
                llm.sleep(level)
        assert not llm.llm_engine.is_sleeping()
        no_part = r"'kv' is no part of the engine; tags are \['weights', 'kv_cache'\]"
        with pytest.raises(ValueError, match=no_part):
            llm.wake_up(tags=["kv"])
        with pytest.raises(ValueError, match=r"tags=\[\] is invalid: it wakes nothing"):
            llm.wake_up(tags=[])
        llm.sleep()
        llm.sleep(level=2)  # what is asleep stays so: level 1's host copy is kept
        with pytest.raises(RuntimeError, match="wake the weights first"):
            llm.wake_up(tags=["kv_cache"])
        with pytest.raises(RuntimeError, match=r"wake_up\(tags=\['weights'\]\) first"):
            llm.load_weights(tiny_llama.hf_model.state_dict())
        with pytest.raises(RuntimeError, match="asleep"):
            llm.set_model_args(max_num_seqs=8)
        llm.wake_up(tags="weights")
        llm.wake_up()
        llm.wake_up()  # nothing asleep: nothing to do
        outs = _generate(llm, [[5, 6, 7]])
    assert_hf_tokens_and_logprobs(tiny_llama.hf_model, [[5, 6, 7]], outs, MAX_TOKENS)


def test_a_sleep_that_cannot_free_the_weights_changes_nothing_a_wake_cannot_undo(tiny_llama):
    """A weight whose storage cannot be resized (borrowed from NumPy here) is refused before any
    weight is copied or freed; the KV cache, freed first, wakes as after any sleep."""
    with _engine(tiny_llama.path) as llm:
        weight = llm.llm_engine.model.model.norm.weight
        weight.data = torch.from_numpy(weight.detach().numpy().copy())
        with pytest.raises(ValueError, match="cannot be freed in place"):
            llm.sleep()
        assert llm.llm_engine.is_sleeping() and llm.get_stats().kv_cache_bytes == 0
        assert _parameter_bytes(llm) > 0
        llm.wake_up()
        outs = _generate(llm, [[5, 6, 7]])
    assert_hf_tokens_and_logprobs(tiny_llama.hf_model, [[5, 6, 7]], outs, MAX_TOKENS)


def test_awq_sleeps_at_level_1_and_refuses_level_2_which_it_could_not_refill(tiny_llama):
    prompts = random_prompts(2, max_len=30, seed=26)
    with _engine(tiny_llama.path, quantization="awq") as llm:
        before = _generate(llm, prompts)
        refusal = r"level=2 is invalid here.*quantization='awq'.*sleep\(level=1\)"
        with pytest.raises(ValueError, match=refusal):
            llm.sleep(level=2)
        assert not llm.llm_engine.is_sleeping()
        llm.sleep(level=1)
        assert _parameter_bytes(llm) == 0
        llm.wake_up()
        after = _generate(llm, prompts)
    assert [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in after] == [
        (o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in before]


def test_lora_adapters_survive_a_sleep(tmp_path, tiny_llama):
    """An adapter loaded in a GPU slot before sleeping serves the same tokens after waking, without
    being read again; the base model's tokens are HF's."""
    from lora_fixtures import ALL_TARGETS, make_adapter
    from pagedlab import LoRARequest

    adapter = make_adapter(tiny_llama.hf_model, tmp_path / "adapter", seed=3, rank=4, alpha=8,
                           targets=ALL_TARGETS)
    lora = LoRARequest("adapter", 1, adapter.path)
    prompts = random_prompts(2, max_len=30, seed=27)
    with _engine(tiny_llama.path, enable_lora=True, max_lora_rank=8) as llm:
        before = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
        llm.sleep(level=1)
        llm.wake_up()
        after = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
        base = _generate(llm, prompts)
        assert llm.llm_engine.runner.lora.num_loads == 1
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
    assert [o.outputs[0].token_ids for o in after] != [o.outputs[0].token_ids for o in base]
    assert_hf_tokens_and_logprobs(tiny_llama.hf_model, prompts, base, MAX_TOKENS)


def test_an_unfinished_request_refuses_sleep(tiny_llama):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 12)]
    with _engine(tiny_llama.path) as llm:
        running = llm.generate_as_completed([[1, 2], [3, 4]], params, use_tqdm=False)
        next(running)
        with pytest.raises(RuntimeError, match="sleep while 1 requests are unfinished"):
            llm.sleep()
        assert not llm.llm_engine.is_sleeping() and len(list(running)) == 1
        llm.sleep()
        assert llm.llm_engine.is_sleeping()


def test_async_engine_sleeps_and_wakes_between_steps(tiny_llama):
    prompts = random_prompts(2, max_len=30, seed=23)
    greedy = GREEDY.clone(detokenize=False)  # no tokenizer in the tiny model

    async def scenario(engine):
        await engine.sleep(1)
        assert await engine.is_sleeping()
        with pytest.raises(RuntimeError, match="asleep"):
            await engine.add_request(prompts[0], greedy).result()
        await engine.wake_up()
        return await asyncio.gather(*(engine.add_request(p, greedy).result() for p in prompts))

    with _engine(tiny_llama.path, max_model_len=512) as llm:
        outs = run_on_async_engine(llm, scenario)
    assert_hf_tokens_and_logprobs(tiny_llama.hf_model, prompts, outs, MAX_TOKENS)


def test_two_tensor_parallel_ranks_sleep_and_wake_together(tmp_path):
    a = build_tiny_model(tmp_path / "a", "llama", seed=1)
    b = build_tiny_model(tmp_path / "b", "llama", seed=2)
    prompts = random_prompts(2, max_len=30, seed=24)
    with _engine(a.path, tensor_parallel_size=2, device="cpu") as llm:
        llm.sleep(level=1)  # first, with A's weights: a rank that did not wake its part fails here
        llm.wake_up()
        woken_a = _generate(llm, prompts)
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        llm.load_weights(b.hf_model.state_dict())  # every rank loads its part into its woken storages
        llm.wake_up(tags=["kv_cache"])
        outs = _generate(llm, prompts)
        llm.sleep(level=1)
        llm.wake_up()
        again = _generate(llm, prompts)
    assert_hf_tokens_and_logprobs(a.hf_model, prompts, woken_a, MAX_TOKENS)
    assert_hf_tokens_and_logprobs(b.hf_model, prompts, outs, MAX_TOKENS)
    assert_hf_tokens_and_logprobs(b.hf_model, prompts, again, MAX_TOKENS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("engine_args", [{"dtype": "bfloat16"}, {"dtype": "bfloat16", "quantization": "fp8"}],
                         ids=["bf16", "fp8"])
def test_on_the_gpu_memory_goes_back_and_the_graphs_replay_the_woken_weights(tmp_path, engine_args):
    """The device memory the driver sees falls by the weights and the KV cache; woken, the
    re-captured decode and mixed-step graphs give the tokens and logprobs of before (level 1)
    and of a fresh engine of model B (level 2 and B's weights loaded)."""
    wide = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=8, head_dim=128)  # ~70 MB
    a = build_tiny_model(tmp_path / "a", "llama", seed=1, **wide)
    b = build_tiny_model(tmp_path / "b", "llama", seed=2, **wide)
    prompts = random_prompts(4, max_len=40, seed=25)
    with LLM(b.path, kv_cache_memory_bytes=256 << 20, **engine_args) as fresh:
        expected = [o.outputs[0].token_ids for o in _generate(fresh, prompts)]
    with LLM(a.path, kv_cache_memory_bytes=256 << 20, **engine_args) as llm:
        assert llm.get_engine_info().cuda_graphs
        before = [o.outputs[0].token_ids for o in _generate(llm, prompts)]
        torch.cuda.synchronize()
        used = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
        llm.sleep(level=1)
        freed = used - (torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0])
        assert freed >= (256 << 20) + llm.get_stats().weight_bytes * 0.9
        llm.wake_up()
        assert [o.outputs[0].token_ids for o in _generate(llm, prompts)] == before
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        llm.load_weights(b.hf_model.state_dict())
        llm.wake_up(tags=["kv_cache"])
        assert [o.outputs[0].token_ids for o in _generate(llm, prompts)] == expected != before


def test_server_dev_routes_sleep_and_wake_and_refuse_requests_asleep(tiny_llama):
    """vLLM's ``VLLM_SERVER_DEV_MODE`` routes: a completion while asleep is a 503 the client may
    retry (``engine_asleep``), and woken the server answers with HF's greedy tokens."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from pagedlab.server.app import ServerThread, build_app

    prompt = [5, 6, 7]
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    want = hf_greedy(tiny_llama.hf_model, prompt, MAX_TOKENS, eos_token_id=None)
    llm = _engine(tiny_llama.path, max_model_len=512)
    engine = AsyncEngine.from_llm(llm)
    try:
        with ServerThread(build_app(engine, enable_metrics=False)) as plain:
            assert httpx.post(plain.url + "/sleep", timeout=60).status_code == 404  # dev mode off
        with ServerThread(build_app(engine, enable_metrics=False, dev_mode=True)) as srv:
            def post(path, **kwargs):
                return httpx.post(srv.url + path, timeout=60, **kwargs)

            bad = post("/sleep", params={"level": 3})
            assert bad.status_code == 400 and "level=3 is invalid" in bad.json()["error"]["message"]
            assert post("/sleep", params={"level": 1}).status_code == 200
            assert httpx.get(srv.url + "/is_sleeping", timeout=60).json() == {"is_sleeping": True}
            for streamed in (False, True):
                asleep = post("/v1/completions", json={**body, "stream": streamed})
                assert asleep.status_code == 503 and asleep.headers["retry-after"] == "1"
                assert asleep.json()["error"]["code"] == "engine_asleep"
            assert post("/sleep", params={"level": "²"}).status_code == 400
            refused = post("/wake_up", params={"tags": "kv_cache"})
            assert refused.status_code == 409
            assert "wake the weights first" in refused.json()["error"]["message"]
            assert post("/wake_up", params=[("tags", "weights"), ("tags", "kv_cache")]).status_code == 200
            assert httpx.get(srv.url + "/is_sleeping", timeout=60).json() == {"is_sleeping": False}
            assert post("/reset_prefix_cache").status_code == 200
            woken = post("/v1/completions", json=body)
            assert woken.status_code == 200 and woken.json()["choices"][0]["token_ids"] == want
    finally:
        engine.shutdown()
        llm.close()
