# make demo: install into .venv, make the synthetic dataset, train VGG16 on it (its time: docs/measurements.md),
#   write its report (model/report.html; its last line says how to open it)
# make test: the same install (one environment: training, pytest, pytest-xdist, onnx, playwright) and run the test suite in
#   two workers; tests/test_report.py also needs Debian's chromium (apt-get install chromium; .ci/run installs it)
# make test-fast: the tests not marked slow (a minute on 2 cores: every module, no training run, no launcher)
# make lint: ruff (requirements-lint.txt) with pyproject.toml's rules; installs only ruff into .venv
# make test-gpu: on a machine with NVIDIA GPUs, the checks the CPU suite cannot make (checks/gpu_selftest.py,
#   ending within 7 minutes; GPU_FLAGS=--quick for the most important ones; make -o .venv/.installed test-gpu
#   PY=python3 without .venv); `python checks/gpu_selftest.py --device cpu` runs every check tiny on a CPU
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SYNTHETIC := data/synthetic
DEMO_FLAGS := --data-dir $(SYNTHETIC) --arch vgg16 --weights none --image-size 32 \
              --batch-size 25 --lr 0.01 --epochs 3 --overwrite

.PHONY: install demo test test-fast lint test-gpu
install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-test.txt requirements-onnx.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -r requirements-test.txt
	touch $@

$(SYNTHETIC)/train: | $(VENV)/.installed
	$(PY) -m src.tools.synthetic $(SYNTHETIC)

demo: $(VENV)/.installed $(SYNTHETIC)/train
	$(PY) train_single.py $(DEMO_FLAGS)
	$(PY) -m src.tools.report model

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 tests

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 -m "not slow" tests

$(VENV)/.lint-installed: requirements-lint.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -r requirements-lint.txt
	touch $@

lint: $(VENV)/.lint-installed
	$(VENV)/bin/ruff check .

GPU_FLAGS ?=
test-gpu: $(VENV)/.installed
	$(PY) checks/gpu_selftest.py --deadline 420 $(GPU_FLAGS)
