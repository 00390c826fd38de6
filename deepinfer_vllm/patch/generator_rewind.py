"""vLLM's V1 runner: the seeded generator rewind after a discarded sample, exact on any device.

**vLLM behaviour (0.32).** After a step that ends inside a prompt (a prefill chunk that
is not the last), the sample drawn for that request is discarded, and
``GPUModelRunner._bookkeeping_sync`` (``vllm/v1/worker/gpu_model_runner.py``; the CPU
runner inherits it) rewinds the request's seeded generator with
``gen.set_offset(gen.get_offset() - 4)``: CUDA's Philox bookkeeping, the offset one CUDA
sampling kernel advances.

**Why it is wrong here.** CPU generators have no ``set_offset`` (the engine dies on the
first seeded request whose prompt is chunked); an NPU generator's offset advances by what
its own kernels consume, not 4. A seeded request would then draw different numbers
depending on how its prompt was chunked.

**What the patch does.** Before the sampler draws (``save_discarded``, from the runner's
``_sample``), each generator of a request whose sample this step discards has its state
saved: a device generator's state (seed and offset) lives on the host, and the sampler's
kernels took their offsets when launched, so restoring it after launch is exact. In the
bookkeeping (``apply``, around vLLM's ``_bookkeeping_sync``) those states are restored
and the generators are hidden from vLLM's offset rewind, then put back. A seeded request
draws the same numbers however its prompt is chunked, alone or in a batch.

**Applied** in each worker process, at every step, by DeepInfer's runners
(``platforms.v41_runner.V41RunnerMixin``: CPU and NPU). Other models served by those
runners take the same path; vLLM's own runners are not changed.

**Removable** when vLLM rewinds generators by saved state rather than by CUDA's offset
(``tests/patch/test_generator_rewind.py`` reads ``_bookkeeping_sync`` and runs the rewind
on a CPU generator).
"""

from __future__ import annotations

import contextlib

import numpy as np


def save_discarded(generators: dict, discard_mask: np.ndarray) -> dict:
    """``{request index: (generator, state)}`` for the requests whose sample this step
    discards (``discard_mask``: one flag per request of the batch) and that have a generator;
    call before the sampler draws."""
    saved = {}
    for i in np.nonzero(discard_mask)[0].tolist():
        gen = generators.get(i)
        if gen is not None:
            saved[i] = (gen, gen.get_state())
    return saved


@contextlib.contextmanager
def apply(generators: dict, saved: dict):
    """Restore the ``saved`` states (``save_discarded``) and, inside, leave those generators
    out of ``generators`` (the batch's), so vLLM's bookkeeping does not rewind them again;
    they are back on leaving."""
    for i, (gen, state) in saved.items():
        gen.set_state(state)
        generators.pop(i, None)
    try:
        yield
    finally:
        for i, (gen, _) in saved.items():
            generators[i] = gen
