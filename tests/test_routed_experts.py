"""Routed experts (vLLM's ``enable_return_routed_experts`` and ``routed_experts_prompt_start``):
each completion's ``routed_experts`` against HF transformers' own router in float32 on the CPU
(the top-k of its router probabilities over prompt + output, ``output_router_logits=True``), row
by row, on tiny random Mixtral and Qwen3-MoE models: a prompt, a batch of lengths 3-60 under
chunked prefill, a prefix-cache hit (its cached rows included), a prompt start, ``n=2``,
preemption with the asynchronous step loop, n-gram speculation, padded graph steps, the Triton
kernels, two tensor-parallel ranks; the flag off; the fused kernels' recorded experts; DELTA
outputs; the server's base64 .npy field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import KV_BYTES, random_prompts, tiny_config
from pagedlab import LLM, SamplingParams
from pagedlab.engine import cuda_graph
from pagedlab.engine.routed_experts import RoutedExperts, expert_id_dtype
from pagedlab.models.mixtral import SparseMoeBlock
from pagedlab.sampling_params import RequestOutputKind

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ROUTES = dict(dtype="float32", kv_cache_memory_bytes=KV_BYTES, enable_return_routed_experts=True)


def hf_routes(hf_model, token_ids: list[int]) -> np.ndarray:
    """HF's choice at every position of ``token_ids``: the top-k experts of its router's
    probabilities, ``[positions, layers, top_k]``, highest first."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids]), output_router_logits=True).router_logits
    top_k = hf_model.config.num_experts_per_tok
    return torch.stack([torch.topk(torch.softmax(layer.float(), -1), top_k, -1).indices for layer in logits],
                       dim=1).numpy()


def assert_hf_routes(hf_model, outputs, start: int = 0) -> None:
    """Every completion's rows are HF's, positions ``start`` to the last but one."""
    for out in outputs:
        for c in out.outputs:
            sequence = out.prompt_token_ids + c.token_ids
            expected = hf_routes(hf_model, sequence)[start:len(sequence) - 1]
            assert c.routed_experts is not None and c.routed_experts.dtype == np.uint8
            assert c.routed_experts.shape == expected.shape
            wrong = np.flatnonzero((c.routed_experts != expected).any(axis=(1, 2)))
            assert not wrong.size, f"rows {wrong.tolist()} of {out.request_id} differ from HF's"


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_a_prompt_then_a_chunked_batch_route_as_hf(tiny_models, arch):
    """One prompt in one step, then four of 3 to 60 tokens in 16-token steps (re-planned)."""
    tiny = tiny_models(arch)
    with LLM(tiny.path, **ROUTES) as llm:
        assert_hf_routes(tiny.hf_model, llm.generate([random_prompts(1, seed=1)[0]], GREEDY, use_tqdm=False))
        llm.set_model_args(max_num_batched_tokens=16)
        prompts = [random_prompts(1, min_len=n, max_len=n, seed=n)[0] for n in (3, 17, 60, 33)]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].routed_experts.shape for o in outs] == [(n + 7, 2, 2) for n in (3, 17, 60, 33)]
    assert_hf_routes(tiny.hf_model, outs)


def test_prefix_cache_hits_prompt_start_and_two_completions(tiny_models):
    """A request on a 36-token cached prefix gets its cached rows too; a prompt start drops the
    rows before it (at the prompt's length, only output rows are left); two sampled completions
    each get their own."""
    tiny = tiny_models("qwen3_moe")
    prefix = random_prompts(1, min_len=36, max_len=36, seed=7)[0]
    with LLM(tiny.path, **ROUTES) as llm:
        llm.generate([prefix + [5, 6]], GREEDY, use_tqdm=False)
        hit = llm.generate([prefix + [9, 8, 7]], GREEDY, use_tqdm=False)
        assert hit[0].num_cached_tokens == 32
        assert_hf_routes(tiny.hf_model, hit)
        for start in (10, 39):
            params = GREEDY.clone(routed_experts_prompt_start=start)
            started = llm.generate([prefix + [9, 8, 7]], params, use_tqdm=False)
            assert_hf_routes(tiny.hf_model, started, start=start)
        assert started[0].outputs[0].routed_experts.shape[0] == 7  # 8 output tokens, the last never ran
        sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
        two = llm.generate([prefix], sampled, use_tqdm=False)
    assert two[0].outputs[0].token_ids != two[0].outputs[1].token_ids
    assert_hf_routes(tiny.hf_model, two)


