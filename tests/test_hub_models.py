"""Hub model ids: ``LLM("org/name")`` finds a model in a Hugging Face cache laid out as
huggingface_hub lays it out (checked with huggingface_hub's own lookups), offline, and says what to
do when the model is neither cached nor downloadable."""

from __future__ import annotations

import huggingface_hub
import pytest
from huggingface_hub import constants as hub_constants

from conftest import KV_BYTES, hf_greedy, random_prompts
from hub_fixtures import write_hub_cache
from pagedlab import LLM, SamplingParams
from pagedlab.loader import resolve_model_source
from pagedlab.loader.hub import is_hub_id, resolve_hub_model

REPO = "pagedlab-test/tiny-llama"


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)


def test_hub_id_form():
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and is_hub_id("Qwen/Qwen3-0.6B")
    for local in ("./model", "/abs/path", "model", "a/b/c", "dir/model.gguf", "../x/y", "~/m"):
        assert not is_hub_id(local), local


def test_cached_hub_model_loads_offline_with_hf_tokens(tmp_path, tiny_llama, offline):
    snapshot = write_hub_cache(tmp_path, REPO, tiny_llama.path)
    # huggingface_hub itself finds the files in this cache
    assert huggingface_hub.try_to_load_from_cache(REPO, "config.json", cache_dir=tmp_path) == str(
        snapshot / "config.json")
    assert huggingface_hub.snapshot_download(REPO, cache_dir=tmp_path, local_files_only=True) == str(snapshot)
    assert resolve_model_source(REPO, download_dir=str(tmp_path)).path == snapshot
    prompts = random_prompts(3, seed=4)
    with LLM(REPO, download_dir=str(tmp_path), kv_cache_memory_bytes=KV_BYTES, max_model_len=128) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
        assert llm.get_engine_info().model_path == snapshot
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama.hf_model, prompt, 6)


def test_revision_selects_the_cached_snapshot(tmp_path, tiny_models, tiny_llama, offline):
    other = tiny_models("qwen2")
    write_hub_cache(tmp_path, REPO, tiny_llama.path)
    v2 = write_hub_cache(tmp_path, REPO, other.path, revision="v2", commit="f" * 40)
    assert resolve_hub_model(REPO, "v2", str(tmp_path)) == v2
    with pytest.raises(ValueError, match=r"revision 'v3'.*not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        resolve_hub_model(REPO, "v3", str(tmp_path))


def test_uncached_model_offline_says_how_to_use_a_local_directory(tmp_path, offline):
    with pytest.raises(ValueError) as err:
        LLM("pagedlab-test/not-cached", download_dir=str(tmp_path))
    msg = str(err.value)
    assert "'pagedlab-test/not-cached'" in msg and "HF_HUB_OFFLINE=1" in msg
    assert "--local-dir DIR" in msg and "LLM('DIR')" in msg


def test_unreachable_hub_says_no_network(tmp_path, monkeypatch):
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ValueError, match=r"could not be downloaded \(no network\?\).*--local-dir DIR"):
        resolve_hub_model("pagedlab-test/not-cached", None, str(tmp_path))


def test_hub_tokenizer_from_the_cache(tmp_path, tiny_llama, smollm2_dir, offline):
    """tokenizer= takes a hub id too (tokenizer files only, no weights needed in the cache)."""
    import transformers

    snapshot = write_hub_cache(tmp_path, "pagedlab-test/smollm2", smollm2_dir,
                               suffixes=(".json", ".txt", ".jinja"))
    text = "The capital of France is"
    with LLM(tiny_llama.path, tokenizer="pagedlab-test/smollm2", download_dir=str(tmp_path),
             kv_cache_memory_bytes=KV_BYTES, max_model_len=128) as llm:
        assert llm.get_engine_info().tokenizer_path == snapshot
        ids = llm.get_tokenizer()(text).input_ids
    assert ids == transformers.AutoTokenizer.from_pretrained(smollm2_dir)(text).input_ids


def test_a_cached_snapshot_missing_a_shard_is_not_taken_as_cached(tmp_path, tiny_llama, offline):
    """A snapshot whose download stopped before every shard its index names arrived is no cached
    model: offline, that is the 'not in the cache' error, not a load of part of the weights."""
    sharded = tmp_path / "sharded"
    tiny_llama.hf_model.save_pretrained(sharded, max_shard_size="100KB")
    sorted(sharded.glob("model-*.safetensors"))[-1].unlink()
    write_hub_cache(tmp_path / "cache", REPO, str(sharded))
    with pytest.raises(ValueError, match=r"not in the Hugging Face cache .* HF_HUB_OFFLINE=1"):
        resolve_hub_model(REPO, None, str(tmp_path / "cache"))
