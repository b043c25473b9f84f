#!/usr/bin/env bash
# A cold-start hook for an autoscaler: run it as a new replica's entrypoint. It waits for the node's
# preload daemon to hold the model, then execs an engine that attaches to it zero-copy; if the
# daemon is absent, failed or not ready in time, it says why and starts the engine cold from the
# checkpoint (or exits with wait-ready's code, for an orchestrator that retries elsewhere).
#
# Settings (environment variables):
#   MODEL_DIR        checkpoint directory: config and tokenizer always, the weights on a cold start (required)
#   MODEL_NAME       the model's name in the daemon (default: MODEL_DIR's directory name, as `preload serve` names it)
#   PORT             the engine's HTTP port (default 8000)
#   PRELOAD          the preload command, split on spaces (default: preload; e.g. ".venv/bin/python -m preload_cli")
#   TIMEOUT          seconds `preload wait-ready` waits (default 600)
#   WAIT_FOR_DAEMON  seconds the warm engine itself waits for a daemon that goes away between the check and its
#                    attach (e.g. restarted), before it falls back to a cold load (default 60)
#   WEIGHTS_VERSION  empty (default): attach to the version loaded from MODEL_DIR's files; "active" or a number:
#                    that version of MODEL_NAME, e.g. what a trainer published (then the engine has no cold fallback)
#   ON_NOT_READY     cold (default): start the engine cold when the daemon is not ready; exit: exit with
#                    wait-ready's code instead
#   DRY_RUN          1: print the engine command instead of exec'ing it (for tests and for checking a setup)
#   PRELOAD_RUNTIME_DIR  the daemons' runtime directory, read by preload itself
#
# Exit codes: the engine's own (this script execs it); with ON_NOT_READY=exit, wait-ready's: 1 timed out, 3 failed,
# 4 no daemon; 2 bad usage (of this script or of wait-ready).
#
#   MODEL_DIR=/models/llama PORT=8000 scripts/autoscaler_hook.sh
set -u

MODEL_DIR=${MODEL_DIR:-}
if [ -z "$MODEL_DIR" ]; then
  echo "autoscaler_hook: set MODEL_DIR to the checkpoint directory" >&2
  exit 2
fi
MODEL_NAME=${MODEL_NAME:-$(basename "$MODEL_DIR")}
PORT=${PORT:-8000}
PRELOAD=${PRELOAD:-preload}
TIMEOUT=${TIMEOUT:-600}
WAIT_FOR_DAEMON=${WAIT_FOR_DAEMON:-60}
WEIGHTS_VERSION=${WEIGHTS_VERSION:-}
ON_NOT_READY=${ON_NOT_READY:-cold}
DRY_RUN=${DRY_RUN:-0}
case $ON_NOT_READY in
  cold|exit) ;;
  *) echo "autoscaler_hook: ON_NOT_READY must be cold or exit, got '$ON_NOT_READY'" >&2; exit 2 ;;
esac

log() { printf 'autoscaler_hook: %s\n' "$*" >&2; }

start_engine() {  # replaces this shell with the engine, so the autoscaler's signals reach it
  if [ "$DRY_RUN" = 1 ]; then
    printf 'would exec:'
    printf ' %q' "$@"
    printf '\n'
    exit 0
  fi
  exec "$@"
}

# PRELOAD is a command line: split on spaces into words.
read -r -a preload <<< "$PRELOAD"

# wait-ready's answer goes to stderr with the rest of this script's log: stdout is the engine's (its
# first line is the JSON ready line).
# wait-ready waits for what the engine attaches: the version loaded from MODEL_DIR's files as they are
# now (3 at once when no daemon is loading and none holds them: start cold), or WEIGHTS_VERSION's.
which=(--from "$MODEL_DIR")
case $WEIGHTS_VERSION in
  "") ;;
  active) which=() ;;
  *) which=(--version "$WEIGHTS_VERSION") ;;
esac
code=0
"${preload[@]}" wait-ready --model "$MODEL_NAME" ${which[@]+"${which[@]}"} --timeout "$TIMEOUT" >&2 || code=$?
case $code in
  0)
    log "the daemon holds $MODEL_NAME; starting the engine warm (ipc_cache)"
    version=()
    if [ -n "$WEIGHTS_VERSION" ]; then version=(--weights-version "$WEIGHTS_VERSION"); fi
    start_engine "${preload[@]}" engine "$MODEL_DIR" --name "$MODEL_NAME" ${version[@]+"${version[@]}"} \
      --load-format ipc_cache --wait-for-daemon "$WAIT_FOR_DAEMON" --port "$PORT"
    ;;
  1) reason="timed out after ${TIMEOUT}s: the daemon is still loading, or $MODEL_NAME is not loaded yet" ;;
  3) reason="the daemon failed to load $MODEL_NAME, or holds other weights than asked (see \`preload status\`)" ;;
  4) reason="no daemon answered within ${TIMEOUT}s" ;;
  *)
    # 2 is bad usage; anything else is not wait-ready's (e.g. 127: PRELOAD not found). Starting cold
    # would hide a broken setup, so stop here whatever ON_NOT_READY says.
    log "\`$PRELOAD wait-ready\` exited with $code (not a readiness answer); check PRELOAD and the flags"
    exit "$code"
    ;;
esac

# Not ready (1, 3, 4). A replica that starts cold serves after a full checkpoint read and holds its own
# copy of the weights, but it serves; an orchestrator that would rather place the replica where a
# daemon is ready sets ON_NOT_READY=exit and acts on the code.
if [ "$ON_NOT_READY" = exit ]; then
  log "$reason; exiting with code $code (ON_NOT_READY=exit)"
  exit "$code"
fi
if [ -n "$WEIGHTS_VERSION" ]; then
  log "$reason; WEIGHTS_VERSION=$WEIGHTS_VERSION is only in the daemon, so the engine cannot start cold;" \
    "exiting with code $code"
  exit "$code"
fi
log "$reason; starting the engine cold from $MODEL_DIR (safetensors)"
start_engine "${preload[@]}" engine "$MODEL_DIR" --name "$MODEL_NAME" --load-format safetensors --port "$PORT"