def _preempting_prompts(cfg) -> tuple[list[list[int]], int]:
    """Five prompts of about 50 tokens, three sharing a 36-token prefix (test_model_families'), and
    the bytes of a 16-token float32 KV block: eight blocks make them preempt each other."""
    prefix = random_prompts(1, min_len=36, max_len=36, seed=7)[0]
    prompts = [prefix + p for p in random_prompts(3, min_len=2, max_len=16, seed=8)] + random_prompts(
        2, min_len=30, max_len=50, seed=9)
    return prompts, 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * (
        cfg.hidden_size // cfg.num_attention_heads) * 4


def test_preempted_requests_keep_every_row_with_the_loop_running_ahead(tiny_models, monkeypatch):
    """Eight blocks of 16, 16-token steps, the step loop scheduling each step before the last is
    read back: five sequences of about 50 tokens are preempted and recomputed; then of four, the
    last admitted (two tokens) is preempted while the step sampling its last token runs, and
    finishes holding no block (its rows read from the blocks it held). Every row is HF's."""
    blockless = []
    finish = RoutedExperts.finish

    def noting(self, request, reason):
        blockless.append(not request.block_ids)
        finish(self, request, reason)
    monkeypatch.setattr(RoutedExperts, "finish", noting)
    tiny = tiny_models("mixtral")
    prompts, block_bytes = _preempting_prompts(tiny.hf_model.config)
    with LLM(tiny.path, **{**ROUTES, "kv_cache_memory_bytes": 8 * block_bytes}, max_model_len=128,
             max_num_batched_tokens=16, async_scheduling=True) as llm:
        outs = llm.generate(prompts, GREEDY.clone(max_tokens=12), use_tqdm=False)
        assert llm.get_stats().num_preemptions > 0 and not any(blockless)
        assert_hf_routes(tiny.hf_model, outs)
        outs = llm.generate(random_prompts(4, min_len=14, max_len=30, seed=1),
                            [GREEDY.clone(max_tokens=n) for n in (30, 30, 30, 2)], use_tqdm=False)
    assert blockless[-4:].count(True) == 1
    assert_hf_routes(tiny.hf_model, outs)


def test_ngram_speculation_keeps_the_rows_of_accepted_tokens(tiny_models):
    """Rejected proposals ran in their positions' slots; those rows are rewritten before they count."""
    tiny = tiny_models("qwen3_moe")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    prompts = [[4, 5, 6, 7] * 8, [9, 10, 11] * 6 + [3]]
    with LLM(tiny.path, **ROUTES, speculative_config=spec) as llm:
        outs = llm.generate(prompts, GREEDY.clone(max_tokens=16), use_tqdm=False)
        stats = llm.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert_hf_routes(tiny.hf_model, outs)


def test_padded_graph_steps_return_the_rows_of_their_real_tokens(tiny_models, monkeypatch):
    """Decode and mixed steps through the CUDA graph runners' padded static inputs, run eagerly on
    the CPU (``cuda_graph.PAD_WITHOUT_CAPTURE``): the buffer holds the padding rows too, the rows
    read back are the real tokens'."""
    monkeypatch.setattr(cuda_graph, "PAD_WITHOUT_CAPTURE", True)
    runs = {"decode": 0, "mixed": 0}
    for cls, kind in ((cuda_graph.CudaGraphRunner, "decode"), (cuda_graph.MixedGraphs, "mixed")):
        def counted(self, *args, _run=cls.run, _kind=kind, **kwargs):
            runs[_kind] += 1
            return _run(self, *args, **kwargs)
        monkeypatch.setattr(cls, "run", counted)
    tiny = tiny_models("mixtral")
    with LLM(tiny.path, **ROUTES, max_num_batched_tokens=64) as llm:
        outs = llm.generate(random_prompts(5, min_len=3, max_len=40, seed=21), GREEDY, use_tqdm=False)
    assert runs["decode"] and runs["mixed"]
    assert_hf_routes(tiny.hf_model, outs)


def test_triton_kernels_route_as_hf_in_the_engine(tiny_models):
    """The Triton backend's fused MoE (under the interpreter on the CPU) records its route kernel's
    experts."""
    tiny = tiny_models("qwen3_moe")
    with LLM(tiny.path, **ROUTES, attention_backend="triton") as llm:
        outs = llm.generate(random_prompts(2, min_len=5, max_len=20, seed=13), GREEDY.clone(max_tokens=4),
                            use_tqdm=False)
    assert_hf_routes(tiny.hf_model, outs)


def test_two_ranks_return_rank_zeros_rows(tiny_models):
    """At tensor_parallel_size=2 over gloo every rank routes alike; rank 0 captures."""
    tiny = tiny_models("mixtral")
    with LLM(tiny.path, **ROUTES, device="cpu", tensor_parallel_size=2, max_num_batched_tokens=16) as llm:
        outs = llm.generate(random_prompts(2, min_len=5, max_len=30, seed=14), GREEDY.clone(max_tokens=5),
                            use_tqdm=False)
    assert_hf_routes(tiny.hf_model, outs)


def test_off_nothing_is_captured_and_the_flag_is_a_plan_setting(tiny_models):
    """Without the flag: no buffer, no layer writes, no store, ``routed_experts`` None. Turned on
    and off again by re-planning."""
    tiny = tiny_models("mixtral")
    prompt = random_prompts(1, seed=2)[0]
    with LLM(tiny.path, dtype="float32", kv_cache_memory_bytes=KV_BYTES) as llm:
        engine, blocks = llm.llm_engine, [m for m in llm.llm_engine.model.modules()
                                          if isinstance(m, SparseMoeBlock)]

        def captured() -> bool:
            return any(b.routes is not None for b in blocks) or engine.runner.routes is not None or \
                engine.routes is not None
        assert len(blocks) == 2 and not captured()
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].routed_experts is None
        llm.set_model_args(enable_return_routed_experts=True)
        assert captured() and llm.get_engine_info().resolved_settings()["enable_return_routed_experts"]
        assert_hf_routes(tiny.hf_model, llm.generate([prompt], GREEDY, use_tqdm=False))
        llm.set_model_args(enable_return_routed_experts=False)
        assert not captured()
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].routed_experts is None


