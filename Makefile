# Two entry points for a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
QUICKSTART := examples/quickstart

.PHONY: demo test venv mlflow-venv engine image model tools unit cluster lint clean bench

demo: venv model  ## a real LoRA fine-tune of a tiny local model, 2 ranks on localhost
	@rm -rf $(QUICKSTART)/.shared/output/quickstart-lora  # a fresh fine-tune, not a resume of the last one
	$(VENV)/bin/ftbundle run $(QUICKSTART)/job.yaml  # ends with a summary: final loss, adapter path, run dir

# make test runs the test modules on TEST_WORKERS pytest-xdist workers (one module per worker
# at a time, longest first: tests/conftest.py); TEST_WORKERS=0 runs them one after another.
TEST_WORKERS ?= 3

test: tools venv mlflow-venv engine image  ## everything CI runs
	$(PY) -m pytest -v -p no:cacheprovider --timeout 1500 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 tests

unit: venv  ## the fast tests: no Docker, no training, no lint (tests/unit; tests/gpu too, skipped without a GPU)
	$(PY) -m pytest -q -p no:cacheprovider -n 2 -m "not cluster and not train and not lint" tests

venv:
	@bash .ci/venv.sh

mlflow-venv:  ## .venv-mlflow: the full mlflow package, for the MLflow tracking server a test runs against
	@bash .ci/mlflow-venv.sh

engine:  ## a Docker engine (installed and started when missing)
	@bash .ci/docker-engine.sh

tools:  ## command-line tools the tests drive (tmux, curl, ssh), installed when missing
	@bash .ci/tools.sh

image: engine venv  ## the images the tests use (test hosts, with systemd too, Slurm hosts, CPU training), built locally, cached by recipe
	@bash .ci/testhost-image.sh >/dev/null
	@bash .ci/testhost-systemd-image.sh >/dev/null
	@bash .ci/slurmhost-image.sh >/dev/null
	@bash .ci/train-image.sh >/dev/null
	@bash .ci/train-lf-image.sh >/dev/null

model: venv
	HF_HUB_OFFLINE=1 $(PY) -m ftbundle.tinymodel --data $(QUICKSTART)/data/support.json --out $(QUICKSTART)/.shared/tiny-llama

bench: venv engine image model  ## the benchmarks under bench/; writes docs/PERFORMANCE.md (about 60 min)
	@. .ci/apt.sh && ftb_need pdsh:pdsh rsync:rsync tc:iproute2
	cd bench && $(CURDIR)/$(PY) launch.py && $(CURDIR)/$(PY) launch.py --simulate 1024 && $(CURDIR)/$(PY) check.py && $(CURDIR)/$(PY) health.py && $(CURDIR)/$(PY) chatty.py && $(CURDIR)/$(PY) teardown.py && $(CURDIR)/$(PY) teardown.py --scale 128 && $(CURDIR)/$(PY) stall.py && $(CURDIR)/$(PY) node_loss.py && $(CURDIR)/$(PY) overhead.py --unbuffered && $(CURDIR)/$(PY) provision.py && $(CURDIR)/$(PY) stage.py && $(CURDIR)/$(PY) gpu_metrics.py
	cd bench && $(CURDIR)/$(PY) report.py

clean:
	rm -rf $(QUICKSTART)/.shared
