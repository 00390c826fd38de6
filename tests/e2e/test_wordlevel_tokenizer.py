"""A checkpoint whose tokenizer lacks the V4.1 chat tokens (plain WordLevel) still loads
and generates from token ids with default ``LLM(...)`` arguments (bfloat16)."""

from __future__ import annotations

import json

import torch

from vllm import LLM, SamplingParams


def test_wordlevel_checkpoint_generates_with_default_args(tmp_path):
    from deepinfer_vllm.reference.model import ReferenceV41
    from deepinfer_vllm.tools.make_checkpoint import make_checkpoint

    path = make_checkpoint(tmp_path / "wordlevel", preset="tiny", seed=3, tokenizer="wordlevel")
    tok = json.loads((path / "tokenizer.json").read_text())
    assert tok["model"]["type"] == "WordLevel"
    assert "<｜User｜>" not in tok["model"]["vocab"]

    llm = LLM(model=str(path))  # defaults: bf16, prefix caching, chunked prefill
    prompt = list(range(50, 80))
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=8))[0]
    ids = list(out.outputs[0].token_ids)
    assert len(ids) == 8 and out.outputs[0].text.strip()
    # Same model in bf16 through the reference, in the engine's default prefill truncation
    # (vLLM's swa_bounded_replay on: compact): the first token is a stable argmax (a random tiny
    # model's later bf16 tokens may legitimately flip).
    from deepinfer_vllm import envs

    ref = ReferenceV41.from_pretrained(str(path), dtype=torch.bfloat16, num_threads=1)
    mode, keep = envs.prefill_truncation_settings(ref.arch.sliding_window, "compact")
    assert ids[0] == int(ref.forward(prompt, truncation_mode=mode, keep_tokens=keep)[-1].argmax())
    del llm
