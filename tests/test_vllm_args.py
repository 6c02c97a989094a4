"""vLLM's remaining common arguments, each doing what vLLM's does (or refused by name): misspelled
keywords, seed, tokenizer_mode, served_model_name, swap_space, cpu_offload_gb, disable_log_stats,
chat's template arguments, TextPrompt/TokensPrompt, and the pooling calls pagedlab does not serve."""

from __future__ import annotations

import logging

import pytest

from conftest import KV_BYTES, random_prompts
from pagedlab import LLM, SamplingParams, TextPrompt, TokensPrompt
from pagedlab.cli.engine_args import engine_config_from_args
from pagedlab.cli.main import build_parser
from pagedlab.config import EngineConfig
from pagedlab.lab.schema import ExperimentError
from pagedlab.lab.spec import experiment_from_dict


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    with LLM(smollm2_dir, kv_cache_memory_bytes=KV_BYTES, max_model_len=256) as llm:
        yield llm


def test_misspelled_keyword_names_the_closest():
    with pytest.raises(ValueError, match=r"^unknown argument 'max_num_seq'; did you mean 'max_num_seqs'\?$"):
        LLM("smollm2-135m-instruct", max_num_seq=4)
    with pytest.raises(ValueError, match=r"did you mean 'gpu_memory_utilization'\?"):
        EngineConfig.from_kwargs(gpu_memory_utilisation=0.5)
    with pytest.raises(ValueError, match=r"unknown argument 'zzz': the engine takes \['model', "):
        EngineConfig.from_kwargs(zzz=1)


def test_yaml_checker_names_the_closest_key(tmp_path):
    (tmp_path / "model").mkdir()
    base = {"name": "x", "model": "model", "dataset": {"prompts": ["a"]}}
    with pytest.raises(ExperimentError,
                       match=r"unknown engine key 'max_num_seq'; did you mean 'max_num_seqs'\?"):
        experiment_from_dict({**base, "engine": {"max_num_seq": 4}}, tmp_path)
    with pytest.raises(ExperimentError, match=r"unknown key; did you mean 'sampling'\?"):
        experiment_from_dict({**base, "samplng": {}}, tmp_path)


def test_new_fields_are_flags_and_yaml_keys(tmp_path):
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "b", "--swap-space", "2",
                                      "--tokenizer-mode", "slow", "--revision", "v1", "--download-dir", "d",
                                      "--no-disable-log-stats"])
    config = engine_config_from_args(args)
    assert (config.served_model_name, config.swap_space, config.tokenizer_mode, config.revision,
            config.download_dir, config.disable_log_stats) == (["a", "b"], 2.0, "slow", "v1", "d", False)
    (tmp_path / "model").mkdir()
    spec = experiment_from_dict({"name": "x", "model": "model", "dataset": {"prompts": ["a"]},
                                 "engine": {"swap_space": 1, "tokenizer_mode": "slow"}}, tmp_path)
    assert spec.base["engine"] == {"swap_space": 1, "tokenizer_mode": "slow"}


@pytest.mark.parametrize("kwargs, message", [
    ({"cpu_offload_gb": 4}, r"cpu_offload_gb=4 is not supported: pagedlab keeps every weight on the device"),
    ({"swap_space": -1}, r"swap_space=-1 is invalid"),
    ({"tokenizer_mode": "mistral"}, r"tokenizer_mode='mistral' is invalid: tokenizer_mode must be one of "
                                    r"\('auto', 'slow'\)"),
    ({"seed": "7"}, r"seed='7' is invalid"),
])
def test_refused_settings_say_why(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs).validate()


def test_seed_makes_sampling_reproducible_across_engines(tiny_llama):
    prompts = random_prompts(4, seed=9)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    def sample(seed):
        with LLM(tiny_llama.path, seed=seed, kv_cache_memory_bytes=KV_BYTES) as llm:
            return ([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)],
                    llm.get_engine_info().config.seed)

    first, again, other = sample(3), sample(3), sample(4)
    assert first == again and first[0] != other[0]
    drawn, seed = sample(None)
    assert isinstance(seed, int) and sample(seed)[0] == drawn  # a drawn seed is recorded and replays


def test_tokenizer_mode_slow_loads_transformers_python_tokenizer(tiny_llama, smollm2_dir, monkeypatch):
    """The mode reaches transformers as use_fast (whose 5.x serves this tokenizer by one class in
    both modes, so the class alone cannot tell them apart)."""
    import transformers

    asked = []
    load = transformers.AutoTokenizer.from_pretrained

    def recorded(path, **kwargs):
        asked.append((str(path), kwargs.get("use_fast")))
        return load(path, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recorded)
    for mode, use_fast in (("auto", True), ("slow", False)):
        asked.clear()
        with LLM(tiny_llama.path, tokenizer=smollm2_dir, tokenizer_mode=mode, kv_cache_memory_bytes=KV_BYTES,
                 max_model_len=64) as llm:
            assert (str(smollm2_dir), use_fast) in asked and {fast for _, fast in asked} == {use_fast}
            expected = load(smollm2_dir, use_fast=use_fast)
            assert type(llm.get_tokenizer()) is type(expected)


def test_served_model_name_is_kept(tiny_llama):
    with LLM(tiny_llama.path, served_model_name="tiny", kv_cache_memory_bytes=KV_BYTES) as llm:
        assert llm.get_engine_info().config.served_model_name == "tiny"


