"""Offline generation with DeepSeek-V4.1 through stock vLLM and the DeepInfer plugin.

    python examples/offline_inference.py --model build/tiny

The plugin is found through vLLM's entry points; nothing here imports it.
On CPU, set ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache), e.g. 2.
"""

from __future__ import annotations

import argparse
import os
import time

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "DeepSeek-V4.1 keeps a causal encoder and a decoder that",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=1024, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, params)
    elapsed = time.perf_counter() - start
    generated = 0
    for out in outputs:
        completion = out.outputs[0]
        generated += len(completion.token_ids)
        print(f"prompt:    {out.prompt!r}")
        print(f"generated: {completion.text!r}")
        print(f"token ids: {list(completion.token_ids)}")
        print()
    print(f"{generated} tokens in {elapsed:.2f} s: {generated / elapsed:.1f} tokens/s")


if __name__ == "__main__":
    main()
