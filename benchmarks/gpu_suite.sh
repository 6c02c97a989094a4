#!/usr/bin/env bash
# The GPU checks and docs/benchmarks.md workloads, run from the source tree on the device machine:
#   bash benchmarks/gpu_suite.sh tests|tests-kernels|gemv|gemv-rows28|gemv-awq|gemv-tp2|gemv-families|moegemv|moegemv-mixtral|route|moebench|binvbench|binvdispatch|lorabench|attnbench|pdl|pdlseed|pdlfamilies|b1matrix|seed|lat|nano|budget|profile|prefix|long|nano-fp8|fp8quant|fp8fuse|long-fp8|fp8-peer|families|batchinv|lora|serve ...   (results under $OUT, default ./bench_out)
# "serve" needs fastapi and uvicorn importable (on a bare GPU image: installed from carried wheels
# into a folder named by PYTHONPATH, which is kept).
set -uo pipefail
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
bench() { python3 -m pagedlab.cli bench "$@"; }
for part in "$@"; do
  case "$part" in
    tests) nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
           python3 -m pytest -m gpu tests/test_gpu.py tests/test_kv_fp8_kernels.py tests/test_kv_fp8_engine.py \
               tests/test_model_families.py tests/test_fused_moe.py tests/test_attention_variants.py \
               tests/test_batch_invariant_gpu.py tests/test_batch_invariant_attention.py tests/test_pdl.py -q -s \
               -p no:cacheprovider 2>&1 | tail -30 ;;
    # the linear-layer and LoRA kernels and their benches' GPU paths (the tests part covers the engine)
    tests-kernels) python3 -m pytest -m gpu tests/test_gemv.py tests/test_gemv_bench.py tests/test_awq.py \
                       tests/test_fp8.py tests/test_lora_kernels.py tests/test_lora_gemv.py tests/test_lora_gpu.py \
                       tests/test_hf_fp8_peer.py tests/test_fp8_fused_inputs.py tests/test_kernels.py \
                       tests/test_batch_invariant_attention.py tests/test_norm_fold.py -q -s -rs -p no:cacheprovider \
                       2>&1 | tail -30 ;;
    # the linear-layer tables, decode-like timing (one call each: a whole sweep of every shape, TP
    # and row count runs past a device call's 10 minutes)
    gemv)  python3 benchmarks/gemv_bench.py --shape llama3-8b --tp 1 --rows 1 4 16 --chain --out "$OUT/gemv.json" ;;
    # the row buckets gemv leaves out, 2 and 8 (AWQ's CUDA-core tiles are swept at 2-8 rows)
    gemv-rows28) python3 benchmarks/gemv_bench.py --shape llama3-8b --tp 1 --rows 2 8 --out "$OUT/gemv_rows28.json" ;;
    # the AWQ kernels alone at 1-8 rows, cuBLAS beside them (after a change to the AWQ GEMV: its
    # AWQ_CONFIGS lines)
    gemv-awq) python3 benchmarks/gemv_bench.py --shape llama3-8b --tp 1 --rows 1 2 4 8 --layers qkv o gate_up down \
                  --paths awq --chain --out "$OUT/gemv_awq.json" ;;
    gemv-tp2) python3 benchmarks/gemv_bench.py --shape llama3-8b --tp 2 --rows 1 4 16 --chain \
                  --out "$OUT/gemv_tp2.json" ;;
    gemv-families) for shape in gemma2-9b qwen3-30b-a3b mixtral-8x7b; do
                     python3 benchmarks/gemv_bench.py --shape $shape --tp 1 --rows 1 4 16 --chain \
                         --out "$OUT/gemv_$shape.json"
                   done ;;
    # the MoE decode GEMVs against the grouped GEMMs at 1-8 tokens (MOE_GEMV_CONFIGS lines to paste
    # where the GEMV layer wins); then the grouped tables at larger batches (each shape's whole
    # default token list runs past a device call's 10 minutes)
    moegemv) python3 benchmarks/moe_bench.py --shapes qwen3-30b-a3b --tokens 1 2 4 8 --out "$OUT/moe_qwen3_small.json" ;;
    moegemv-mixtral) python3 benchmarks/moe_bench.py --shapes mixtral-8x7b --tokens 1 2 4 8 \
                         --out "$OUT/moe_mixtral_small.json" ;;
    # the routing launch's warps at decode through prefill token counts, both MoE shapes
    # (ROUTE_NUM_WARPS lines to paste where a count beats the heuristic)
    route) python3 benchmarks/moe_bench.py --route-only --tokens 1 2 4 8 64 256 2048 --out "$OUT/route_warps.json" ;;
    moebench) for shape in qwen3-30b-a3b mixtral-8x7b; do
                python3 benchmarks/moe_bench.py --shapes $shape --tokens 64 256 2048 --out "$OUT/moe_$shape.json"
              done ;;
    # the batch-invariant matmul's configs (verified bitwise, the BATCH_INVARIANT_CONFIGS lines to
    # paste) and every kernel the mode swaps, timed against the default mode
    binvbench) python3 benchmarks/batch_invariant_bench.py --out "$OUT/binv_bench.json" ;;
    # the mode's matmul as dispatched (the persistent TMA launch for prefill) against cuBLAS at
    # 256/1,024/8,192 rows per 8B linear, each checked bitwise against the in-program launch
    binvdispatch) python3 benchmarks/batch_invariant_bench.py --dispatch-only --out "$OUT/binv_dispatch.json" ;;
    # the LoRA shrink/expand kernels per Llama-3-8B linear at 1/4/16/64/256 tokens over 8 slots,
    # checked against the torch reference, the LoRA linear as the engine runs it (fused into the
    # base GEMV where that runs, else base + shrink + expand), and the sums per decode step
    lorabench) python3 benchmarks/lora_bench.py --out "$OUT/lora_bench.json" ;;
    # decode attention per DecodeConfig (key tile x warps x stages) on W-nano-like batches, checked
    # against the current config, and the DECODE_ATTENTION_CONFIGS lines to paste
    attnbench) python3 benchmarks/attention_bench.py --out "$OUT/attention_bench.json" ;;
    # probe for a next kernel (docs/benchmarks.md): programmatic dependent launch between batch-1
    # GEMVs (issue 13)
    pdl)   python3 benchmarks/pdl_probe.py --out "$OUT/pdl_probe.json" ;;
    # PDL across the whole decode step (kernels/pdl.py): W-seed batch 1 without, then with
    pdlseed) for pdl in 0 1; do
               PAGEDLAB_PDL=$pdl bench throughput --workload W-seed --batch-size 1 --json "$OUT/w_seed_pdl$pdl.json"
             done ;;
    # the same for the batch-1 targets of issue 15, where ~12 small kernels a layer are most of the
    # gap (Qwen3-30B-A3B: 48 layers, 2.9x its floor)
    pdlfamilies) for shape in qwen3-30b-a3b gemma2-9b; do
                   for pdl in 0 1; do
                     PAGEDLAB_PDL=$pdl bench throughput --workload W-seed --shape $shape --batch-size 1 \
                         --json "$OUT/w_seed_${shape}_pdl$pdl.json"
                   done
                 done ;;
    # W-seed batch 1 of bf16, FP8, AWQ, LoRA, batch-invariant (Llama-3-8B shape), Gemma-2-9B and
    # Qwen3-30B-A3B, each with PDL off and on, one process (issues 13-16 batch-1 targets)
    b1matrix) python3 benchmarks/batch1_matrix.py --out "$OUT/batch1_matrix.json" ;;
    seed)  bench throughput --workload W-seed --batch-size 1 16 64 256 --backend pagedlab hf --json "$OUT/w_seed.json" ;;
    lat)   bench latency --workload W-lat --backend pagedlab hf --repeats 3 --json "$OUT/w_lat.json" ;;
    nano)  bench throughput --workload W-nano --backend pagedlab hf --json "$OUT/w_nano.json" ;;
    # issue 21's scheduler share: the step token budget on W-seed batch 256 and W-nano (TTFT and tok/s)
    budget) for tokens in 4096 8192 16384; do
              bench throughput --workload W-seed --batch-size 256 --max-num-batched-tokens $tokens \
                  --json "$OUT/w_seed_budget$tokens.json"
              bench throughput --workload W-nano --max-num-batched-tokens $tokens --json "$OUT/w_nano_budget$tokens.json"
            done ;;
    # the step split and the prefill phase against the matmul peak (profile_steps.py)
    profile) python3 benchmarks/profile_steps.py --workload W-seed --batch-size 256 --mixed-graphs off \
                 --json "$OUT/profile_w_seed.json"
             python3 benchmarks/profile_steps.py --workload W-nano --mixed-graphs off --json "$OUT/profile_w_nano.json" ;;
    prefix) bench throughput --workload W-prefix --repeats 3 --json "$OUT/w_prefix.json" ;;
    long)  bench throughput --workload W-long --json "$OUT/w_long.json" ;;
    # FP8 KV cache against the model-dtype cache, same gpu_memory_utilization: num_kv_blocks and
    # kv_cache_gib in each row's "extra" show the cached tokens (2x), output tok/s the speed
    nano-fp8) for kv in auto fp8; do bench throughput --workload W-nano --kv-cache-dtype $kv --json "$OUT/w_nano_kv_$kv.json"; done ;;
    # the FP8 activation quantization kernels alone, one program a row against the split form
    fp8quant) python3 benchmarks/fp8_quant_bench.py --out "$OUT/fp8_quant_bench.json" ;;
    # FP8 weights with the activation quantization in its own launch, then in the producers
    fp8fuse) for fused in 0 1; do
               PAGEDLAB_FP8_FUSED_INPUTS=$fused bench throughput --workload W-seed --batch-size 1 256 \
                   --quantization fp8 --json "$OUT/w_seed_fp8_fused$fused.json"
             done ;;
    long-fp8) for kv in auto fp8; do bench throughput --workload W-long --kv-cache-dtype $kv --json "$OUT/w_long_kv_$kv.json"; done ;;
    # issue 13's FP8 peers, same run: W-seed batch 1 and 256 on pagedlab bf16, pagedlab fp8 and HF
    # transformers' FineGrainedFP8Config (hf fp8), HF bf16 at batch 1. Where transformers' FP8
    # matmul kernel cannot load (it comes from the Hub through the `kernels` package) the hf fp8
    # step stops at once with that reason and writes no JSON; its GPU tests say the same.
    fp8-peer) python3 -m pytest -m gpu tests/test_hf_fp8_peer.py -q -rs -s -p no:cacheprovider 2>&1 | tail -12
              bench throughput --workload W-seed --batch-size 1 256 --json "$OUT/fp8peer_pagedlab_bf16.json"
              bench throughput --workload W-seed --batch-size 1 256 --quantization fp8 \
                  --json "$OUT/fp8peer_pagedlab_fp8.json"
              bench throughput --workload W-seed --batch-size 1 256 --backend hf --quantization fp8 \
                  --json "$OUT/fp8peer_hf_fp8.json"
              bench throughput --workload W-seed --batch-size 1 --backend hf --json "$OUT/fp8peer_hf_bf16.json" ;;
    # issue 15's targets: the MoE and Gemma 2 shapes (dummy bf16) at batch 1/64/256, in 512 / out 128,
    # against HF generate in the same run (batch 256 skipped for HF: minutes per row)
    families) for shape in qwen3-30b-a3b mixtral-8x7b gemma2-9b; do
                bench throughput --workload W-seed --shape $shape --batch-size 1 64 256 --json "$OUT/w_seed_$shape.json"
                bench throughput --workload W-seed --shape $shape --batch-size 1 64 --backend hf --json "$OUT/w_seed_${shape}_hf.json"
              done ;;
    # batch-invariant mode against the default, same run: W-seed batch 256 output tok/s (target:
    # at most 15% lower) and batch 1 TPOT p50 (target: at most 10% higher)
    batchinv) for mode in no-batch-invariant batch-invariant; do
                bench throughput --workload W-seed --batch-size 1 256 --$mode --json "$OUT/w_seed_$mode.json"
              done ;;
    # issue 16's targets, same run: W-seed with 8 random rank-16 adapters on all seven projections
    # spread round-robin over the batch against the engine without LoRA (batch 256 output tok/s: at
    # least 0.8x; batch 1, which runs one adapter, TPOT p50: at most 1.15x), and the HF+PEFT peer
    # (unmerged) at batch 1 (one adapter) and 64 (8 adapters, PEFT's mixed batch). Estimated at
    # 4 minutes, not yet timed.
    lora) bench throughput --workload W-seed --batch-size 1 256 --json "$OUT/w_seed_lora_off.json"
          bench throughput --workload W-seed --batch-size 1 256 --num-loras 8 --lora-rank 16 \
              --json "$OUT/w_seed_lora_8xr16.json"
          bench throughput --workload W-seed --batch-size 1 64 --backend hf --num-loras 8 --lora-rank 16 \
              --json "$OUT/w_seed_lora_8xr16_hf.json" ;;
    serve) model=$(python3 -c "from pagedlab.workloads import shape_dir; print(shape_dir('llama3-8b'))")
           python3 -m pagedlab.cli serve --model "$model" --load-format dummy --dtype bfloat16 \
               --max-model-len 2048 --port 8000 > "$OUT/serve_log.txt" 2>&1 &
           server=$!
           until python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')" 2>/dev/null; do
             kill -0 $server 2>/dev/null || { tail -20 "$OUT/serve_log.txt"; exit 1; }; sleep 2
           done
           # rate:prompts, so each rate runs for tens of seconds
           for pair in 1:40 4:100 16:200 inf:256; do
             python3 -m pagedlab.cli bench serve --base-url http://127.0.0.1:8000 --num-prompts "${pair#*:}" \
                 --request-rate "${pair%%:*}" --input-len 512 --output-len 128 --ignore-eos --temperature 0 \
                 --seed 0 --num-warmups 1 --disable-tqdm --json "$OUT/serve_rate_${pair%%:*}.json"
           done
           kill $server ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
