#!/usr/bin/env bash
# Tensor parallelism on the GPUs of one host (issue 20), from the source tree on the device machine:
#   bash benchmarks/tp_suite.sh tests|allreduce|seed8b|seed70b|awq|hfpeer ...   (results under $OUT)
set -uo pipefail
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
bench() { python3 -m pagedlab.cli bench throughput --workload W-seed --backend pagedlab "$@"; }
for part in "$@"; do
  case "$part" in
    tests) nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
           python3 -m pytest -m gpu tests/test_tensor_parallel_engine.py tests/test_peer_all_reduce.py -v -x \
               -p no:cacheprovider -o faulthandler_timeout=150 --durations=10 2>&1 | tee "$OUT/tests.log" | tail -30 ;;
    allreduce) python3 benchmarks/all_reduce_bench.py --world-size 2 --out "$OUT/all_reduce.json" ;;
    seed8b) bench --batch-size 1 256 --backend pagedlab hf --json "$OUT/seed8b_tp1.json"
            bench --batch-size 1 256 --tensor-parallel-size 2 --disable-custom-all-reduce --json "$OUT/seed8b_tp2_nccl.json"
            bench --batch-size 1 256 --tensor-parallel-size 2 --json "$OUT/seed8b_tp2_oneshot.json" ;;
    seed70b) bench --shape llama3-70b --batch-size 1 64 256 --tensor-parallel-size 2 --json "$OUT/seed70b_tp2.json" ;;
    awq) bench --batch-size 1 --tensor-parallel-size 2 --quantization awq --enforce-eager --json "$OUT/seed8b_tp2_awq.json" ;;
    hfpeer) torchrun --nproc-per-node 2 benchmarks/hf_tp_peer.py --shape llama3-8b --batch-size 1 64 \
                --checkpoint /tmp/hf-llama3-8b --json "$OUT/hf_tp2.json" 2>&1 | grep -v Warning | tail -8 ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
