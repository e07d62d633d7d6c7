#!/usr/bin/env bash
# One device call: GPU tests, then the benchmarks, logs and JSON under $OUT (or benchmarks/out).
# Usage: bash benchmarks/h200_run.sh [tests] [lora-tests] [gemv] [profile] [latency] [latency-ab] [throughput] [seqs] [smoke] [serve] [serve-defaults] [lora-carveout] [multi-lora] [lora-silu] [lora-gemm] [lora-token] [lora-stacked] [lora-ab] [lora-final] [lora-tiles] [lora-decode-sweep] [ml-b64] [ml-b256] [pdl-ab] [splitk-ab] [rotary-ab] [power] [attn-ab]
set -u
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
lora_b256() {   # batch 256 with 16 and 64 adapters (64 slots), lines prefixed "b256: "; $1: JSON name under $OUT
  timeout 240 python3 benchmarks/multi_lora.py --batch-sizes 256 --input-len 512 --output-len 128 --skip-hf \
    --num-adapters 16,64 --max-loras 64 --base-last --out "$OUT/$1" 2>&1 \
    | grep -E "^chorus|decode graph|eager" | sed "s/^/b256: /"
}
for phase in "$@"; do
  t0=$(date +%s)
  case $phase in
    tests)
      timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_kernel_layer_ops.py \
        tests/kernels/test_kernel_paged_attention.py tests/kernels/test_kernel_kv_write.py tests/models/test_gpu_parity.py tests/models/test_fused_decode.py 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    lora-tests)
      timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/lora/test_peft_parity.py tests/kernels/test_kernel_lora.py \
        tests/kernels/test_kernel_gemv.py tests/kernels/test_kernel_lora_fused.py tests/lora/test_fused_lora_path.py tests/lora/test_lora_overlap.py \
        tests/kernels/test_kernel_lora_silu_mul.py -k "cuda or gpu" 2>&1 | tee "$OUT/lora_tests.log" | tail -8 ;;
    gemv)      # decode GEMV configs vs cuBLAS (and the fused norm / SiLU-and-mul prologues)
      timeout 150 python3 benchmarks/gemv_sweep.py --out "$OUT/gemv_sweep.json" 2>&1 | tee "$OUT/gemv_sweep.log" | tail -60 ;;
    profile)   # kernel tables: decode batch 1 and 256 (base model), decode batch 64 with 16 adapters
      timeout 150 python3 benchmarks/profile_step.py --llama3-8b-dummy --batch-sizes 1,256 --skip-mixed --top 16 \
        --out "$OUT/profile_base.json" 2>&1 | grep -v Warning | tee "$OUT/profile_base.log" | tail -40
      timeout 150 python3 benchmarks/profile_step.py --llama3-8b-dummy --batch-sizes 64 --skip-mixed --top 16 \
        --lora-adapters 16 --out "$OUT/profile_lora.json" 2>&1 | grep -v Warning | tee "$OUT/profile_lora.log" | tail -22 ;;
    seqs)      # offline throughput vs max_num_seqs / max_num_batched_tokens (vLLM's H100-class LLM defaults: 1024 / 16384)
      for cfg in ${SEQS_CFGS:-256:8192 512:16384 1024:16384}; do   # max_num_seqs:max_num_batched_tokens
        seqs=${cfg%%:*}; toks=${cfg##*:}
        timeout 200 python3 benchmarks/throughput.py --llama3-8b-dummy --num-prompts 1000 --input-len 128:1024 \
          --output-len 64:512 --skip-hf --max-num-seqs $seqs --max-num-batched-tokens $toks \
          --out "$OUT/throughput_seqs$seqs.json" 2>&1 | tee "$OUT/throughput_seqs$seqs.log" | grep -v Warning | tail -9
      done ;;
    latency-ab)   # batch 1 and 2 with the fused decode GEMVs off (cuBLAS + separate norm / SiLU kernels)
      CHORUS_DECODE_GEMV_MAX_TOKENS=0 timeout 150 python3 benchmarks/latency.py --llama3-8b-dummy --batch-sizes 1,2 \
        --context-len 512 --steps 32 --skip-hf --out "$OUT/latency_gemv_off.json" 2>&1 | grep -v Warning | tail -6 ;;
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
    lora-carveout)   # LoRA + base GEMMs per decoder layer (serial vs overlapped), then multi-LoRA at batch
      # 64, with cuBLAS leaving 0 / 8 / 16 SMs to the LoRA side stream (CHORUS_GEMM_SM_CARVEOUT)
      for sms in ${CARVEOUTS:-0 8 16}; do
        CHORUS_GEMM_SM_CARVEOUT=$sms timeout 90 python3 benchmarks/kernels.py --lora-only \
          --out "$OUT/lora_kernels_carveout$sms.json" 2>&1 | grep -E "gemms_" | sed "s/^/carveout $sms: /"
      done
      for sms in ${CARVEOUTS:-0 8 16}; do
        CHORUS_GEMM_SM_CARVEOUT=$sms timeout 120 python3 benchmarks/multi_lora.py --batch-sizes 64 --input-len 512 \
          --output-len 128 --skip-hf --num-adapters 16,64 --base-last --out "$OUT/ml_carveout$sms.json" 2>&1 \
          | grep -E "^chorus|decode graph" | sed "s/^/carveout $sms: /"
      done ;;
    multi-lora)   # the issue-4 table without transformers + PEFT: batch 64 (1/4/16/64 adapters) and 256 (16/64), 64 slots
      timeout 240 python3 benchmarks/multi_lora.py --batch-sizes 64 --input-len 512 --output-len 128 --skip-hf \
        --num-adapters 1,4,16,64 --base-last --out "$OUT/multi_lora_b64.json" 2>&1 | grep -E "^chorus|decode graph|eager"
      timeout 240 python3 benchmarks/multi_lora.py --batch-sizes 256 --input-len 512 --output-len 128 --skip-hf \
        --num-adapters 16,64 --max-loras 64 --base-last --out "$OUT/multi_lora_b256.json" 2>&1 | grep -E "^chorus|decode graph|eager" ;;
    lora-silu)   # the gate/up LoRA update inside SiLU-and-mul (CHORUS_LORA_FUSE_SILU_MUL) off / on at batch 64,
      # then on at batch 256
      for fuse in ${FUSES:-0 1}; do
        CHORUS_LORA_FUSE_SILU_MUL=$fuse timeout 200 python3 benchmarks/multi_lora.py --batch-sizes 64 \
          --input-len 512 --output-len 128 --skip-hf --num-adapters ${SILU_ADAPTERS:-16,64} --max-loras 64 --base-last \
          --out "$OUT/ml_silu$fuse.json" 2>&1 | grep -E "^chorus|decode graph|eager" | sed "s/^/fuse $fuse: /"
      done
      lora_b256 ml_silu_b256.json ;;
    lora-gemm)   # kernels.gemm_lora: GPU tests, then batch 64 with the one-launch LoRA GEMM on (64) / off (0)
      timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_kernel_gemm_lora.py \
        ${GEMM_TESTS-tests/lora/test_peft_parity.py} -k "cuda or gpu" 2>&1 | tee "$OUT/gemm_lora_tests.log" | tail -4
      if [ -n "${GEMM_SWEEP:-}" ]; then
        timeout 240 python3 benchmarks/gemm_lora_sweep.py --out "$OUT/gemm_lora_sweep.json" 2>&1 | grep -v Warn | tee "$OUT/gemm_lora_sweep.log" | tail -75
        best=$(python3 -c "import json; print(json.load(open('$OUT/gemm_lora_sweep.json'))['best'])" 2>/dev/null)
        export CHORUS_LORA_GEMM_CONFIG="$best"; echo "CHORUS_LORA_GEMM_CONFIG=$best"
      fi
      for gm in ${GEMM_MAX:-64 0}; do
        CHORUS_LORA_GEMM_MAX_TOKENS=$gm timeout 200 python3 benchmarks/multi_lora.py --batch-sizes 64 \
          --input-len 512 --output-len 128 --skip-hf --num-adapters ${GEMM_ADAPTERS:-16,64} --max-loras 64 --base-last \
          --out "$OUT/ml_gemm$gm.json" 2>&1 | grep -E "^chorus|decode graph|eager" | sed "s/^/gemm $gm: /"
      done ;;
    lora-token)   # per-token (BGMV) expand programs at decode: GPU tests, the decode sweep, then batch 64
      # with them (the default) and with the segment programs (per_token=0)
      timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_kernel_lora.py \
        tests/kernels/test_kernel_lora_silu_mul.py tests/lora/test_peft_parity.py -k "cuda or gpu" 2>&1 \
        | tee "$OUT/lora_token_tests.log" | tail -4
      timeout 300 python3 benchmarks/lora_prefill_sweep.py --tokens ${SWEEP_TOKENS:-64} --adapters ${SWEEP_ADAPTERS:-1,16,64} --skip-shrink \
        --out "$OUT/decode_expand_sweep.json" 2>&1 | grep -v Warn | tee "$OUT/decode_expand_sweep.log" | tail -12
      for pt in ${PER_TOKEN:-1 0}; do
        # per_token=1 is the decode default; the override would force it on prefill steps too
        CHORUS_LORA_EXPAND_CONFIG=$([ "$pt" = 0 ] && echo per_token=0) timeout 200 python3 benchmarks/multi_lora.py --batch-sizes 64 \
          --input-len 512 --output-len 128 --skip-hf --num-adapters ${TOKEN_ADAPTERS:-16,64} --max-loras 64 --base-last \
          --out "$OUT/ml_token$pt.json" 2>&1 | grep -E "^chorus|decode graph|eager" | sed "s/^/per_token $pt: /"
      done
      if [ -n "${TOKEN_B256:-}" ]; then
        lora_b256 ml_token_b256.json
      fi ;;
    lora-stacked)   # the shrink inside the base GEMM at decode (CHORUS_LORA_STACKED_MAX_TOKENS): GPU tests, then
      # batch 64 with it (128, the default) and without it (0); STACKED_B256=1 adds batch 256
      timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_kernel_lora.py \
        tests/kernels/test_kernel_lora_silu_mul.py tests/lora/test_peft_parity.py tests/lora/test_fused_lora_path.py \
        tests/lora/test_lora_overlap.py -k "cuda or gpu" 2>&1 | tee "$OUT/lora_stacked_tests.log" | tail -4
      for st in ${STACKED:-128 0}; do
        CHORUS_LORA_STACKED_MAX_TOKENS=$st timeout 240 python3 benchmarks/multi_lora.py --batch-sizes 64 \
          --input-len 512 --output-len 128 --skip-hf --num-adapters ${STACKED_ADAPTERS:-1,16,64} --max-loras 64 --base-last \
          --out "$OUT/ml_stacked$st.json" 2>&1 | grep -E "^chorus|decode graph|eager" | sed "s/^/stacked $st: /"
      done
      if [ -n "${STACKED_B256:-}" ]; then
        lora_b256 ml_stacked_b256.json
      fi ;;
    lora-ab)   # the LoRA decode GPU tests, then batch 64 once per assignment in AB (e.g. AB="CHORUS_LORA_FUSE_ROTARY=1
      # CHORUS_LORA_FUSE_ROTARY=0"), AB_ADAPTERS adapters (default 16,64); AB_B256=1 adds batch 256 (defaults)
      timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_kernel_lora_rotary.py tests/kernels/test_kernel_lora_norm.py \
        tests/kernels/test_kernel_kv_write.py tests/lora/test_peft_parity.py tests/lora/test_fused_lora_path.py \
        -k "cuda or gpu" 2>&1 | tee "$OUT/lora_ab_tests.log" | tail -4
      for kv in ${AB:-CHORUS_LORA_FUSE_ROTARY=1}; do
        env "$kv" timeout 240 python3 benchmarks/multi_lora.py --batch-sizes 64 --input-len 512 --output-len 128 \
          --skip-hf --num-adapters ${AB_ADAPTERS:-16,64} --max-loras 64 --base-last --out "$OUT/ml_ab_${kv//=/_}.json" \
          2>&1 | grep -E "^chorus|decode graph|eager" | sed "s/^/$kv: /"
      done
      if [ -n "${AB_B256:-}" ]; then
        lora_b256 ml_ab_b256.json
      fi ;;
    lora-tiles)   # the o/down update inside add + RMSNorm at every size (segment tiles above 512 tokens): GPU tests, sweep
      timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_kernel_lora_norm.py \
        tests/kernels/test_kernel_lora_silu_mul.py tests/lora/test_peft_parity.py -k "cuda or gpu" 2>&1 \
        | tee "$OUT/lora_tiles_tests.log" | tail -4
      timeout 200 python3 benchmarks/lora_prefill_sweep.py --fused-consumers --tokens ${SWEEP_TOKENS:-256,16384} \
        --adapters ${SWEEP_ADAPTERS:-16,64} --out "$OUT/fused_consumers_sweep.json" 2>&1 | grep -v Warn | tail -12 ;;
    ml-b256)   # batch 256 with 16 and 64 adapters, lines prefixed with $ML_TAG
      lora_b256 "ml_b256_${ML_TAG:-new}.json" | sed "s/^/${ML_TAG:-new} /" ;;
    lora-decode-sweep)   # the fused LoRA consumers' decode configs back to back, the stacked GEMM by slots covered
      timeout 300 python3 benchmarks/lora_decode_sweep.py --out "$OUT/lora_decode_sweep.json" 2>&1 | grep -v Warn \
        | tee "$OUT/lora_decode_sweep.log" | tail -20
      timeout 120 python3 benchmarks/stacked_gemm_sweep.py --tokens 64,256 --out "$OUT/stacked_gemm_sweep.json" 2>&1 \
        | grep -v Warn | tee "$OUT/stacked_gemm_sweep.log" ;;
    ml-b64)   # batch 64 (ML_ADAPTERS, default 16,64), lines prefixed with $ML_TAG
      timeout 240 python3 benchmarks/multi_lora.py --batch-sizes 64 --input-len 512 --output-len 128 --skip-hf \
        --num-adapters ${ML_ADAPTERS:-16,64} --max-loras 64 --base-last --out "$OUT/ml_b64_${ML_TAG:-new}.json" 2>&1 \
        | grep -E "^chorus|decode graph|eager" | sed "s/^/${ML_TAG:-new}: /" ;;
    lora-final)   # the LoRA GPU tests not in lora-token, the decode sweep at 128 tokens, the batch-64 table
      timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_kernel_gemv.py \
        tests/kernels/test_kernel_lora_fused.py tests/lora/test_fused_lora_path.py tests/lora/test_lora_overlap.py \
        -k "cuda or gpu" 2>&1 | tee "$OUT/lora_final_tests.log" | tail -4
      timeout 200 python3 benchmarks/lora_prefill_sweep.py --tokens 128 --adapters 16,64 --skip-shrink \
        --out "$OUT/decode_expand_sweep128.json" 2>&1 | grep -v Warn | tail -8
      timeout 240 python3 benchmarks/multi_lora.py --batch-sizes 64 --input-len 512 --output-len 128 --skip-hf \
        --num-adapters 1,4,16,64 --max-loras 64 --base-last --out "$OUT/multi_lora_b64.json" 2>&1 \
        | grep -E "^chorus|decode graph|eager" ;;
    pdl-ab)   # CHORUS_PDL off / on / off / on (batch 256 and 1), after the PDL and attention GPU tests
      timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_pdl.py \
        tests/kernels/test_kernel_paged_attention.py -k "gpu or cuda" 2>&1 | tee "$OUT/pdl_tests.log" | tail -2
      for r in 1 2; do for p in 0 1; do
        CHORUS_PDL=$p timeout 150 python3 benchmarks/latency.py --llama3-8b-dummy --batch-sizes 256,1 --context-len 512 \
          --steps 32 --skip-hf --out "$OUT/latency_pdl${p}_$r.json" 2>&1 | grep -E "^ +(256|1) " | sed "s/^/pdl $p: /"
      done; done ;;
    splitk-ab)   # split-K o/down GEMMs summed in the add + RMSNorm: GPU tests, the sweep at small batches,
      # then CHORUS_GEMM_SPLIT_K / CHORUS_PDL 0/0, 1/0, 1/1 twice (batch 256, 128, 32, 1)
      timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_kernel_layer_ops.py \
        tests/models/test_gpu_parity.py 2>&1 | tee "$OUT/splitk_tests.log" | tail -2
      timeout 60 python3 benchmarks/splitk_sweep.py --shapes down,o --ms 3,4,8,16,32 --splits 2 \
        --out "$OUT/splitk_small.json" 2>&1 | grep -v Warn
      for r in 1 2; do for sp in 0/0 1/0 1/1; do
        CHORUS_GEMM_SPLIT_K=${sp%/*} CHORUS_PDL=${sp#*/} timeout 150 python3 benchmarks/latency.py --llama3-8b-dummy \
          --batch-sizes 256,128,32,1 --context-len 512 --steps 32 --skip-hf --out "$OUT/latency_splitk${sp/\//_}_$r.json" \
          2>&1 | grep -E "^ +(256|128|32|1) " | sed "s|^|split/pdl $sp: |"
      done; done ;;
    rotary-ab)   # rotary + KV write inside the decode attention kernel: GPU tests, then
      # CHORUS_DECODE_FUSE_ROTARY 0 / 1 (ROUNDS times, default 1; batches ROTARY_BATCHES, default 256,128,32,1;
      # e.g. ROTARY_BATCHES=16,8,4,2 times the rest of auto's range)
      timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_kernel_paged_decode_rotary.py \
        tests/models/test_gpu_parity.py 2>&1 | tee "$OUT/rotary_tests.log" | tail -2
      timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_kernel_paged_attention.py \
        tests/kernels/test_pdl.py -k "gpu or cuda" 2>&1 | tee -a "$OUT/rotary_tests.log" | tail -2
      for r in $(seq ${ROUNDS:-1}); do for f in 0 1; do
        CHORUS_DECODE_FUSE_ROTARY=$f timeout 70 python3 benchmarks/latency.py --llama3-8b-dummy \
          --batch-sizes ${ROTARY_BATCHES:-256,128,32,1} --context-len 512 --steps 32 --skip-hf \
          --out "$OUT/latency_rotary${f}_$r.json" 2>&1 | grep -E "^ +[0-9]+ +[0-9.]+ " | sed "s|^|fuse_rotary $f: |"
      done; done ;;
    power)   # board power / SM clock / energy per call of batch-256 attention, GEMMs, a copy (power_probe.py)
      timeout 200 python3 benchmarks/power_probe.py --seconds ${POWER_SECONDS:-3} --out "$OUT/power_probe.json" 2>&1 \
        | grep -v Warn | tee "$OUT/power_probe.log" ;;
    attn-ab)   # decode attention tiles in the engine: CHORUS_ATTN_DECODE_CONFIG per item of ATTN_CFGS ("default" =
      # unset; items separated by spaces), ROUNDS times, batches ATTN_BATCHES (default 256,128)
      for r in $(seq ${ROUNDS:-2}); do i=0; for cfg in ${ATTN_CFGS:-default tile_n=32,num_warps=1,num_stages=3}; do
        i=$((i + 1))   # JSON per position, so a config listed twice keeps both runs
        env $([ "$cfg" = default ] || echo "CHORUS_ATTN_DECODE_CONFIG=$cfg") timeout 100 python3 benchmarks/latency.py \
          --llama3-8b-dummy --batch-sizes ${ATTN_BATCHES:-256,128} --context-len 512 --steps 32 --skip-hf \
          --out "$OUT/latency_attn_${cfg//[=,]/_}_${r}_$i.json" 2>&1 | grep -E "^ +[0-9]+ +[0-9.]+ " | sed "s|^|$cfg: |"
      done; done ;;
    serve-defaults)   # chorus serve as a user starts it (engine process, 1024 seqs / 8192 tokens); the
      # first burst right after start shows whether start-up compiled the eager attention variants
      python3 -c "from pathlib import Path; from benchmarks.throughput import dummy_checkpoint; \
dummy_checkpoint(Path('/tmp/chorus-llama3-8b-dummy'), 'bfloat16')"
      OUT="$OUT/serve-defaults" PORT=8123 timeout 280 bash benchmarks/serve_run.sh /tmp/chorus-llama3-8b-dummy \
        "${SERVE_RATES:-inf:160 32:160 inf:256}" --load-format dummy 2>&1 | grep -E "server ready|Output token|TTFT|TPOT"
      grep -E "compiled|Captured" "$OUT/serve-defaults/server.log" ;;
    serve)   # the same rates with the engine loop in a thread, then in its own process
      python3 -c "from pathlib import Path; from benchmarks.throughput import dummy_checkpoint; \
dummy_checkpoint(Path('/tmp/chorus-llama3-8b-dummy'), 'bfloat16')"
      for mode in --no-engine-process --engine-process; do
        OUT="$OUT/serve$mode" PORT=8123 timeout 280 bash benchmarks/serve_run.sh /tmp/chorus-llama3-8b-dummy \
          "${SERVE_RATES:-8:80 32:160 inf:160}" --load-format dummy $mode 2>&1 | grep -E "Output token|TTFT|TPOT" ;
      done ;;
  esac
  echo "== phase $phase took $(( $(date +%s) - t0 )) s"
done
