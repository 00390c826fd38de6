"""The Ascend platform's device-side assumptions, on an NPU (device-only, outside CI like the
rest of ``tests/npu``: ``pytest tests/npu`` on an Ascend host with torch_npu). NEVER RUN: this
project has no NPU. Each test checks one thing the simulated NPU cannot show, because the
simulation hands it to the host; ``tests/platforms/ascend/`` checks the same logic on stubs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

torch_npu = pytest.importorskip("torch_npu")
if not torch.npu.is_available():  # torch.npu exists once torch_npu is imported
    pytest.skip("no NPU visible", allow_module_level=True)

from deepinfer_vllm.platforms.ascend import device as npu  # noqa: E402
from deepinfer_vllm.platforms.ascend.worker import MemoryFigures, kv_cache_bytes  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30


@pytest.fixture(scope="module")
def layer():
    """This process's device layer, on NPU 0 (the tests below that need a context use it)."""
    dev = npu.get()
    assert not dev.simulated
    dev.set_device(0)
    return dev


def test_detection_and_platform_queries_open_no_context():
    """What vLLM's API server and engine core run (platform detection, the device name and
    count, the total memory) leaves torch_npu uninitialised and takes no memory on NPU 0: a
    second process on NPU 0 sees its free memory unchanged while the first is still alive.
    Also: the SoC name read without a context is an Ascend 950's."""
    probe = textwrap.dedent(
        """
        import sys, torch_npu
        from deepinfer_vllm.platforms import ascend
        from deepinfer_vllm.platforms.ascend.platform import DeepInferAscendPlatform as P
        claimed = ascend.ascend_platform_plugin()
        name, count = P.get_device_name(), P.device_count()
        try:
            P.get_device_total_memory()
            refused = False
        except NotImplementedError:
            refused = True
        print(claimed, name, count, refused, torch_npu.npu.is_initialized(), flush=True)
        sys.stdin.readline()
        """
    )
    torch.npu.set_device(0)
    torch.npu.empty_cache()
    free_before, _ = torch.npu.mem_get_info(0)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    proc = subprocess.Popen([sys.executable, "-c", probe], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline().split()
        time.sleep(1.0)
        free_during, _ = torch.npu.mem_get_info(0)
    finally:
        proc.communicate("\n", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    claimed, name, count, refused, initialised = line[0], line[1], int(line[2]), line[3], line[4]
    assert claimed.endswith("DeepInferAscendPlatform") and npu.is_ascend_950(name)
    assert count == torch.npu.device_count() and refused == "True" and initialised == "False"
    assert free_before - free_during < 64 * MIB, (free_before, free_during)


def test_memory_figures_behave_as_the_kv_budget_assumes(layer):
    """``kv_cache_bytes`` reads: free memory drops by what is held (``mem_get_info``), the
    allocator's peak covers a freed temporary (``max_memory_allocated`` since
    ``reset_peak_memory_stats``), and ``empty_cache`` gives cached blocks back."""
    dev = torch.device("npu", 0)
    layer.empty_cache()
    init_free, total = layer.mem_get_info(dev)
    layer.reset_peak_memory_stats(dev)
    held = torch.empty(GIB, dtype=torch.uint8, device=dev)
    temp = torch.empty(2 * GIB, dtype=torch.uint8, device=dev)
    del temp
    layer.synchronize(dev)
    peak = layer.max_memory_allocated(dev)
    layer.empty_cache()
    free_after, _ = layer.mem_get_info(dev)
    fig = MemoryFigures(total=total, init_free=init_free, free_after=free_after, peak=peak,
                        allocated_after=layer.memory_allocated(dev))
    assert GIB <= init_free - free_after < GIB + 256 * MIB  # the held GiB and allocator rounding
    assert 2 * GIB <= fig.peak - fig.allocated_after < 2 * GIB + 64 * MIB
    kv, terms = kv_cache_bytes(fig, (total - init_free + 8 * GIB) / total)
    assert terms["consumed"] == init_free - free_after and kv > 0
    del held


def test_ue8m0_scales_as_uint8_on_the_npu(layer):
    """The platform holds UE8M0 scales as uint8 (``ue8m0_storage_dtype``): released e8m0 bytes
    copied onto the NPU as uint8 decode there to the host's values, and the FP8 row decode
    the Engram tables use gives the host's result."""
    import vllm.platforms

    from deepinfer_vllm.model_executor.layers.params import ue8m0_dtype
    from deepinfer_vllm.ops import quant
    from deepinfer_vllm.platforms.ascend.platform import DeepInferAscendPlatform

    assert DeepInferAscendPlatform.ue8m0_storage_dtype == torch.uint8
    if isinstance(vllm.platforms.current_platform, DeepInferAscendPlatform):
        assert ue8m0_dtype() == torch.uint8
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 256, generator=g)
    values, scales = quant.quant_fp8_rows(rows)
    released = scales.view(torch.uint8).view(torch.float8_e8m0fnu)
    on_npu = torch.empty(released.shape, dtype=ue8m0_dtype(), device="npu")
    on_npu.copy_(released.view(torch.uint8).to("npu"))
    assert torch.equal(on_npu.cpu(), released.view(torch.uint8))
    assert torch.equal(quant.ue8m0_decode(on_npu).cpu(), quant.ue8m0_decode(released))
    want = quant.dequant_fp8_rows(values, released, torch.float32)
    got = quant.dequant_fp8_rows(values.to("npu"), on_npu, torch.float32).cpu()
    assert torch.equal(got, want)


def test_npu_generator_state_rewind_repeats_the_draws(layer):
    """The runner rewinds a discarded prompt chunk's generator by restoring its state (not
    vLLM's CUDA offset step): on an NPU generator that repeats the sampler's numbers."""
    g = torch.Generator(device="npu").manual_seed(11)
    state = g.get_state()
    first = torch.rand(4096, device="npu", generator=g)
    torch.multinomial(torch.ones(8, 1000, device="npu"), 1, generator=g)
    g.set_state(state)
    assert torch.equal(torch.rand(4096, device="npu", generator=g), first)


def test_synchronize_waits_for_queued_work(layer):
    """Adaptive verification reads the clock after ``synchronize``: the device layer's call
    waits for queued kernels (queueing alone takes a fraction of their run time)."""
    a = torch.randn(4096, 4096, device="npu", dtype=torch.bfloat16)
    layer.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        a = a @ a.T / 4096
    queued = time.perf_counter() - t0
    layer.synchronize()
    finished = time.perf_counter() - t0
    assert finished > 2 * queued, (queued, finished)


def test_allocation_failure_is_recognised_as_out_of_memory(layer):
    """More than the device holds raises an error the runner's load-time handler turns into
    vLLM's clear out-of-memory message (``TorchNPU.is_out_of_memory``)."""
    _, total = layer.mem_get_info(torch.device("npu", 0))
    with pytest.raises(Exception) as got:
        torch.empty(2 * total, dtype=torch.uint8, device="npu")
    assert layer.is_out_of_memory(got.value), repr(got.value)
