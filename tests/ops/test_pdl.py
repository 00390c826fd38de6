"""The programmatic-dependent-launch contract of ``ops/triton/pdl.py``, checked on the kernels' sources.

A kernel launched with PDL may start while its predecessor still runs; it is correct only because its first
statement waits for the predecessor (``grid_wait(PDL)``). So: every launched kernel takes ``PDL`` and waits
first, and every launch passes ``**pdl_args(device)`` (which sets ``PDL`` and Triton's ``launch_pdl``
together). What the wait does on the device is shown by ``tests/gpu/test_pdl.py``; that the PTX waits before
any global access, by ``tests/gpu/compile_sm90.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import deepinfer_vllm.ops.triton as triton_ops
from deepinfer_vllm.ops.triton import pdl

SOURCES = sorted(p for p in Path(triton_ops.__file__).parent.glob("*.py") if p.name != "pdl.py")


def _jit_functions(tree: ast.Module) -> dict[str, tuple[ast.FunctionDef, bool]]:
    """Every ``@triton.jit`` / ``@gluon.jit`` function: name -> (node, is_gluon)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                text = ast.unparse(d)
                if text.startswith(("triton.jit", "gluon.jit")):
                    out[node.name] = (node, text.startswith("gluon"))
    return out


def _launches(tree: ast.Module):
    """``kernel[grid](...)`` calls: (kernel expression name, call node)."""
    for node in ast.walk(tree):
        func = node.func if isinstance(node, ast.Call) else None
        if isinstance(func, ast.Subscript) and isinstance(func.value, ast.Name):
            yield func.value.id, node


def _kernels_of(name: str, tree: ast.Module) -> list[str]:
    """The functions a launched name may be: itself, or every value assigned to it (``kernel = a``,
    ``kernel, x = a, y``, ``kernel = a if c else b``)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = [(target, node.value)]
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(target.elts, node.value.elts))
            for t, v in pairs:
                if isinstance(t, ast.Name) and t.id == name:
                    values = (v.body, v.orelse) if isinstance(v, ast.IfExp) else (v,)
                    found += [ast.unparse(x) for x in values]
    return found or [name]


def contract_problems(source: str) -> list[str]:
    tree = ast.parse(source)
    jit = _jit_functions(tree)
    problems = []
    launched = set()
    for name, call in _launches(tree):
        kernels = [k for k in _kernels_of(name, tree) if k in jit]
        if not kernels:
            continue
        launched.update(kernels)
        kernel = " / ".join(kernels)
        spread = [ast.unparse(k.value) for k in call.keywords if k.arg is None]
        if not any(s.startswith("pdl_args(") for s in spread):
            problems.append(f"line {call.lineno}: launch of {kernel} without **pdl_args(device)")
    for kernel in sorted(launched):
        node, gluon = jit[kernel]
        names = [a.arg for a in node.args.args]
        if "PDL" not in names:
            problems.append(f"{kernel} takes no PDL")
        first = node.body[0]
        docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
        body = node.body[1:] if docstring else node.body
        want = "gluon_grid_wait(PDL)" if gluon else "grid_wait(PDL)"
        if ast.unparse(body[0]) != want:
            problems.append(f"{kernel}: first statement is {ast.unparse(body[0])!r}, not {want}")
    return problems


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_every_launched_kernel_waits_first(path):
    assert contract_problems(path.read_text()) == []


def test_every_kernel_is_covered():
    """The check sees the kernels: every ``@jit`` function named ``*_kernel`` in the package is launched in
    its module (so it was checked above), and the main modules launch some (a change of the launch syntax
    cannot make the check vacuous)."""
    counts = {}
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        jit = _jit_functions(tree)
        launched = {k for n, _ in _launches(tree) for k in _kernels_of(n, tree) if k in jit}
        assert {k for k in jit if k.endswith("_kernel")} == launched, path.name
        counts[path.name] = len(launched)
    assert sum(counts.values()) >= 30, counts
    main = ("fp8_gemm", "fp8_gemm_gluon", "fp8_gemm_wide_gluon", "moe_gemm", "moe_gemm_gluon", "routing", "mhc", "indexer", "topk",
            "sparse_mla_decode_gluon", "splitk", "stored_gemm")
    for name in (f"{m}.py" for m in main):
        assert counts[name] >= 1, name


def test_contract_check_fails_on_a_missing_wait_or_launch_argument():
    src = (Path(triton_ops.__file__).parent / "splitk.py").read_text()
    assert contract_problems(src) == []
    no_wait = src.replace("    grid_wait(PDL)\n", "", 1)
    assert any("first statement" in p for p in contract_problems(no_wait))
    late_wait = src.replace("    grid_wait(PDL)\n    i = tl.program_id(0)", "    i = tl.program_id(0)", 1)
    late_wait = late_wait.replace("    total = M * N\n", "    grid_wait(PDL)\n    total = M * N\n", 1)
    assert late_wait != src and any("first statement" in p for p in contract_problems(late_wait))
    no_args = src.replace("**pdl_args(part.device),", "", 1)
    assert any("without **pdl_args" in p for p in contract_problems(no_args))


def test_pdl_args_off_the_gpu():
    """CPU tensors (and the interpreter) launch without PDL; Triton's ``launch_pdl`` is never passed alone."""
    assert pdl.pdl_args(torch.device("cpu")) == {"PDL": False}
    assert pdl.pdl_args(torch.empty(1).device) == {"PDL": False}
