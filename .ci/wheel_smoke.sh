#!/usr/bin/env bash
# Wheel smoke: what `pip install thinkgate` gives a new user, on a clean venv.
#
# Builds the wheel from this checkout, installs it ALONE (base dependencies only, no extras) into a fresh venv,
# then, from a scratch directory so the checkout is not importable:
#   - the wheel holds gateway/ and router/ only (no training package, no models, no bench or tests);
#   - `thinkgate --help`; `thinkgate train tiny`, `thinkgate bench --help` answer in one line (source checkout);
#   - `python -X importtime -c "import gateway.app"` imports no lab or extra library;
#   - the shipped test splits load (package data) and verifying a math answer names the `eval` extra;
#   - `thinkgate serve` with the engine on answers in one line that a wheel ships no model, and how to fix it;
#   - `thinkgate serve` with the engine off against the test upstream (tests/fixtures/upstream_sim.py, run with
#     the dev venv's python), one chat request with the development key, `thinkgate usage export --format csv`
#     shows its usage row, and `--format parquet` answers in one line which extra to install;
#   - no state was written into site-packages.
# Every step is bounded by a timeout; any failure fails CI. Usage: .ci/wheel_smoke.sh [DEV_PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DEV_PY=${1:-$REPO/.venv/bin/python}
# absolute without resolving symlinks (a venv's python is a symlink to the base interpreter): the steps below cd away
case "$DEV_PY" in /*) ;; *) DEV_PY="$REPO/$DEV_PY" ;; esac
if command -v python3.11 >/dev/null 2>&1; then PY=python3.11; else PY=python3; fi
WORK=$(mktemp -d /tmp/thinkgate-wheel-smoke.XXXXXX)
UP_PID=""
GW_PID=""
cleanup() {
  set +e   # a killed child's status must not abort the clean-up
  if [ -n "$GW_PID" ]; then kill "$GW_PID" 2>/dev/null; wait "$GW_PID" 2>/dev/null; fi
  if [ -n "$UP_PID" ]; then kill "$UP_PID" 2>/dev/null; wait "$UP_PID" 2>/dev/null; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
T0=$(date +%s)
step() { echo "wheel-smoke [$(( $(date +%s) - T0 ))s] $*"; }
fail() { echo "wheel-smoke: FAIL: $*" >&2; for f in "$WORK"/*.log; do [ -f "$f" ] && tail -n 30 "$f" >&2; done; exit 1; }
free_port() { "$DEV_PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

step "build the wheel (from a copy of the tracked tree: no stale build/ output)"
mkdir -p "$WORK/src"
git -C "$REPO" ls-files -z --cached --others --exclude-standard \
  | (cd "$REPO" && tar --null --ignore-failed-read -T - -cf - 2>/dev/null) | tar -xf - -C "$WORK/src"
timeout 300 "$DEV_PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$WORK/src" >"$WORK/build.log" 2>&1 \
  || fail "wheel build"
WHEEL=$(ls "$WORK"/dist/thinkgate-*.whl)

step "the wheel carries the product only: no training package, no models, no bench or tests"
"$DEV_PY" - "$WHEEL" <<'EOF' || fail "the wheel carries more than the product"
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
tops = sorted({n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))})
bad = [n for n in names if n.split("/")[0] in ("training", "models", "bench", "tests") or n.endswith(".safetensors")]
print(f"  {len(names)} files, top-level: {tops}; training/models/bench/tests/weights: {len(bad)}")
sys.exit(1 if bad or tops != ["gateway", "router"] else 0)
EOF

step "install $(basename "$WHEEL") alone into a fresh venv"
timeout 120 "$PY" -m venv "$WORK/venv" || fail "venv"
timeout 600 "$WORK/venv/bin/pip" install -q "$WHEEL" >"$WORK/install.log" 2>&1 || fail "pip install of the wheel"
TG="$WORK/venv/bin/thinkgate"
VPY="$WORK/venv/bin/python"
SITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for extra in torch transformers trl vllm math_verify matplotlib pyarrow openai tqdm; do
  if "$VPY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$extra') is None)"; then
    fail "the base install pulled $extra (it belongs in an extra)"
  fi
done

mkdir -p "$WORK/run"
cd "$WORK/run"   # never the checkout: its packages must not shadow the installed ones
export THINKGATE_STATE_DIR="$WORK/state" THINKGATE_ENGINE__ENABLED=false HF_HUB_OFFLINE=1
unset THINKGATE_CONFIG

step "thinkgate --help"
timeout 60 "$TG" --help >"$WORK/help.log" 2>&1 || fail "thinkgate --help"
grep -q "serve" "$WORK/help.log" || fail "thinkgate --help lists no serve command"

step "train and bench (not in the wheel) answer every invocation with one line: run them from a source checkout"
for args in "train" "train tiny" "train --help" "bench --help"; do
  set +e
  # shellcheck disable=SC2086  # the words of $args are the arguments
  timeout 60 "$TG" $args >"$WORK/plugin.log" 2>&1
  RC=$?
  set -e
  [ "$RC" -eq 2 ] || fail "thinkgate $args: exit $RC, expected 2: $(cat "$WORK/plugin.log")"
  [ "$(wc -l <"$WORK/plugin.log")" -eq 1 ] && grep -q "unavailable here.*source checkout" "$WORK/plugin.log" \
    || fail "thinkgate $args: $(cat "$WORK/plugin.log")"
done

step "import gateway.app imports no lab library"
timeout 60 "$VPY" -X importtime -c "import gateway.app" 2>"$WORK/importtime.log" || fail "import gateway.app"
"$VPY" - "$WORK/importtime.log" <<'EOF' || fail "import gateway.app pulled a lab library"
import sys
lab = {"torch", "transformers", "trl", "vllm", "math_verify", "matplotlib", "pyarrow", "openai", "tqdm", "bench",
       "tests", "training"}
seen = {line.split("|")[-1].strip().split(".")[0] for line in open(sys.argv[1]) if line.startswith("import time:")}
bad = sorted(seen & lab)
print(f"  {len(seen)} top-level modules imported; lab libraries: {bad or 'none'}")
sys.exit(1 if bad else 0)
EOF

step "serve with the engine on and no model (a wheel ships none) ends in one line naming the fix"
set +e
THINKGATE_ENGINE__ENABLED=true timeout 60 "$TG" serve >"$WORK/nomodel.log" 2>&1
RC=$?
set -e
[ "$RC" -eq 2 ] || fail "serve with no model: exit $RC, expected 2: $(cat "$WORK/nomodel.log")"
[ "$(wc -l <"$WORK/nomodel.log")" -eq 1 ] || fail "serve with no model: not one line: $(cat "$WORK/nomodel.log")"
grep -q "THINKGATE_ENGINE__MODEL_PATH" "$WORK/nomodel.log" || fail "serve with no model: $(cat "$WORK/nomodel.log")"
echo "  $(cut -c1-110 "$WORK/nomodel.log")..."

step "shipped data: gsm8k/math test splits load; math checking names its extra"
timeout 60 "$VPY" - <<'EOF' || fail "package data or the missing-extra message"
from router.errors import MissingExtra
from router.tasks import load_task, verify

problems = load_task("gsm8k", "test", 3) + load_task("math", "test", 3)
assert len(problems) == 6, problems
try:
    verify(problems[-1], "42")
except MissingExtra as exc:
    assert "install the 'eval' extra: pip install '<the thinkgate wheel or checkout>[eval]'" in str(exc), exc
else:
    raise AssertionError("math-verify is not installed, yet verify() did not say which extra to install")
try:
    load_task("gsm8k", "train", 1)
except FileNotFoundError as exc:
    assert "source checkout" in str(exc), exc
print("  test splits: 6 problems loaded from package data")
EOF

step "serve (engine off) against the test upstream"
UP_PORT=$(free_port)
GW_PORT=$(free_port)
"$DEV_PY" "$REPO/tests/fixtures/upstream_sim.py" --port "$UP_PORT" --model sim-model >"$WORK/upstream.log" 2>&1 &
UP_PID=$!
cat >"$WORK/thinkgate.yaml" <<EOF
server: {host: 127.0.0.1, port: $GW_PORT}
redis: {key_prefix: "smoke-$$-$T0:"}
tiers:
  - {name: none, base_url: "http://127.0.0.1:$UP_PORT/v1", model: sim-model, max_tokens: 64, thinking_budget: 0,
     enable_thinking: false, budget_mode: "off"}
  - {name: short, base_url: "http://127.0.0.1:$UP_PORT/v1", model: sim-model, max_tokens: 96, thinking_budget: 32}
  - {name: long, base_url: "http://127.0.0.1:$UP_PORT/v1", model: sim-model, max_tokens: 448, thinking_budget: 320,
     prices: {input_usd_per_mtok: "0.50", output_usd_per_mtok: "2.00"}}
EOF
export THINKGATE_CONFIG="$WORK/thinkgate.yaml"
timeout 300 "$TG" serve >"$WORK/serve.log" 2>&1 &
GW_PID=$!
HEALTH=""
for _ in $(seq 1 120); do
  if curl -fsS -o /dev/null "http://127.0.0.1:$GW_PORT/health" 2>/dev/null; then HEALTH=ok; break; fi
  kill -0 "$GW_PID" 2>/dev/null || fail "thinkgate serve exited"
  sleep 0.5
done
[ -n "$HEALTH" ] || fail "thinkgate serve not healthy within 60 s"
[ -f "$THINKGATE_STATE_DIR/dev-key" ] || fail "no development key in \$THINKGATE_STATE_DIR"
KEY=$(cat "$THINKGATE_STATE_DIR/dev-key")

step "one chat request with the development key"
timeout 30 curl -fsS "http://127.0.0.1:$GW_PORT/v1/chat/completions" -H "authorization: Bearer $KEY" \
  -H 'content-type: application/json' \
  -d '{"model": "long", "messages": [{"role": "user", "content": "What is 2 + 3?"}]}' >"$WORK/chat.json" \
  || fail "chat request"
"$VPY" -c "
import json, sys
r = json.load(open(sys.argv[1]))
assert r['choices'][0]['message']['content'].startswith('echo:'), r
assert r['usage']['completion_tokens'] > 0, r
print('  answer:', r['choices'][0]['message']['content'][:40], '| usage:', r['usage']['total_tokens'], 'tokens')
" "$WORK/chat.json" || fail "chat answer"

step "thinkgate usage export --format csv"
ROWS=0
for _ in $(seq 1 20); do   # the usage event is written after the response: allow it a moment
  timeout 60 "$TG" usage export --format csv -o "$WORK/usage.csv" >"$WORK/export.log" 2>&1 || fail "usage export csv"
  ROWS=$(( $(wc -l <"$WORK/usage.csv") - 1 ))
  [ "$ROWS" -ge 1 ] && break
  sleep 0.5
done
[ "$ROWS" -ge 1 ] || fail "usage export: no row for the request"
grep -q ",long," "$WORK/usage.csv" || fail "usage export: no row for tier long"
echo "  $ROWS usage row(s)"

step "thinkgate usage export --format parquet names the extra"
set +e
timeout 60 "$TG" usage export --format parquet -o "$WORK/usage.parquet" >"$WORK/parquet.log" 2>&1
RC=$?
set -e
[ "$RC" -eq 2 ] || fail "parquet export without pyarrow: exit $RC, expected 2"
[ "$(wc -l <"$WORK/parquet.log")" -eq 1 ] || fail "parquet export: not one line: $(cat "$WORK/parquet.log")"
grep -q "install the 'report' extra: pip install '<the thinkgate wheel or checkout>\[report\]'" "$WORK/parquet.log" || fail "parquet export: $(cat "$WORK/parquet.log")"
echo "  $(cat "$WORK/parquet.log")"

kill "$GW_PID" && wait "$GW_PID" 2>/dev/null || true
GW_PID=""
if find "$SITE" -name '.thinkgate' -o -name 'usage-spool.jsonl' -o -name 'dev-key' | grep -q .; then
  fail "state was written into site-packages"
fi
step "passed"
