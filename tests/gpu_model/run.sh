#!/usr/bin/env bash
# On the GPU host, from the repository root, with build/gpu_carry carried (tests/gpu_model/carry.py):
# unpack vLLM's sources and the missing wheels under /tmp, then run the model-class tests
# (pytest arguments may name test files; default: all of tests/gpu_model, with
# `-n 5 --dist loadgroup` unless the arguments set -n or --dist), or with
# `--python SCRIPT ARGS...` a script in the same environment (e.g. sync_inventory.py).
set -euo pipefail
if [ ! -d /tmp/gpu_model_vllm/vllm ]; then
  rm -rf /tmp/gpu_model_deps /tmp/gpu_model_vllm && mkdir -p /tmp/gpu_model_deps /tmp/gpu_model_vllm
  python -m pip install --quiet --no-deps --no-index --target /tmp/gpu_model_deps build/gpu_carry/wheels/*.whl
  tar -xJf build/gpu_carry/vllm_src.tar.xz -C /tmp/gpu_model_vllm
fi
export PYTHONPATH="/tmp/gpu_model_vllm:$PWD:/tmp/gpu_model_deps"
if [ "${1:-}" = "--python" ]; then
  shift
  exec python "$@"
fi
targets=()
workers=()
for a in "$@"; do
  [[ "$a" == tests/* ]] && targets+=("$a")
  [[ "$a" == -n* || "$a" == --numprocesses* || "$a" == --dist* || "$a" == no:xdist ]] && workers+=("$a")
done
[ ${#targets[@]} -eq 0 ] && set -- tests/gpu_model "$@"
# Default: 5 xdist workers, one per test group (the tests' xdist_group marks: a group shares its
# reference outputs and compiled Triton kernels), each with a fifth of the cores (conftest.py).
if [ ${#workers[@]} -eq 0 ] && python -c "import xdist" 2>/dev/null; then
  set -- -n 5 --dist loadgroup "$@"
fi
python -m pytest -p no:cacheprovider "$@"
