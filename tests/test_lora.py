"""LoRA adapters (``enable_lora``/``LoRARequest``) against PEFT in HF transformers, float32 greedy
on tiny random models: each adapter alone, a batch mixing adapters and the base model, rsLoRA and
different ranks and targets, prefix caching kept apart per adapter, LRU eviction and reload, and
the errors for bad adapters."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import KV_BYTES, assert_hf_tokens_and_logprobs, build_tiny_model, hf_greedy, random_prompts
from lora_fixtures import ALL_TARGETS, make_adapter, peft_greedy
from pagedlab import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPTS = random_prompts(2, max_len=40, seed=3)
ADAPTER_SPECS = {  # name -> (rank, alpha, targets, rslora)
    "all-r8": (8, 16, ALL_TARGETS, False),
    "qv-r4-rslora": (4, 8, ["q_proj", "v_proj"], True),
    "mlp-r16": (16, 8, ["gate_proj", "up_proj", "down_proj", "o_proj"], False),
}


@pytest.fixture(scope="module")
def llama_adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {name: make_adapter(tiny_llama.hf_model, root / name, seed, *spec)
            for seed, (name, spec) in enumerate(ADAPTER_SPECS.items())}


@pytest.fixture(scope="module")
def expected(tiny_llama, llama_adapters):
    """HF+PEFT greedy tokens of every prompt, per adapter (None: the base model)."""
    result = {name: peft_greedy(a, tiny_llama.hf_model, PROMPTS, GREEDY.max_tokens)
              for name, a in llama_adapters.items()}
    result[None] = peft_greedy(None, tiny_llama.hf_model, PROMPTS, GREEDY.max_tokens)
    return result


def lora_request(adapters, name: str) -> LoRARequest:
    return LoRARequest(name, list(ADAPTER_SPECS).index(name) + 1, adapters[name].path)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_adapters_differ_from_the_base_model(expected):
    """The references are worth comparing against: each adapter changes the greedy tokens."""
    for name in ADAPTER_SPECS:
        assert expected[name] != expected[None], name


def test_each_adapter_matches_peft_and_merged(tiny_llama, llama_adapters, expected):
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_loras=1,
             max_lora_rank=16) as llm:
        for name, adapter in llama_adapters.items():
            lora = lora_request(llama_adapters, name)
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)
            assert tokens(outs) == expected[name], name
            merged = copy.deepcopy(adapter.peft_model).merge_and_unload()
            assert tokens(outs) == [hf_greedy(merged, p, GREEDY.max_tokens) for p in PROMPTS], name
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected[None]


def test_mixed_batch_gives_each_request_its_own_tokens(tiny_llama, llama_adapters, expected):
    """Three adapters and the base model interleaved in one generate call: one batch, prompts
    chunked over steps that also run decodes, steps launched before the last is read back."""
    names = [None, *ADAPTER_SPECS]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [lora_request(llama_adapters, n) if n else None for _ in PROMPTS for n in names]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_loras=3,
             max_lora_rank=16, async_scheduling=True, max_num_batched_tokens=32) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    want = [expected[n][i] for i in range(len(PROMPTS)) for n in names]
    assert tokens(outs) == want


def test_prefix_caching_keeps_adapters_apart(tiny_llama, llama_adapters, expected):
    prompt = random_prompts(1, min_len=40, max_len=40, seed=5)[0]  # two full blocks of 16
    a, b = lora_request(llama_adapters, "all-r8"), lora_request(llama_adapters, "qv-r4-rslora")
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_loras=2,
             max_lora_rank=16) as llm:
        first = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=a)
        hits = llm.get_stats().prefix_cache_hit_tokens
        for lora in (b, None):
            second = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)
            assert llm.get_stats().prefix_cache_hit_tokens == hits  # nothing of adapter a's KV is reused
            want = hf_greedy(llama_adapters[lora.lora_name].peft_model if lora else tiny_llama.hf_model,
                             prompt, GREEDY.max_tokens)
            assert tokens(second) == [want]
        again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=a)
        assert llm.get_stats().prefix_cache_hit_tokens == hits + 32  # the same adapter does share
        assert tokens(again) == tokens(first)


def test_lru_eviction_and_reload_give_the_same_tokens(tiny_llama, llama_adapters, expected):
    """One GPU slot and one CPU copy: every change of adapter evicts the last and reads from disk."""
    order = ["all-r8", "mlp-r16", "all-r8", "qv-r4-rslora"]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_loras=1,
             max_cpu_loras=1, max_lora_rank=16, enable_prefix_caching=False) as llm:
        for name in order:
            lora = lora_request(llama_adapters, name)
            outs = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=lora)
            assert tokens(outs) == expected[name][:1], name
        manager = llm.llm_engine.runner.lora
        assert manager.num_loads == len(order)
        assert [r.lora_name for r in manager.list_loras()] == ["qv-r4-rslora"]


def test_more_adapters_than_slots_in_one_call(tiny_llama, llama_adapters, expected):
    """Three adapters over two slots: the scheduler runs at most two at a time, all finish right."""
    names = list(ADAPTER_SPECS)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_loras=2,
             max_lora_rank=16) as llm:
        outs = llm.generate([PROMPTS[0]] * 3, GREEDY, use_tqdm=False,
                            lora_request=[lora_request(llama_adapters, n) for n in names])
    assert tokens(outs) == [expected[n][0] for n in names]


def test_qwen3_adapter_matches_peft(tiny_models, tmp_path):
    tiny = tiny_models("qwen3")
    adapter = make_adapter(tiny.hf_model, tmp_path / "qwen3", 7, 8, 32, ALL_TARGETS, use_rslora=True)
    want = peft_greedy(adapter, tiny.hf_model, PROMPTS, GREEDY.max_tokens)
    assert want != peft_greedy(None, tiny.hf_model, PROMPTS, GREEDY.max_tokens)
    with LLM(tiny.path, kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_lora_rank=8) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("q", 1, adapter.path))
    assert tokens(outs) == want


def test_chat_and_beam_search_take_a_lora_request(tiny_llama, llama_adapters):
    from pagedlab import BeamSearchParams

    lora = lora_request(llama_adapters, "all-r8")
    peft_model = llama_adapters["all-r8"].peft_model
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_lora_rank=16) as llm:
        beams = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}],
                                BeamSearchParams(beam_width=2, max_tokens=6), lora_request=lora)
    with torch.no_grad():
        want = peft_model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=6, num_beams=2, do_sample=False,
                                   early_stopping=True, length_penalty=1.0)
    assert beams[0].sequences[0].tokens == want[0].tolist()


def test_bad_adapters_are_clear_errors(tiny_llama, llama_adapters, tmp_path):
    path = llama_adapters["mlp-r16"].path
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm, \
            pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, path))
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_lora_rank=8) as llm:
        with pytest.raises(ValueError, match=r"rank 16 .*max_lora_rank=8"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("big", 1, path))
        with pytest.raises(ValueError, match="does not exist"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("gone", 2, str(tmp_path / "missing")))
        (tmp_path / "no-weights").mkdir()
        (tmp_path / "no-weights" / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8}))
        with pytest.raises(ValueError, match=r"adapter_model\.safetensors"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("w", 3, str(tmp_path / "no-weights")))
        head = make_adapter(tiny_llama.hf_model, tmp_path / "head", 0, 4, 8, ["lm_head"])
        with pytest.raises(ValueError, match=r"targets module 'lm_head'.*q_proj"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("h", 4, head.path))
        assert tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == [
            hf_greedy(tiny_llama.hf_model, PROMPTS[0], GREEDY.max_tokens)]  # nothing was left behind
    with pytest.raises(ValueError, match="lora_int_id=0"):
        LoRARequest("zero", 0, path)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(tiny_llama.path, enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        LLM(tiny_llama.path, enable_lora=True, tensor_parallel_size=2)


VARIANT_SETTINGS = {  # PEFT LoRA variants whose forward is not W x + s B A x
    "alora_invocation_tokens": [5, 6],  # aLoRA: adapts only the tokens from its invocation on
    "use_bdlora": {"target_modules_bd_a": ["q_proj"], "nblocks": 2},  # block-diagonal factors
    "kasa_config": {"beta": 1e-4},  # a trained singular-value diagonal between A and B
    "arrow_config": {"top_k": 2},  # routing between adapters
    "use_qalora": True,  # inputs pooled in groups before A
}


def test_lora_variants_that_change_the_forward_are_refused(tiny_llama, llama_adapters, tmp_path):
    """Served as plain LoRA these would give other tokens than PEFT: each is refused by name, as
    DoRA is (the config as PEFT saves it, beside plain LoRA weights)."""
    from peft import LoraConfig

    weights = llama_adapters["all-r8"].path + "/adapter_model.safetensors"
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_lora_rank=16) as llm:
        for lora_id, (key, value) in enumerate(VARIANT_SETTINGS.items(), start=1):
            directory = tmp_path / key
            LoraConfig(r=8, lora_alpha=16, target_modules=ALL_TARGETS, task_type="CAUSAL_LM",
                       **{key: value}).save_pretrained(directory)
            (directory / "adapter_model.safetensors").symlink_to(weights)
            with pytest.raises(ValueError, match=f"sets {key}="):
                llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False,
                             lora_request=LoRARequest(key, lora_id, str(directory)))


def test_an_adapter_of_other_shapes_is_refused_when_named(tiny_llama, tmp_path):
    """An adapter of a model with the same module names but another MLP width (PEFT cannot load it
    onto this model either) fails the call that names it, before any step runs: a step failing
    would abort every request in flight."""
    other = build_tiny_model(tmp_path / "wider", "llama", intermediate_size=96)
    adapter = make_adapter(other.hf_model, tmp_path / "wider-lora", 0, 4, 8, ALL_TARGETS)
    lora = LoRARequest("wider", 1, adapter.path)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_lora_rank=8) as llm:
        with pytest.raises(ValueError, match=r"wider.*mlp\.\w+_proj.*another model"):
            llm.llm_engine.validate_lora_request(lora)
        assert llm.llm_engine.runner.lora.list_loras() == []


def test_lora_on_moe_expert_parameters_is_refused_by_name(tiny_models, tmp_path):
    """PEFT's ``all-linear`` on an MoE model adds ``target_parameters`` (the experts' fused
    weights, the router): refused naming that setting, not a tensor name PEFT made up."""
    tiny = tiny_models("mixtral")
    adapter = make_adapter(tiny.hf_model, tmp_path / "moe", 0, 4, 8, "all-linear")
    with LLM(tiny.path, kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_lora_rank=8) as llm, \
            pytest.raises(ValueError, match=r"sets target_parameters=.*gate_up_proj"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("moe", 1, adapter.path))


def test_phi3_fused_targets_match_peft(tiny_models, tmp_path):
    """Phi-3's checkpoint fuses q/k/v and gate/up, so its adapters put one LoRA on each fused
    linear (A [r, in], B [q+k+v, r]): each part of pagedlab's fused linear gets A and its rows of
    B, and tokens and logprobs are PEFT's."""
    tiny = tiny_models("phi3")
    targets = ["qkv_proj", "gate_up_proj", "o_proj", "down_proj"]
    adapter = make_adapter(tiny.hf_model, tmp_path / "phi3", 3, 8, 16, targets, rank_pattern={"o_proj": 4})
    assert peft_greedy(adapter, tiny.hf_model, PROMPTS, GREEDY.max_tokens) != peft_greedy(
        None, tiny.hf_model, PROMPTS, GREEDY.max_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, logprobs=1, ignore_eos=True)
    with LLM(tiny.path, kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_lora_rank=8) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=LoRARequest("phi", 1, adapter.path))
    assert_hf_tokens_and_logprobs(adapter.peft_model, PROMPTS, outs, GREEDY.max_tokens)


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox"])
def test_models_without_lora_capable_linears_are_refused(tiny_models, arch):
    """GPT-2's Conv1D ``c_attn`` and NeoX's ``query_key_value`` get no LoRA layers: enable_lora
    is refused naming the model and what pagedlab puts LoRA on, not accepted to drop adapters."""
    with pytest.raises(ValueError, match=r"enable_lora=True: \w+ has no linear .*'q_proj'.*'qkv_proj'"):
        LLM(tiny_models(arch).path, kv_cache_memory_bytes=KV_BYTES, enable_lora=True)


class _NotAWeight:
    """A pickled object a ``weights_only`` load must refuse."""


def test_adapter_model_bin_is_read_without_safetensors(tiny_llama, llama_adapters, expected, tmp_path):
    """PEFT's older format (``save_pretrained(safe_serialization=False)``: ``adapter_model.bin``)
    is read as vLLM reads it, ``torch.load(weights_only=True)``: PEFT's tokens; a pickle holding
    anything but tensors is refused naming the file, and nothing in it runs."""
    llama_adapters["all-r8"].peft_model.save_pretrained(tmp_path / "bin", safe_serialization=False)
    assert not (tmp_path / "bin" / "adapter_model.safetensors").exists()
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8}))
    torch.save({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": _NotAWeight()},
               tmp_path / "evil" / "adapter_model.bin")
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_lora_rank=16) as llm:
        lora = LoRARequest("bin", 1, str(tmp_path / "bin"))
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)) == expected["all-r8"]
        with pytest.raises(ValueError, match=r"adapter_model\.bin.*weights_only=True.*_NotAWeight"):
            llm.llm_engine.validate_lora_request(LoRARequest("evil", 2, str(tmp_path / "evil")))
