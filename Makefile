# make demo: install training alone into .venv (requirements.txt: torch, torchvision, accelerate, pandas, pillow,
#   tqdm, matplotlib, jinja2 for the report, tensorboard), make the synthetic dataset, train VGG16 on it (its time:
#   docs/measurements.md), write its report (model/report.html; its last line says how to open it)
# make test: everything into .venv (requirements-test.txt: training, the trackers of requirements-track.txt, the
#   ONNX export of requirements-onnx.txt, ruff and mypy, pytest, pytest-xdist, playwright) and run the test suite in
#   two workers; tests/test_report.py also needs Debian's chromium: installed here as root (checks/browser.py),
#   elsewhere one line says what to install and the browser tests are skipped
# make test-fast: the tests not marked slow (a minute on 2 cores: every module, no training run, no launcher)
# make lint: ruff and mypy (requirements-lint.txt) with pyproject.toml's rules, in the same install as make test
#   (mypy reads torch's own annotations, so the code that only a GPU runs is checked against them too)
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

$(VENV)/.installed: requirements.txt requirements-track.txt requirements-onnx.txt requirements-lint.txt requirements-ray.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -r requirements-test.txt
	touch $@ $(VENV)/.train-installed

# Training alone: what make demo needs (a later make test adds the rest to the same .venv).
$(VENV)/.train-installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -r requirements.txt
	touch $@

$(SYNTHETIC)/train: | $(VENV)/.train-installed
	$(PY) -m src.tools.synthetic $(SYNTHETIC)

demo: $(VENV)/.train-installed $(SYNTHETIC)/train
	$(PY) train_single.py $(DEMO_FLAGS)
	$(PY) -m src.tools.report model

test: $(VENV)/.installed
	$(PY) checks/browser.py
	$(PY) -m pytest -q -rs -n 2 tests

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 -m "not slow" tests

$(VENV)/.lint-installed: requirements-lint.txt | $(VENV)/.installed
	$(VENV)/bin/pip install -r requirements-lint.txt
	touch $@

lint: $(VENV)/.lint-installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

GPU_FLAGS ?=
test-gpu: $(VENV)/.installed
	$(PY) checks/gpu_selftest.py --deadline 420 $(GPU_FLAGS)
