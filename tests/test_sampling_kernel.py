"""Gumbel-max sampling (kernels/sampling.py): the torch Philox against Triton's, the Triton kernel
(interpreted) against the torch reference, the draw's distribution, and the per-row seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedlab.engine.step_inputs import row_seeds
from pagedlab.kernels.sampling import (gumbel_scores_torch, philox4x32, philox_uniforms, sample_tokens,
                                       sample_tokens_torch)

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
SEEDS = [0, 1, -1, 12345, INT64_MIN, INT64_MAX, 0x7FFFFFFF, -0x123456789ABCDEF]


def _seeds(rows: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(INT64_MIN, INT64_MAX, (rows,), generator=generator, dtype=torch.int64)


def _triton_randint4x(seeds: list[int], counters: int) -> torch.Tensor:
    """Triton's own ``tl.randint4x`` (interpreted): ``[len(seeds), counters, 4]`` as uint32 in int64."""
    import triton
    import triton.language as tl

    @triton.jit
    def randint4x_kernel(seed_ptr, out_ptr, COUNTERS: tl.constexpr):
        row = tl.program_id(0)
        offsets = tl.arange(0, COUNTERS)
        r0, r1, r2, r3 = tl.randint4x(tl.load(seed_ptr + row), offsets)
        out = out_ptr + row * COUNTERS * 4 + offsets * 4
        tl.store(out, r0.to(tl.int32, bitcast=True))
        tl.store(out + 1, r1.to(tl.int32, bitcast=True))
        tl.store(out + 2, r2.to(tl.int32, bitcast=True))
        tl.store(out + 3, r3.to(tl.int32, bitcast=True))

    out = torch.empty(len(seeds), counters, 4, dtype=torch.int32)
    randint4x_kernel[(len(seeds),)](torch.tensor(seeds, dtype=torch.int64), out, COUNTERS=counters)
    return out.long() & 0xFFFFFFFF


def test_torch_philox_is_tritons_bit_for_bit():
    counters = 64
    want = _triton_randint4x(SEEDS, counters)
    got = torch.stack(philox4x32(torch.arange(counters), torch.tensor(SEEDS).unsqueeze(1)), dim=-1)
    assert torch.equal(got, want)


def test_uniforms_follow_tritons_conversion_into_zero_one():
    seeds = torch.tensor(SEEDS)
    u = philox_uniforms(seeds, 999)
    bits = torch.stack(philox4x32(torch.arange(250), seeds.unsqueeze(1)), dim=-1).flatten(1)[:, :999]
    signed = torch.where(bits > 0x7FFFFFFF, bits - (1 << 32), bits)  # Triton: int32, ~x of a negative
    assert torch.equal(u, torch.where(signed < 0, ~signed, signed).float() * torch.tensor(4.6566127342e-10))
    assert u.dtype == torch.float32 and u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01


def _mixed_batch(rows: int, vocab: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    temperature = torch.tensor([0.6, 0.0, 1.0, 0.3, 2.5, 0.05, 0.6, 0.0] * rows)[:rows]
    return logits, temperature, _seeds(rows, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab, num_chunks, block", [
    (1, 1000, None, 1024), (5, 4999, 3, 256), (8, 2053, 1, 512), (3, 1001, 7, 64), (6, 4096, None, 256)])
def test_kernel_gives_the_references_tokens(dtype, rows, vocab, num_chunks, block):
    from pagedlab.kernels.sampling_kernels import sample_tokens_triton

    logits, temperature, seeds = _mixed_batch(rows, vocab, dtype, seed=vocab + rows)
    want = sample_tokens_torch(logits, temperature, seeds)
    got = sample_tokens_triton(logits, temperature, seeds, num_chunks=num_chunks, block=block)
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()
    greedy = temperature == 0
    assert torch.equal(got[greedy], logits[greedy].argmax(-1))
    if (~greedy).sum() >= 3:  # the noise does move tokens
        assert not torch.equal(got[~greedy], logits[~greedy].argmax(-1))


