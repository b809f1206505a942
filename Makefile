# Two commands on a fresh machine (each makes .venv and installs what it needs first):
#   make demo   SFT of the tiny model on CPU (configs/sft/tiny_cpu.yaml), about 2 minutes on 2 cores
#   make test   the test suite (CPU; `gpu`-marked tests run only where CUDA is present)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test install clean

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
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

demo: install
	HF_HUB_OFFLINE=1 $(PY) -m recipes.sft fit --config configs/sft/tiny_cpu.yaml

test: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest

clean:
	rm -rf $(VENV) runs
