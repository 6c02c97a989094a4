"""Mixed-step CUDA graphs on the CPU: the token buckets, the padded sequence layout under both
attention implementations, and whole engines whose steps run through the graph runners' padded
static inputs eagerly (``cuda_graph.PAD_WITHOUT_CAPTURE``) giving HF's float32 greedy tokens and
PEFT's with LoRA; in batch-invariant mode padding leaves every logprob bitwise the same.
The captured graphs themselves are checked on a GPU (test_mixed_graphs_gpu.py)."""

from __future__ import annotations

import collections
import itertools

import pytest
import torch

from conftest import KV_BYTES, hf_greedy, random_prompts
from lora_fixtures import ALL_TARGETS, make_adapter
from pagedlab import LLM, LoRARequest, SamplingParams
from pagedlab.engine import cuda_graph
from pagedlab.engine.cuda_graph import MAX_MIXED_GRAPH_TOKENS, mixed_capture_sizes, padded_sequences
from pagedlab.engine.model_runner import ModelRunner
from pagedlab.kernels.paged_attention import decode_order, paged_attention_torch, paged_attention_triton
from pagedlab.layers.attention.torch_backend import TorchAttentionBackend

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def test_mixed_buckets_cover_the_budget_in_quarter_octaves():
    sizes = mixed_capture_sizes(8192, limit=8192)
    assert sizes[:9] == [16, 32, 48, 64, 80, 96, 112, 128, 160]
    assert sizes[-1] == 8192 and sizes == sorted(set(sizes)) and len(sizes) <= 32
    assert all(big <= small * 1.25 for small, big in itertools.pairwise(sizes[3:]))  # a step pads by < 25%
    assert mixed_capture_sizes(100) == [16, 32, 48, 64, 80, 96, 100]  # the budget itself is the last
    assert mixed_capture_sizes(10) == [10]
    assert mixed_capture_sizes(10**6)[-1] == MAX_MIXED_GRAPH_TOKENS  # larger steps run eagerly


def test_the_mixed_graph_limit_is_read_when_the_buckets_are_made(monkeypatch):
    """A benchmark (or a user) that sets MAX_MIXED_GRAPH_TOKENS before building the engine gets
    graphs up to it: the default is not bound when the module loads."""
    assert cuda_graph.MAX_MIXED_GRAPH_TOKENS != 3072  # the value set must differ from the default
    monkeypatch.setattr(cuda_graph, "MAX_MIXED_GRAPH_TOKENS", 3072)
    assert mixed_capture_sizes(8192)[-4:] == [1792, 2048, 2560, 3072]


def test_padded_sequences_add_one_padding_sequence_then_empty_ones():
    starts, lens = padded_sequences([3, 1, 5], [10, 7, 5], size=16, num_entries=6)
    assert starts == [0, 3, 4, 9, 16, 16, 16]
    assert lens == [10, 7, 5, 7, 0, 0]  # the padding sequence: 7 tokens, no context
    assert padded_sequences([4], [4], size=4, num_entries=2) == ([0, 4, 4], [4, 0])
    with pytest.raises(ValueError, match="3 sequences needs at most 2"):
        padded_sequences([1, 1, 1], [1, 1, 1], size=16, num_entries=3)
    with pytest.raises(ValueError, match="17 tokens does not fit a graph of 16"):
        padded_sequences([17], [17], size=16, num_entries=3)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("sliding_window", [None, 8])
