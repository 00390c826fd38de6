"""Loading as users load: a hub id resolved from an offline Hugging Face cache goes through
vLLM's own resolution and weight iterator, and serves the same tokens as the folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HUB_ID = "deepseek-ai/DeepSeek-V4.1-Flash-1017"
REVISION = "0123456789abcdef0123456789abcdef01234567"

_RUN = """
import sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=512, seed=0, enforce_eager=True)
    prompt = [int(t) for t in sys.argv[2].split(",")]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], greedy)
    print("TOKENS", ",".join(map(str, out[0].outputs[0].token_ids)))
"""


def _offline_cache(checkpoint: str, root: Path) -> Path:
    """The layout huggingface_hub leaves after a download: refs/main -> snapshots/<rev>/."""
    repo = root / ("models--" + HUB_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(checkpoint, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    return root


@pytest.mark.xdist_group("test_hub_id_from_an_offline_cache_serves_the_reference")  # an engine each: side by side
def test_hub_id_from_an_offline_cache_serves_the_reference(
    tiny_checkpoint, tmp_path, acceptance_prompts, reference_greedy
):
    cache = _offline_cache(tiny_checkpoint, tmp_path / "hub")
    script = tmp_path / "run.py"
    script.write_text(_RUN)
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    prompt = acceptance_prompts[1]
    out = subprocess.run(
        [sys.executable, str(script), HUB_ID, ",".join(map(str, prompt))],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("TOKENS "))
    # The hub id is no path in the script's folder: the weights came from the cache snapshot.
    assert [int(t) for t in line.split()[1].split(",")] == reference_greedy[1]


@pytest.mark.xdist_group("test_weight_bytes_cli_reports_each_worker")  # an engine each: side by side
def test_weight_bytes_cli_reports_each_worker(tiny_checkpoint):
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepinfer_vllm.tools.weight_bytes",
            "--model",
            tiny_checkpoint,
            "--dtype",
            "float32",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "worker 0" in lines
    rows = {
        line.split()[0]: line.split()[1:]
        for line in lines
        if line and line.split()[0] in ("experts", "total")
    }
    assert rows["experts"][0] == rows["experts"][1]  # resident == checkpoint bytes
    assert float(rows["total"][2]) <= 1.05


def test_a_bad_tensor_is_named_in_the_users_process_before_any_engine_starts(tiny_checkpoint, tmp_path):
    """A mis-shaped and a missing tensor: ``vllm.LLM`` raises at config time with both names,
    not vLLM's generic "Engine core initialization failed" from a child process."""
    import torch
    from safetensors.torch import load_file, save_file
    from vllm import LLM

    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["layers.2.attn.kv_norm.weight"] = torch.ones(7, dtype=torch.bfloat16)
    del tensors["layers.0.ffn.gate.bias"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        LLM(model=str(bad), dtype="float32", max_model_len=256)
    text = str(err.value)
    assert "layers.2.attn.kv_norm.weight" in text and "layers.0.ffn.gate.bias" in text, text
    assert "Engine core initialization failed" not in text
