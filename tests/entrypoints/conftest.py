"""Fixtures for the serving-layer tests: the V4.1 tokenizer the checkpoints ship."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def v41_tokenizer(tmp_path_factory):
    """``tiny``'s tokenizer (``make_checkpoint`` writes the same one), loaded the way
    vLLM's server loads it."""
    import vllm  # noqa: F401  (vLLM's import order)
    from vllm.tokenizers import get_tokenizer

    from deepinfer_vllm.tools.tokenizer_builder import build_v41_tokenizer, save_tokenizer

    out = tmp_path_factory.mktemp("v41_tokenizer")
    save_tokenizer(build_v41_tokenizer(), out, 4096)
    return get_tokenizer(str(out))
