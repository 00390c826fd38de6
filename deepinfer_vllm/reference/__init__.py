"""Plain-PyTorch, full-sequence reference of DeepSeek-V4.1 (the test oracle; no vLLM).

``ReferenceV41`` runs one whole sequence at positions ``0..T-1`` through every layer with no
KV cache, composing the per-operator references of ``deepinfer_vllm.ops``. The vLLM model
class is checked against it token for token.
"""

from deepinfer_vllm.reference.model import TRUNCATION_MODES, ForwardTrace, ReferenceV41

__all__ = ["TRUNCATION_MODES", "ForwardTrace", "ReferenceV41"]
