"""Timing, ceilings and table rows shared by the GPU kernel benchmarks.

Every number is measured in the same process as the kernels it is compared
with: device-to-device copy bandwidth, and bf16 / fp8 matmul rates through
torch. Kernel modules under ``benchmarks/gpu/`` expose ``run(ceilings)`` that
returns a list of :class:`Row`; ``benchmarks/gpu_kernels.py`` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


_FLUSH_BYTES = 256 << 20  # > the H200's 50 MB L2


def _syncs_with_host(fn) -> bool:
    """Whether ``fn`` synchronises with the host (then it cannot be graph-captured)."""
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return False
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize()


def _graph_seconds(fn, flush: torch.Tensor, reps: int) -> float:
    """Seconds per call of ``fn`` replayed from a CUDA graph, each call after an L2
    flush; the flushes are timed in their own graph and subtracted."""

    def capture(body) -> torch.cuda.CUDAGraph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            body()  # warm-up (allocations, autotuning) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                body()
        return g

    def replay(g) -> float:
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        return sorted(times)[len(times) // 2]

    g_both = capture(lambda: (flush.zero_(), fn()))
    g_flush = capture(flush.zero_)
    return max(replay(g_both) - replay(g_flush), 0.0) / reps


def time_s(fn, warmup: int = 5, rep: int = 30, graph: bool = True) -> float:
    """Median seconds per call of ``fn``, L2 flushed before every call.

    Kernels are timed replayed from a CUDA graph, as vLLM runs decode, so the
    Python launch cost (~20-40 us per Triton launch) is not counted. Code that
    synchronises with the host (reference paths; detected with torch's sync
    debug mode) or ``graph=False`` is timed eagerly with CUDA events.
    """
    from triton.testing import do_bench

    if graph and not _syncs_with_host(fn):
        flush = torch.empty(_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        return _graph_seconds(fn, flush, reps=max(rep // 3, 5))
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e-3


@dataclass
class Ceilings:
    copy_bytes_per_s: float
    bf16_flops_per_s: float
    fp8_flops_per_s: float


def measure_ceilings(device: str = "cuda") -> Ceilings:
    """Copy bandwidth (read + write bytes) and dense matmul rates, measured now."""
    n = 1 << 30  # 1 GiB
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t_copy = time_s(lambda: dst.copy_(src), graph=False)
    copy_bw = 2 * n / t_copy
    del src, dst
    m = k = nn = 8192
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(nn, k, device=device, dtype=torch.bfloat16)
    t_bf16 = time_s(lambda: a @ b.t(), graph=False)
    fp8_rate = float("nan")
    if hasattr(torch, "_scaled_mm"):
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        try:
            t_fp8 = time_s(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), graph=False)
            fp8_rate = 2 * m * nn * k / t_fp8
        except RuntimeError:
            pass
    return Ceilings(copy_bw, 2 * m * nn * k / t_bf16, fp8_rate)


@dataclass
class Row:
    """One benchmark line. ``bytes`` counts what the kernel must read + write."""

    kernel: str
    shape: str
    seconds: float
    bytes: float = 0.0
    flops: float = 0.0
    baseline: str = ""
    baseline_seconds: float = float("nan")
    extra: dict = field(default_factory=dict)

    def cells(self, c: Ceilings) -> list[str]:
        bw = self.bytes / self.seconds
        fl = self.flops / self.seconds
        speedup = self.baseline_seconds / self.seconds if self.baseline else float("nan")
        return [
            self.kernel,
            self.shape,
            f"{self.seconds * 1e6:.1f}",
            f"{bw / 1e12:.2f}",
            f"{fl / 1e12:.1f}" if self.flops else "-",
            f"{100 * bw / c.copy_bytes_per_s:.0f}%",
            f"{100 * fl / c.bf16_flops_per_s:.0f}%" if self.flops else "-",
            f"{100 * fl / c.fp8_flops_per_s:.0f}%" if self.flops else "-",
            f"{speedup:.2f}x vs {self.baseline}" if self.baseline else "-",
        ]


HEADER = ["kernel", "shape", "us", "TB/s", "TFLOP/s", "% copy", "% bf16 mm", "% fp8 mm", "vs baseline"]


def print_module(run) -> None:
    """A benchmark module run on its own: the ceilings measured now, then its rows."""
    c = measure_ceilings()
    print(
        f"copy {c.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 {c.bf16_flops_per_s / 1e12:.0f} TFLOP/s, "
        f"fp8 {c.fp8_flops_per_s / 1e12:.0f} TFLOP/s"
    )
    print("  ".join(HEADER))
    for row in run(c):
        print("  ".join(row.cells(c)))
