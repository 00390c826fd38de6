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
    config.addinivalue_line("markers", "xdist_group(name): tests xdist's --dist loadgroup runs in one worker")
    # Each process (xdist worker) gets its share of the host's cores for torch's intra-op
    # threads (the host-side reference, the harness's host work). With 16 threads in each of
    # 12 workers on 16 cores, a reference forward that takes 0.1-0.3 s alone took 25-50 s
    # (H200 host, 2026-12), and the suite did not finish in 9.5 minutes.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


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


# Where a test's time goes (GPU_MODEL_TIMING=FILE): seconds/calls of the reference's load, greedy
# and forward (greedy's forwards counted in both) and of the harness's build and steps (synchronised),
# one line per test appended to FILE (xdist workers too).
if os.environ.get("GPU_MODEL_TIMING"):
    import functools
    import time

    _acc: dict[str, list[float]] = {}

    def _wrap(cls, name: str, label: str, static: bool = False) -> None:
        orig = getattr(cls, name)

        @functools.wraps(orig)
        def inner(*a, **k):
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                if torch.cuda.is_initialized():
                    torch.cuda.synchronize()
                e = _acc.setdefault(label, [0.0, 0])
                e[0] += time.perf_counter() - t
                e[1] += 1

        setattr(cls, name, staticmethod(inner) if static else inner)

    def pytest_sessionstart(session):
        from v41_harness import PagedHarness

        from deepinfer_vllm.reference.model import ReferenceV41

        _wrap(ReferenceV41, "from_pretrained", "ref.load", static=True)
        _wrap(ReferenceV41, "greedy_generate", "ref.greedy")
        _wrap(ReferenceV41, "forward", "ref.forward")
        _wrap(PagedHarness, "__init__", "harness.init")
        _wrap(PagedHarness, "step", "harness.step")

    @pytest.fixture(autouse=True)
    def _part_timing(request):
        _acc.clear()
        t = time.perf_counter()
        yield
        total = time.perf_counter() - t
        parts = " ".join(f"{k}={v[0]:.1f}s/{v[1]}" for k, v in sorted(_acc.items()))
        with open(os.environ["GPU_MODEL_TIMING"], "a") as f:
            f.write(f"{request.node.nodeid} total={total:.1f}s threads={torch.get_num_threads()} {parts}\n")
