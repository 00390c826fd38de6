"""``patch.torch_device_calls``: vLLM's GPU runner calls ``torch.cuda``/``torch.accelerator``
by name; the patch points those names at the device for as long as it is applied."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from deepinfer_vllm.patch import torch_device_calls


def test_vllms_gpu_runner_still_makes_these_device_calls_by_name():
    """Every ``torch.cuda``/``torch.accelerator`` name vLLM's runner uses is listed (replaced,
    or why not). When this fails, vLLM's runner makes other device calls (check the NPU
    runner still runs them on the device), or none of these (the patch may go)."""
    from vllm.v1.worker import gpu_model_runner

    source = inspect.getsource(gpu_model_runner)
    used = set(re.findall(r"\btorch\.(?:cuda|accelerator)\.[A-Za-z_]+", source))
    assert used == set(torch_device_calls.RUNNER_CALLS), used ^ set(torch_device_calls.RUNNER_CALLS)
    for call in ("torch.cuda.Stream()", "torch.cuda.Event(blocking=True)", "torch.cuda.current_stream()",
                 "with torch.cuda.stream(", "torch.accelerator.synchronize()"):
        assert call in source, call


def test_the_device_layer_replaces_every_call_the_patch_lists():
    from deepinfer_vllm.platforms.ascend.device import SimulatedNPU

    replaced = {
        f"{owner.__name__}.{name}" for owner, name in SimulatedNPU().torch_patches() if owner is not torch
    }
    listed = {name for name, what in torch_device_calls.RUNNER_CALLS.items() if what == "replaced"}
    assert replaced == listed


def test_apply_sets_and_restores_in_order():
    class Stream:
        pass

    class Other:
        pass

    stock = torch.cuda.Stream
    with torch_device_calls.apply({(torch.cuda, "Stream"): Stream}):
        assert torch.cuda.Stream is Stream
        with torch_device_calls.apply({(torch.cuda, "Stream"): Other}):
            assert torch.cuda.Stream is Other
        assert torch.cuda.Stream is Stream
    assert torch.cuda.Stream is stock
    with pytest.raises(RuntimeError), torch_device_calls.apply({(torch.cuda, "Stream"): Stream}):
        raise RuntimeError("the worker failed")
    assert torch.cuda.Stream is stock
