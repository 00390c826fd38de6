"""Where the model's decode step waits for the host on a GPU (run on the GPU host through
``run.sh``'s environment: ``PYTHONPATH=... python tests/gpu_model/sync_inventory.py``).

Runs one prefill of two requests, then one decode step whose forward and logits run with
``torch.cuda.set_sync_debug_mode("warn")`` (inputs and metadata prepared before, as vLLM's
runner does), and prints every synchronising call site in
``deepinfer_vllm`` (file:line, count), innermost frame of ours first. This is the list a
device-clean decode step has to empty (issue 22).
"""

from __future__ import annotations

import collections
import os
import sys
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model_executor"))

import torch  # noqa: E402
from v41_harness import PagedHarness  # noqa: E402

from deepinfer_vllm.tools.make_checkpoint import make_checkpoint  # noqa: E402


def main() -> None:
    checkpoint = "/tmp/sync_inventory_tiny"
    if not Path(checkpoint, "config.json").exists():
        make_checkpoint(checkpoint, preset="tiny", seed=0)
    harness = PagedHarness(checkpoint, dtype="bfloat16", device="cuda")
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(3, 120000, (n,), generator=g).tolist() for n in (40, 23))
    harness.step([("a", a), ("b", b)])
    harness.step([("a", [5]), ("b", [6])])  # first decode: lazy set-up happens here
    torch.cuda.synchronize()
    sites: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        ours = [f for f in traceback.extract_stack() if "deepinfer_vllm" in f.filename]
        where = (
            f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].line}"
            if ours
            else f"{filename}:{lineno}"
        )
        sites[where] += 1

    prepared = harness.prepare([("a", [7]), ("b", [8])])  # the runner's host part
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        harness.run(prepared)
        torch.cuda.set_sync_debug_mode("default")
    print(f"decode step of 2 requests: {sum(sites.values())} synchronising calls at {len(sites)} sites")
    for where, n in sites.most_common():
        print(f"{n:4d}  {where}")


if __name__ == "__main__":
    main()
