"""``deepinfer-weight-bytes``: each worker's resident weight bytes, measured on a running engine.

    deepinfer-weight-bytes --model DIR [--tensor-parallel-size N] [--dtype float32]

Starts V4.1 in ``vllm.LLM`` and prints, for every worker (vLLM's
``collective_rpc`` into ``V41WorkerMixin.deepinfer_weight_bytes``, which every
DeepInfer worker has), the resident bytes per component beside the checkpoint's bytes for the same
tensors (``model_executor.resident_bytes``). Workers also log their line after
loading.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from deepinfer_vllm.model_executor.resident_bytes import format_report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="deepinfer-weight-bytes",
        description="Start V4.1 in vLLM and print each worker's resident weight bytes per component.",
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=1024)
    args = parser.parse_args(argv)
    from vllm import LLM

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        enforce_eager=True,
    )
    for rank, report in enumerate(llm.collective_rpc("deepinfer_weight_bytes")):
        print(format_report(report, f"worker {rank}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
