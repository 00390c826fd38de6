#!/usr/bin/env bash
# On the GPU host, from the repository root, with build/gpu_carry carried (tests/gpu_model/carry.py):
# unpack vLLM's sources and the missing wheels under /tmp, then run the model-class tests.
set -euo pipefail
rm -rf /tmp/gpu_model_deps /tmp/gpu_model_vllm && mkdir -p /tmp/gpu_model_deps /tmp/gpu_model_vllm
python -m pip install --quiet --no-deps --no-index --target /tmp/gpu_model_deps build/gpu_carry/wheels/*.whl
tar -xJf build/gpu_carry/vllm_src.tar.xz -C /tmp/gpu_model_vllm
export PYTHONPATH="/tmp/gpu_model_vllm:$PWD:/tmp/gpu_model_deps"
python -m pytest tests/gpu_model -q -p no:cacheprovider "$@"
