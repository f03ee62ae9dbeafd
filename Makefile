# dgemma: `make demo` (set up + train the demo config on the bundled corpus + sample + score the samples + report)
# and `make test` (set up if needed + the test suite). Needs only Python 3.11 and pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEMO_WORKDIR ?= workdirs/demo
REPORT ?= report
# pip byte-compiles every file it installs (21,000 here, most never imported: paired installs of the requirements
# on a 2-core host took 50-109 s with it, 19-54 s without); the venv is installed without that, and Python compiles
# a module when it is first imported. Make's commands let Python write those .pyc files into .venv (an empty value,
# even where the environment forbids writing them), so no process compiles the same module twice.
export PYTHONDONTWRITEBYTECODE :=

.PHONY: venv demo test test-fast data bench clean

$(VENV)/.installed: requirements.txt requirements-test.txt requirements-cuda-plugin.txt requirements-tpu-plugin.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -r requirements.txt -r requirements-test.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -c "import dgemma.api, dgemma.train.loop"  # compiles what every command imports
	$(PY) -m pip install -q --no-deps --target $(VENV)/cuda-plugin -r requirements-cuda-plugin.txt
	$(PY) -m pip install -q --no-deps --target $(VENV)/tpu-plugin -r requirements-tpu-plugin.txt
	touch $@

venv: $(VENV)/.installed

data: venv
	$(PY) -m dgemma.tools.prepare_data --config=configs/demo.py

demo: venv data
	$(PY) train.py --config=configs/demo.py --workdir=$(DEMO_WORKDIR)
	$(PY) sample.py --config=configs/demo.py --workdir=$(DEMO_WORKDIR) --text_out=$(DEMO_WORKDIR)/samples.txt \
	  --config.sample.trajectory_html=$(REPORT)/trajectory.html
	$(PY) -m eval.samples --checkpoint=$(DEMO_WORKDIR) --real_words=train --num_samples=32 \
	  --out=$(DEMO_WORKDIR)/sample_quality.json
	$(PY) -m dgemma.tools.report --workdir=$(DEMO_WORKDIR) --out=$(REPORT)

# `make test` is what CI runs from a fresh clone: an empty compilation cache, where JAX would pay a cache key (the
# module serialized and hashed) and a lookup for each of the run's ~7,500 compiles, most of them tiny, for a few dozen
# hits (docs/benchmarks.md); it compiles without the cache. `make test-fast`, the edit loop, keeps it (.jax_cache/).
test: venv  # everything, the slow tier included (what CI runs)
	JAX_ENABLE_COMPILATION_CACHE=false $(PY) -m pytest -q -n 2 --dist loadfile --durations=20 tests

test-fast: venv  # the edit loop: no subprocesses, 8-device runs, notebooks or torch parity (tests/conftest.py)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow" tests

bench: venv  # the CPU benchmarks of docs/benchmarks.md (bench/gpu_full_model.py needs a GPU)
	$(PY) bench/train_throughput.py --config=configs/demo.py
	$(PY) bench/model_forward.py
	$(PY) bench/moe.py
	$(PY) bench/sampler_vs_hf.py
	$(PY) bench/memory_check.py
	$(PY) bench/prompt_buckets.py

clean:
	rm -rf $(DEMO_WORKDIR) $(REPORT)
