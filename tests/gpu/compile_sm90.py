"""Compile every kernel launch of ``tests/gpu`` for the H200 (sm90) on a machine without a GPU.

Triton compiles to PTX and a cubin without a device (its wheel ships ``ptxas``); what it needs from a device
is the target and each launch's arguments, which decide the specialisation (each pointer's 16-byte alignment,
integers equal to 1 or divisible by 16, the constexprs). This runs the device tests themselves, at the
device's shapes (``shapes()`` gives the large ones too), on CPU tensors, with a driver that reports one sm90
device and a ``JITFunction.run`` that compiles each launch instead of running it, so every Triton and Gluon
kernel a test reaches is compiled exactly as the H200 would compile it. The tests' own outcomes mean nothing
here (no kernel ran; their results are uninitialised memory) and are not reported; a test stops at its first
failed assertion, so launches after it in the same test are not reached. Run it with the device's Triton first
on the path:

    pip install --no-deps --target /tmp/t36 triton==3.6.0      # the H200's Triton
    PYTHONPATH=/tmp/t36:$PWD python tests/gpu/compile_sm90.py [--ptxas-v] [--dump-ptx DIR] [pytest arguments: tests/gpu]

For a kernel compiled with ``PDL`` it checks that the PTX waits for the grid dependency
(``griddepcontrol.wait``) before its first global memory access, and that no Triton kernel converts an MMA
accumulator between two MMA layouts (a loop whose dots got different warp layouts). It prints each failure and
the counts; exit status 1 if anything failed. ``--ptxas-v`` lists registers and spills per kernel, and the kernels whose
asynchronous wgmmas ptxas serialized.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# tests/gpu/conftest.py accepts a machine without CUDA in this mode (and the device fixture gives the CPU).
os.environ["DEEPINFER_COMPILE_SM90"] = "1"
os.environ.pop("TRITON_INTERPRET", None)

# A load, store, atomic, reduction, asynchronous copy or prefetch of global memory (any qualifiers).
_GLOBAL_ACCESS = re.compile(
    r"^\s*(@!?%p\d+\s+)?((ld|st|atom|red|prefetch)\.[\w:.]*global|cp\.async|cp\.reduce)", re.M
)


# An MMA accumulator converted to another MMA layout (Triton gave one loop's dots different warp layouts: the
# accumulator goes through shared memory at each conversion; the stored-weight GEMM on 8 warps did it twice per K tile).
_MMA_TO_MMA = re.compile(r"ttg\.convert_layout %\S+ : tensor<[^>]*#mma\d*> -> tensor<[^>]*#mma\d*>")


def _check_pdl_ptx(ptx: str) -> str | None:
    """None when ``griddepcontrol.wait`` comes before the first global access of the kernel's PTX."""
    wait = ptx.find("griddepcontrol.wait")
    if wait < 0:
        return "no griddepcontrol.wait in the PTX"
    first = _GLOBAL_ACCESS.search(ptx)
    if first is not None and first.start() < wait:
        return f"a global access precedes the wait: {first.group(0).strip()!r}"
    return None