def test_kernel_reads_strided_rows_and_ignores_the_other_rows():
    """A row's token depends on its logits, temperature and seed only: not on the rows beside it,
    their number, or the chunking; a strided view (a slice of a wider buffer) reads the same."""
    from pagedlab.kernels.sampling_kernels import sample_tokens_triton

    logits, temperature, seeds = _mixed_batch(6, 1500, torch.float16, seed=3)
    wide = torch.full((6, 1600), 50.0, dtype=torch.float16)
    wide[:, :1500] = logits
    full = sample_tokens_triton(wide[:, :1500], temperature, seeds, block=256)
    assert full.tolist() == sample_tokens_torch(logits, temperature, seeds).tolist()
    for rows in ([4], [5, 1], [0, 2, 3]):
        sub = sample_tokens_triton(logits[rows], temperature[rows], seeds[rows], num_chunks=2, block=128)
        assert sub.tolist() == full[rows].tolist()


def test_ties_go_to_the_lowest_index_across_chunks_and_all_masked_rows_to_zero():
    from pagedlab.kernels.sampling_kernels import sample_tokens_triton

    logits = torch.zeros(4, 1000)
    logits[0, [700, 90, 333]] = 5.0  # three chunks share the maximum
    logits[1] = float("-inf")
    logits[2, [999, 998]] = 1.0
    logits[3] = float("-inf")
    logits[3, 612] = 0.0  # one token left: sampled rows must take it
    temperature = torch.tensor([0.0, 0.0, 0.0, 0.7])
    seeds = torch.arange(4)
    for num_chunks in (1, 3, 8):
        got = sample_tokens_triton(logits, temperature, seeds, num_chunks=num_chunks, block=64)
        assert got.tolist() == [90, 0, 998, 612] == logits.argmax(-1).tolist()
    assert sample_tokens_torch(logits, temperature, seeds).tolist() == [90, 0, 998, 612]


def test_cpu_dispatch_runs_the_reference():
    logits, temperature, seeds = _mixed_batch(4, 300, torch.float32, seed=1)
    want = sample_tokens_torch(logits, temperature, seeds)
    assert torch.equal(sample_tokens(logits, temperature, seeds), want)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_draws_follow_softmax_of_logits_over_temperature(temperature):
    """20,000 rows of one logit vector, each with its own seed: the token frequencies pass a
    chi-square test against softmax(logits / T) (11 degrees of freedom, p > 0.001)."""
    draws, vocab = 20_000, 12
    g = torch.Generator().manual_seed(int(temperature * 10))
    row = torch.randn(vocab, generator=g) * 1.5
    logits = row.expand(draws, vocab)
    tokens = sample_tokens_torch(logits, torch.full((draws,), temperature), _seeds(draws, g))
    counts = torch.bincount(tokens, minlength=vocab).double()
    expected = torch.softmax(row.double() / temperature, -1) * draws
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 31.26, (chi_square, counts.tolist(), expected.tolist())


