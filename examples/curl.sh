#!/usr/bin/env bash
# curl against a running `chorus serve` (default http://127.0.0.1:8000). Set CHORUS_API_KEY if the
# server was started with --api-key.
set -euo pipefail
URL=${CHORUS_URL:-http://127.0.0.1:8000}
AUTH=(-H "Authorization: Bearer ${CHORUS_API_KEY:-EMPTY}")
MODEL=$(curl -s "${AUTH[@]}" "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')

echo "== chat completion"
curl -s "${AUTH[@]}" "$URL/v1/chat/completions" -H "Content-Type: application/json" -d "{
  \"model\": \"$MODEL\",
  \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}],
  \"max_tokens\": 32, \"temperature\": 0
}"
echo; echo "== streamed completion (SSE)"
curl -sN "${AUTH[@]}" "$URL/v1/completions" -H "Content-Type: application/json" -d "{
  \"model\": \"$MODEL\", \"prompt\": \"The capital of France is\", \"max_tokens\": 8, \"temperature\": 0,
  \"stream\": true, \"stream_options\": {\"include_usage\": true}
}"
echo "== tokenize, health, metrics"
curl -s "$URL/tokenize" -H "Content-Type: application/json" -d '{"prompt": "Hello world"}'; echo
curl -s -o /dev/null -w "health: %{http_code}\n" "$URL/health"
curl -s "$URL/metrics" | grep -E '^chorus:(num_requests_running|generation_tokens_total|kv_cache_usage_perc)'