def test_a_dense_model_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="enable_return_routed_experts=True is invalid: LlamaForCausalLM has "
                                         "no mixture-of-experts layers"):
        LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_return_routed_experts=True)


@pytest.mark.parametrize("value", [-1, True, 1.5, "2"])
def test_bad_prompt_starts_are_refused_by_name(value):
    with pytest.raises(ValueError, match=f"routed_experts_prompt_start={value!r} is invalid"):
        SamplingParams(routed_experts_prompt_start=value)


def test_prompt_start_is_at_most_the_prompt_and_read_from_numpy(tiny_models):
    assert type(SamplingParams(routed_experts_prompt_start=np.int64(3)).routed_experts_prompt_start) is int
    message = r"routed_experts_prompt_start=6 is invalid: it must be at most the prompt's length \(5 tokens\)"
    with LLM(tiny_models("mixtral").path, **ROUTES) as llm, pytest.raises(ValueError, match=message):
        llm.generate([[4, 5, 6, 7, 8]], GREEDY.clone(routed_experts_prompt_start=6), use_tqdm=False)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_only_a_completions_final_output_carries_its_rows(tiny_models, kind):
    """As vLLM's: none while a completion runs; with DELTA, in one output (two completions, one
    stopped early by a token only it samples), and merged deltas (``RequestOutput.add``) hold them."""
    tiny = tiny_models("mixtral")
    prompt = random_prompts(1, min_len=12, max_len=12, seed=4)[0]
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    with LLM(tiny.path, **ROUTES) as llm:
        first, second = (c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs)
        stop = next(t for t in first[2:] if t not in second)  # the same seeds sample the same tokens again
        engine, outputs = llm.llm_engine, []
        engine.add_request("r", prompt, params.clone(stop_token_ids=[stop], output_kind=kind))
        while engine.has_unfinished_requests():
            outputs += engine.step()
    assert outputs[-1].outputs[0].finish_reason == "stop" and outputs[-1].outputs[1].finish_reason == "length"
    for index in (0, 1):
        carried = [o.outputs[index].routed_experts is not None for o in outputs]
        finished = [o.outputs[index].finish_reason is not None for o in outputs]
        assert carried == (finished if kind == RequestOutputKind.CUMULATIVE else
                           [f and not any(finished[:i]) for i, f in enumerate(finished)])
    assert sum(o.outputs[0].finish_reason is not None for o in outputs) > 1  # the first ended before the last
    final = outputs[0]
    for later in outputs[1:]:
        final = final.add(later) if kind == RequestOutputKind.DELTA else later
    assert_hf_routes(tiny.hf_model, [final])


