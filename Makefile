# The two commands the README documents: `make test` and `make reproduce`.
# Both build .venv at the repository root from nothing but this repo.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
ARCH   := $(shell uname -m)
# torch/torchvision pins that import together (torchvision from PyPI does not
# import beside torch 2.13); the GPU host brings its own torch 2.11.
ifeq ($(ARCH),x86_64)
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
else
TORCH_PINS := torch==2.9.1 torchvision==0.24.1
endif

.PHONY: venv lock test reproduce analysis report wheelhouse tvm-artifacts clean

venv: $(VENV)/.installed

# An x86_64 host without a GPU (CI) installs .ci/requirements-cpu.txt with --no-deps: the same
# pins, less triton (0.9 GB of GPU-kernel compiler), so .venv is ~5.5 GB instead of ~6.4 GB.
# A check then fails the build if the lock misses anything else (run `make lock`).
# CPU_LOCK=0 forces the full install; CPU_LOCK=1 forces the lock.
ifeq ($(ARCH),x86_64)
CPU_LOCK ?= $(if $(shell command -v nvidia-smi 2>/dev/null),0,1)
else
CPU_LOCK ?= 0
endif
LOCK := .ci/requirements-cpu.txt

$(VENV)/.installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(CPU_LOCK),1)
	$(PY) -m pip install -q --no-cache-dir --no-deps -r $(LOCK)
	$(PY) -m pip install -q --no-cache-dir --no-deps -e .
	$(PY) .ci/cpu_lock.py --check $(TORCH_PINS)
else
	$(PY) -m pip install -q --no-cache-dir $(TORCH_PINS)
	$(PY) -m pip install -q --no-cache-dir -e '.[test]'
endif
	touch $@

# Rewrite the CPU lock after changing pyproject.toml's dependencies or TORCH_PINS.
lock:
	$(PYTHON) .ci/cpu_lock.py $(TORCH_PINS) > $(LOCK).new && mv $(LOCK).new $(LOCK)

test: venv
	$(PY) -m pytest -q

reproduce: venv
	$(PY) -m experiments.reproduce

analysis: venv
	$(PY) -m experiments.analysis
	$(PY) -m experiments.tensile_plans
	$(PY) -m experiments.tensile_plans --stream-optimizer 16 --max-overhead 0,0.1,0.3
	$(PY) -m experiments.tensile_bounds

report: venv
	$(PY) -m experiments.report

# Pure-Python wheels for offline GPU hosts (no network there): see README.
wheelhouse: venv
	$(PY) -m experiments.wheelhouse --dest .whl

# TVM libraries for an offline GPU host, built here on a CPU host (docs/tvm-offline.md).
tvm-artifacts: venv
	$(PY) -m baselines.tvm_build --models resnet50,resnet101,inception_v3,mobilenet_v2,efficientnet_b0,efficientnet_b5,nasnet_a_mobile,nasnet_a_large,amoebanet,darts,googlenet,densenet121,pnasnet5large --batches 1,32 --target cuda-sm90 --out .artifacts/tvm --ffi-wheel 3.12 --skip-existing

clean:
	rm -rf $(VENV) .pytest_cache