def test_scores_are_logits_over_temperature_plus_gumbel_noise():
    logits, temperature, seeds = _mixed_batch(8, 64, torch.float32, seed=2)
    scores = gumbel_scores_torch(logits, temperature, seeds)
    sampled = temperature > 0
    u = philox_uniforms(seeds[sampled], 64).double()
    noise = -torch.log(-torch.log(u))
    torch.testing.assert_close(scores[sampled].double(),
                               logits[sampled].double() / temperature[sampled, None].double() + noise,
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(scores[~sampled], logits[~sampled])


@pytest.mark.parametrize("bad, match", [
    (dict(logits=torch.zeros(2, 5, dtype=torch.int32)), "logits of shape"),
    (dict(logits=torch.zeros(10)), "logits of shape"),
    (dict(temperature=torch.ones(3)), "temperature of shape"),
    (dict(temperature=torch.ones(2, dtype=torch.float64)), "temperature of shape"),
    (dict(seeds=torch.zeros(2, dtype=torch.int32)), "seeds of shape"),
])
def test_bad_inputs_name_what_is_wrong(bad, match):
    args = dict(logits=torch.zeros(2, 5), temperature=torch.ones(2), seeds=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=match):
        sample_tokens_torch(**{**args, **bad})


def test_triton_launcher_checks_its_own_limits():
    from pagedlab.kernels.sampling_kernels import sample_tokens_triton

    args = (torch.ones(2), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="vocabulary must be contiguous"):
        sample_tokens_triton(torch.zeros(5, 2).t(), *args)
    with pytest.raises(ValueError, match="block=48"):
        sample_tokens_triton(torch.zeros(2, 5), *args, block=48)


def test_row_seeds_of_seeded_requests_depend_on_seed_and_position_only():
    step_a, step_b = 7, (1 << 64) - 3
    seeded = row_seeds([5, 5, 6, INT64_MIN], [0, 1, 0, 3], step_a)
    assert seeded.dtype == np.int64 and len(set(seeded.tolist())) == 4
    # the same (seed, position) anywhere in any batch, whatever the step
    moved = row_seeds([None, 6, None, 5], [9, 0, 2, 1], step_b)
    assert moved[1] == seeded[2] and moved[3] == seeded[1]
    assert row_seeds([INT64_MAX + 1], [3], 1)[0] == seeded[3]  # seeds count modulo 2**64


def test_row_seeds_of_unseeded_rows_follow_the_step_seed_and_row():
    a = row_seeds([None, None, 3], [0, 0, 0], step_seed=11)
    assert a[0] != a[1]
    assert row_seeds([None, None], [5, 8], step_seed=11).tolist() == a[:2].tolist()  # positions unused
    assert row_seeds([None], [0], step_seed=12)[0] != a[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_matches_reference_at_w_nano_shape():
    """256 rows x Qwen3's 151,936 bf16 logits at temperature 0.6 (every 16th row greedy): the kernel's
    tokens are the reference's (on the GPU too). The kernel's and torch's ``log`` may round a last
    ulp apart, so a row may differ only where the reference's two scores tie to within that."""
    from pagedlab.kernels.sampling_kernels import sample_tokens_triton

    g = torch.Generator().manual_seed(0)
    rows, vocab = 256, 151_936
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(torch.bfloat16).cuda()
    temperature = torch.full((rows,), 0.6)
    temperature[::16] = 0.0
    temperature, seeds = temperature.cuda(), _seeds(rows, g).cuda()
    want = sample_tokens_torch(logits, temperature, seeds)
    for num_chunks in (None, 1, 5):
        got = sample_tokens_triton(logits, temperature, seeds, num_chunks=num_chunks)
        differ = (got != want).nonzero().squeeze(1)
        if differ.numel():
            scores = gumbel_scores_torch(logits, temperature, seeds)[differ]
            a, b = scores.gather(1, got[differ, None]), scores.gather(1, want[differ, None])
            assert torch.all((a - b).abs() <= 4e-6 * b.abs().clamp(min=1)), differ.tolist()
        assert differ.numel() <= 2, differ.tolist()
    greedy = temperature == 0
    assert torch.equal(got[greedy], logits[greedy].argmax(-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warm_up_compiles_every_variant_a_batch_can_launch(monkeypatch):
    """After ``warm_up_sampling`` on 300 rows of logits, sampling any 1 to 300 of them, in bf16 or
    float32, at any temperature, compiles nothing more (the chunk count specializes no kernel),
    and the tokens still match the reference."""
    from triton.runtime.jit import JITFunction

    from pagedlab.kernels.sampling import warm_up_sampling

    compiles = []
    compile_kernel = JITFunction._do_compile

    def counted(self, *args, **kwargs):
        compiles.append(self.__name__)
        return compile_kernel(self, *args, **kwargs)
    monkeypatch.setattr(JITFunction, "_do_compile", counted)
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(300, 50_021, generator=g) * 4).to(torch.bfloat16).cuda()
    warm_up_sampling(logits)
    assert compiles, "the warm-up compiled nothing: the test cannot tell"
    compiles.clear()
    temperature = torch.full((300,), 0.8).cuda()
    seeds = _seeds(300, g).cuda()
    for rows in (1, 2, 3, 7, 16, 33, 64, 100, 131, 255, 256, 300):
        for values in (logits[:rows], logits[:rows].float()):
            got = sample_tokens(values, temperature[:rows], seeds[:rows])
            want = sample_tokens_torch(values, temperature[:rows], seeds[:rows])
            assert (got != want).sum() <= 1
    assert compiles == []
