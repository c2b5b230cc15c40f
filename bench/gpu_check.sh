#!/usr/bin/env bash
# One short, prepared check of GRPO rollouts on a GPU machine (an NVIDIA H200, no network), run once:
#   bash bench/gpu_check.sh            # from the repository root, with .whl/ (trl, datasets, dill, multiprocess)
# That machine's image has torch/transformers/accelerate but not trl, datasets or vLLM. vLLM (hundreds of MB)
# cannot travel there, so the script records that `import vllm` fails and the GRPO rollouts use transformers
# `generate` on CUDA: the vLLM-rollout figure is honestly "not measurable there".
# Steps: pip-install the carried wheels into /tmp/site; nvidia-smi; versions, the vLLM probe and the ledger's
# device detection; a plain generate throughput check (256 prompts x 128 sampled tokens); then GRPO with
# training/configs/gpu_check.yaml (30 steps, 64 rollouts a step, correctness + kimi_length, dynamic sampling,
# fp32 master weights with bf16 autocast, the cost ledger at the H200 price) under `timeout`; a graceful ledger
# budget stop comes first if steps are slow. Recorded: share of weights that moved, reward first/last 5 steps,
# detected device, the step split and the whole-run phase split with the billed share of the command's wall time.
# Outputs, flat in $OUT (the device tool returns at most 8 files): log.txt, gpu_check.json (all the numbers),
# summary.json, ledger.jsonl, metrics.jsonl, length.png, cost.png, run.tgz (the run directory without weights).
# Under 6 minutes in all. Local dry run on CPU (overrides, all optional):
#   OUT=/tmp/gc-out PY=python3.11 WHEELS=/tmp/whl311 GPU_CHECK_CONFIG=cpu.yaml GPU_CHECK_TPUT_BATCH=16 \
#     GPU_CHECK_TPUT_TOKENS=16 bash bench/gpu_check.sh
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
PY="${PY:-python3}"
WHEELS="${WHEELS:-.whl}"
export OUT="${OUT:-/tmp/gpu-check-out}"
mkdir -p "$OUT"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
  && export PYTHONPATH="/tmp/site:$PWD" || exit 1

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HOME=/tmp/hf-home \
  TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg PYTHONWARNINGS=ignore::FutureWarning
export GC_WORK=/tmp/gpu-check-work GC_RUN=/tmp/gpu-check-work/run  # the run dir stays outside $OUT (8-file cap)
export GC_CONFIG="${GPU_CHECK_CONFIG:-training/configs/gpu_check.yaml}"
export GC_TPUT_BATCH="${GPU_CHECK_TPUT_BATCH:-256}" GC_TPUT_TOKENS="${GPU_CHECK_TPUT_TOKENS:-128}"
TRAIN_TIMEOUT=330  # seconds; shortened below if the earlier steps ran long (whole script < 6 min)
FINISH_BY=350      # seconds after the start by which training must have ended

