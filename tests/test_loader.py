"""Loading: sharded safetensors, GGUF files (converted once, then cached), dummy weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import KV_BYTES, build_tiny_model, hf_greedy, random_prompts, tiny_config
from gguf_fixtures import write_tiny_gguf
from test_server_support import CHAT_TEMPLATE
from pagedlab import LLM, SamplingParams
from pagedlab.config import resolve_max_model_len
from pagedlab.loader.gguf import embedded_model_path, gguf_cache_dir

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def test_sharded_safetensors_load_like_one_file(tiny_models, tmp_path):
    tiny = tiny_models("qwen3")
    tiny.hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 3
    prompts = random_prompts(3, seed=80)
    with LLM(str(tmp_path), kv_cache_memory_bytes=KV_BYTES) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(tiny.hf_model, p, 12) for p in prompts]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dummy_weights_need_only_config(arch, tiny_models, tmp_path):
    """A directory of config.json alone has no tokenizer, though transformers builds an empty one
    (no vocabulary: every text encodes to no tokens) for some model types, Qwen2's among them."""
    (tmp_path / "config.json").write_text((Path(tiny_models(arch).path) / "config.json").read_text())
    with LLM(str(tmp_path), load_format="dummy", kv_cache_memory_bytes=KV_BYTES, seed=3) as llm:
        first = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert llm.get_tokenizer() is None
    with LLM(str(tmp_path), load_format="dummy", kv_cache_memory_bytes=KV_BYTES, seed=3) as llm:
        assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first


@pytest.mark.slow
def test_gguf_file_path_is_converted_once_with_its_tokenizer(smollm2_dir, smollm2_hf, monkeypatch):
    import transformers

    model, tokenizer = smollm2_hf
    gguf = embedded_model_path("smollm2-135m-instruct")
    assert gguf_cache_dir(gguf).is_dir()  # the smollm2_dir fixture converted it already

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("the GGUF file was dequantized again instead of read from the cache")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_second_conversion)
    with LLM(str(gguf), kv_cache_memory_bytes=32 << 20, max_model_len=512) as llm:
        assert llm.get_tokenizer().chat_template == tokenizer.chat_template
        out = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(model, tokenizer("The capital of France is").input_ids, 12)


@pytest.mark.parametrize("rope, positions", [
    ({"rope_type": "linear", "factor": 2.0}, 1024),
    ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128}, 1024),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}, 512),
])
def test_rope_scaling_stretches_the_context_as_vllm_derives_it(rope, positions):
    """max_model_len defaults to max_position_embeddings times a linear (or YaRN, from its original
    length) RoPE factor, as vLLM's _get_and_verify_max_len; Llama 3's is already the scaled one."""
    config = tiny_config("llama", rope_parameters={"rope_theta": 10000.0, **rope})
    assert resolve_max_model_len(None, config) == positions
    with pytest.raises(ValueError, match=f"supports at most {positions} positions"):
        resolve_max_model_len(positions + 1, config)


def test_a_prompt_past_max_position_embeddings_of_a_linear_scaled_model_matches_transformers(tmp_path):
    """With linear RoPE scaling the engine serves positions past max_position_embeddings (512 here,
    1024 scaled), its rotary table covering them, and agrees with transformers there."""
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    tiny = build_tiny_model(tmp_path, "llama", rope_parameters=rope)
    prompt = random_prompts(1, min_len=600, max_len=601, seed=81)[0]
    with LLM(str(tmp_path), kv_cache_memory_bytes=KV_BYTES) as llm:
        assert llm.get_engine_info().max_model_len == 1024
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(tiny.hf_model, prompt, 12)


def test_sharded_checkpoint_reads_only_the_files_its_index_names(tiny_llama, tmp_path):
    """A weight file beside the indexed shards (Mistral ships consolidated.safetensors, its own
    layout of the same weights) is not read, as transformers and vLLM skip it."""
    from safetensors.torch import save_file

    tiny_llama.hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4)}, str(tmp_path / "consolidated.safetensors"))
    prompt = random_prompts(1, seed=82)[0]
    with LLM(str(tmp_path), kv_cache_memory_bytes=KV_BYTES) as llm:
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama.hf_model, prompt, 12)


def test_a_shard_missing_from_its_index_is_named(tiny_llama, tmp_path):
    """A shard the index lists but the directory lacks is an error naming that file, not a list
    of the weights it held."""
    tiny_llama.hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    shards[1].unlink()
    with pytest.raises(ValueError, match=rf"weight files \['{shards[1].name}'\] listed in .* are missing"):
        LLM(str(tmp_path), kv_cache_memory_bytes=KV_BYTES)


