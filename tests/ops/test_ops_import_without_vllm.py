"""``deepinfer_vllm.ops`` (references and Triton kernels) must import without vLLM.

The GPU host that runs ``tests/gpu`` and ``benchmarks/gpu_kernels.py`` has no
vLLM; this test blocks the ``vllm`` package in a fresh interpreter and
imports every module under ``ops/`` (and the GPU benchmark modules).
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import deepinfer_vllm.ops as ops_pkg

ROOT = Path(__file__).resolve().parents[2]

_BLOCK_VLLM = """
import importlib.abc, sys
class _NoVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(f"blocked import of {name}")
        return None
sys.meta_path.insert(0, _NoVllm())
"""


def _modules() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(ops_pkg.__path__, prefix="deepinfer_vllm.ops.")]
    bench = sorted(p.stem for p in (ROOT / "benchmarks" / "gpu").glob("*.py") if p.stem != "__init__")
    return names + [f"benchmarks.gpu.{b}" for b in bench]


def test_every_ops_module_imports_with_vllm_blocked():
    modules = _modules()
    assert "deepinfer_vllm.ops.quant" in modules and "deepinfer_vllm.ops.triton" in modules
    code = _BLOCK_VLLM + "".join(f"import {m}\n" for m in modules) + (
        "assert not any(k == 'vllm' or k.startswith('vllm.') for k in sys.modules)\nprint('ok', len(sys.argv))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")