@pytest.mark.parametrize("config", ["grouped", "gemv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_kernels_record_the_experts_they_ran(config, dtype):
    """``fused_moe_triton`` (the interpreter on the CPU) writes into a layer's strided uint8 column
    of a capture buffer the experts its kernels chose, the route kernel's or the GEMV path's own
    routing, ties included (the lowest index first); the rest of the buffer is left alone."""
    from test_fused_moe import _gemv, _lowest_index_first, _moe_inputs, _tie_logits

    from pagedlab.kernels.fused_moe import fused_moe_triton, moe_torch

    x, _, w13, w2 = _moe_inputs(4, 64, 48, 8, dtype, seed=3)
    logits = _tie_logits(8, 2).to(dtype)
    choice = _gemv((16, 32), (32, 16)) if config == "gemv" else None
    buffer = torch.full((6, 3, 2), 255, dtype=torch.uint8)
    out = fused_moe_triton(x, logits, w13, w2, 2, True, choice, routes=buffer[:, 1])
    assert torch.equal(buffer[:4, 1].long(), _lowest_index_first(logits.float(), 2))
    assert (buffer[4:, 1] == 255).all() and (buffer[:, [0, 2]] == 255).all()
    assert torch.equal(out, fused_moe_triton(x, logits, w13, w2, 2, True, choice))  # the same launches
    moe_torch(x.float(), logits.float(), w13.float(), w2.float(), 2, True, routes=buffer[:, 2])  # its top-k
    assert torch.equal(buffer[:4, 2].long(), torch.topk(torch.softmax(logits.float(), -1), 2).indices)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", ["grouped", "gemv"])
def test_fused_kernels_record_their_experts_inside_a_cuda_graph(config):
    """Qwen3-30B-A3B's experts in bf16 at a 4-token decode batch (the GEMV path's measured config,
    or the grouped path's), captured once into a layer's column of a uint8 buffer and replayed on
    new bf16 logits, rows of ties then random ones: each replay leaves the kernels' choice (the
    lowest index first among equal logits) in the buffer, and nothing else."""
    from test_fused_moe import _activations, _lowest_index_first, _moe_inputs, _tie_logits

    from pagedlab.kernels.fused_moe import fused_moe_triton
    from pagedlab.kernels.fused_moe_configs import MOE_GEMV_CONFIGS, moe_config

    hidden, inter, num_experts, top_k = 2048, 768, 128, 8
    x, _, w13, w2 = _moe_inputs(4, hidden, inter, num_experts, torch.bfloat16)
    logits = torch.zeros(4, num_experts, dtype=torch.bfloat16, device="cuda")
    choice = (MOE_GEMV_CONFIGS[(num_experts, hidden, inter, top_k, 4)] if config == "gemv"
              else moe_config(4, num_experts, hidden, inter, top_k, 132))
    buffer = torch.zeros(16, 4, top_k, dtype=torch.uint8, device="cuda")
    fused_moe_triton(x, logits, w13, w2, top_k, True, choice, routes=buffer[:, 2])  # compiles outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe_triton(x, logits, w13, w2, top_k, True, choice, routes=buffer[:, 2])
    random_logits = _activations(4, hidden, num_experts, torch.float32)[1]
    for new_logits in (_tie_logits(num_experts, top_k), random_logits):
        logits.copy_(new_logits.to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(buffer[:4, 2].long(), _lowest_index_first(logits.float(), top_k))
    assert not buffer[4:].any() and not buffer[:, [0, 1, 3]].any()


def test_expert_id_dtypes_are_the_narrowest():
    assert [expert_id_dtype(n) for n in (8, 256, 257, 65536, 65537)] == [
        np.uint8, np.uint8, np.uint16, np.uint16, np.int32]


def test_the_command_line_flag_sets_it():
    from pagedlab.cli.engine_args import CommandParser, add_engine_args, engine_config_from_args

    parser = CommandParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--enable-return-routed-experts"])) \
        .enable_return_routed_experts
    assert not engine_config_from_args(parser.parse_args([])).enable_return_routed_experts


def _moe_chat_model(directory) -> tuple[str, torch.nn.Module]:
    """The tiny chat model's tokenizer and template with a tiny random Mixtral of its vocabulary."""
    import transformers

    from test_server_support import build_tiny_chat_model

    path = build_tiny_chat_model(directory)
    cfg = tiny_config("mixtral", vocab_size=len(transformers.AutoTokenizer.from_pretrained(path)))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def served_moe(tmp_path_factory):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from pagedlab.engine.async_engine import AsyncEngine
    from pagedlab.server.app import ServerThread, build_app

    path, hf_model = _moe_chat_model(tmp_path_factory.mktemp("moe_chat"))
    llm = LLM(path, **ROUTES)
    engine = AsyncEngine.from_llm(llm)
    thread = ServerThread(build_app(engine, enable_metrics=False))
    try:
        yield thread.__enter__().url, hf_model
    finally:
        thread.__exit__(None, None, None)
        engine.shutdown()
        llm.close()


def _post(url: str, path: str, **body):
    import httpx

    return httpx.post(url + path, json={"temperature": 0, "max_tokens": 6, "return_token_ids": True, **body},
                      timeout=60)


def test_server_choices_carry_base64_npy_routes(served_moe):
    """Completions and chat: each choice's ``routed_experts`` decodes (``np.load``) to HF's rows
    (from ``routed_experts_prompt_start``); a stream's chunks carry none; bad starts are 400s."""
    from pagedlab.server.routed_experts import decode_routed_experts

    url, hf_model = served_moe
    prompt = [5, 17, 33, 8, 99, 41, 7]
    body = _post(url, "/v1/completions", prompt=prompt, routed_experts_prompt_start=2).json()
    choice = body["choices"][0]
    rows = decode_routed_experts(choice["routed_experts"])
    assert rows.dtype == np.uint8
    np.testing.assert_array_equal(rows, hf_routes(hf_model, prompt + choice["token_ids"])[2:-1])
    chat = _post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "Why is the sky blue?"}])
    choice = chat.json()["choices"][0]
    rows = decode_routed_experts(choice["routed_experts"])
    assert rows.shape[0] > len(choice["token_ids"]) and rows.shape[1:] == (2, 2)
    chunks = _post(url, "/v1/completions", prompt=prompt, stream=True).text
    assert "data:" in chunks and "routed_experts" not in chunks
    for start, message in ((-1, "greater than or equal to 0"), (8, "at most the prompt's length (7 tokens)")):
        r = _post(url, "/v1/completions", prompt=prompt, routed_experts_prompt_start=start)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_a_server_without_the_flag_leaves_the_field_out(tmp_path):
    from pagedlab.engine.async_engine import AsyncEngine
    from pagedlab.server.app import ServerThread, build_app

    pytest.importorskip("uvicorn")
    path, _ = _moe_chat_model(tmp_path)
    with LLM(path, kv_cache_memory_bytes=KV_BYTES) as llm:
        engine = AsyncEngine.from_llm(llm)
        try:
            with ServerThread(build_app(engine, enable_metrics=False)) as server:
                body = _post(server.url, "/v1/completions", prompt=[5, 6, 7]).json()
        finally:
            engine.shutdown()
    assert body["choices"][0]["token_ids"] and "routed_experts" not in body["choices"][0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_cuda_graphs_and_the_triton_kernels_route_as_hf_on_gpu(tiny_models, arch):
    """On a GPU in float32: decode and mixed steps replayed from CUDA graphs (the buffer written
    inside them), the Triton kernels, the asynchronous step loop, chunked prefill, a prefix-cache
    hit and preemption, every row HF's; and the same rows from an eager engine."""
    tiny = tiny_models(arch)
    prompts, block_bytes = _preempting_prompts(tiny.hf_model.config)
    rows = {}
    for eager in (False, True):
        with LLM(tiny.path, **{**ROUTES, "kv_cache_memory_bytes": 8 * block_bytes}, device="cuda",
                 attention_backend="triton", enforce_eager=eager, max_num_batched_tokens=16,
                 max_model_len=128) as llm:
            outs = llm.generate(prompts, GREEDY.clone(max_tokens=12), use_tqdm=False)
            stats = llm.get_stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
        assert_hf_routes(tiny.hf_model, outs)
        rows[eager] = [o.outputs[0].routed_experts for o in outs]
    assert all(np.array_equal(a, b) for a, b in zip(rows[False], rows[True]))
