"""Shared fixtures: tiny random HF models built on the fly, and the embedded SmolLM2."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ.setdefault("PAGEDLAB_CACHE_DIR",
                      str(Path(__file__).resolve().parent.parent / ".cache" / "pagedlab"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Without CUDA, Triton kernels run interpreted, and Triton fixes that choice when a kernel is
    # decorated: set it before any test module, or a library it imports (peft), loads triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import speed_up_triton_interpreter

    speed_up_triton_interpreter()
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # pytest-xdist: share the cores, not oversubscribe them
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
# Subprocesses (the CLI, killed experiments) run this checkout's source too, whatever is installed.
_SRC = str(Path(__file__).resolve().parent.parent / "src")
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_SRC] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

KV_BYTES = 16 << 20  # keeps CPU tests small


def pytest_runtest_setup(item):
    """Modules that share Ray or the PostgreSQL database (or an expensive module fixture) carry one
    ``xdist_group``, which ``--dist loadgroup`` runs on one worker. pytest-xdist marks a grouped
    test by appending ``@group`` to its node id, and where a pytest release ignores that (pytest
    9.2 with xdist 3.8: pytest-xdist#1386) the groups are dropped without a word and those modules
    race: such a test fails instead of running."""
    if (item.get_closest_marker("xdist_group") and "@" not in item.nodeid
            and os.environ.get("PYTEST_XDIST_WORKER") and item.config.getvalue("loadgroup")):
        pytest.fail("--dist loadgroup dropped this test's xdist_group: this pytest and pytest-xdist do not "
                    "group tests (pytest-xdist#1386); install pytest<9.2", pytrace=False)


@dataclass
class TinyModel:
    name: str
    path: str
    hf_model: torch.nn.Module


def gated_tolerance(dtype) -> dict:
    """``assert_close`` tolerances of a gated GEMV's ``silu(gate) * up`` against ``silu_and_mul``
    of the plain GEMV's output. The two launches sum the products in tiles of different shapes, so
    float32 outputs agree to the GEMV's own tolerance, not bitwise (under the interpreter numpy's
    BLAS picks its summation order by the tile's shape and the CPU: on an AVX2-only AMD EPYC a
    16-row float32 case differed by 4.8e-5 at 3.5), and the reference rounds gate and up to the
    output dtype before the SiLU, so float16 agrees within one rounding (and the GPU's fast exp)."""
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-5, rtol=1e-3)


def tiny_config(arch: str, **overrides):
    import transformers

    common = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.1, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common)
    elif arch == "llama3":
        cfg = transformers.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=None)
    elif arch == "mistral_window":  # every layer windowed, the window shorter than the prompts
        cfg = transformers.MistralConfig(**common, sliding_window=16)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    elif arch == "gpt2":
        cfg = transformers.GPT2Config(**common, n_inner=128, activation_function="gelu_new")
    elif arch == "phi3":  # Phi-4-mini's partial rotary
        cfg = transformers.Phi3Config(**common, sliding_window=None, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})
    elif arch == "phi3_longrope":  # LongRoPE switching to its long factors past 32 tokens
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0], "original_max_position_embeddings": 32}
        cfg = transformers.Phi3Config(**common, sliding_window=None, rope_parameters=rope,
                                      original_max_position_embeddings=32)
    elif arch == "gemma2":  # attention and final logit soft-capping; local/global layers
        cfg = transformers.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
                                        final_logit_softcapping=5.0, attn_logit_softcapping=1.0)
    elif arch == "gemma3":  # local/global RoPE bases and windows, q/k norms
        layer_types = ["sliding_attention", "full_attention"]
        cfg = transformers.Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=24,
                                            sliding_window=16, layer_types=layer_types)
    elif arch == "mixtral":  # 8 experts, top-2
        cfg = transformers.MixtralConfig(**{**common, "intermediate_size": 32}, num_local_experts=8,
                                         num_experts_per_tok=2, sliding_window=None)
    elif arch == "qwen3_moe":  # 8 experts, top-2, router weights not renormalized
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=32, norm_topk_prob=False)
    elif arch in ("gpt_neox", "gpt_neox_sequential"):  # Pythia: partial rotary, parallel residual
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
        cfg = transformers.GPTNeoXConfig(**common, hidden_act="gelu", rope_parameters=rope,
                                         use_parallel_residual=arch == "gpt_neox")
    else:
        raise KeyError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def build_tiny_model(directory: Path, arch: str, seed: int = 0, **overrides) -> TinyModel:
    import transformers

    cfg = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    attn_implementation = "eager" if arch == "gemma2" else "sdpa"  # transformers has no SDPA Gemma 2
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    model = model.float().eval()
    model.generation_config.pad_token_id = 0
    model.save_pretrained(directory)
    return TinyModel(arch, str(directory), model)


