"""With the plugin installed, a non-V4.1 model behaves exactly as under stock vLLM.

The same tiny Llama runs twice in fresh processes: once with DeepInfer's CPU
platform active (the default on this host) and once with ``DEEPINFER_PLATFORM=off``
(stock ``CpuPlatform``). Scheduling-relevant config, the compilation settings vLLM
chooses for the default (compiled) engine and greedy tokens must match. The tokens
come from an eager engine in both processes: compiling the Llama (vLLM's own graph,
the same on both sides once the settings match) took half of the test's time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys
    if __name__ == "__main__":
        from vllm import LLM, SamplingParams
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform
        args = dict(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=128, seed=0)
        compiled = EngineArgs(**args).create_engine_config().compilation_config
        llm = LLM(enforce_eager=True, **args)
        cfg = llm.llm_engine.vllm_config
        out = llm.generate([{"prompt_token_ids": [5, 9, 23, 42, 7]}],
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        print("RESULT " + json.dumps({
            "platform": type(current_platform).__name__,
            "block_size": cfg.cache_config.block_size,
            "prefix_caching": cfg.cache_config.enable_prefix_caching,
            "chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "worker_cls": cfg.parallel_config.worker_cls,
            "compilation": [str(compiled.mode), compiled.backend, str(compiled.cudagraph_mode),
                            sorted(compiled.custom_ops), sorted(compiled.splitting_ops or [])],
            "tokens": list(out[0].outputs[0].token_ids),
        }))
    """
)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return str(path)


def _run(model: str, tmp_path, **env) -> dict:
    script = tmp_path / "run_llama.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), model],
        capture_output=True, text=True, timeout=600, env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_llama_is_unchanged_by_the_plugin(tiny_llama, tmp_path):
    ours = _run(tiny_llama, tmp_path, DEEPINFER_PLATFORM="auto")
    stock = _run(tiny_llama, tmp_path, DEEPINFER_PLATFORM="off")
    assert ours.pop("platform") == "DeepInferCpuPlatform"
    assert stock.pop("platform") == "CpuPlatform"
    assert ours == stock
    assert len(ours["tokens"]) == 8
