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

Weights before the wait. A weight GEMM launched early has its programs resident while the predecessor still runs
(often a short kernel reading little: a norm, RoPE, the attention's decode), with the memory mostly idle. Its
weights are written by no kernel of the step, so reading them cannot race with the predecessor: the dense and
stored-weight GEMMs prefetch the first bytes of each of their weight rows into L2 (``prefetch_rows`` /
``gluon_prefetch_rows``: ``prefetch.global.L2`` line by line, no data returned to the program) before they wait;
their loads after the wait find those bytes in L2. The only statements allowed before the wait are arithmetic on
the program ids and arguments and these prefetches (checked on the sources by ``tests/ops/test_pdl.py``, on the
PTX by ``tests/gpu/compile_sm90.py``: no load, store or copy of global memory precedes ``griddepcontrol.wait``).
How much a launch prefetches (``prefetch_bytes``: at most ``PREFETCH_BYTES`` together) is chosen on the host from
shapes; without PDL it is zero. ``PREFETCH_BYTES = 0`` is the benchmark's same-run baseline
(``benchmarks/gpu_model.py --prefetch-baseline``), not a setting.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = [
    "ENABLED",
    "PREFETCH_BYTES",
    "PREFETCH_QUANTUM",
    "gluon_grid_wait",
    "gluon_prefetch_rows",
    "grid_wait",
    "pdl_args",
    "prefetch_bytes",
    "prefetch_rows",
]

ENABLED = True
# Weight bytes one GEMM launch prefetches into L2 before its grid wait, all programs together (module docstring):
# a third of the H200's 50 MB L2, about 4 us of its copy rate.
PREFETCH_BYTES = 16 << 20
# Each program's prefetch of a row is a multiple of this: up to four parts of whole 128-byte lines.
PREFETCH_QUANTUM = 512

# An L2 prefetch of the 128-byte line holding address $1 when $2 is not zero. (The bulk form,
# ``cp.async.bulk.prefetch.L2``, one instruction a row, crashes ptxas 12.8 in the wide dense kernel.)
_PREFETCH_ASM = "{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\n@p prefetch.global.L2 [$1];\nmov.b32 $0, 0;\n}"
_PREFETCH_PTX = tl.constexpr(_PREFETCH_ASM)

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


@triton.jit
def prefetch_rows(row_ptr, row_stride, nbytes, rows, on, ROWS: tl.constexpr, PARTS: tl.constexpr):
    """Before ``grid_wait``: the first ``nbytes`` of each of the first ``rows`` of ``ROWS`` rows (``row_ptr`` the
    first row's first element; rows ``row_stride`` elements apart) prefetched into L2 where ``on``, line by line,
    each row in ``PARTS`` parts of ``nbytes / PARTS``; nothing is read into the program."""
    elem_bytes: tl.constexpr = row_ptr.dtype.element_ty.primitive_bitwidth // 8
    i = tl.arange(0, ROWS * PARTS)
    part_bytes = nbytes // PARTS
    ptr = row_ptr + (i % ROWS).to(tl.int64) * row_stride + (i // ROWS) * (part_bytes // elem_bytes)
    flag = (on & (i % ROWS < rows)).to(tl.int32)
    for off in range(0, part_bytes, 128):
        tl.inline_asm_elementwise(
            _PREFETCH_PTX, "=r,l,r", [ptr + off // elem_bytes, flag], dtype=tl.int32, is_pure=False, pack=1
        )


def _gluon_grid_wait_impl():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    _PREFETCH_PTX_G = gl.constexpr(_PREFETCH_ASM)

    @gluon.jit
    def gluon_grid_wait(PDL: gl.constexpr):
        """``grid_wait`` for Gluon kernels (the same two PTX instructions)."""
        if PDL:
            gl.inline_asm_elementwise(
                "griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
            )
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def gluon_prefetch_rows(
        row_ptr, row_stride, nbytes, on, ROWS: gl.constexpr, PARTS: gl.constexpr, NUM_WARPS: gl.constexpr
    ):
        """``prefetch_rows`` for Gluon kernels, all ``ROWS`` rows: one (row, part) a thread when ``ROWS * PARTS``
        is the CTA's thread count."""
        elem_bytes: gl.constexpr = row_ptr.dtype.element_ty.primitive_bitwidth // 8
        L: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        i = gl.arange(0, ROWS * PARTS, layout=L)
        part_bytes = nbytes // PARTS
        ptr = row_ptr + (i % ROWS).to(gl.int64) * row_stride + (i // ROWS) * (part_bytes // elem_bytes)
        flag = gl.full([ROWS * PARTS], on, gl.int32, L)
        for off in range(0, part_bytes, 128):
            gl.inline_asm_elementwise(
                _PREFETCH_PTX_G, "=r,l,r", [ptr + off // elem_bytes, flag], dtype=gl.int32, is_pure=False, pack=1
            )

    return gluon_grid_wait, gluon_prefetch_rows


try:
    gluon_grid_wait, gluon_prefetch_rows = _gluon_grid_wait_impl()
except ImportError:  # pragma: no cover - Triton without Gluon: no Gluon kernel is defined either
    gluon_grid_wait = gluon_prefetch_rows = None


@functools.lru_cache(maxsize=None)
def _device_supports(device_type: str, index: int | None) -> bool:
    if device_type != "cuda" or not _GDC or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def prefetch_bytes(device: torch.device, rows: int, span: int) -> int:
    """Bytes of each of ``rows`` (weight row, K split) spans of ``span`` bytes that a launch prefetches before its
    grid wait (module docstring): together at most ``PREFETCH_BYTES``, a multiple of ``PREFETCH_QUANTUM``; 0
    without PDL."""
    if not (PREFETCH_BYTES > 0 and pdl_args(device)["PDL"]):
        return 0
    per_row = min(span, PREFETCH_BYTES // max(rows, 1))
    return per_row // PREFETCH_QUANTUM * PREFETCH_QUANTUM


def pdl_args(device: torch.device) -> dict:
    """Launch keyword arguments for a kernel taking ``PDL`` (see the module docstring)."""
    if ENABLED and _device_supports(device.type, device.index):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