class _StubDriver:
    """Reports one sm90 device; Triton compiles for it and nothing is launched (``warmup=True``)."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def is_active(self):
        return True


class _Props:
    multi_processor_count = 132
    name = "NVIDIA H200 (compile only)"


def _pretend_sm90():
    """What the wrappers and tests ask of ``torch.cuda``, answered for one H200 (nothing is launched)."""
    import torch

    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_properties = lambda device=None: _Props()
    torch.cuda.get_device_name = lambda device=None: _Props.name
    torch.cuda.current_device = lambda: 0
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.synchronize = lambda device=None: None
    # Launch with PDL as on the H200 (pdl_args gives PDL=False for CPU tensors).
    from deepinfer_vllm.ops.triton import pdl

    pdl._device_supports = lambda device_type, index: True


class Compiler:
    """Replaces ``JITFunction.run`` (Triton and Gluon kernels alike): compile, inspect, never launch."""

    def __init__(self, ptxas_v: bool, dump_ptx: str | None = None):
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction

        driver.set_active(_StubDriver())
        self.failures: dict[str, str] = {}
        self.keys: set = set()
        self.pdl_checked = 0
        self.ptxas_v = ptxas_v
        self.dump_ptx = Path(dump_ptx) if dump_ptx else None
        self.regs: dict[str, set] = {}
        self.serialized: dict[str, int] = {}  # kernels whose async wgmmas ptxas serialized (its info C7515)
        jit_run = JITFunction.run
        compiler = self

        def compile_only(fn, *args, grid, warmup, **kwargs):
            name = f"{fn.module}.{fn.__name__}"
            try:
                kernel = jit_run(fn, *args, grid=grid, warmup=True, **kwargs)
            except Exception as e:
                msg = str(e).strip().splitlines()
                compiler.failures.setdefault(f"{name}: {type(e).__name__}: {msg[-1] if msg else ''}", name)
                raise
            try:
                compiler.inspect(name, kernel, kwargs)
            except Exception as e:  # a broken check must not pass for a clean compile
                compiler.failures.setdefault(f"{name}: inspecting: {type(e).__name__}: {e}", name)
            return kernel

        JITFunction.run = compile_only

    def inspect(self, name, kernel, kwargs):
        key = (name, kernel.hash)
        if key in self.keys:
            return
        self.keys.add(key)
        if self.dump_ptx is not None:
            self.dump_ptx.mkdir(parents=True, exist_ok=True)
            (self.dump_ptx / f"{name.rsplit('.', 1)[-1]}-{kernel.hash[:12]}.ptx").write_text(kernel.asm["ptx"])
        ttgir = kernel.asm.get("ttgir", "")
        if _MMA_TO_MMA.search(ttgir):
            self.failures.setdefault(f"{name}: an MMA accumulator converted between MMA layouts ({kwargs})", name)
        if kwargs.get("PDL"):
            self.pdl_checked += 1
            problem = _check_pdl_ptx(kernel.asm["ptx"])
            if problem:
                self.failures.setdefault(f"{name}: PDL: {problem}", name)
        if self.ptxas_v:
            regs, spills, serialized = _ptxas_info(kernel)
            self.regs.setdefault(name, set()).add((regs, spills))
            if serialized:
                self.serialized[name] = self.serialized.get(name, 0) + 1


def _ptxas_info(kernel) -> tuple[int, int, bool]:
    """(registers, spill store bytes, wgmma serialized) of the kernel's PTX by the bundled ``ptxas -v`` (the
    compiled kernel's ``n_regs`` is only known once a driver loads it). ptxas serializes ``wgmma.mma_async``
    (waits for each before the next: no MMA under other work) when it cannot keep the accumulators untouched
    between issue and wait, and says so only as its info C7515."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        arch = "sm_90a"
        run = subprocess.run([get_ptxas(90).path, "-v", f"-arch={arch}", f.name, "-o", os.devnull],
                             capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", run.stderr)
    spills = re.search(r"(\d+) bytes spill stores", run.stderr)
    return (int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else -1, "C7515" in run.stderr)


def _package_kernels() -> set[str]:
    """``module.name`` of every ``*_kernel`` JIT function in ``deepinfer_vllm.ops.triton``."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import deepinfer_vllm.ops.triton as pkg

    names = set()
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for attr, value in vars(module).items():
            if isinstance(value, JITFunction) and attr.endswith("_kernel") and value.module == module.__name__:
                names.add(f"{module.__name__}.{attr}")
    return names


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ptxas-v", action="store_true", help="registers, spills, wgmma serialization per kernel")
    p.add_argument("--dump-ptx", metavar="DIR", help="also write each compiled kernel's PTX into DIR")
    a, pytest_args = p.parse_known_args()
    import pytest
    import triton

    print(f"Triton {triton.__version__} from {Path(triton.__file__).parent}")
    _pretend_sm90()
    c = Compiler(a.ptxas_v, a.dump_ptx)
    args = list(pytest_args)
    if not any(a.startswith("tests") or a.endswith(".py") or "::" in a for a in args):
        args.append(str(Path(__file__).parent))
    pytest.main(["-qq", "--tb=no", "-rN", "--no-header", "-p", "no:cacheprovider", "-p", "no:xdist",
                 "--rootdir", str(ROOT), *args])
    functions = {k[0] for k in c.keys}
    print(f"{len(c.keys)} distinct kernels compiled for sm90 ({len(functions)} functions), "
          f"{c.pdl_checked} checked for the PDL wait; {len(c.failures)} failures")
    package = _package_kernels()
    print(f"package kernels compiled: {len(package & functions)} of {len(package)}; not reached by these tests: "
          f"{sorted(n.rsplit('.', 1)[1] for n in package - functions) or 'none'}")
    for name, rs in sorted(c.regs.items()):
        print(f"  {name}: registers/spills {sorted(rs)}")
    for name, n in sorted(c.serialized.items()):
        print(f"  {name}: wgmma serialized by ptxas (C7515) in {n} of its compiled variants")
    for f in c.failures:
        print("FAIL", f)
    return 1 if c.failures else 0


if __name__ == "__main__":
    sys.exit(main())
