"""DeepInfer's CPU worker and model runner.

The stock CPU runner is reused as is; ours only adds what V4.1's metadata
needs and vLLM's common metadata does not carry: each request's prompt
length, which anchors DeepInfer's prefill truncation of the decoder half
(``DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE``). Other models never see a
difference (only ``V41StepMetadata`` objects are touched).
"""

from __future__ import annotations

import vllm.v1.worker.cpu_worker as stock_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from deepinfer_vllm.attention_backends.mla_swa import V41StepMetadata


class DeepInferCPUModelRunner(CPUModelRunner):
    def _build_attention_metadata(self, num_tokens: int, num_reqs: int, *args, **kwargs):
        attn_metadata, spec_metadata = super()._build_attention_metadata(num_tokens, num_reqs, *args, **kwargs)
        prompt_lens = None
        layers = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
        for per_layer in layers:
            for meta in per_layer.values():
                if isinstance(meta, V41StepMetadata):
                    if prompt_lens is None:
                        prompt_lens = (
                            self.input_batch.num_prompt_tokens_cpu_tensor[: meta.num_reqs].to(dtype=meta.seq_lens.dtype)
                        )
                    meta.prompt_lens = prompt_lens
        return attn_metadata, spec_metadata


class DeepInferCPUWorker(CPUWorker):
    def deepinfer_weight_bytes(self) -> dict[str, dict[str, int]]:
        """This worker's resident weight bytes per component, beside the checkpoint's
        (``collective_rpc("deepinfer_weight_bytes")``; ``deepinfer-weight-bytes``)."""
        from deepinfer_vllm.model_executor.weight_bytes import weight_bytes

        return weight_bytes(self.model_runner.get_model())

    def init_device(self):
        # The stock worker names its runner class directly; swap it in for
        # the duration of the call (this process only runs this worker).
        stock_runner = stock_worker.CPUModelRunner
        stock_worker.CPUModelRunner = DeepInferCPUModelRunner
        try:
            super().init_device()
        finally:
            stock_worker.CPUModelRunner = stock_runner
