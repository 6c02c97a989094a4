"""How close decode attention comes to merely reading its keys and values, on one GPU in bf16.

On attention_bench's decode batches it times (``gpu_timing.graph_seconds``: CUDA-graph replays,
L2 flushed) the attention launch as the engine runs it (split-KV where the policy splits), a
kernel that only streams the same K and V tiles by the same paged addresses with the same grid
and sequence order, key tile, warps and stages (it sums them, so no load is dropped), the same
kernel reading each sequence's blocks as one consecutive slab (no block-table gather), and torch
summing the whole cache. It prints microseconds, KV bytes over the time and the fraction of
4.8 TB/s. Stream near attention: the access pattern and the program shape are the limit; stream
well above it: the kernel's own compute and pipelining.

    PYTHONPATH=src:benchmarks python3 benchmarks/attention_stream_bench.py
    PYTHONPATH=src:benchmarks python3 benchmarks/attention_stream_bench.py --batches "128x[100,2048]"
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

import attention_bench as ab
from gpu_timing import PEAK_BYTES_PER_S, graph_seconds
from pagedlab.kernels.paged_attention import decode_order

DEFAULT_ROWS = (("qwen3-0.6b", "256x[100,2048]"), ("qwen3-0.6b", "128x[100,2048]"),
                ("qwen3-0.6b", "64x[100,2048]"), ("qwen3-0.6b", "32x[100,2048]"),
                ("llama3-8b", "256x[513,640]"), ("llama3-8b", "64x[513,640]"))
# (key tile, warps, stages) streamed besides the engine's own line
STREAM_LAUNCHES = ((64, 4, 3), (128, 4, 2), (64, 8, 2), (32, 4, 3))


@triton.jit
def stream_kv_kernel(k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, seq_order_ptr, out_ptr, stride_block,
                     stride_token, stride_head, stride_table, GATHER: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (KV head, i), as the decode launch's grid: the sum of sequence ``seq_order[i]``'s
    keys and values in that head, read TILE_N tokens at a time through the block table (GATHER)
    or from the sequence's first block on, consecutively."""
    head = tl.program_id(0)
    seq = tl.load(seq_order_ptr + tl.program_id(1))
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([TILE_N, HEAD_DIM], dtype=tl.float32)
    first_block = tl.load(block_tables_ptr + seq * stride_table)
    for start in range(0, seq_len, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        valid = pos < seq_len
        if GATHER:
            blocks = tl.load(block_tables_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=valid, other=0)
        else:
            blocks = first_block + pos // BLOCK_SIZE
        offset = blocks.to(tl.int64) * stride_block + (pos % BLOCK_SIZE) * stride_token + head * stride_head
        ptrs = offset[:, None] + offs_d[None, :]
        k = tl.load(k_ptr + ptrs, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + ptrs, mask=valid[:, None], other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(out_ptr + seq * tl.num_programs(0) + head, tl.sum(tl.sum(acc, 1), 0))


def slab_tables(batch: dict) -> torch.Tensor:
    """Block tables naming, for each sequence, as many consecutive blocks as its own table does,
    each sequence's run after the one before it (the slab reads the same number of bytes)."""
    counts = (batch["seq_lens"].long() + batch["k_cache"].shape[1] - 1) // batch["k_cache"].shape[1]
    starts = torch.cumsum(counts, 0) - counts
    width = batch["block_tables"].shape[1]
    steps = torch.arange(width, device=starts.device)
    return (starts[:, None] + steps[None, :]).to(torch.int32)


def stream_kv_triton(batch: dict, gather: bool, tile_n: int, num_warps: int, num_stages: int):
    """A no-argument call of ``stream_kv_kernel`` over ``batch`` (attention_bench's layout);
    it returns the [sequences, KV heads] float32 sums."""
    k, v, lens = batch["k_cache"], batch["v_cache"], batch["seq_lens"]
    tables = batch["block_tables"] if gather else slab_tables(batch)
    out = torch.empty(lens.shape[0], k.shape[2], dtype=torch.float32, device=k.device)
    order = torch.from_numpy(decode_order(lens.tolist())).to(k.device)

    def call() -> torch.Tensor:
        stream_kv_kernel[(k.shape[2], lens.shape[0])](
            k, v, tables, lens, order, out, k.stride(0), k.stride(1), k.stride(2), tables.stride(0),
            GATHER=gather, BLOCK_SIZE=k.shape[1], TILE_N=tile_n, HEAD_DIM=k.shape[3], num_warps=num_warps,
            num_stages=num_stages)
        return out
    return call


def stream_kv_torch(batch: dict, gather: bool = True) -> torch.Tensor:
    """The reference of ``stream_kv_triton``: each sequence's keys plus values summed per KV head."""
    k, v, lens = batch["k_cache"], batch["v_cache"], batch["seq_lens"]
    tables = batch["block_tables"] if gather else slab_tables(batch)
    rows = []
    for i, n in enumerate(lens.tolist()):
        blocks = tables[i, :(n + k.shape[1] - 1) // k.shape[1]].long()
        keys, values = (cache[blocks].flatten(0, 1)[:n].float() for cache in (k, v))
        rows.append((keys + values).sum(dim=(0, 2)))
    return torch.stack(rows)


def measure_row(shape: str, batch_name: str) -> tuple[int, dict[str, float]]:
    """The batch's KV bytes and the seconds of each launch over it; the streams are checked
    against the reference first."""
    num_heads, num_kv_heads, head_dim = ab.SHAPES[shape]
    num_seqs, fewest, most = ab.BATCHES[batch_name]
    batch = ab.make_batch(num_seqs, fewest, most, num_heads, num_kv_heads, head_dim)
    config = ab.current_config((head_dim, num_heads // num_kv_heads, ab.KV_BITS), None)
    engine_line = (config.tile_n, config.num_warps, config.num_stages)
    policy_split = ab.split_modes(num_seqs, num_kv_heads, most)[0]
    times = {"attention (engine's launch)": _timed(ab.decode_call(batch, most, policy_split))}
    for gather in (True, False):
        got = stream_kv_triton(batch, gather, *engine_line)()
        torch.testing.assert_close(got, stream_kv_torch(batch, gather), rtol=1e-3, atol=1e-1)
    for launch in dict.fromkeys((engine_line, *STREAM_LAUNCHES)):
        times["stream gather {}/{}w/{}s".format(*launch)] = _timed(stream_kv_triton(batch, True, *launch))
    slab = stream_kv_triton(batch, False, *engine_line)
    times["stream slab {}/{}w/{}s".format(*engine_line)] = _timed(slab)
    flat = torch.cat([batch["k_cache"].view(-1), batch["v_cache"].view(-1)])
    kv_bytes = ab.kv_bytes_read(batch)
    times["torch sum of the whole cache"] = _timed(flat.sum) * kv_bytes / (flat.numel() * flat.element_size())
    return kv_bytes, times


def _timed(call) -> float:
    call()  # compiles and loads outside the capture
    torch.cuda.synchronize()
    return graph_seconds(call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", nargs="+", choices=list(ab.BATCHES),
                        help="these batches on both shapes (default: W-nano's and W-seed's decode batches)")
    args = parser.parse_args()
    rows = [(s, b) for s in ab.SHAPES for b in args.batches] if args.batches else DEFAULT_ROWS
    print(f"{torch.cuda.get_device_name()}; bf16 KV cache, block size {ab.BLOCK_SIZE}")
    for shape, batch_name in rows:
        kv_bytes, times = measure_row(shape, batch_name)
        print(f"{shape} {batch_name}: {kv_bytes / 1e6:.0f} MB of KV", flush=True)
        for label, seconds in times.items():
            print(f"  {label:<36} {seconds * 1e6:8.1f} us  {kv_bytes / seconds / 1e12:5.2f} TB/s "
                  f"({kv_bytes / seconds / PEAK_BYTES_PER_S:.0%})", flush=True)


if __name__ == "__main__":
    main()
