#!/bin/bash
# Prefix caching, frugal against vLLM 0.26.0 on one GPU with the same client (`vllm bench serve`).
#
# Every prompt is one shared random prefix of PREFIX_LEN tokens and INPUT_LEN random tokens of its
# own (`--random-prefix-len`), OUTPUT_LEN tokens out, at each of CONCURRENCIES; then, at C=1, the
# same lengths with no shared prefix (every prompt a miss), for the TTFT of a miss. Both servers run
# with automatic prefix caching on (their default), dummy weights at the model's real shapes.
# After each run the server's prefix-cache counters go next to the result as <tag>_c<C>.metrics.
#
# Device side, from the project root, after the vllm_peer kit is staged (its README, calls 1..N):
#   bash benchmarks/prefix_cache_peer.sh vllm; bash benchmarks/prefix_cache_peer.sh frugal
# Knobs: MODEL [llama-3.1-8b], PREFIX_LEN [2048], INPUT_LEN [128], OUTPUT_LEN [128],
# CONCURRENCIES ["1 16 64"], ROUNDS [4], and those of .peer/bin/common.sh. Results: $RESULTS
# (packed into $OUT/peer_results.tar.gz), tags <engine>_<model>_kvbf16_prefix<P> and _miss<P+I>.
set -u
ENGINE=${1:?usage: $0 vllm|frugal}
shift
export CONCURRENCIES=${CONCURRENCIES:-1 16 64}
PREFIX_LEN=${PREFIX_LEN:-2048}; INPUT_LEN=${INPUT_LEN:-128}; OUTPUT_LEN=${OUTPUT_LEN:-128}
source .peer/bin/common.sh bf16
TAG0=$TAG

bench() {  # bench PREFIX INPUT CONCURRENCIES: one `vllm bench serve` per concurrency, tag $TAG
  local prefix=$1 in=$2 C N W
  for C in $3; do
    if [ "$(date +%s)" -ge "$DEADLINE_AT" ]; then echo "== deadline: $TAG C=$C skipped"; break; fi
    N=$(( ${ROUNDS:-4} * C > 16 ? ${ROUNDS:-4} * C : 16 )); W=${WARMUPS:-$(( C > 2 ? C : 2 ))}
    echo "== bench $TAG C=$C N=$N ($(( $(date +%s) - T0 ))s into the script)" | tee -a "$BLOG"
    $PY -m vllm.entrypoints.cli.main bench serve --backend openai \
        --base-url "http://127.0.0.1:$PORT" --endpoint /v1/completions --model "$MODEL" \
        --tokenizer "$MODEL_DIR" --dataset-name random --random-prefix-len "$prefix" \
        --random-input-len "$in" --random-output-len "$OUTPUT_LEN" --ignore-eos --seed 0 \
        --max-concurrency "$C" --num-prompts "$N" --num-warmups "$W" \
        --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --disable-tqdm \
        --save-result --result-dir "$RESULTS" --result-filename "${TAG}_c${C}.json" \
        --metadata engine="$ENGINE" model="$MODEL" kv_cache="$KV" >> "$BLOG" 2>&1 \
      || echo "== bench C=$C failed (rc $?): see $BLOG" | tee -a "$BLOG"
    $PY -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$PORT/metrics').read().decode())" \
        | grep -E "prefix_cache_(queries|hits)_total" > "$RESULTS/${TAG}_c${C}.metrics"
    bash .peer/bin/pack.sh -q
  done
}

if [ "$ENGINE" = vllm ]; then
  start_server $PY -m vllm.entrypoints.cli.main serve "$MODEL_DIR" --served-model-name "$MODEL" \
      --load-format dummy --dtype bfloat16 --max-model-len "${MAX_LEN:-4096}" \
      --gpu-memory-utilization "${GPU_UTIL:-0.9}" --host 127.0.0.1 --port "$PORT" \
      --enable-prefix-caching ${EXTRA_SERVE_ARGS:-}
else
  source benchmarks/peer_frugal.sh
  start_frugal --max-model-len "${MAX_LEN:-4096}" --gpu-memory-utilization "${GPU_UTIL:-0.9}" \
      --enable-prefix-caching ${EXTRA_SERVE_ARGS:-}
fi
TAG=${TAG0}_prefix${PREFIX_LEN}; BLOG=$RESULTS/bench_$TAG.log; : > "$BLOG"
bench "$PREFIX_LEN" "$INPUT_LEN" "$CONCURRENCIES"
TAG=${TAG0}_miss$(( PREFIX_LEN + INPUT_LEN )); BLOG=$RESULTS/bench_$TAG.log; : > "$BLOG"
bench 0 $(( PREFIX_LEN + INPUT_LEN )) 1
