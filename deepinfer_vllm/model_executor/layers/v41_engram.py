"""Engram conditional memory (docs/architecture.md, "Engram"): FP8 row tables split over the expert group,
held as parameters in device memory or in host memory (``model_executor.engram_host``, set by vLLM's
``engram_config``). ``EngramRuntime`` hashes every Engram layer's rows at the start of a step and, for
rows in host memory, starts bringing them to the device there (DeepInfer's ``EngramRuntime.fetch``);
each layer then takes its own rows."""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.linear import ColumnParallelLinear

from deepinfer_vllm.attention_backends.cache_layout import CacheDecl
from deepinfer_vllm.attention_backends.mla_swa import V41CacheLayer
from deepinfer_vllm.configs import V41Arch
from deepinfer_vllm.model_executor.engram_host import EngramPlacement, HostRows, Pending, RowTransfer
from deepinfer_vllm.model_executor.layers.parallel import (
    ParallelLayout,
    TokenExchange,
    all_reduce,
    gather_tokens,
    split_evenly,
    token_counts,
)
from deepinfer_vllm.model_executor.layers.params import held, ue8m0_dtype
from deepinfer_vllm.model_executor.layers.step_state import StepState
from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.engram import (
    ENGRAM_BEFORE_START,
    compress_token_ids,
    engram_gate_update,
    engram_hash,
    engram_multipliers,
    engram_offsets,
    engram_primes,
)


class EngramTables:
    """Hash constants shared by all Engram layers, derived once from the config."""

    def __init__(self, arch: V41Arch):
        self.old2new: torch.Tensor | None = None
        self.pad_id: int | None = None
        self.max_ngram = arch.engram_max_ngram_size
        self.pad_token_id = arch.engram_pad_token_id
        self.image_token_id = arch.image_token_id
        primes = engram_primes(
            arch.engram_layer_ids, arch.engram_max_ngram_size, arch.engram_n_heads, arch.engram_vocab_size
        )
        self.primes = primes
        self.offsets = {layer: engram_offsets(p) for layer, p in primes.items()}
        self.multipliers: dict[int, list[int]] = {}
        self.compressed_vocab_size = arch.engram_compressed_vocab_size
        self._arch = arch

    def set_vocab(self, old2new: torch.Tensor) -> None:
        """Raw id -> compressed id, derived from the checkpoint's tokenizer at load time
        (the hash multipliers depend on the compressed vocabulary's size)."""
        a = self._arch
        largest = int(old2new.max()) if old2new.numel() else -1
        if largest >= a.engram_compressed_vocab_size:
            raise ValueError(
                f"the tokenizer compresses to id {largest}, outside engram_compressed_vocab_size="
                f"{a.engram_compressed_vocab_size} of the config: tokenizer and config do not match"
            )
        self.old2new = old2new
        self._old2new_on: dict[torch.device, torch.Tensor] = {}
        self.pad_id = int(old2new[self.pad_token_id])
        self.multipliers = {
            layer: engram_multipliers(layer, a.engram_max_ngram_size, a.engram_compressed_vocab_size)
            for layer in a.engram_layer_ids
        }

    def ngram_ids(self, raw_history: torch.Tensor, is_image_history: torch.Tensor) -> torch.Tensor:
        """``raw_history [T, max_ngram]`` raw ids at ``p - s`` (-1 before the start)."""
        before = raw_history < 0
        device = raw_history.device
        if device not in self._old2new_on:  # once per device, not once per step
            self._old2new_on[device] = self.old2new.to(device, torch.int64)
        comp = compress_token_ids(raw_history.clamp_min(0), self._old2new_on[device], is_image_history)
        return torch.where(before, torch.full_like(comp, ENGRAM_BEFORE_START), comp)

    def rows(self, layer_id: int, ngram_ids: torch.Tensor) -> torch.Tensor:
        """Global row ids ``[T, cols]`` of layer ``layer_id``'s table for the n-grams ``ngram_ids``
        (int64 arithmetic: the same ids on the host as on any device)."""
        return engram_hash(
            ngram_ids,
            self.pad_id,
            self.multipliers[layer_id],
            self.primes[layer_id],
            self.offsets[layer_id],
            id_bound=self.compressed_vocab_size,
        )


