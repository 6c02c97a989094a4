"""The HF transformers tensor-parallel peer of `pagedlab bench throughput --workload W-seed
--tensor-parallel-size N`: ``from_pretrained(..., tp_plan="auto")`` under torchrun, static-batch
greedy ``generate`` on the same prompts, timed per step as `pagedlab bench`'s HF peer is.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/hf_tp_peer.py \\
        --shape llama3-8b --batch-size 1 64 --checkpoint /tmp/hf-llama3-8b --json hf_tp.json

transformers' tensor parallelism loads a checkpoint, so the first run writes one of random bf16
weights of the shape (rank 0, on the GPU, in safetensors shards) and later runs reuse it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from pagedlab.physical_floor import physical_floor
from pagedlab.workloads import make_workload, model_shape, run_hf_generate

SHARD_BYTES = 4 << 30


def write_random_checkpoint(shape: str, path: Path) -> None:
    """config.json and random bf16 safetensors shards (norms at one) for the shape."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = model_shape(shape)
    with torch.device("meta"):
        names = {n: p.shape for n, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator("cuda").manual_seed(0)
    weight_map, shard, shard_bytes = {}, {}, 0

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            file = f"model-{len(set(weight_map.values())):05d}.safetensors"
            save_file(shard, str(path / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shard, shard_bytes = {}, 0

    for name, shape_ in names.items():
        if len(shape_) == 1:
            tensor = torch.ones(shape_, dtype=torch.bfloat16, device="cuda")
        else:
            tensor = torch.randn(shape_, generator=generator, device="cuda", dtype=torch.bfloat16) * 0.02
        shard[name] = tensor.cpu()
        shard_bytes += tensor.numel() * 2
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    checkpoint = Path(args.checkpoint)
    if rank == 0 and not (checkpoint / "config.json").is_file():
        write_random_checkpoint(args.shape, checkpoint)
    dist.barrier()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), tp_plan="auto", dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").eval()
    config = model.config
    rows = []
    for batch in args.batch_size:
        workload = make_workload("W-seed", config.vocab_size, batch, args.input_len, args.output_len)
        floor = physical_floor(config, [args.input_len] * batch, [args.output_len] * batch,
                               tensor_parallel_size=world_size)
        warm = make_workload("W-seed", config.vocab_size, batch, args.input_len, 4)
        run_hf_generate(model, warm, "warm-up", None)
        result = run_hf_generate(model, workload, f"W-seed b={batch} tp={world_size}", floor)
        rows.append(result.to_dict())
        if rank == 0:
            print(f"HF tp_plan TP={world_size} batch {batch}: {result.output_tok_s:,.0f} output tok/s, "
                  f"TTFT {result.ttft_p50_ms:.1f} ms, TPOT {result.tpot_p50_ms:.2f} ms, "
                  f"{result.over_floor:.2f}x floor", flush=True)
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps({"world_size": world_size, "rows": rows}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
