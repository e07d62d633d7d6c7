#!/usr/bin/env bash
# Start `chorus serve` on MODEL_DIR and run benchmarks/serve.py against it at several request rates.
# Usage: bash benchmarks/serve_run.sh MODEL_DIR "RATE:NUM_PROMPTS ..." [extra chorus serve flags]
# e.g. (H200, Llama-3-8B shape, random weights):
#   bash benchmarks/serve_run.sh /tmp/chorus-llama3-8b-dummy "8:100 32:200 inf:200" --load-format dummy
set -u
MODEL_DIR=$1; RUNS=$2; shift 2
OUT=${OUT:-benchmarks/out}; PORT=${PORT:-8123}
IN_LEN=${IN_LEN:-512}; OUT_LEN=${OUT_LEN:-128}
mkdir -p "$OUT"
python3 -m engine.cli serve "$MODEL_DIR" --port "$PORT" --host 127.0.0.1 --max-model-len 2048 \
  --no-enable-prefix-caching --disable-log-requests --disable-uvicorn-access-log \
  --uvicorn-log-level warning "$@" > "$OUT/server.log" 2>&1 &
SERVER=$!
START=$(date +%s)
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "server died"; tail -30 "$OUT/server.log"; exit 1; }
  sleep 1
done
echo "server ready after $(( $(date +%s) - START )) s"
for run in $RUNS; do
  rate=${run%%:*}; n=${run##*:}
  python3 benchmarks/serve.py --base-url "http://127.0.0.1:$PORT" --num-prompts "$n" --request-rate "$rate" \
    --input-len "$IN_LEN" --output-len "$OUT_LEN" --out "$OUT/serve_rate_$rate.json" 2>&1 | tail -26
done
kill -INT $SERVER; wait $SERVER
