"""The quantisation method vLLM records for V4.1 checkpoints, and its layer methods.

The released ``quantization_config`` says ``quant_method: fp8``; left alone,
vLLM would route it to its own FP8 methods (GPU kernels, bf16 only). This
config claims V4.1 checkpoints when DeepInfer's model serves them and gives
vLLM's parallel linear, embedding and head layers methods that hold the
released bytes:

* ``V41Fp8LinearMethod``: FP8 E4M3 ``weight`` with one UE8M0 ``scale`` per
  32x32 tile (the checkpoint's own parameter names);
* ``V41StoredLinearMethod``: bf16 / fp32 linears (compressor, indexer keys,
  index weights), held in the dtype the checkpoint stores;
* ``V41EmbeddingMethod``: the bf16 embedding and head.

Which tensor has which format comes from ``checkpoint.expected_tensors``
(one source of the format): the model binds its config with ``bind_format``
before building layers, and layers are looked up by their prefix, which is
the checkpoint name of their weight without ``.weight``. Every GEMM decodes
its weight when it runs (``ops.weight_gemm``) and returns ``x.dtype``, or the
accumulation dtype when asked (row-parallel partial sums). Each method builds
its GEMM operators when vLLM builds its layer, under the model's device and
dtype (``layers.params.built_for``), which fixes their kernels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Parameter

from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.utils import set_weight_attrs

from deepinfer_vllm.configs import V41Arch, is_v41_config
from deepinfer_vllm.configs import checkpoint
from deepinfer_vllm.model_executor.layers.params import built_for, ue8m0_dtype
from deepinfer_vllm.ops.weight_gemm import FP8_TILE, Fp8BlockGemm, Fp8GroupedGemm, StoredGemm

METHOD_NAME = "deepinfer_v41"

# safetensors dtype string -> the torch dtype a parameter keeps it in.
TORCH_DTYPES = {
    checkpoint.FP8: torch.float8_e4m3fn,
    checkpoint.E8M0: torch.float8_e8m0fnu,
    checkpoint.FP4: torch.int8,
    checkpoint.BF16: torch.bfloat16,
    checkpoint.F32: torch.float32,
}
TILE = FP8_TILE


class _HeldWeights:
    """``create_weights`` for the methods below: each names the parameters it holds for a
    ``[rows, cols]`` slice (``params``), and every one of them is sharded by vLLM's
    loaders along ``output_dim`` 0 / ``input_dim`` 1 like the weight."""

    def params(self, layer, rows: int, cols: int, full: tuple[int, int]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        rows, cols = sum(output_partition_sizes), input_size_per_partition
        for name, data in self.params(layer, rows, cols, (output_size, input_size)).items():
            param = Parameter(data, requires_grad=False)
            set_weight_attrs(param, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
            layer.register_parameter(name, param)


class V41Fp8LinearMethod(_HeldWeights, LinearMethodBase):
    """Dense FP8 E4M3 weight ``[out, in]`` + UE8M0 ``scale`` per 32x32 tile, as released."""

    def __init__(self):
        device, dtype = built_for()
        self.gemm = Fp8BlockGemm(device, dtype)
        self.grouped_gemm = Fp8GroupedGemm(device, dtype)

    def params(self, layer, rows: int, cols: int, full: tuple[int, int]) -> dict[str, torch.Tensor]:
        if rows % TILE or cols % TILE:
            raise ValueError(
                f"{layer.prefix}: this rank's slice [{rows}, {cols}] of the FP8 weight "
                f"{list(full)} does not keep whole {TILE}x{TILE} scale tiles; "
                "choose a tensor_parallel_size that splits it into multiples of 32"
            )
        return {
            "weight": torch.empty(rows, cols, dtype=torch.float8_e4m3fn),
            "scale": torch.empty(rows // TILE, cols // TILE, dtype=ue8m0_dtype()),
        }

    def process_weights_after_loading(self, layer) -> None:
        """Refuse, by name, scale bytes the chosen GEMM kernel cannot decode exactly."""
        self.gemm.check_scales(layer.scale, f"{layer.prefix}.scale")

    def apply(self, layer, x: torch.Tensor, bias=None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.gemm(x, layer.weight, layer.scale, out_dtype)

    def apply_grouped(self, layer, x: torch.Tensor) -> torch.Tensor:
        """Block-diagonal ``x [T, G, K]`` times the ``G`` row groups of ``W`` -> ``[T, G, N/G]``."""
        return self.grouped_gemm(x, layer.weight, layer.scale)


class _StoredWeight(_HeldWeights):
    """A weight held in the one dtype the checkpoint stores it in."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.gemm = StoredGemm(*built_for())

    def params(self, layer, rows: int, cols: int, full: tuple[int, int]) -> dict[str, torch.Tensor]:
        return {"weight": torch.empty(rows, cols, dtype=self.dtype)}


class V41StoredLinearMethod(_StoredWeight, LinearMethodBase):
    """A bf16 / fp32 linear, kept in the dtype the checkpoint stores it in."""

    def apply(self, layer, x: torch.Tensor, bias=None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.gemm(x, layer.weight, out_dtype)


class V41EmbeddingMethod(_StoredWeight, QuantizeMethodBase):
    """The embedding and head: bf16 rows as released; logits accumulate in the
    activations' accumulation dtype and come out fp32 (DeepInfer's logits)."""

    def embedding(self, layer, input_: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(input_, layer.weight)

    def apply(self, layer, x: torch.Tensor, bias=None) -> torch.Tensor:
        return self.gemm(x, layer.weight, torch.float32)


@register_quantization_config(METHOD_NAME)
class DeepInferV41QuantConfig(QuantizationConfig):
    """FP8 32x32 UE8M0 dense weights + packed FP4 experts, held as released."""

    def __init__(self, released: dict[str, Any]):
        super().__init__()
        self.released = dict(released)
        self._formats: dict[str, checkpoint.TensorSpec] | None = None

    def bind_format(self, arch: V41Arch) -> None:
        """Learn each tensor's storage format from the model's config (before layers are built)."""
        self._formats = checkpoint.expected_tensors(arch)

    def storage(self, prefix: str) -> checkpoint.TensorSpec:
        if self._formats is None:
            raise RuntimeError(f"{METHOD_NAME}: bind_format(arch) must run before layers are built")
        spec = self._formats.get(f"{prefix}.weight")
        if spec is None:
            raise ValueError(f"{METHOD_NAME}: layer {prefix!r} has no '{prefix}.weight' in the V4.1 format")
        return spec

    def get_name(self) -> str:
        return METHOD_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "DeepInferV41QuantConfig":
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        if user_quant not in (None, METHOD_NAME):
            return None
        return METHOD_NAME if is_v41_config(hf_config) else None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, VocabParallelEmbedding):
            return V41EmbeddingMethod(TORCH_DTYPES[self.storage(prefix).dtype])
        if isinstance(layer, LinearBase):
            dtype = self.storage(prefix).dtype
            if dtype == checkpoint.FP8:
                return V41Fp8LinearMethod()
            return V41StoredLinearMethod(TORCH_DTYPES[dtype])
        return None
