#!/usr/bin/env bash
# Create bench/.venv-litellm: LiteLLM's proxy for the side-by-side overhead benchmark (bench/gateway_overhead.py
# --litellm). Not a product dependency: its own environment, its own process. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-python3.11}"
VENV=bench/.venv-litellm
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q 'litellm[proxy]'
LITELLM_LOCAL_MODEL_COST_MAP=True LITELLM_TELEMETRY_DISABLED=true "$VENV/bin/python" -c "import litellm, importlib.metadata as m; print('litellm', m.version('litellm'))"
