# make demo: install into .venv, make the synthetic dataset, train VGG16 on it (its time: docs/performance.md)
# make test: the same install (one environment: training, pytest, pytest-xdist, onnx) and run the test suite in two workers
# make test-gpu: on a machine with NVIDIA GPUs, the checks the CPU suite cannot make (checks/gpu_selftest.py;
#   GPU_FLAGS=--quick for the most important ones; make -o .venv/.installed test-gpu PY=python3 without .venv)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SYNTHETIC := data/synthetic
DEMO_FLAGS := --data-dir $(SYNTHETIC) --arch vgg16 --weights none --image-size 32 \
              --batch-size 25 --lr 0.01 --epochs 3 --overwrite

.PHONY: install demo test test-gpu
install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-test.txt requirements-onnx.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -r requirements-test.txt
	touch $@

$(SYNTHETIC)/train: | $(VENV)/.installed
	$(PY) -m src.tools.synthetic $(SYNTHETIC)

demo: $(VENV)/.installed $(SYNTHETIC)/train
	$(PY) train_single.py $(DEMO_FLAGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 tests

GPU_FLAGS ?=
test-gpu: $(VENV)/.installed
	$(PY) checks/gpu_selftest.py $(GPU_FLAGS)
