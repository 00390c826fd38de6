"""How V4.1's weights and tokens are split over vLLM's process groups.

Everything follows vLLM's own flags and groups (no launcher of ours):

* ``tensor_parallel_size``: query heads, the grouped output projection, the
  shared expert and the large dense projections are split over the TP group
  as vLLM splits MLA models; the single latent KV head, the compressor and the
  indexer are replicated (their caches live on every rank); embedding and
  head are vocab-parallel.
* ``data_parallel_size``: attention is data-parallel (each DP rank its own
  requests); idle DP ranks run vLLM's dummy batches, so every rank enters
  the MoE and Engram collectives of every layer.
* The MoE group is vLLM's expert group: all ``dp * tp`` ranks of a pipeline
  stage (``FusedMoEParallelConfig``'s flattening). With
  ``enable_expert_parallel`` each rank holds ``n_routed_experts / (dp * tp)``
  whole experts (contiguous ids); without it each rank holds a ``1 / (dp *
  tp)`` slice of every expert's intermediate dimension. Engram table rows are
  split over the same group (DeepInfer's engram-parallel group).

Collectives go through vLLM's group coordinators. Sums of partial results
travel in the accumulation dtype (fp64 in fp32 models) and are rounded once
after the reduction, so a split model rounds where one rank would; vLLM's
CPU shared-memory TP path has no fp64 kernel, so those reduce over the
group's torch.distributed group instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer_vllm.configs import V41Arch

__all__ = [
    "ParallelLayout",
    "TokenExchange",
    "all_reduce",
    "check_parallel",
    "check_vllm_parallel",
    "gather_tokens",
    "split_evenly",
    "token_counts",
]

# dtypes vLLM's CPU shared-memory all-reduce handles.
_SHM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes and ranks of the groups this rank belongs to (one pipeline stage)."""

    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    expert_parallel: bool = False

    @property
    def moe_size(self) -> int:
        """Ranks that split the routed experts and the Engram rows (vLLM's EP group)."""
        return self.tp_size * self.dp_size

    @property
    def moe_rank(self) -> int:
        return self.dp_rank * self.tp_size + self.tp_rank

    @classmethod
    def from_vllm(cls, vllm_config) -> "ParallelLayout":
        from vllm.distributed import get_dp_group, get_tensor_model_parallel_rank
        from vllm.distributed import get_tensor_model_parallel_world_size

        par = vllm_config.parallel_config
        dp = get_dp_group()
        return cls(
            tp_size=get_tensor_model_parallel_world_size(),
            tp_rank=get_tensor_model_parallel_rank(),
            dp_size=dp.world_size,
            dp_rank=dp.rank_in_group,
            expert_parallel=bool(par.enable_expert_parallel) and dp.world_size * par.tensor_parallel_size > 1,
        )

    # ----------------------------------------------------------- expert split
    def local_experts(self, n_experts: int) -> range:
        """Routed expert ids this rank holds (all of them without expert parallelism)."""
        if not self.expert_parallel:
            return range(n_experts)
        per = n_experts // self.moe_size
        return range(self.moe_rank * per, (self.moe_rank + 1) * per)

    def expert_inter(self, inter: int) -> tuple[int, int]:
        """``(first column, width)`` of every expert's intermediate slice on this rank."""
        if self.expert_parallel:
            return 0, inter
        width = inter // self.moe_size
        return self.moe_rank * width, width

    def engram_rows(self, rows: int) -> tuple[int, int]:
        """``(first row, rows held)`` of an Engram table of ``rows`` rows on this rank.

        Shards have ``ceil(rows / moe_size)`` rows; the last holds the remainder.
        """
        lo, hi = split_evenly(rows, self.moe_size, self.moe_rank)
        return lo, hi - lo


