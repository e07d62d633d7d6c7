#!/usr/bin/env bash
# One device call: GPU tests, then the benchmarks, logs and JSON under $OUT (or benchmarks/out).
# Usage: bash benchmarks/h200_run.sh [tests] [latency] [throughput] [smoke] [serve]
set -u
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
for phase in "$@"; do
  t0=$(date +%s)
  case $phase in
    tests)
      timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_kernel_layer_ops.py \
        tests/kernels/test_kernel_paged_attention.py tests/kernels/test_kernel_kv_write.py tests/models/test_gpu_parity.py 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    smoke)
      python3 benchmarks/latency.py --llama3-8b-dummy --batch-sizes 1,64 --steps 8 --skip-hf \
        --out "$OUT/latency_smoke.json" 2>&1 | grep -v Warning | tail -20 ;;
    latency)
      timeout 200 python3 benchmarks/latency.py --llama3-8b-dummy --batch-sizes 1,32,128,256 --context-len 512 \
        --steps 32 --out "$OUT/latency.json" 2>&1 | tee "$OUT/latency.log" | grep -v Warning | tail -22 ;;
    throughput)
      timeout 330 python3 benchmarks/throughput.py --llama3-8b-dummy --num-prompts 1000 --input-len 128:1024 \
        --output-len 64:512 --hf-batch-size 64 --hf-max-prompts 64 --hf-continuous --out "$OUT/throughput.json" 2>&1 \
        | tee "$OUT/throughput.log" | grep -v Warning | tail -12 ;;
    serve)   # the same rates with the engine loop in a thread, then in its own process
      python3 -c "from pathlib import Path; from benchmarks.throughput import dummy_checkpoint; \
dummy_checkpoint(Path('/tmp/chorus-llama3-8b-dummy'), 'bfloat16')"
      for mode in --no-engine-process --engine-process; do
        OUT="$OUT/serve$mode" PORT=8123 timeout 280 bash benchmarks/serve_run.sh /tmp/chorus-llama3-8b-dummy \
          "8:80 32:160 inf:160" --load-format dummy $mode 2>&1 | grep -E "Output token|TTFT|TPOT" ;
      done ;;
  esac
  echo "== phase $phase took $(( $(date +%s) - t0 )) s"
done
