"""Kernel tests on the CPU under Triton's interpreter, whatever the test run imported first.

The interpreter must be on before Triton is first imported (vLLM and the Gluon modules import it
at collection), so a test module imports ``INTERPRETED`` and ``rerun_interpreted`` from here: in
a normal run its kernel tests skip (their fixtures call ``interpreted_module``) and one test reruns the
whole file in a subprocess with ``TRITON_INTERPRET=1`` set from the start, asserting that it passed.
Under the interpreter, ``scan_builtins_once`` (called on import here) takes most of the interpreter's
per-call overhead away without changing what any kernel computes.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path


def _interpreted() -> bool:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    if "triton.language" not in sys.modules:
        return True  # imported later, under the interpreter
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.zeros, InterpretedFunction)


def scan_builtins_once() -> None:
    """Make Triton's interpreter find the ``triton.language`` builtins of a module or class once.

    On every kernel launch and every call of a ``@triton.jit`` helper, the interpreter lists all members
    of ``triton.language``, ``tl.math``, ``tl.tensor``, ... (``inspect.getmembers``: ``dir``, a sort,
    a ``getattr`` each) to wrap the builtins among them: ~40% of ``test_kernel_path_interpreted``'s
    time. Here the names that hold builtins are listed on the first scan of each module or class, and
    every later scan looks at those names only, wrapping each one whose current value is a builtin:
    the same members wrapped in the same order (names never gain builtins; a wrapped member is no
    builtin, so a scan inside a launch wraps nothing, as before). A Triton without the function leaves
    the interpreter as it is."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_builtin", None)
    if original is None or getattr(original, "scans_once", False) or not hasattr(interpreter, "_patch_attr"):
        return
    names: dict[object, list[str]] = {}

    def _patch_builtin(pkg, builder, scope):
        found = names.get(pkg)
        if found is None:
            found = names[pkg] = [n for n, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
        for name in found:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    _patch_builtin.scans_once = True
    interpreter._patch_builtin = _patch_builtin


INTERPRETED = _interpreted()
if INTERPRETED:
    scan_builtins_once()


def rerun_interpreted(path: str) -> None:
    """Run the test file ``path`` in a subprocess under the interpreter; fail with its output unless
    it passed (its own rerun test skips itself there)."""
    # a fresh pytest: not an xdist worker of this run (tests/conftest.py asks workers for their options)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["TRITON_INTERPRET"] = "1"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", path],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    assert " passed" in run.stdout and " skipped" in run.stdout


def interpreted_module(name: str):
    """The kernel module ``name``, built under the interpreter when imported here; skips in the parent
    process, where the file's rerun test runs it."""
    import pytest

    if not INTERPRETED:
        pytest.skip("run under the interpreter by test_kernels_interpreted")
    return importlib.import_module(name)
