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

.PHONY: venv test reproduce analysis report wheelhouse tvm-artifacts clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-cache-dir $(TORCH_PINS)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

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