main() {
  rm -rf "$GC_WORK" && mkdir -p "$GC_WORK"
  echo "== gpu_check $(date -u +%FT%TZ) on $(hostname), $(nproc) cores, $(uname -m); config $GC_CONFIG"
  echo "== wheels: $(ls "$WHEELS" | tr '\n' ' ')"
  echo "== nvidia-smi"
  timeout 30 nvidia-smi || echo "nvidia-smi: not available (rc $?)"
  timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null

  echo "== versions, vLLM probe, device detection, generate throughput"
  timeout 120 "$PY" - <<'PY'
import importlib.metadata as md
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers
import yaml

work = Path(os.environ["GC_WORK"])
env: dict = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
for dist in ("transformers", "trl", "datasets", "accelerate", "tokenizers", "huggingface_hub", "pyarrow", "typer"):
    try:
        env[dist] = md.version(dist)
    except md.PackageNotFoundError:
        env[dist] = None
try:  # the vLLM-rollout figure needs vLLM on this machine; record whether it is there at all
    import vllm

    env["vllm"] = {"importable": True, "version": getattr(vllm, "__version__", None)}
except Exception as e:
    env["vllm"] = {"importable": False, "error": f"{type(e).__name__}: {e}"}
try:
    from trl.import_utils import is_vllm_available

    env["trl_is_vllm_available"] = bool(is_vllm_available())
except Exception as e:  # the training step will say more; keep measuring
    env["trl_is_vllm_available"] = f"trl import failed: {type(e).__name__}: {e}"
print(json.dumps(env, indent=1))

from training.grpo.run import detect_device

cuda = torch.cuda.is_available()
kind, count = detect_device()
cfg_path = Path(os.environ["GC_CONFIG"])
cfg = yaml.safe_load(cfg_path.read_text())
prices = cfg.get("ledger", {}).get("price_usd_per_device_hour") or {}
env["device"] = {
    "cuda_available": cuda,
    "name": torch.cuda.get_device_name(0) if cuda else "cpu",
    "detected_kind": kind,
    "count": count,
    "priced": kind in prices,
    "price_usd_per_device_hour": prices.get(kind),
    "forced_kind": None,
}
if cuda and kind not in prices:  # keep the one run alive: bill as an H200 and say so
    cfg.setdefault("ledger", {})["device_kind"] = "nvidia-h200"
    cfg_path = work / "gpu_check.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env["device"]["forced_kind"] = "nvidia-h200"
(work / "config_path").write_text(str(cfg_path))
print(json.dumps(env["device"], indent=1))
(work / "env.json").write_text(json.dumps(env, indent=1))

# Plain transformers generate throughput on the shipped tiny model: B chat prompts x T sampled new tokens
# (min_new_tokens = max_new_tokens, so exactly B*T tokens), fp32, after a warm-up; median of 3.
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.grpo.config import DEFAULT_MODEL_DIR, TaskConfig
from training.grpo.data import load_problems, problem_rows

dev = torch.device("cuda" if cuda else "cpu")
if not cuda:
    torch.set_num_threads(1)
tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).to(dev).eval()
b_max, t_new = int(os.environ["GC_TPUT_BATCH"]), int(os.environ["GC_TPUT_TOKENS"])
rows = problem_rows(load_problems(TaskConfig(n_train=b_max), "train", b_max))
enc = [
    tok.encode(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    for r in rows
]
pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    e = [enc[i % len(enc)] for i in range(n)]
    w = max(map(len, e))
    ids = torch.tensor([[pad] * (w - len(x)) + x for x in e], device=dev)
    mask = torch.tensor([[0] * (w - len(x)) + [1] * len(x) for x in e], device=dev)
    return ids, mask


def sync() -> None:
    if cuda:
        torch.cuda.synchronize()


def run(n: int, t: int) -> float:
    ids, mask = batch(n)
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=t, min_new_tokens=t, pad_token_id=pad,
        )
    sync()
    assert out.shape == (n, ids.shape[1] + t), out.shape
    return time.perf_counter() - t0


torch.manual_seed(0)
run(min(8, b_max), 8)  # warm-up (kernels, allocator)
tput = []
for n in sorted({b_max, min(64, b_max)}, reverse=True):  # 64 = the rollouts of one GRPO step in gpu_check.yaml
    secs = [run(n, t_new) for _ in range(3)]
    med = statistics.median(secs)
    tput.append({"batch": n, "new_tokens": t_new, "median_s": round(med, 4), "runs_s": [round(s, 4) for s in secs],
                 "tokens_per_s": round(n * t_new / med, 1), "ms_per_decode_step": round(1000 * med / t_new, 3)})
    print(f"generate throughput: batch {n} x {t_new} sampled tokens: {n * t_new / med:,.0f} tokens/s "
          f"(median {med:.3f} s of 3, {1000 * med / t_new:.2f} ms per decode step)")
env["generate_throughput"] = tput
if cuda:
    env["generate_max_memory_allocated_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
(work / "env.json").write_text(json.dumps(env, indent=1))
PY
  echo "== step rc $?"

  local cfg left
  cfg="$(cat "$GC_WORK/config_path" 2>/dev/null || echo "$GC_CONFIG")"
  left=$((FINISH_BY - SECONDS)); ((left < TRAIN_TIMEOUT)) && TRAIN_TIMEOUT=$left; ((TRAIN_TIMEOUT < 60)) && TRAIN_TIMEOUT=60
  echo "== GRPO: training.grpo.cli.grpo --config $cfg --output-dir $GC_RUN --quiet (timeout ${TRAIN_TIMEOUT}s)"
  # The CLI function itself (training.grpo.cli.grpo, what `python -m training.grpo` runs), called without typer's
  # argv parsing: recent typer parses options through pydantic, which that image does not have.
  local t_train=$SECONDS
  timeout -k 10 "$TRAIN_TIMEOUT" "$PY" - "$cfg" "$GC_RUN" <<'PY'
import sys
import time
from pathlib import Path

from training.grpo.cli import grpo

t0 = time.perf_counter()
try:
    grpo(config=Path(sys.argv[1]), max_steps=None, output_dir=Path(sys.argv[2]), resume=None, quiet=True,
         force=False, allow_dirty=True)  # the carried tree has no .git
finally:
    print(f"training command wall: {time.perf_counter() - t0:.1f} s")
PY
  echo "== step rc $? (124 = timeout)"
  echo $((SECONDS - t_train)) > "$GC_WORK/train_cmd_s"

  echo "== collect"
  timeout 60 "$PY" - <<'PY'
import json
import os
from pathlib import Path

work, run = Path(os.environ["GC_WORK"]), Path(os.environ["GC_RUN"])
out = json.loads((work / "env.json").read_text()) if (work / "env.json").is_file() else {}
rows = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines() if x.strip()] \
    if (run / "ledger.jsonl").is_file() else []
summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else None
steps = [r for r in rows if r.get("kind", "step") == "step"]
g = {"steps_in_ledger": len(steps), "finished": summary is not None}
if steps:
    tot = {k: sum(r[k] for r in steps) for k in ("rollouts", "sampled_tokens", "trained_tokens", "dropped_rollouts",
                                                 "wall_ms", "sampling_ms", "reward_ms", "update_ms", "eval_ms")}
    g.update(tot)
    gen_s = tot["sampling_ms"] / 1000
    g["rollout_tokens_per_s_generate"] = round(tot["sampled_tokens"] / gen_s, 1) if gen_s else None
    g["rollouts_per_s_generate"] = round(tot["rollouts"] / gen_s, 2) if gen_s else None
    g["mean_step_s"] = round(tot["wall_ms"] / 1000 / len(steps), 3)
    g["generation_share_of_step"] = round(tot["sampling_ms"] / tot["wall_ms"], 3) if tot["wall_ms"] else None
    g["device_kind"], g["cost_micro_usd"] = rows[-1]["device_kind"], rows[-1]["cum_cost_micro_usd"]
if summary:
    for k in ("global_step", "stop_reason", "spent_usd", "device_hours", "accuracy_before", "accuracy_after",
              "usd_per_accuracy_point", "train_wall_s", "eval_wall_s", "billed_ms_by_phase", "published_step"):
        g[k] = summary.get(k)
    cmd_s = float((work / "train_cmd_s").read_text()) if (work / "train_cmd_s").is_file() else None
    if cmd_s:  # whole-run billing: the ledger's device time against the command's wall time x devices
        g["billed_share_of_command_wall"] = round(summary["device_hours"] * 3600 / (cmd_s * summary["device_count"]), 3)
metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()] \
    if (run / "metrics.jsonl").is_file() else []
rewards = [m["reward"] for m in metrics if "loss" in m and "reward" in m]
if len(rewards) >= 6:  # reward rises: mean of the last 5 logged steps against the first 5
    g["reward_first5"], g["reward_last5"] = round(sum(rewards[:5]) / 5, 4), round(sum(rewards[-5:]) / 5, 4)
try:  # weights move under bf16 autocast with fp32 master weights: share of parameters changed by training
    import torch
    from safetensors.torch import load_file

    from training.grpo.config import DEFAULT_MODEL_DIR

    a, b = load_file(DEFAULT_MODEL_DIR / "model.safetensors"), load_file(run / "model" / "model.safetensors")
    changed = sum(int((a[k].float() != b[k].float()).sum()) for k in a if k in b)
    total = sum(a[k].numel() for k in a if k in b)
    g["weights_changed_share"] = round(changed / total, 6) if total else None
    g["weights_dtype"] = str(next(iter(b.values())).dtype)
except Exception as e:
    g["weights_changed_share"] = f"not measured: {type(e).__name__}: {e}"
out["grpo_transformers_rollouts"] = g
out["vllm_rollouts"] = {
    "measured": False,
    "reason": "vLLM is not installed on this machine and cannot be carried (its wheels are hundreds of MB; "
    "the working tree that travels is capped at 64 MiB; no network there)",
} if not out.get("vllm", {}).get("importable") else {"measured": False, "reason": "not run by this script"}
Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps(out, indent=1))
PY
  for f in summary.json ledger.jsonl metrics.jsonl plots/length.png plots/cost.png; do
    [[ -f "$GC_RUN/$f" ]] && cp "$GC_RUN/$f" "$OUT/"
  done
  [[ -d "$GC_RUN" ]] && tar -C "$GC_WORK" -czf "$OUT/run.tgz" --exclude='*.safetensors' --exclude='*.pt' \
    --exclude='*.pth' --exclude='*.bin' run
  echo "== done in ${SECONDS}s; \$OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
}

main 2>&1 | tee "$OUT/log.txt"
