"""Programmatic dependent launch (PDL) for every kernel of the step, Triton and Gluon alike.

A decode step on the H200 is a chain of short kernels (one layer: about 60 launches of 2-30 us); between two
of them the device drains the first kernel's last wave, then starts the next one's programs, a gap of a few
microseconds each time, graphed or not. With PDL (sm90 and later) a kernel may be launched while its
predecessor still runs: its programs start as SMs free up and wait, at their first statement, for the
predecessor to have finished and its writes to be visible (``griddepcontrol.wait``), so the gap is hidden
behind the predecessor's tail. Each kernel then signals at once that its own dependent may be launched
(``griddepcontrol.launch_dependents``; the dependent is launched only after every program of this kernel has
started or finished, so it only takes SM room this kernel no longer needs).

Why this is always safe: the wait is the first statement of every kernel, before any load or store, and it
waits for the predecessor's completion (not for its signal), so every kernel still sees all writes of all
earlier kernels (the predecessor completed only after its own wait returned, and so on). Kernels of other
libraries (cuBLAS, torch) are launched without the attribute and wait as before.

Contract, checked by ``tests/ops/test_pdl.py`` on the sources: every Triton kernel takes a constexpr ``PDL``
and calls ``grid_wait(PDL)`` first (Gluon kernels ``gluon_grid_wait(PDL)``), and every launch
passes ``**pdl_args(device)``, which gives ``PDL=True`` and Triton's ``launch_pdl=True`` together on an sm90+
CUDA device and ``PDL=False`` elsewhere (CPU, the interpreter, an older Triton without grid dependency
control). ``tests/gpu/test_pdl.py`` shows on the device that a kernel launched this way sees its predecessor's
late writes (and that one without the wait does not). ``ENABLED = False`` turns it off for a same-run baseline
(``benchmarks/gpu_model.py --pdl-baseline``); it is not a setting.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["ENABLED", "grid_wait", "gluon_grid_wait", "pdl_args"]

ENABLED = True

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _GDC = True
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    _GDC = False


@triton.jit
def grid_wait(PDL: tl.constexpr):
    """First statement of every Triton kernel: wait for the predecessor grid, then let dependents launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def _gluon_grid_wait_impl():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def gluon_grid_wait(PDL: gl.constexpr):
        """``grid_wait`` for Gluon kernels (the same two PTX instructions)."""
        if PDL:
            gl.inline_asm_elementwise(
                "griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
            )
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    return gluon_grid_wait


try:
    gluon_grid_wait = _gluon_grid_wait_impl()
except ImportError:  # pragma: no cover - Triton without Gluon: no Gluon kernel is defined either
    gluon_grid_wait = None


@functools.lru_cache(maxsize=None)
def _device_supports(device_type: str, index: int | None) -> bool:
    if device_type != "cuda" or not _GDC or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_args(device: torch.device) -> dict:
    """Launch keyword arguments for a kernel taking ``PDL`` (see the module docstring)."""
    if ENABLED and _device_supports(device.type, device.index):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
