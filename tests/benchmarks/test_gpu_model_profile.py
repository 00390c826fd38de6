"""``benchmarks/gpu_model.py``'s ``--profile`` kernel table on hand-written launch intervals (runs on the CPU)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(mp: pytest.MonkeyPatch):
    """The benchmark script as a module. Importing it sets ``VLLM_TARGET_DEVICE=cpu`` (for its config classes) and
    extends ``sys.path``; ``mp`` undoes both, or every engine this worker starts later would miss the plugin's CPU
    platform (vLLM's CPU platform would serve it)."""
    mp.setenv("VLLM_TARGET_DEVICE", "cpu")
    mp.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("gpu_model", ROOT / "benchmarks" / "gpu_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def gpu_model(monkeypatch):
    return _load(monkeypatch)


def _rows(lines):
    """{name: (own, span, calls)} of the table's kernel rows."""
    out = {}
    for line in lines[1:]:
        name, own, span, _, calls, _ = line.split()
        out[name] = (float(own), float(span), float(calls))
    return out


def test_waits_behind_a_predecessor_count_to_the_predecessor(gpu_model):
    # two steps of: a GEMM, then (launched under its last wave, PDL) a SwiGLU that waits 80 us of its 90 us span,
    # a gap, then a short kernel; in the second step the short kernel is listed first (the table sorts by start)
    step = [("gemm", 0.0, 100.0), ("swiglu", 20.0, 110.0), ("norm", 120.0, 125.0)]
    second = [(name, start + 1000.0, end + 1000.0) for name, start, end in reversed(step)]
    lines = gpu_model.kernel_table(step + second, steps=2)
    assert lines[0].startswith("device kernels per step: 3, busy 115.0 us/step (spans 195.0)")
    rows = _rows(lines)
    assert rows == {"gemm": (100.0, 100.0, 1.0), "swiglu": (10.0, 90.0, 1.0), "norm": (5.0, 5.0, 1.0)}
    assert list(rows) == ["gemm", "swiglu", "norm"]  # by own time


def test_a_launch_inside_another_owns_nothing_and_names_are_cut(gpu_model):
    long = "k" * 90
    lines = gpu_model.kernel_table([(long, 0.0, 50.0), ("inner", 10.0, 20.0), ("tail", 40.0, 70.0)], steps=1)
    rows = _rows(lines)
    assert rows["k" * 70] == (50.0, 50.0, 1.0)
    assert rows["inner"] == (0.0, 10.0, 1.0)  # wholly covered by the earlier launch
    assert rows["tail"] == (20.0, 30.0, 1.0)
    assert "busy 70.0 us/step (spans 90.0)" in lines[0]


def test_loading_the_script_leaves_no_setting_behind():
    before = os.environ.get("VLLM_TARGET_DEVICE"), list(sys.path)
    with pytest.MonkeyPatch.context() as mp:
        assert _load(mp).kernel_table([], steps=1)[0].startswith("device kernels per step: 0")
        assert os.environ["VLLM_TARGET_DEVICE"] == "cpu"
    assert (os.environ.get("VLLM_TARGET_DEVICE"), sys.path) == before
