"""vLLM's GPU runner on a device that is not CUDA: the device calls it makes by name.

**vLLM behaviour (0.32).** ``GPUModelRunner`` (``vllm/v1/worker/gpu_model_runner.py``)
makes its stream, event and synchronisation calls on ``torch.cuda`` and
``torch.accelerator`` directly, not through the platform: ``torch.cuda.Stream()``
(copy streams), ``torch.cuda.Event(...)`` (copy-ready events),
``torch.cuda.current_stream()``, ``with torch.cuda.stream(...)``,
``torch.accelerator.synchronize()`` and ``torch.accelerator.empty_cache()``; and
``torch.Event`` (device-generic) for its asynchronous outputs.

**Why it is insufficient.** DeepInfer's NPU runner is vLLM's ``GPUModelRunner``
(``platforms.ascend.worker``). On an Ascend host ``torch.cuda`` has no device, so these
calls fail or act on nothing; on the simulated NPU (host tensors) torch's CPU backend
has no events (``torch.Event().record()`` raises).

**What the patch does.** ``apply(replacements)`` is a context manager: inside it, each
``(owner, name)`` of ``replacements`` (the device layer's ``TorchNPU.torch_patches``:
``torch_npu``'s classes and calls on an NPU, null streams and events when simulated) is
set on ``owner``, and vLLM's runner code runs unchanged on the device; on leaving, the
values found on entry are back. Nested uses restore in order. Classes are replaced by
classes, never by functions: code that dynamo compiles (vLLM's sampler) tests values
with ``isinstance`` against these names, and a function there kills the step.
:data:`RUNNER_CALLS` lists the names vLLM's runner calls and what the patch does with
each.

**Applied** in each NPU worker process: from ``DeepInferNPUWorker.init_device`` to its
``shutdown`` (the whole life of the worker), and around the runner's construction.

**Removable** when vLLM's GPU runner asks the platform (or torch's device-generic
``torch.accelerator``/``torch.Stream``/``torch.Event`` API, with ``torch_npu``'s backend
behind it) for its streams and events. ``tests/patch/test_torch_device_calls.py`` lists
the ``torch.cuda``/``torch.accelerator`` calls of the installed vLLM's runner and fails
when they change.
"""

from __future__ import annotations

import contextlib

# The ``torch.cuda``/``torch.accelerator`` names vLLM 0.32's GPU runner calls: replaced by
# the device's, or why not.
RUNNER_CALLS = {
    "torch.cuda.Stream": "replaced",
    "torch.cuda.Event": "replaced",
    "torch.cuda.current_stream": "replaced",
    "torch.cuda.stream": "replaced",
    "torch.accelerator.synchronize": "replaced",
    "torch.accelerator.empty_cache": "replaced",
    "torch.cuda.OutOfMemoryError": "kept: torch.OutOfMemoryError, any device",
    "torch.accelerator.get_memory_info": "kept: CUDA-graph capture and sleep mode only, off on the NPU",
}


@contextlib.contextmanager
def apply(replacements: dict):
    """Inside, ``owner.name`` is ``value`` for each ``(owner, name): value`` of
    ``replacements``; the values found on entry are restored on leaving."""
    saved = {key: getattr(*key) for key in replacements}
    for (owner, name), value in replacements.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)
