"""The V4.1 model class on a GPU host that has torch and Triton but no vLLM (never collected
by CI: see ``norecursedirs``).

vLLM's Python sources and the pure-Python or cp312 wheels of the dependencies that host
lacks are carried there (``tests/gpu_model/carry.py`` builds the bundle here, ``run.sh``
unpacks it there and runs these tests). vLLM's compiled extension cannot be carried (this
project's build is vLLM's CPU wheel), so ``vllm.platforms.cuda`` does not import;
``VLLM_TARGET_DEVICE=cpu`` selects vLLM's CPU platform classes for configuration only, and
the model, its weights, caches and step tensors live on the GPU (the harness of
``tests/model_executor`` with ``device="cuda"``). This exercises the model class, vLLM's
layers and our attention kernels on the device; vLLM's engine, scheduler and CUDA platform
do not run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model_executor"))


def pytest_configure(config):
    if not torch.cuda.is_available():
        raise pytest.UsageError("tests/gpu_model needs a CUDA device (and the carried vLLM sources: run.sh)")


def _checkpoint(tmp_path_factory, preset: str) -> str:
    from deepinfer_vllm.tools.make_checkpoint import make_checkpoint

    out = tmp_path_factory.mktemp(preset)
    make_checkpoint(out, preset=preset, seed=0)
    return str(out)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    return _checkpoint(tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory) -> str:
    return _checkpoint(tmp_path_factory, "small")