def _hf_from_gguf(path: Path):
    """transformers' own reading of a GGUF file (dequantized to float32): the reference."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.mark.parametrize("arch, qtype", [("llama", "Q8_0"), ("mistral", "BF16"), ("qwen2", "Q4_1"),
                                         ("qwen3", "Q5_0")])
def test_a_gguf_without_a_tokenizer_loads_as_transformers_reads_it(arch, qtype, chat_dir, tmp_path,
                                                                   monkeypatch):
    """A GGUF file with weights but no tokenizer fields loads as a weights-only directory does,
    taking ``tokenizer=`` as vLLM's GGUF users pass it, with transformers' dequantized weights and
    config (rotary permutation, GQA heads, tied embeddings, RoPE base, RMS epsilon)."""
    monkeypatch.setenv("PAGEDLAB_CACHE_DIR", str(tmp_path / "cache"))
    # transformers reads no head_dim from a Qwen3 GGUF: its default, 128
    tiny = build_tiny_model(tmp_path / "hf", arch, **({"head_dim": 128} if arch == "qwen3" else {}))
    path = tmp_path / f"tiny-{arch}.{qtype}.gguf"
    write_tiny_gguf(path, tiny.hf_model, qtype)
    reference = _hf_from_gguf(path)
    prompts = random_prompts(3, seed=83)
    with LLM(str(path), tokenizer=chat_dir, kv_cache_memory_bytes=KV_BYTES) as llm:
        assert llm.get_tokenizer().chat_template == CHAT_TEMPLATE
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(reference, p, 12) for p in prompts]


def test_a_gguf_tokenizer_encodes_and_templates_as_transformers_reads_it(chat_dir, tmp_path, monkeypatch):
    """The tokenizer converted from a GGUF file's fields (byte-level BPE, special tokens, BOS added,
    chat template) encodes, decodes and applies the template as transformers' GGUF tokenizer."""
    import transformers

    monkeypatch.setenv("PAGEDLAB_CACHE_DIR", str(tmp_path / "cache"))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(chat_dir, dtype=torch.float32)
    path = tmp_path / "chat.Q8_0.gguf"
    write_tiny_gguf(path, hf_model, "Q8_0", tokenizer_dir=Path(chat_dir))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    texts = ["The quick brown fox", " leading  spaces\tand\nnewlines ", "émoji 🤗 中文", "</s><s>x", ""]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}]
    with LLM(str(path), kv_cache_memory_bytes=KV_BYTES) as llm:
        tokenizer = llm.get_tokenizer()
        for text in texts:
            ids = reference(text).input_ids
            assert tokenizer(text).input_ids == ids
            assert tokenizer.decode(ids) == reference.decode(ids)
        assert (tokenizer.apply_chat_template(chat, add_generation_prompt=True)
                == reference.apply_chat_template(chat, add_generation_prompt=True))
        out = llm.generate("Why is the sky", GREEDY, use_tqdm=False)[0]
    prompt = reference("Why is the sky").input_ids
    assert out.outputs[0].token_ids == hf_greedy(_hf_from_gguf(path), prompt, 12)


def test_a_split_gguf_is_refused_naming_its_parts(tiny_llama, tmp_path, monkeypatch):
    """A GGUF model split in parts (llama-gguf-split's -00001-of-00003.gguf) is refused, as vLLM
    loads only single-file GGUF models: transformers would read one part and leave the weights of
    the others random."""
    monkeypatch.setenv("PAGEDLAB_CACHE_DIR", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama.hf_model, split_max_tensors=8)
    parts = sorted(tmp_path.glob("tiny-*-of-00003.gguf"))
    assert len(parts) == 3
    for part in parts:
        with pytest.raises(ValueError, match=rf"{part.name} is one of the 3 parts of a split GGUF model.*"
                                             r"llama-gguf-split --merge"):
            LLM(str(part), kv_cache_memory_bytes=KV_BYTES)


def test_a_gguf_lacking_a_weight_is_refused_naming_it(tiny_llama, tmp_path, monkeypatch):
    """A GGUF file without a tensor the model needs is an error naming the weight, as vLLM's
    loader and a safetensors checkpoint lacking it, not a model with that weight left random."""
    monkeypatch.setenv("PAGEDLAB_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "truncated.gguf"
    write_tiny_gguf(path, tiny_llama.hf_model, leave_out=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(ValueError, match=r"truncated.gguf lacks weights for: model.layers.1.mlp.up_proj"):
        LLM(str(path), kv_cache_memory_bytes=KV_BYTES)
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # nothing cached


@pytest.mark.parametrize("lost", ["config.json", "model.safetensors"])
def test_a_damaged_gguf_conversion_in_the_cache_is_redone(lost, tiny_llama, tmp_path, monkeypatch):
    """A cached conversion missing one of its files (a cleanup cut short) is converted again, not
    read as it is: the model then loads as transformers reads the GGUF file."""
    from pagedlab.loader.gguf import convert_gguf

    monkeypatch.setenv("PAGEDLAB_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_llama.hf_model, "Q8_0")
    (convert_gguf(path) / lost).unlink()
    prompt = random_prompts(1, seed=84)[0]
    with LLM(str(path), kv_cache_memory_bytes=KV_BYTES) as llm:
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(_hf_from_gguf(path), prompt, 12)


def test_tokenizer_may_be_a_gguf_file(tiny_llama, chat_dir, tmp_path, monkeypatch):
    """``tokenizer=`` naming a .gguf file takes the tokenizer in its fields, as vLLM's get_tokenizer
    reads one (transformers' GGUF tokenizer), rather than leaving the engine without one."""
    import transformers

    monkeypatch.setenv("PAGEDLAB_CACHE_DIR", str(tmp_path / "cache"))
    chat_model = transformers.AutoModelForCausalLM.from_pretrained(chat_dir, dtype=torch.float32)
    write_tiny_gguf(tmp_path / "chat.gguf", chat_model, tokenizer_dir=Path(chat_dir))
    write_tiny_gguf(tmp_path / "weights.gguf", tiny_llama.hf_model)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="chat.gguf")
    with LLM(str(tmp_path / "weights.gguf"), tokenizer=str(tmp_path / "chat.gguf"),
             kv_cache_memory_bytes=KV_BYTES) as llm:
        text = "Why is the sky blue?"
        assert llm.get_tokenizer()(text).input_ids == reference(text).input_ids
    config_file = str(Path(tiny_llama.path) / "config.json")
    with pytest.raises(ValueError, match=r"tokenizer '.*config.json' is a file but not a .gguf file"):
        LLM(tiny_llama.path, tokenizer=config_file, kv_cache_memory_bytes=KV_BYTES)
