"""Device-only kernel tests (never collected by CI: see ``norecursedirs``).

Run on the GPU host with ``pytest tests/gpu``. The same tests run on a CPU box
under Triton's interpreter (``TRITON_INTERPRET=1 pytest tests/gpu``) on the
small shapes only, which is how the kernels are developed without a GPU.
Nothing here imports vLLM: the GPU host does not have it.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# compile_sm90.py: every launch compiled for sm90, nothing run (CPU tensors, the device's shapes).
COMPILE_ONLY = os.environ.get("DEEPINFER_COMPILE_SM90") == "1"


def pytest_configure(config):
    if not torch.cuda.is_available() and not INTERPRET and not COMPILE_ONLY:
        raise pytest.UsageError(
            "tests/gpu needs a CUDA device, or TRITON_INTERPRET=1 to run the small shapes on CPU"
        )


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")


def shapes(small: list, large: list) -> list:
    """Parametrisation: every shape on a GPU, only ``small`` under the interpreter."""
    return list(small) if INTERPRET else list(small) + list(large)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with a value no kernel would produce (NaN / 0xFF bytes)."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(-1 if t.dtype.is_signed else 0xFF)
