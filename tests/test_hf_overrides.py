"""``hf_overrides`` (vLLM's): the model's HF config changed before it is built. Each engine is
checked against HF transformers built from the same config.json with the same change made by
hand (float32, CPU), and against the unchanged model; max_model_len follows a changed context as
vLLM derives it; the CLI's JSON form, bad input, the draft model, and the HF parity check."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
import transformers

from conftest import KV_BYTES, hf_greedy, random_prompts
from pagedlab import LLM, SamplingParams
from pagedlab.cli.engine_args import EngineArgs, FlexibleArgumentParser
from pagedlab.hf_overrides import apply_hf_overrides
from pagedlab.lab.repro.hf import hf_parity
from pagedlab.lab.testing import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = random_prompts(3, min_len=5, max_len=30, seed=3)
LINEAR_X2 = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}


def engine_tokens(path: str, prompts=PROMPTS, **engine_args) -> list[list[int]]:
    with LLM(path, device="cpu", dtype="float32", kv_cache_memory_bytes=KV_BYTES, **engine_args) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def hf_reference(path: str, change) -> torch.nn.Module:
    """HF transformers' model of ``path`` with its config changed by ``change(config)`` by hand."""
    config = transformers.AutoConfig.from_pretrained(path)
    change(config)
    return transformers.AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32,
                                                             attn_implementation="sdpa").eval()


def hf_tokens(model, prompts=PROMPTS) -> list[list[int]]:
    return [hf_greedy(model, p, GREEDY.max_tokens, eos_token_id=None) for p in prompts]


def one_layer(config):
    config.num_hidden_layers = 1
    return config


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # GPT-2 stores the count as n_layer, its layers as h.N
def test_fewer_layers_give_hf_tokens_of_the_cut_model(tiny_models, arch):
    tiny = tiny_models(arch)
    cut = engine_tokens(tiny.path, hf_overrides={"num_hidden_layers": 1})
    assert cut == hf_tokens(hf_reference(tiny.path, one_layer))
    assert cut != hf_tokens(tiny.hf_model)  # the override changed the model
    with LLM(tiny.path, device="cpu", kv_cache_memory_bytes=KV_BYTES,
             hf_overrides={"num_hidden_layers": 1}) as llm:
        info = llm.get_engine_info()
        assert info.hf_config.num_hidden_layers == 1 and llm.llm_engine.runner.num_layers == 1


def test_a_callable_override_works_as_the_dict(tiny_llama):
    assert engine_tokens(tiny_llama.path, hf_overrides=one_layer) == \
        hf_tokens(hf_reference(tiny_llama.path, one_layer))
    with pytest.raises(ValueError, match="returned NoneType: it must return the PretrainedConfig"):
        LLM(tiny_llama.path, device="cpu", hf_overrides=lambda config: None)


@pytest.mark.parametrize("overrides, expected", [
    ({}, 512),
    ({"max_position_embeddings": 1024}, 1024),
    (LINEAR_X2, 1024),  # vLLM: max_position_embeddings times the factor
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 96}}, 384),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
     512),  # already scaled, as vLLM reads it
], ids=["none", "positions", "linear", "yarn", "llama3"])
def test_max_model_len_follows_the_changed_context(tiny_llama, overrides, expected):
    """The tiny models have 512 positions; the expectations are vLLM's _get_and_verify_max_len."""
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES,
             hf_overrides=overrides or None) as llm:
        info = llm.get_engine_info()
        assert info.max_model_len == expected
        assert info.hf_config.rope_parameters["rope_theta"] == 10000.0  # the checkpoint's, kept


def test_context_extension_runs_past_the_checkpoints_positions_as_hf(tiny_llama):
    with pytest.raises(ValueError, match="max_model_len=1024 is invalid: the model supports at most 512"):
        LLM(tiny_llama.path, device="cpu", max_model_len=1024)
    prompts = random_prompts(1, min_len=600, max_len=600, seed=5)  # past the 512 positions of config.json

    def linear_x2(config):
        config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}

    tokens = engine_tokens(tiny_llama.path, prompts, hf_overrides=LINEAR_X2, max_model_len=1024)
    assert tokens == hf_tokens(hf_reference(tiny_llama.path, linear_x2), prompts)
    assert tokens != hf_tokens(tiny_llama.hf_model, prompts)


