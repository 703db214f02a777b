# Sourced by the benchmarks/*_peer.sh scripts after .peer/bin/common.sh (device side, project
# root): start_frugal FLAGS... serves $MODEL_DIR with random weights on $PORT through
# common.sh's start_server, with the project's own dependencies the kit lacks (gguf, from
# .peer/extra) installed into $EXTRA_SITE once per machine.
start_frugal() {
  EXTRA_SITE=${EXTRA_SITE:-/tmp/extra}
  if ls .peer/extra/*.whl >/dev/null 2>&1 && [ ! -f "$EXTRA_SITE/.wheels" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$EXTRA_SITE" \
        .peer/extra/*.whl && ls .peer/extra > "$EXTRA_SITE/.wheels"
  fi
  start_server env PYTHONPATH="$ROOT:$SITE:$EXTRA_SITE" $PY -m frugal.cli.main serve \
      "$MODEL_DIR" --served-model-name "$MODEL" --load-format dummy --dtype bfloat16 \
      --host 127.0.0.1 --port "$PORT" "$@"
}
