"""Programmatic dependent launch on the device (``ops/triton/pdl.py``).

A producer kernel lets its dependents launch at once, then spins for about half a millisecond and only then
writes its output. A control kernel launched with PDL but without the wait starts under the spin and reads the
old values: that shows PDL really overlaps the launches here (otherwise the test could not fail). The
package's own kernels, launched through ``pdl_args``, must read the new values, also two launches deep and
replayed from a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from conftest import INTERPRET

from deepinfer_vllm.ops.triton.pdl import pdl_args
from deepinfer_vllm.ops.triton.routing import add_shared
from deepinfer_vllm.ops.triton.splitk import splitk_reduce

pytestmark = pytest.mark.skipif(
    INTERPRET or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="programmatic dependent launch needs an sm90+ GPU (not the interpreter)",
)

SPIN_NS = 500_000


@triton.jit
def _now():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _late_producer(x_ptr, n, value, SPIN: tl.constexpr, BLOCK: tl.constexpr):
    """Lets dependents launch, spins ``SPIN`` ns, then writes ``value`` to ``x[:n]``."""
    tl.extra.cuda.gdc_launch_dependents()
    start = _now()
    t = start
    while t - start < SPIN:
        t = _now()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.full([BLOCK], value, tl.float32), mask=offs < n)


@triton.jit
def _copy_without_wait(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def _produce(x: torch.Tensor, value: float):
    _late_producer[(triton.cdiv(x.numel(), 1024),)](x, x.numel(), value, SPIN=SPIN_NS, BLOCK=1024)


def _steps(part, out, shared, final, value):
    _produce(part, value)
    splitk_reduce(part, out)  # reads part: must wait for the producer
    final.copy_(add_shared(out, shared))  # reads out: two launches deep


def _control(x, y, value):
    _produce(x, value)
    _copy_without_wait[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024, launch_pdl=True)


def test_pdl_args_turn_it_on_here():
    assert pdl_args(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}


@pytest.mark.parametrize("graphed", [False, True])
def test_kernels_wait_for_a_late_predecessor(graphed):
    dev = torch.device("cuda")
    part = torch.zeros(2, 64, 512, device=dev)  # split-K partials: 2 x 64 x 512 fp32
    out = torch.zeros(64, 512, device=dev)
    shared = torch.full((64, 512), 0.5, device=dev, dtype=torch.bfloat16)
    final = torch.zeros(64, 512, device=dev, dtype=torch.bfloat16)
    x = torch.zeros(4096, device=dev)
    y = torch.full((4096,), -1.0, device=dev)

    def run(value):
        _steps(part, out, shared, final, value)
        _control(x, y, value)

    run(1.0)  # compile every kernel first: a compile between two launches would hide the overlap
    torch.cuda.synchronize()
    part.zero_(), x.zero_(), y.fill_(-1.0)
    value = 3.0
    if graphed:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run(value)
        part.zero_(), x.zero_(), y.fill_(-1.0)
        torch.cuda.synchronize()
        g.replay()
    else:
        run(value)
    torch.cuda.synchronize()
    # The control started under the producer's spin: PDL overlapped the launches.
    assert (y == 0).all(), "the control kernel saw the producer's writes: PDL did not overlap the launches"
    assert (x == value).all()
    # Ours waited: the sum of the two partials, then plus the shared 0.5.
    assert torch.equal(out, torch.full_like(out, 2 * value))
    assert torch.equal(final, torch.full_like(final, 2 * value + 0.5))