def test_attention_over_a_padded_step_equals_the_step(impl, sliding_window):
    """A chunk after context, a decode and a fresh prefill, padded to 32 tokens and 6 sequences
    with stale block-table rows: the real rows are the unpadded step's, the padding rows finite."""
    g = torch.Generator().manual_seed(0)
    block_size, kv_heads, heads, head_dim, num_blocks = 16, 2, 4, 32, 12
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    query_lens, seq_lens = [5, 1, 9], [21, 30, 9]
    tables = torch.randperm(num_blocks, generator=g)[:9].view(3, 3).int()
    num_tokens, size, entries = sum(query_lens), 32, 6
    q = torch.randn(size, heads, head_dim, generator=g)
    starts = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    ref = paged_attention_torch(q[:num_tokens], k_cache, v_cache, starts, torch.tensor(seq_lens).int(),
                                tables, 0.3, sliding_window=sliding_window)
    padded_starts, padded_lens = padded_sequences(query_lens, seq_lens, size, entries)
    padded_tables = torch.randint(0, num_blocks, (entries, 3), generator=g).int()  # stale rows
    padded_tables[:3] = tables
    args = (q, k_cache, v_cache, torch.tensor(padded_starts).int(), torch.tensor(padded_lens).int(),
            padded_tables, 0.3)
    if impl == "torch":
        out = paged_attention_torch(*args, sliding_window=sliding_window)
    else:
        out = paged_attention_triton(*args, max_query_len=size, sliding_window=sliding_window)
    torch.testing.assert_close(out[:num_tokens], ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


@pytest.fixture
def padded_runs(monkeypatch) -> collections.Counter:
    """Graph runners on the CPU that run their padded inputs eagerly; counts their steps."""
    monkeypatch.setattr(cuda_graph, "PAD_WITHOUT_CAPTURE", True)
    calls: collections.Counter = collections.Counter()
    for cls, kind in ((cuda_graph.CudaGraphRunner, "decode"), (cuda_graph.MixedGraphs, "mixed")):
        def counted(self, *args, _run=cls.run, _kind=kind, **kwargs):
            calls[_kind] += 1
            return _run(self, *args, **kwargs)
        monkeypatch.setattr(cls, "run", counted)
    return calls


@pytest.fixture(scope="module")
def prefix_prompts():
    """Prompts sharing prefixes (prefix-cache hits) and unrelated ones, 3 to 90 tokens."""
    base = random_prompts(1, min_len=70, max_len=70, seed=7)[0]
    others = random_prompts(2, max_len=90, seed=8)
    return [base[:n] + extra for n, extra in zip([70, 40, 65, 17], [[5, 6], [7], [8, 9, 10], []])] + others


def _bytes_per_block(tiny) -> int:
    cfg = tiny.hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * head_dim * 4


@pytest.mark.parametrize("arch, engine_args", [
    ("llama", dict(max_num_batched_tokens=100)),  # chunks of several buckets mixed with decodes
    # 16-token chunks (one bucket), every sequence entry in use, input ids from the step in flight
    ("llama", dict(max_num_batched_tokens=16, max_num_seqs=3, async_scheduling=True)),
    ("llama", dict(max_model_len=128, num_blocks=8)),  # preemption and recompute
    ("qwen3", dict(max_num_batched_tokens=48)),
    ("qwen3_moe", dict(max_num_batched_tokens=48)),  # the padding rows go through the router too
    ("mistral_window", dict(max_num_batched_tokens=48)),  # sliding window of 16
], ids=["chunked-100", "async-chunked-16-seqs-3", "preemption", "qwen3", "qwen3-moe", "window"])
def test_padded_mixed_steps_give_hf_tokens(tiny_models, prefix_prompts, padded_runs, arch, engine_args):
    tiny = tiny_models(arch)
    args = dict(engine_args)
    num_blocks = args.pop("num_blocks", None)
    kv_bytes = KV_BYTES if num_blocks is None else num_blocks * _bytes_per_block(tiny)
    expected = [hf_greedy(tiny.hf_model, p, GREEDY.max_tokens) for p in prefix_prompts]
    with LLM(tiny.path, kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=True, **args) as llm:
        assert llm.get_engine_info().config.cuda_graph_mixed_steps
        outs = llm.generate(prefix_prompts, GREEDY, use_tqdm=False)
        stats = llm.get_stats()
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert padded_runs["mixed"] > 0 and padded_runs["decode"] > 0
    assert stats.prefix_cache_hit_tokens > 0
    if num_blocks is not None:
        assert stats.num_preemptions > 0


class _RerunGraph:
    """A CUDA graph's stand-in on the CPU: ``replay`` runs the captured forward again on the static
    buffers and writes its result where the capture's output lives, as a replay would."""

    def __init__(self, forward, args, output: torch.Tensor):
        self.forward, self.args, self.output = forward, args, output

    def replay(self) -> None:
        self.output.copy_(self.forward(*self.args))


def _rerun_capture(graph_pool, forward, *args):
    forward(*args)  # the warm-up
    output = forward(*args)
    return _RerunGraph(forward, args, output), output


def test_captured_graph_plumbing_gives_hf_tokens(tiny_llama, prefix_prompts, padded_runs, monkeypatch):
    """The capture and replay path (buckets captured largest first, one static output, decode
    outputs per size) with replays that rerun the captured forward: HF's tokens."""
    monkeypatch.setattr(ModelRunner, "uses_cuda_graphs", property(lambda self: self.plan is not None))
    monkeypatch.setattr(cuda_graph, "_capture", _rerun_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *args: 0)
    expected = [hf_greedy(tiny_llama.hf_model, p, GREEDY.max_tokens) for p in prefix_prompts]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=100) as llm:
        runner = llm.llm_engine.runner
        assert sorted(runner.mixed_graphs.graphs) == runner.mixed_graphs.sizes and runner.cuda_graphs.graphs
        outs = llm.generate(prefix_prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert padded_runs["mixed"] > 0 and padded_runs["decode"] > 0


def test_mixed_steps_off_leaves_them_eager(tiny_llama, padded_runs):
    prompts = random_prompts(4, max_len=50, seed=3)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=32,
             cuda_graph_mixed_steps=False) as llm:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert padded_runs["mixed"] == 0 and padded_runs["decode"] > 0


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph"])
def test_decode_steps_give_attention_their_sequences_longest_first(tiny_llama, monkeypatch, padded):
    """Each decode step's attention metadata carries its sequences longest first (``decode_order``),
    and a padded graph step's padding rows after them in their own order: what the Triton decode
    launch takes its sequences in."""
    monkeypatch.setattr(cuda_graph, "PAD_WITHOUT_CAPTURE", padded)
    seen = []

    def spy(self, q, k_cache, v_cache, metadata, *args, _attend=TorchAttentionBackend.attend, **kwargs):
        if metadata.max_query_len == 1:
            seen.append((metadata.seq_lens.tolist(), metadata.seq_order.tolist()))
        return _attend(self, q, k_cache, v_cache, metadata, *args, **kwargs)
    monkeypatch.setattr(TorchAttentionBackend, "attend", spy)
    prompts = random_prompts(7, min_len=3, max_len=40, seed=21)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (12, 12, 12, 12, 12, 6, 3)]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, attention_backend="torch") as llm:
        llm.generate(prompts, params, use_tqdm=False)  # 7 sequences, then 6 and 5 in the graph of 8
    assert {sum(n > 1 for n in lens) for lens, _ in seen} >= {5, 6, 7}
    for lens, order in seen:
        real = sum(n > 1 for n in lens)  # padding sequences hold one key, real ones at least two
        assert lens[real:] == [1] * (len(lens) - real) and (padded or real == len(lens))
        assert order == decode_order(lens[:real]).tolist() + list(range(real, len(lens)))
        assert sorted(order) == list(range(len(lens)))