def split_evenly(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[lo, hi)`` of part ``index`` when ``n`` items are cut into ``parts`` of ``ceil(n / parts)``."""
    per = -(-n // parts)
    lo = min(index * per, n)
    return lo, min(lo + per, n)


def check_parallel(arch: V41Arch, tp: int, dp: int, pp: int, expert_parallel: bool) -> None:
    """Refuse a parallel setting V4.1 cannot be split by, naming the setting."""
    if pp != 1:
        raise ValueError(
            f"pipeline_parallel_size={pp}: DeepInfer's V4.1 does not support pipeline parallelism "
            "(layers share KV across the stack); use tensor_parallel_size or "
            "data_parallel_size with enable_expert_parallel"
        )
    if tp < 1 or dp < 1:
        raise ValueError(f"tensor_parallel_size={tp} and data_parallel_size={dp} must be >= 1")
    for what, value in (("num_attention_heads", arch.num_heads), ("o_groups", arch.o_groups)):
        if value % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the model's {what}={value} "
                "(each rank takes whole query heads and whole output groups)"
            )
    for what, value in (("moe_intermediate_size", arch.moe_intermediate_size),):
        if value % tp or (value // tp) % 32:
            raise ValueError(
                f"tensor_parallel_size={tp} splits the shared expert's {what}={value} into slices "
                "that are not multiples of 32 (FP8 weights keep 32x32 scale tiles)"
            )
    moe = tp * dp
    if expert_parallel:
        if arch.n_routed_experts % moe:
            raise ValueError(
                f"enable_expert_parallel over {moe} ranks (data_parallel_size={dp} x "
                f"tensor_parallel_size={tp}) does not divide n_routed_experts={arch.n_routed_experts}"
            )
    elif moe > 1:
        inter = arch.moe_intermediate_size
        if inter % moe or (inter // moe) % 32:
            raise ValueError(
                f"without enable_expert_parallel every expert is split over data_parallel_size x "
                f"tensor_parallel_size = {moe} ranks, and moe_intermediate_size={inter} does not split "
                "into multiples of 32 (FP4 scales cover 32 columns); pass enable_expert_parallel=True"
            )


def check_vllm_parallel(arch: V41Arch, parallel_config) -> None:
    """``check_parallel`` with the sizes of a vLLM ``ParallelConfig``."""
    check_parallel(
        arch,
        parallel_config.tensor_parallel_size,
        parallel_config.data_parallel_size,
        parallel_config.pipeline_parallel_size,
        bool(parallel_config.enable_expert_parallel),
    )


# ---------------------------------------------------------------- collectives
def _process_group(group, t: torch.Tensor):
    """The torch.distributed group of a vLLM coordinator that takes tensors on ``t``'s device."""
    return group.cpu_group if t.device.type == "cpu" else group.device_group


def all_reduce(group, t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over a vLLM group coordinator, in ``t``'s own dtype (returns the sum)."""
    if group.world_size == 1:
        return t
    t = t.contiguous()
    if t.device.type == "cpu" and t.dtype not in _SHM_DTYPES:
        dist.all_reduce(t, group=_process_group(group, t))
        return t
    return group.all_reduce(t)


def gather_tokens(group, rows: torch.Tensor, counts: list[int], fill: float = 0) -> torch.Tensor:
    """All ranks' ``rows`` (``counts[r]`` rows on rank ``r``) stacked in rank order,
    each padded with ``fill`` rows to ``max(counts)``: ``[world * max, ...]``."""
    width = max(counts)
    if group.world_size == 1 and rows.shape[0] == width:
        return rows  # nothing to pad or exchange
    padded = rows.new_full((width, *rows.shape[1:]), fill)
    padded[: rows.shape[0]] = rows
    if group.world_size == 1:
        return padded
    out = torch.empty((group.world_size * width, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    dist.all_gather_into_tensor(out, padded.contiguous(), group=_process_group(group, out))
    return out


def token_counts(group, n: int, device) -> list[int]:
    """Every rank's token count in ``group`` (one small all-gather)."""
    if group.world_size == 1:
        return [n]
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    out = torch.empty(group.world_size, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, mine, group=_process_group(group, out))
    return out.tolist()


class TokenExchange:
    """One layer's trip of this rank's tokens through the expert group (MoE, Engram).

    ``gather`` stacks every data-parallel rank's rows (each padded to the longest,
    in rank order), ``reduce`` sums what the group's ranks computed for them, in
    the tensor's dtype, and ``own`` takes this rank's rows back.
    """

    def __init__(self, layout: ParallelLayout, n_tokens: int, device):
        self.layout = layout
        self.n_tokens = n_tokens
        if layout.dp_size > 1:
            from vllm.distributed import get_dp_group

            self.dp = get_dp_group()
            self.counts = token_counts(self.dp, n_tokens, torch.device(device))

    def gather(self, rows: torch.Tensor, fill: float = 0) -> torch.Tensor:
        if self.layout.dp_size == 1:
            return rows
        return gather_tokens(self.dp, rows, self.counts, fill)

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.layout.moe_size == 1:
            return t
        from vllm.distributed import get_ep_group

        return all_reduce(get_ep_group(), t)

    def own(self, rows: torch.Tensor) -> torch.Tensor:
        if self.layout.dp_size == 1:
            return rows
        start = self.layout.dp_rank * max(self.counts)
        return rows[start : start + self.n_tokens]
