#!/bin/bash
# 8-bit KV cache formats, frugal against vLLM 0.26.0's FP8 cache on one GPU with the same client
# (`vllm bench serve`), every server with the same KV budget (KV_GIB GiB) and max length.
#
# One server start per engine and format, two workloads on it:
#   512 in / 128 out at C = 1 and 64 (tag <engine>_<model>_kv<format>_kv<KV_GIB>g_c<C>.json);
#   the capacity workload, 4,096 in / 512 out at C = 64, 128 prompts, 8 warm-ups (the same tag
#   with _cap): 64 requests of 4,608 tokens (295k) do not fit a 20 GiB bf16 cache (164k tokens).
# The frugal log line "KV cache: N pages x 16 tokens = T tokens" gives each format's capacity,
# and its KV check line the KL against an unquantized cache.
#
# Device side, from the project root, after the vllm_peer kit is staged (its README, calls 1..N):
#   bash benchmarks/kv_formats_peer.sh vllm            # vLLM --kv-cache-dtype fp8
#   bash benchmarks/kv_formats_peer.sh frugal FORMAT   # auto, fp8, fp8_per_token_head,
#                                                      # int8_per_token_head, fp8_v
# Knobs: MODEL [llama-3.1-8b], KV_GIB [20], MAX_LEN [5120] and those of .peer/bin/common.sh.
# Results: $RESULTS (packed into $OUT/peer_results.tar.gz).
set -u
ENGINE=${1:?usage: $0 vllm|frugal [FORMAT]}
FORMAT=${2:-fp8}
KV_GIB=${KV_GIB:-20}
export MAX_LEN=${MAX_LEN:-5120}
source .peer/bin/common.sh bf16
TAG=${ENGINE}_${MODEL}_kv${FORMAT}_kv${KV_GIB}g
SLOG=$RESULTS/serve_$TAG.log; BLOG=$RESULTS/bench_$TAG.log

if [ "$ENGINE" = vllm ]; then
  [ "$FORMAT" = fp8 ] || { echo "vLLM side: fp8 only"; exit 2; }
  start_server $PY -m vllm.entrypoints.cli.main serve "$MODEL_DIR" --served-model-name "$MODEL" \
      --load-format dummy --dtype bfloat16 --max-model-len "$MAX_LEN" --host 127.0.0.1 \
      --port "$PORT" --kv-cache-dtype fp8 --kv-cache-memory-bytes "${KV_GIB}G" \
      ${EXTRA_SERVE_ARGS:-}
  grep -E "KV cache|Maximum concurrency" "$SLOG" | tail -n 4
else
  source benchmarks/peer_frugal.sh
  start_frugal --max-model-len "$MAX_LEN" --kv-cache-dtype "$FORMAT" \
      --kv-cache-memory "${KV_GIB}GiB" ${EXTRA_SERVE_ARGS:-}
  grep -E "KV cache" "$SLOG" | tail -n 4
fi
KV=$FORMAT
VERSION=$ENGINE
[ "$ENGINE" = frugal ] && VERSION="frugal@$(git rev-parse --short HEAD 2>/dev/null || echo "${FRUGAL_REV:-unknown}")"
INPUT_LEN=512 OUTPUT_LEN=128 CONCURRENCIES="1 64" bench_all engine_version="$VERSION"
TAG=${TAG}_cap; BLOG=$RESULTS/bench_$TAG.log
INPUT_LEN=4096 OUTPUT_LEN=512 CONCURRENCIES=64 ROUNDS=2 WARMUPS=8 bench_all \
    engine_version="$VERSION"