def test_padded_mixed_steps_with_lora_give_peft_tokens(tiny_llama, padded_runs, tmp_path):
    adapter = make_adapter(tiny_llama.hf_model, tmp_path / "a", 3, 8, 16, ALL_TARGETS)
    prompts = random_prompts(4, min_len=10, max_len=50, seed=4)
    loras = [None, LoRARequest("a", 1, adapter.path), None, LoRARequest("a", 1, adapter.path)]
    expected = [hf_greedy(tiny_llama.hf_model if lora is None else adapter.peft_model, p, GREEDY.max_tokens)
                for p, lora in zip(prompts, loras)]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=32, enable_lora=True,
             max_lora_rank=8) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert padded_runs["mixed"] > 0


def _logprob_rows(outs) -> list:
    rows = []
    for o in outs:
        rows += [(t, lp.logprob) for entry in o.prompt_logprobs[1:] for t, lp in entry.items()]
        rows += [(t, lp.logprob) for entry in o.outputs[0].logprobs for t, lp in entry.items()]
    return rows


def test_padding_keeps_batch_invariant_logprobs_bitwise(tiny_models, monkeypatch):
    tiny = tiny_models("qwen3")
    prompts = random_prompts(3, min_len=10, max_len=40, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=2)
    runs = []
    for padded in (False, True):
        monkeypatch.setattr(cuda_graph, "PAD_WITHOUT_CAPTURE", padded)
        with LLM(tiny.path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=24,
                 batch_invariant=True) as llm:
            assert (llm.llm_engine.runner.mixed_graphs is not None) is padded
            runs.append(_logprob_rows(llm.generate(prompts, params, use_tqdm=False)))
    assert runs[0] == runs[1]