def test_architectures_and_model_type_overrides_serve_a_renamed_checkpoint(tiny_llama, tmp_path):
    """A fine-tune saved under a name neither transformers nor pagedlab knows, vLLM's recipe:
    ``{"architectures": [...], "model_type": ...}`` (model_type picks transformers' config class)."""
    renamed = tmp_path / "renamed"
    shutil.copytree(tiny_llama.path, renamed)
    config = json.loads((renamed / "config.json").read_text())
    (renamed / "config.json").write_text(json.dumps({**config, "architectures": ["MyLlamaForCausalLM"],
                                                     "model_type": "my_llama"}))
    with pytest.raises(ValueError, match=r"architecture \['MyLlamaForCausalLM'\].*is not supported"):
        LLM(str(renamed), device="cpu")
    overrides = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    assert engine_tokens(str(renamed), hf_overrides=overrides) == hf_tokens(tiny_llama.hf_model)


def test_bad_overrides_are_refused_by_name(tiny_llama, caplog):
    for value, message in [(5, "hf_overrides=5 is invalid: hf_overrides must be a dict or a callable"),
                           ("num_hidden_layers=1", "hf_overrides='num_hidden_layers=1' is invalid"),
                           ({1: 2}, "its key 1 is not a string"),
                           ({"rope_scaling": {"rope_type": "linear"}},
                            "RoPE parameters .* fail transformers' check: .*factor")]:
        with pytest.raises(ValueError, match=message):
            LLM(tiny_llama.path, device="cpu", hf_overrides=value)
    # a key the config lacks is set anyway, as vLLM sets it, with a warning naming the closest one
    with caplog.at_level(logging.WARNING, logger="pagedlab.hf_overrides"):
        tokens = engine_tokens(tiny_llama.path, hf_overrides={"num_hidden_layer": 1})
    assert "did you mean 'num_hidden_layers'?" in caplog.text
    assert tokens == hf_tokens(tiny_llama.hf_model)  # nothing the model reads changed


def test_nested_dicts_merge_into_sub_configs_and_replace_plain_dicts():
    """vLLM's _apply_dict_overrides: a dict for a sub-config changes only the keys it names; a
    dict for a dict-valued attribute replaces it; flat values are set first."""
    config = transformers.Gemma3Config(text_config={"num_hidden_layers": 4, "hidden_size": 64, "head_dim": 16,
                                                    "num_attention_heads": 4, "num_key_value_heads": 1})
    overrides = {"text_config": {"num_hidden_layers": 2}, "image_token_index": 7,
                 "vision_config": {"num_hidden_layers": 1}}
    changed = apply_hf_overrides(config, overrides)
    assert changed.text_config.num_hidden_layers == 2 and changed.text_config.hidden_size == 64
    assert changed.vision_config.num_hidden_layers == 1 and changed.image_token_index == 7
    assert overrides["text_config"] == {"num_hidden_layers": 2}  # the caller's dict is left alone
    llama = transformers.LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                      "partial_rotary_factor": 0.5})
    apply_hf_overrides(llama, {"rope_parameters": {"rope_type": "linear", "factor": 3.0}})
    assert llama.rope_parameters == {"rope_type": "linear", "factor": 3.0, "rope_theta": 500.0,
                                     "partial_rotary_factor": 0.5}


