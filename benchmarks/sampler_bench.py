"""Temperature sampling of a step's logits on one GPU: the torch path the sampler ran before the
Gumbel-max kernel (bf16 logits to float32, argmax, divide by the temperature, softmax, Exp(1)
noise from one generator or one per seeded row, divide, argmax, select) against
``sample_tokens_triton`` (``kernels/sampling.py``), at W-nano's shape (Qwen3-0.6B's 151,936-entry
vocabulary, bf16, temperature 0.6). Prints microseconds per call (CUDA events, the mean of
``--iters`` calls after ``--warmup``) for each row count.

    PYTHONPATH=src python3 benchmarks/sampler_bench.py
    PYTHONPATH=src python3 benchmarks/sampler_bench.py --rows 1 64 256 --vocab 151936
"""

from __future__ import annotations

import argparse
import functools

import torch

from pagedlab.kernels.sampling_kernels import sample_tokens_triton


def torch_sample(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                 generators: list[torch.Generator | None], default: torch.Generator) -> torch.Tensor:
    """The sampler's draw before the kernel (the exponential race), one row per request."""
    logits = logits.float()
    token_ids = logits.argmax(dim=-1)
    probs = (logits / temperature.unsqueeze(1)).softmax(-1)
    q = torch.empty_like(probs)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        q.exponential_(generator=default)
    for i in seeded:
        q[i].exponential_(generator=generators[i])
    return torch.where(greedy, token_ids, probs.div(q).argmax(dim=-1))


def time_us(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def bench_rows(rows: int, args: argparse.Namespace, default: torch.Generator) -> tuple[float, float, float]:
    """Microseconds per call of the torch path (unseeded, then every row seeded) and of the kernel."""
    device = default.device
    logits = torch.randn(rows, args.vocab, device=device).mul_(4).bfloat16()
    temperature = torch.full((rows,), args.temperature, device=device)
    greedy = torch.zeros(rows, dtype=torch.bool, device=device)
    seeds = torch.randint(-(1 << 63), (1 << 63) - 1, (rows,), dtype=torch.int64, device=device)
    per_row = [torch.Generator(device=device).manual_seed(i) for i in range(rows)]
    calls = (functools.partial(torch_sample, logits, temperature, greedy, [None] * rows, default),
             functools.partial(torch_sample, logits, temperature, greedy, per_row, default),
             functools.partial(sample_tokens_triton, logits, temperature, seeds))
    return tuple(time_us(call, args.warmup, args.iters) for call in calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args()
    default = torch.Generator(device="cuda").manual_seed(0)
    print(f"vocab {args.vocab}, bf16, temperature {args.temperature}: us per call")
    print(f"{'rows':>5} {'torch':>10} {'torch seeded':>13} {'kernel':>10} {'speedup':>8}")
    for rows in args.rows:
        plain, seeded, kernel = bench_rows(rows, args, default)
        print(f"{rows:>5} {plain:>10.1f} {seeded:>13.1f} {kernel:>10.1f} {plain / kernel:>7.1f}x")


if __name__ == "__main__":
    main()