def test_stats_are_logged_unless_disabled(tiny_llama, caplog):
    prompts = random_prompts(3, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    caplog.set_level(logging.INFO, logger="pagedlab.stats")
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        llm.generate(prompts, params, use_tqdm=False)
    assert not [r for r in caplog.records if r.name == "pagedlab.stats"]
    with LLM(tiny_llama.path, disable_log_stats=False, kv_cache_memory_bytes=KV_BYTES) as llm:
        llm.generate(prompts, params, use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "pagedlab.stats"]
    assert lines and "generation throughput" in lines[-1] and "running 0, waiting 0" in lines[-1]


def test_text_and_tokens_prompts(smollm2):
    text = "The capital of France is"
    ids = smollm2.get_tokenizer()(text).input_ids
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    outs = smollm2.generate([TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=ids), text], greedy,
                            use_tqdm=False)
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids == ids
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    no_bos = smollm2.generate(TextPrompt(prompt=text, add_special_tokens=False), greedy, use_tqdm=False)[0]
    assert no_bos.prompt_token_ids == smollm2.get_tokenizer()(text, add_special_tokens=False).input_ids
    with pytest.raises(ValueError, match="prompt key 'multi_modal_data' is not supported"):
        smollm2.generate({"prompt": text, "multi_modal_data": {"image": None}}, greedy)


def test_chat_template_arguments(smollm2):
    tokenizer = smollm2.get_tokenizer()
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    conversation = [{"role": "user", "content": "Name a colour."},
                    {"role": "assistant", "content": "A colour is"}]
    out = smollm2.chat(conversation, greedy, use_tqdm=False, add_generation_prompt=False,
                       continue_final_message=True)[0]
    expected = tokenizer.apply_chat_template(conversation, tokenize=False, continue_final_message=True)
    assert out.prompt == expected and out.prompt.endswith("A colour is")
    # as vLLM, chat_template_kwargs override the arguments of the same name
    continue_args = {"add_generation_prompt": False, "continue_final_message": True}
    out = smollm2.chat(conversation, greedy, use_tqdm=False, chat_template_kwargs=continue_args)[0]
    assert out.prompt == expected
    template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}{{ suffix }}"
    out = smollm2.chat(conversation[:1], greedy, use_tqdm=False, chat_template=template,
                       chat_template_kwargs={"suffix": "END"})[0]
    assert out.prompt == "Name a colour.|END"
    assert out.prompt_token_ids == tokenizer("Name a colour.|END", add_special_tokens=False).input_ids
    # as vLLM's LLM.chat, tools reach the template's ``tools``
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    tool_template = "{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{{ messages[0]['content'] }}"
    out = smollm2.chat(conversation[:1], greedy, use_tqdm=False, chat_template=tool_template, tools=tools)[0]
    want = tokenizer.apply_chat_template(conversation[:1], tools=tools, chat_template=tool_template,
                                         tokenize=False)
    assert out.prompt == want == "get_time;Name a colour."
    with pytest.raises(ValueError,
                       match="add_generation_prompt=True and continue_final_message=True conflict"):
        smollm2.chat(conversation, greedy, continue_final_message=True)
    with pytest.raises(ValueError, match="last message is the assistant's"):
        smollm2.chat(conversation[:1], greedy, add_generation_prompt=False, continue_final_message=True)


@pytest.mark.parametrize("method", ["encode", "embed", "classify", "score", "reward"])
def test_pooling_calls_are_refused_by_name(smollm2, method):
    with pytest.raises(NotImplementedError, match=rf"LLM.{method}\(\) is not supported: pagedlab serves text "
                                                  "generation only"):
        getattr(smollm2, method)(["a text"])


def test_engine_args_build_the_parser_of_vllm_scripts(tiny_llama):
    """vLLM's examples add the engine flags with ``EngineArgs.add_cli_args`` to a
    ``FlexibleArgumentParser`` (or one of its groups), which takes ``--max_model_len`` as
    ``--max-model-len``, then pass ``vars(args)`` to ``LLM`` or ``EngineArgs.from_cli_args(args)``."""
    from pagedlab import EngineArgs
    from pagedlab.utils import FlexibleArgumentParser
    from pagedlab.utils.argparse_utils import FlexibleArgumentParser as same_parser

    assert same_parser is FlexibleArgumentParser
    parser = FlexibleArgumentParser()
    assert EngineArgs.add_cli_args(parser) is parser
    args = parser.parse_args(["--model", tiny_llama.path, "--max_model_len=128", "--enable-prefix-caching",
                              "--kv-cache-memory-bytes", "16MiB"])
    expected = EngineArgs(model=tiny_llama.path, max_model_len=128, enable_prefix_caching=True,
                          kv_cache_memory_bytes=KV_BYTES)
    assert EngineArgs.from_cli_args(args) == expected
    assert EngineConfig.from_kwargs(**vars(args)) == EngineConfig(**vars(expected))  # LLM(**vars(args))

    parser = FlexibleArgumentParser()
    group = parser.add_argument_group("Engine arguments")
    EngineArgs.add_cli_args(group)
    group.set_defaults(model=tiny_llama.path)
    parser.add_argument("--max-tokens", type=int)
    args = vars(parser.parse_args(["--max-num-seqs", "4", "--max-tokens", "8"]))
    assert args.pop("max_tokens") == 8
    assert EngineConfig.from_kwargs(**args) == EngineConfig(model=tiny_llama.path, max_num_seqs=4)