def test_cli_takes_the_json_form():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    given = {"num_hidden_layers": 1, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    args = parser.parse_args(["--hf-overrides", json.dumps(given)])
    assert EngineArgs.from_cli_args(args).hf_overrides == given
    assert parser.parse_args([f"--hf_overrides={json.dumps(given)}"]).hf_overrides == given  # vLLM's spelling
    assert parser.parse_args([]).hf_overrides is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--hf-overrides", "num_hidden_layers=1"])


def test_the_draft_model_keeps_its_own_config(tiny_llama):
    """As in vLLM, the target's overrides are not the draft's; outputs stay the target's."""
    spec = {"method": "draft_model", "model": tiny_llama.path, "num_speculative_tokens": 2}
    with LLM(tiny_llama.path, device="cpu", dtype="float32", kv_cache_memory_bytes=KV_BYTES,
             hf_overrides={"num_hidden_layers": 1}, speculative_config=spec) as llm:
        assert llm.llm_engine.draft.hf_config.num_hidden_layers == 2
        assert llm.llm_engine.hf_config.num_hidden_layers == 1
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert tokens == hf_tokens(hf_reference(tiny_llama.path, one_layer))


def test_hf_parity_builds_its_reference_with_the_engines_overrides(tiny_llama):
    with LLM(tiny_llama.path, device="cpu", dtype="float32", kv_cache_memory_bytes=KV_BYTES,
             hf_overrides={"num_hidden_layers": 1}) as llm:
        result = hf_parity(llm, PROMPTS, max_tokens=6)
        assert result.same and result.metrics["greedy_match_rate"] == 1.0
        unchanged = hf_parity(llm, PROMPTS, hf_model=tiny_llama.hf_model, max_tokens=6)
        assert not unchanged.same  # what the check would report with the checkpoint's config


def test_two_ranks_build_the_overridden_model(tiny_llama):
    """Tensor parallelism over two CPU processes: rank 1 builds its shard from rank 0's changed
    config, a lambda's too (it is never pickled to the worker)."""
    prompts = PROMPTS[:2]
    tokens = engine_tokens(tiny_llama.path, prompts, tensor_parallel_size=2,
                           hf_overrides=lambda config: apply_hf_overrides(config, {"num_hidden_layers": 1,
                                                                                   **LINEAR_X2}))

    def cut_and_scaled(config):
        one_layer(config)
        config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}

    assert tokens == hf_tokens(hf_reference(tiny_llama.path, cut_and_scaled), prompts)


def test_the_lab_keys_and_records_the_overrides(tmp_path):
    """A sweep over hf_overrides: each value is its own run key and model load, and each stored
    run's params and manifest say which config it ran (the model's parameters counted from it)."""
    pytest.importorskip("yaml")
    pytest.importorskip("sqlalchemy")
    from pagedlab.lab.experiments import expand_runs, experiment_from_dict, run_experiment
    from pagedlab.lab.store import ResultStore

    cut = {"num_hidden_layers": 1}
    spec = {"name": "cut", "model": str(make_tiny_model(tmp_path / "tiny", tokenizer=False)),
            "engine": {"device": "cpu", "kv_cache_memory_bytes": KV_BYTES},
            "benchmark": {"batch_size": 1, "input_len": 4, "output_len": 2},
            "grid": {"engine.hf_overrides": [None, cut]}}
    runs = expand_runs(experiment_from_dict(spec))
    assert runs[0].run_key != runs[1].run_key and runs[0].group_key != runs[1].group_key
    assert run_experiment(experiment_from_dict(spec), db=str(tmp_path / "r.db"), quiet=True).ok
    with ResultStore(str(tmp_path / "r.db")) as store:
        stored = {r["run_key"]: r for r in store.runs()}
    base, changed = stored[runs[0].run_key], stored[runs[1].run_key]
    assert base["params"]["engine.hf_overrides"] is None and changed["params"]["engine.hf_overrides"] == cut
    assert base["manifest"]["engine"]["hf_overrides"] is None
    assert changed["manifest"]["engine"]["hf_overrides"] == cut
    # a layer of the tiny Llama: q, o 64x64; k, v 64x32 (2 of 4 heads); gate, up, down 64x128; two norms
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    assert base["manifest"]["model"]["parameters"] - changed["manifest"]["model"]["parameters"] == per_layer


def test_a_callable_is_recorded_by_its_name(tiny_llama):
    from pagedlab.lab.manifest import collect_manifest

    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES, hf_overrides=one_layer) as llm:
        manifest = collect_manifest(llm, hash_weights=False)
    assert manifest["engine"]["hf_overrides"] == "callable:test_hf_overrides.one_layer"
    json.dumps(manifest)  # storable as it is
