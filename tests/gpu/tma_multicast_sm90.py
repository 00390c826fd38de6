"""Whether this Triton's Gluon lowers a TMA copy shared by a CTA cluster to one multicast copy on sm90.

The dense FP8 GEMMs at 128-512 rows re-read ``x`` for every 128 weight columns (``benchmarks/README.md``, "Issue
34, sixteenth session"): multicasting each ``x`` tile to the CTAs of a cluster that share it would divide that
traffic by the cluster size. Gluon's Hopper TMA copy takes no multicast argument, but Gluon has CTA-group layouts
(``cga_layout``) and ``num_ctas``; this compiles (no device needed, ``compile_sm90``'s stub driver) one kernel that
copies a 64 x 64 tile by TMA into shared memory laid out three ways, and prints each variant's TMA instructions:
one CTA; two CTAs holding the same tile (``cga_layout=[[0, 0]]``: the multicast case); two CTAs holding one half
each (``[[1, 0]]``). Exit status 0 when the replicated tile's copy is a ``.multicast::cluster`` one, 1 when it is not.

    PYTHONPATH=/tmp/t36:$PWD python tests/gpu/tma_multicast_sm90.py

Triton 3.6 (the H200's): the replicated tile is copied by each CTA of the cluster on its own (same coordinates,
no ``.multicast::cluster``), exit status 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compile_sm90  # sets the compile-only mode before Triton is imported


def main() -> int:
    import torch
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    compile_sm90._pretend_sm90()
    compiler = compile_sm90.Compiler(ptxas_v=False)
    compiled = {}
    compiler.inspect = lambda name, kernel, kwargs: compiled.setdefault(str(kwargs["REG"].cga_layout), kernel)

    @gluon.jit
    def copy_tile(desc, out_ptr, REG: gl.constexpr):
        smem = gl.allocate_shared_memory(gl.bfloat16, [64, 64], desc.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        mbarrier.expect(bar, 64 * 64 * 2)
        tma.async_copy_global_to_shared(desc, [0, 0], bar, smem)
        mbarrier.wait(bar, 0)
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, REG))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, REG))
        gl.store(out_ptr + rows[:, None] * 64 + cols[None, :], smem.load(REG))

    x = torch.empty(256, 64, dtype=torch.bfloat16)
    out = torch.empty(64, 64, dtype=torch.bfloat16)
    for cga, ctas in (([], 1), ([[0, 0]], 2), ([[1, 0]], 2)):
        shared = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=cga)
        reg = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=cga)
        copy_tile[(ctas,)](TensorDescriptor.from_tensor(x, [64, 64], shared), out, REG=reg, num_warps=4, num_ctas=ctas)
    for cga, kernel in compiled.items():
        lines = [line.strip() for line in kernel.asm["ptx"].splitlines() if "cp.async.bulk.tensor" in line]
        print(f"cga_layout={cga}:", *lines, sep="\n  ")
    multicast = any(".multicast::cluster" in line for line in compiled["[[0, 0]]"].asm["ptx"].splitlines())
    print("replicated tile copied by one multicast:", multicast)
    return 0 if multicast else 1


if __name__ == "__main__":
    sys.exit(main())
