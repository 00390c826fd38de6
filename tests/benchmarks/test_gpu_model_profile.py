"""``benchmarks/gpu_model.py``'s ``--profile`` kernel table on hand-written launch intervals (runs on the CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_model", ROOT / "benchmarks" / "gpu_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(lines):
    """{name: (own, span, calls)} of the table's kernel rows."""
    out = {}
    for line in lines[1:]:
        name, own, span, _, calls, _ = line.split()
        out[name] = (float(own), float(span), float(calls))
    return out


def test_waits_behind_a_predecessor_count_to_the_predecessor():
    # two steps of: a GEMM, then (launched under its last wave, PDL) a SwiGLU that waits 80 us of its 90 us span,
    # a gap, then a short kernel; in the second step the short kernel is listed first (the table sorts by start)
    step = [("gemm", 0.0, 100.0), ("swiglu", 20.0, 110.0), ("norm", 120.0, 125.0)]
    second = [(name, start + 1000.0, end + 1000.0) for name, start, end in reversed(step)]
    lines = _module().kernel_table(step + second, steps=2)
    assert lines[0].startswith("device kernels per step: 3, busy 115.0 us/step (spans 195.0)")
    rows = _rows(lines)
    assert rows == {"gemm": (100.0, 100.0, 1.0), "swiglu": (10.0, 90.0, 1.0), "norm": (5.0, 5.0, 1.0)}
    assert list(rows) == ["gemm", "swiglu", "norm"]  # by own time


def test_a_launch_inside_another_owns_nothing_and_names_are_cut():
    long = "k" * 90
    lines = _module().kernel_table([(long, 0.0, 50.0), ("inner", 10.0, 20.0), ("tail", 40.0, 70.0)], steps=1)
    rows = _rows(lines)
    assert rows["k" * 70] == (50.0, 50.0, 1.0)
    assert rows["inner"] == (0.0, 10.0, 1.0)  # wholly covered by the earlier launch
    assert rows["tail"] == (20.0, 30.0, 1.0)
    assert "busy 70.0 us/step (spans 90.0)" in lines[0]