def shape_config_dir(directory: Path, shape: str, num_layers: int) -> str:
    """``directory`` holding only the config.json of a known model shape (``pagedlab.workloads``)
    cut to ``num_layers`` layers: a real-width model for dummy weights on the GPU."""
    from pagedlab.workloads import model_shape

    config = model_shape(shape)
    config.num_hidden_layers = num_layers
    config.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Builds each tiny architecture once per session: ``tiny_models("qwen3")``."""
    cache: dict[str, TinyModel] = {}

    def get(arch: str) -> TinyModel:
        if arch not in cache:
            cache[arch] = build_tiny_model(tmp_path_factory.mktemp(arch), arch)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> TinyModel:
    return tiny_models("llama")


SMOLLM2_TEXTS = [  # a mixed batch of short and longer prompts: prose, code, Q&A
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Q: What is 12 times 7?\nA:",
    "List three primary colors:",
    "Translate to French: Good morning, my friend.",
    "The mitochondria is",
    "import numpy as np\n\n# compute the mean of an array\n",
    "Why is the sky blue? Explain briefly in one paragraph for a curious ten year old child who asks",
    "Hi",
    "In 1969, the first humans",
    "A haiku about autumn:\n",
]


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The embedded SmolLM2-135M-Instruct, converted once to a cached safetensors directory. On a
    GPU machine without its PyPI package (the device image installs nothing) the tests that need
    it skip; on the CPU (CI) its absence stays an error."""
    from pagedlab.loader import resolve_model_source

    try:
        return str(resolve_model_source("smollm2-135m-instruct").path)
    except ValueError as missing:
        if torch.cuda.is_available():
            pytest.skip(str(missing))
        raise


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    return model, tokenizer


REPRO_PROMPTS = ["The quick brown fox", "Why is the sky blue?", "Paged attention stores keys",
                 "Question: what is two plus two?\nAnswer:", "hello world, how are you today?"]


@pytest.fixture(scope="session")
def chat_dir(tmp_path_factory):
    """A tiny chat model with a real tokenizer (the repro checks'); read only: tests copy it to
    change it."""
    from test_server_support import build_tiny_chat_model

    return build_tiny_chat_model(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def chat_llm(chat_dir):
    from pagedlab import LLM

    with LLM(chat_dir, kv_cache_memory_bytes=KV_BYTES, device="cpu") as llm:
        yield llm


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """HF transformers' greedy continuation of one prompt (no padding involved)."""
    from pagedlab.lab.repro.hf import hf_eos_ids, hf_greedy_whole_sequence, switches_long_rope

    if switches_long_rope(model):  # generate's switch differs between transformers releases
        if set(kwargs) - {"eos_token_id"}:
            raise TypeError(f"a LongRoPE reference takes eos_token_id only, not {sorted(kwargs)}")
        eos = set() if "eos_token_id" in kwargs and kwargs["eos_token_id"] is None else hf_eos_ids(model)
        return hf_greedy_whole_sequence(model, prompt_ids, max_new_tokens, eos)[0]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             **kwargs)
    return out[0, len(prompt_ids):].tolist()


def _hf_greedy_with_logits(hf_model, prompt: list[int], max_new_tokens: int):
    from pagedlab.lab.repro.hf import hf_greedy_whole_sequence, switches_long_rope

    if switches_long_rope(hf_model):
        return hf_greedy_whole_sequence(hf_model, prompt, max_new_tokens, set())
    with torch.no_grad():
        gen = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    return gen.sequences[0, len(prompt):].tolist(), [row[0] for row in gen.logits]


def assert_hf_tokens_and_logprobs(hf_model, prompts: list[list[int]], outs, max_new_tokens: int,
                                  atol: float = 1e-4) -> None:
    """Each of ``outs`` (``LLM.generate`` results of ``prompts``, greedy, with logprobs) has HF's
    greedy tokens, and each chosen token's logprob within ``atol`` of HF's log-softmax."""
    for prompt, out in zip(prompts, outs, strict=True):
        tokens, logits = _hf_greedy_with_logits(hf_model, prompt, max_new_tokens)
        completion = out.outputs[0]
        assert completion.token_ids == tokens
        for step, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
            ref = torch.log_softmax(logits[step].float(), -1)
            assert abs(position[token].logprob - ref[token].item()) < atol


def run_on_async_engine(llm, scenario, timeout: float = 120.0):
    """``await scenario(engine)`` on an ``AsyncEngine`` serving ``llm``'s engine core, shut down after."""
    from pagedlab.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_llm(llm)
    try:
        return asyncio.run(asyncio.wait_for(scenario(engine), timeout))
    finally:
        engine.shutdown()


def random_prompts(count: int, vocab: int = 1000, min_len: int = 3, max_len: int = 60, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def tokens_and_logprobs(outs) -> list[tuple[list[int], list[dict[int, float]]]]:
    """(token ids, {token: logprob} per step) of each request's first completion."""
    completions = [o.outputs[0] for o in outs]
    return [(c.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs])
            for c in completions]


def assert_same_decode(fused, unfused, tie: float = 0.25, close: float = 0.25) -> None:
    """Greedy steps (``tokens_and_logprobs``) agree and their top logprobs lie within ``close``,
    up to a first divergence, which must be a near-tie (the two tokens within ``tie`` in the fused
    step): a fused FP8 norm sums in another order than Inductor's, which moves a bf16 rounding of
    the normed value and so an FP8 rounding in about one element of 16. At the 8B shape's dummy
    weights that noise moved a top logprob by 0.09 (H200, 2026-12-01); a wrong scale or element
    moves them by whole units."""
    for (tokens, logprobs), (other_tokens, other_logprobs) in zip(fused, unfused, strict=True):
        assert len(logprobs) == len(tokens) and len(other_logprobs) == len(other_tokens)
        for step, (token, other) in enumerate(zip(tokens, other_tokens)):
            mine, theirs = logprobs[step], other_logprobs[step]
            for t in mine.keys() & theirs.keys():
                assert abs(mine[t] - theirs[t]) < close, (step, t, mine[t], theirs[t])
            if token != other:
                assert other in mine and abs(mine[token] - mine[other]) < tie, (step, mine, theirs)
                break
