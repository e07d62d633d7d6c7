#!/usr/bin/env bash
# One device call for issue 4: the GPU LoRA tests (CUDA graphs on/off vs PEFT, kernels), the LoRA
# kernels against their memory-traffic bound, benchmarks/multi_lora.py with transformers + PEFT in
# the same run, then (time permitting) the shrink/expand config sweep. Logs and JSON under $OUT.
set -u
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/device.txt"
t0=$(date +%s)
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/lora/test_peft_parity.py tests/kernels/test_kernel_lora.py \
  -k "cuda or gpu" 2>&1 | tee "$OUT/tests.log" | tail -5
echo "== tests took $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 45 python3 benchmarks/kernels.py --lora-only --out "$OUT/lora_kernels.json" 2>&1 | tee "$OUT/lora_kernels.log" | tail -22
echo "== kernels took $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 330 python3 benchmarks/multi_lora.py --batch-sizes 64,256 --input-len 512 --output-len 128 \
  --hf-batch-size 64 --hf-output-lens 1,5 --hf-time-budget 170 --out "$OUT/multi_lora.json" 2>&1 \
  | grep -v -i warn | tee "$OUT/multi_lora.log" | tail -34
echo "== multi_lora took $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout ${SWEEP_S:-60} python3 benchmarks/kernels.py --lora-sweep --out "$OUT/lora_sweep.json" 2>&1 | tee "$OUT/lora_sweep.log" | tail -30
echo "== sweep took $(( $(date +%s) - t0 )) s"
if [ -n "${FUSED:-}" ]; then   # FUSED=1: the same Chorus rows with the one-launch LoRA kernel (kernels/lora_fused.py)
  t0=$(date +%s)
  CHORUS_LORA_KERNEL=fused timeout 240 python3 benchmarks/multi_lora.py --batch-sizes 64,256 --input-len 512 \
    --output-len 128 --skip-hf --out "$OUT/multi_lora_fused.json" 2>&1 | grep -v -i warn | tee "$OUT/multi_lora_fused.log" | tail -24
  echo "== multi_lora (fused LoRA kernel) took $(( $(date +%s) - t0 )) s"
fi
