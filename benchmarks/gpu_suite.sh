#!/usr/bin/env bash
# The GPU checks and DESIGN.md §4 workloads, run from the source tree on the device machine:
#   bash benchmarks/gpu_suite.sh tests|seed|nano|prefix|long ...   (results under $OUT, default ./bench_out)
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
bench() { python3 -m pagedlab.cli bench "$@"; }
for part in "$@"; do
  case "$part" in
    tests) nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
           python3 -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider 2>&1 | tail -25 ;;
    seed)  bench throughput --workload W-seed --batch-size 1 16 64 256 --backend pagedlab hf --json "$OUT/w_seed.json" ;;
    lat)   bench latency --workload W-lat --backend pagedlab hf --repeats 3 --json "$OUT/w_lat.json" ;;
    nano)  bench throughput --workload W-nano --backend pagedlab hf --json "$OUT/w_nano.json" ;;
    prefix) bench throughput --workload W-prefix --json "$OUT/w_prefix.json" ;;
    long)  bench throughput --workload W-long --json "$OUT/w_long.json" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