class TokenHistory(nn.Module):
    """Raw token ids of the last positions, paged by vLLM (Engram look-back)."""

    def __init__(self, decl: CacheDecl, cache_layers: dict[str, V41CacheLayer]):
        super().__init__()
        self.cache = V41CacheLayer(decl)
        cache_layers[decl.name] = self.cache

    def _slots(self, state: StepState, pos: torch.Tensor, req: torch.Tensor):
        meta = state.attn_metadata[self.cache.prefix]
        blocks = meta.block_table[req, pos // meta.block_size]
        return blocks, pos % meta.block_size

    def record_and_read(self, input_ids: torch.Tensor, state: StepState, depth: int) -> torch.Tensor:
        """Store this step's ids, then return ids at ``p - s`` for s < depth (-1 before 0)."""
        cache = self.cache.kv_cache.view(self.cache.kv_cache.shape[0], -1)
        pos, req = state.positions, state.token_req
        blocks, offs = self._slots(state, pos, req)
        cache[blocks, offs] = input_ids.to(torch.int32)
        back = pos.unsqueeze(1) - torch.arange(depth, device=pos.device)
        valid = back >= 0
        safe = back.clamp_min(0)
        blocks, offs = self._slots(state, safe, req.unsqueeze(1).expand_as(safe))
        ids = cache[blocks, offs].long()
        return torch.where(valid, ids, torch.full_like(ids, -1))


class EngramTable(nn.Module):
    """One Engram table as released (E4M3 rows, UE8M0 per 1x32), its rows split over vLLM's expert
    group (over the tensor-parallel group when the host's data-parallel ranks share one copy): this
    rank holds rows ``[row0, row0 + rows)`` and a lookup gathers every row from its owner. The rows
    are parameters in device memory, or ``host`` (``HostRows``) with the parameters viewing them
    there."""

    def __init__(
        self,
        num_rows: int,
        dim: int,
        layout: ParallelLayout,
        placement: EngramPlacement | None = None,
        tag: str = "table",
    ):
        super().__init__()
        self.layout = layout
        self.placement = placement = placement or EngramPlacement()
        if placement.split == "tp":
            self.group_size, rank = layout.tp_size, layout.tp_rank
        else:
            self.group_size, rank = layout.moe_size, layout.moe_rank
        lo, hi = split_evenly(num_rows, self.group_size, rank)
        self.row0, n = lo, hi - lo
        self.host: HostRows | None = None
        if placement.host:
            self.host = HostRows(n, dim, ue8m0_dtype(), placement, tag)
            self.weight = nn.Parameter(self.host.weight, requires_grad=False)
            self.scale = nn.Parameter(self.host.scale, requires_grad=False)
        else:
            self.weight = held(n, dim, dtype=torch.float8_e4m3fn)
            self.scale = held(n, dim // 32, dtype=ue8m0_dtype())
        for p in (self.weight, self.scale):
            p.weight_loader = self._load_rows

    @property
    def exchanges(self) -> bool:
        """Whether a lookup needs every data-parallel rank's rows (rows split over the expert group)."""
        return self.placement.split == "moe" and self.layout.dp_size > 1

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.host is not None and not self.host.writer:
            return  # a copy shared by the host's data-parallel ranks: its first rank loads it
        src = loaded.narrow(0, self.row0, param.shape[0])
        param.data.copy_(src.view(param.dtype) if src.element_size() == 1 else src)

    def _owned(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows held here, decoded to ``dtype``; zeros for rows held elsewhere."""
        n = self.weight.shape[0]
        if n == 0:
            return torch.zeros(*rows.shape, self.weight.shape[1], dtype=dtype, device=rows.device)
        safe, owned = self.local(rows)
        emb = quant.dequant_fp8_rows(self.weight[safe], self.scale[safe], dtype)
        return emb.masked_fill_(~owned.unsqueeze(-1), 0.0)

    def local(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's row ids of global ``rows`` (0 where it does not own the row) and which it owns."""
        local = rows - self.row0
        owned = (local >= 0) & (local < self.weight.shape[0])
        return torch.where(owned, local, torch.zeros_like(local)), owned

    def lookup(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows in device memory: ``rows [T, cols]`` (global row ids) -> decoded rows
        ``[T, cols, dim]`` in ``dtype``."""
        if self.layout.moe_size == 1:
            return quant.dequant_fp8_rows(self.weight[rows], self.scale[rows], dtype)
        ex = TokenExchange(self.layout, rows.shape[0], rows.device)
        # Every row has one owner, so the sum over ranks is that row, exactly.
        return ex.own(ex.reduce(self._owned(ex.gather(rows, fill=self.row0), dtype)))

    def combine(self, emb: torch.Tensor, exchange: TokenExchange | None) -> torch.Tensor:
        """Rows from host memory, decoded (zeros where another rank owns the row) -> every row of
        this rank's tokens: summed over the owners and, after an exchange, this rank's tokens taken
        back."""
        if exchange is not None:
            return exchange.own(exchange.reduce(emb))
        if self.group_size == 1:
            return emb
        from vllm.distributed import get_ep_group, get_tp_group

        return all_reduce(get_tp_group() if self.placement.split == "tp" else get_ep_group(), emb)


class _CountedExchange(TokenExchange):
    """``TokenExchange`` whose ranks' token counts are already known on the host (no device read)."""

    def __init__(self, layout: ParallelLayout, n_tokens: int, counts: list[int]):
        from vllm.distributed import get_dp_group

        self.layout, self.n_tokens, self.counts = layout, n_tokens, counts
        self.dp = get_dp_group()


class EngramStep:
    """One step's Engram inputs, shared by its Engram layers: every layer's global row ids
    (``rows``), the image mask, and for rows in host memory the transfers already issued."""

    def __init__(
        self,
        is_image: torch.Tensor,
        rows: dict[int, torch.Tensor],
        pending: dict[int, Pending] | None = None,
        exchange: TokenExchange | None = None,
    ):
        self.is_image = is_image
        self.rows = rows
        self.pending = pending or {}
        self.exchange = exchange

    def embeddings(self, layer_id: int, table: EngramTable, dtype: torch.dtype) -> torch.Tensor:
        """Layer ``layer_id``'s decoded rows ``[T, cols, dim]`` for this rank's tokens."""
        if table.host is None:
            return table.lookup(self.rows[layer_id], dtype)
        weight, scale = self.pending.pop(layer_id).wait()
        return table.combine(quant.dequant_fp8_rows(weight, scale, dtype), self.exchange)


class EngramRuntime:
    """The step-level side of the Engram layers (``tables``: layer id -> its table): ``start`` reads
    the step's n-gram windows, hashes every layer's rows and, for tables in host memory, issues
    their transfers to the device before the first layer runs.

    Windows come from the device's token history, or, with the ``copy`` transfer, from the host:
    the runner reads them from its token table (``engram_host.step_windows``) into the step
    metadata (``engram_windows``), and the host hashes them, so no row id is read back from the
    device."""

    def __init__(
        self,
        hash_tables: EngramTables,
        history: TokenHistory,
        tables: dict[int, EngramTable],
        placement: EngramPlacement,
        layout: ParallelLayout,
    ):
        self.hash_tables = hash_tables
        self.history = history
        self.tables = tables
        self.placement = placement
        self.layout = layout
        self.transfer = RowTransfer(placement.transfer) if placement.host else None

    @property
    def window_depth(self) -> int:
        """Columns of the host windows the runner must provide (0: none, the device hashes)."""
        return self.hash_tables.max_ngram if self.placement.transfer == "copy" else 0

    def report(self) -> dict:
        """Where the rows are: bytes of the tables' rows in host memory and as device parameters,
        the transfer, whether the host copy is shared, and rows moved to the device so far."""
        host = [t.host for t in self.tables.values() if t.host is not None]
        device = sum(
            p.numel() * p.element_size()
            for t in self.tables.values()
            if t.host is None
            for p in (t.weight, t.scale)
        )
        return {
            "host_bytes": sum(h.nbytes for h in host),
            "device_bytes": device,
            "transfer": self.placement.transfer,
            "shared": self.placement.shared,
            "rows_moved": self.transfer.rows_moved if self.transfer is not None else 0,
        }

    def loaded(self) -> None:
        """After loading: ranks that attached to a shared host copy wait until its writer loaded it."""
        if any(t.host is not None and t.host.shared for t in self.tables.values()):
            from vllm.distributed import get_dp_group

            get_dp_group().barrier()

    def start(self, input_ids: torch.Tensor, state: StepState, is_image: torch.Tensor) -> EngramStep:
        """The step's Engram inputs (``input_ids``: this rank's ``T`` tokens)."""
        depth = self.hash_tables.max_ngram
        T = input_ids.shape[0]
        if self.window_depth:
            raw = self._host_windows(state, T)
        elif state.has_caches:
            raw = self.history.record_and_read(input_ids, state, depth)
        else:
            raw = torch.full((T, depth), -1, dtype=torch.int64, device=input_ids.device)
            raw[:, 0] = input_ids
        ngram_ids = self.hash_tables.ngram_ids(raw, raw == self.hash_tables.image_token_id)
        rows = {layer_id: self.hash_tables.rows(layer_id, ngram_ids) for layer_id in self.tables}
        return self.begin(rows, is_image)

    def _host_windows(self, state: StepState, T: int) -> torch.Tensor:
        if not state.has_caches:
            # vLLM's profiling and dummy runs: outputs are discarded, hash the pad n-grams.
            return torch.full((T, self.window_depth), -1, dtype=torch.int64)
        meta = next(iter(state.attn_metadata.values()))
        windows = getattr(meta, "engram_windows", None)
        if windows is None or windows.shape != (T, self.window_depth):
            raise RuntimeError(
                "Engram rows in host memory (copy transfer) are hashed on the host from the step's "
                f"n-gram windows [{T}, {self.window_depth}] (step metadata 'engram_windows', filled by "
                "DeepInfer's runner); this step has "
                + ("none" if windows is None else f"{list(windows.shape)}")
            )
        return windows.to("cpu", torch.int64)

    def begin(self, rows: dict[int, torch.Tensor], is_image: torch.Tensor) -> EngramStep:
        """Issue the transfers of every table in host memory for ``rows`` (layer id -> global row
        ids of this rank's tokens; on the host for ``copy``, on the device otherwise)."""
        if self.transfer is None:
            return EngramStep(is_image, rows)
        T, device = is_image.shape[0], is_image.device
        exchange = None
        if any(t.exchanges for t in self.tables.values()):
            # Every data-parallel rank's rows, so that each owner can serve them.
            ids = list(rows)
            both = torch.cat([rows[i] for i in ids], dim=1)
            if self.placement.transfer == "copy":
                from vllm.distributed import get_dp_group

                dp = get_dp_group()
                counts = token_counts(dp, T, both.device)  # host tensors: the group's CPU side
                exchange = _CountedExchange(self.layout, T, counts)
                both = gather_tokens(dp, both, counts, fill=-1)
            else:
                exchange = TokenExchange(self.layout, T, device)
                both = exchange.gather(both, fill=-1)
            rows = dict(zip(ids, both.split([rows[i].shape[1] for i in ids], dim=1)))
        pending = {}
        for layer_id, table in self.tables.items():
            local, owned = table.local(rows[layer_id])
            pending[layer_id] = self.transfer.issue(table.host, local, owned, device)
        return EngramStep(is_image, rows, pending, exchange)


class V41Engram(nn.Module):
    """One Engram layer: the FP8 row table, ``wkv`` (column-parallel, gathered) and the
    per-stream gate weights (replicated)."""

    def __init__(
        self,
        arch: V41Arch,
        layer_id: int,
        num_rows: int,
        quant_config,
        layout: ParallelLayout,
        prefix: str,
        placement: EngramPlacement | None = None,
    ):
        super().__init__()
        self.layer_id = layer_id
        self.eps = arch.rms_norm_eps
        n_cols = arch.engram_n_columns
        dim = arch.engram_head_dim
        self.embed = EngramTable(num_rows, dim, layout, placement, tag=f"layer{layer_id}")
        self.wkv = ColumnParallelLinear(
            n_cols * dim,
            (arch.hc_mult + 1) * arch.hidden_size,
            bias=False,
            gather_output=True,
            quant_config=quant_config,
            prefix=f"{prefix}.wkv",
            return_bias=False,
        )
        self.q_weight = held(arch.hc_mult, arch.hidden_size, dtype=torch.bfloat16)
        self.k_weight = held(arch.hc_mult, arch.hidden_size, dtype=torch.bfloat16)

    def forward(self, streams: torch.Tensor, step: EngramStep) -> torch.Tensor:
        emb = step.embeddings(self.layer_id, self.embed, streams.dtype)
        kv = self.wkv(emb.flatten(1))
        return engram_gate_update(streams, kv, self.q_weight, self.k_weight, self.eps, step.is_image)
