"""Engram rows in host memory, set with vLLM's own ``EngramConfig`` (docs/design-notes.md, "Engram").

V4.1's two Engram tables (E4M3 rows with UE8M0 scales, about 100 GB each at Flash) are read a few
dozen rows per token, so DeepInfer and vLLM keep them in host memory and bring each step's rows to
the device. The plugin reads vLLM's ``engram_config`` (``LLM(..., engram_config={...})``,
``vllm serve --engram-config '{...}'``), which vLLM builds and checks for every V4.1 model on every
platform (unknown fields are refused by vLLM, by name):

* ``cpu_offload`` (vLLM's default: on): the rows live in host memory where the model runs on a
  device. On the CPU platform they are host memory already: the setting does not apply (logged
  once) and the rows stay parameters like the others.
* ``dp_shared_memory`` (vLLM turns it on with ``data_parallel_size > 1``): the data-parallel ranks of
  a host map one copy of the rows, a ``/dev/shm`` file that the first rank of each group creates
  and loads while the others attach. Rows are then split over the tensor-parallel group only, and
  every rank gathers its own tokens' rows from the host's copy: no Engram exchange over data
  parallelism. Where the ranks do not all see one ``/dev/shm`` (several hosts) or it cannot hold
  the tables, the rows stay split over the expert group in each rank's own host memory (logged),
  as vLLM falls back.
* ``embedding_across_dp``: vLLM's V4.1 does not read it (its Qwen n-gram embeddings do); the
  plugin splits rows as above whatever it says (reported in the log line).
* ``use_thp``: reported, not used (ordinary pages).

How a step's rows reach the device (the *transfer*, chosen by the device; both exact, neither
waits for the device on the host):

* ``uva`` (CUDA): the host tables are registered with the driver (``cudaHostRegister``) and read
  through a device view of them (unified virtual addressing, vLLM's approach). The hashes stay on
  the device; at the start of the step every Engram layer's gather is issued on a side stream,
  and each layer waits only for its own rows (DeepInfer's ``EngramRuntime.fetch``). Nothing is
  staged on the host, so the step can be captured in a CUDA graph.
* ``copy`` (Ascend, where no device view of host memory is known to work): the host hashes the
  step's n-grams itself, from the token ids its runner already holds (``step_windows``; the same
  integer arithmetic as the device, so the same rows), gathers the rows into a staging buffer
  (pinned where the platform pins) and copies them to device buffers, non-blocking on a side
  stream, at the start of the step. On the simulated NPU (device tensors are host tensors, in
  separate buffers) that copy is what a test can remove to see the tokens change.

Rows a rank does not own arrive as zero bytes (E4M3 zero, scale byte 0), which decode to +0.0,
so the sum over the owners is each row exactly, as with rows in device memory.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from deepinfer_vllm.configs import V41Arch
from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout, split_evenly
from deepinfer_vllm.ops.engram import engram_history_windows

logger = logging.getLogger(__name__)

__all__ = [
    "SHM_DIR",
    "TRANSFERS",
    "EngramPlacement",
    "HostRows",
    "RowTransfer",
    "dummy_windows",
    "engram_placement",
    "engram_settings",
    "host_plan",
    "step_windows",
]

TRANSFERS = ("uva", "copy")
SHM_DIR = "/dev/shm"
FIELDS = ("cpu_offload", "embedding_across_dp", "dp_shared_memory", "use_thp")


# ------------------------------------------------------------------ settings
def engram_settings(vllm_config) -> dict:
    """The fields of vLLM's ``engram_config`` (its defaults where vLLM built none).

    ``additional_config`` has no ``engram_config`` of the plugin's: vLLM accepts its own field on
    every platform, so one there is refused rather than silently ignored."""
    additional = getattr(vllm_config, "additional_config", None) or {}
    if isinstance(additional, dict) and "engram_config" in additional:
        raise ValueError(
            "additional_config['engram_config']: set Engram placement with vLLM's own engram_config "
            "(LLM(engram_config={...}) or --engram-config '{...}'), which every platform accepts"
        )
    cfg = getattr(vllm_config, "engram_config", None)
    if cfg is None:
        from vllm.config import EngramConfig

        cfg = EngramConfig()
    return {name: getattr(cfg, name) for name in FIELDS}


@dataclass(frozen=True)
class EngramPlacement:
    """Where this rank keeps its Engram rows and how a step's rows reach the device."""

    host: bool = False  # rows in host memory (else parameters in device memory)
    transfer: str | None = None  # "uva" or "copy" with host rows
    shared: bool = False  # one host copy per host, mapped by its data-parallel ranks
    settings: dict = field(default_factory=dict)  # vLLM's engram_config fields as read
    note: str = ""  # the decision, in words (logged)

    @property
    def split(self) -> str:
        """The group the rows are split over: ``tp`` with a shared host copy, else ``moe``."""
        return "tp" if self.shared else "moe"


def _transfer_for(device: torch.device) -> tuple[str | None, str]:
    """The transfer of ``device`` (None: rows stay parameters) and why."""
    import vllm.platforms

    # On the class: vLLM's Platform.__getattr__ would warn about the name on other platforms.
    declared = getattr(type(vllm.platforms.current_platform), "engram_host_transfer", None)
    if declared is not None:
        if declared not in TRANSFERS:
            raise ValueError(f"engram_host_transfer={declared!r}: expected one of {TRANSFERS}")
        return declared, "declared by the platform"
    if device.type == "cuda":
        return "uva", "CUDA device"
    if device.type == "cpu":
        return None, "does not apply on CPU (the rows are host memory already)"
    if device.type == "meta":
        return None, "is not applied to a model built on the meta device (memory planning)"
    return None, f"no transfer for device type {device.type!r}; rows stay in device memory"


def engram_placement(
    vllm_config, arch: V41Arch, layout: ParallelLayout, device: torch.device | None = None
) -> EngramPlacement:
    """Decide this rank's placement from vLLM's ``engram_config`` and the device the model is built
    on (torch's default device while vLLM builds it); logs one line. With ``dp_shared_memory`` the
    expert group checks together that its ranks see one ``/dev/shm`` that can hold the tables
    (one small collective while the model is built), so every rank decides the same."""
    settings = engram_settings(vllm_config)
    if not arch.engram_layer_ids:
        return EngramPlacement(settings=settings, note="no Engram layers")
    device = torch.device(device) if device is not None else torch.get_default_device()
    transfer, why = _transfer_for(device)
    moe = f"rows split over the expert group ({layout.moe_size} ranks)"
    unused = (
        f"embedding_across_dp={settings['embedding_across_dp']} and use_thp={settings['use_thp']} not used"
    )
    if not settings["cpu_offload"]:
        placement = EngramPlacement(
            settings=settings, note=f"rows in device memory (cpu_offload=False); {moe}"
        )
    elif transfer is None:
        placement = EngramPlacement(
            settings=settings,
            note=f"engram_config {why}: cpu_offload=True, dp_shared_memory={settings['dp_shared_memory']} "
            f"not applicable; rows are parameters, {moe}",
        )
    else:
        shared = bool(settings["dp_shared_memory"]) and layout.dp_size > 1
        how = f"{moe}, each rank's in its own memory"
        if shared:
            error = _probe_shared_memory(_table_bytes(arch))
            if error is None:
                how = (
                    f"rows split over tensor parallelism ({layout.tp_size} ranks), one copy per host "
                    "shared by its data-parallel ranks (dp_shared_memory=True)"
                )
            else:
                shared = False
                how += f" (dp_shared_memory=True not possible: {error})"
        placement = EngramPlacement(
            host=True,
            transfer=transfer,
            shared=shared,
            settings=settings,
            note=f"rows in host memory (cpu_offload=True), {transfer} transfer ({why}); {how}; {unused}",
        )
    (logger.debug if device.type == "meta" else logger.info)("DeepInfer V4.1 Engram: %s", placement.note)
    return placement


def _table_bytes(arch: V41Arch) -> int:
    """Bytes of every Engram table, values and scales."""
    dim = arch.engram_head_dim
    return sum(arch.engram_num_embeddings) * (dim + dim // 32)


def _groups():
    """vLLM's data-parallel and expert group coordinators (looked up at call time: tests stand in)."""
    import vllm.distributed

    return vllm.distributed.get_dp_group(), vllm.distributed.get_ep_group()


def _all_gather_object(group, obj) -> list:
    out = [None] * group.world_size
    torch.distributed.all_gather_object(out, obj, group=group.cpu_group)
    return out


def _probe_shared_memory(nbytes: int) -> str | None:
    """None when every rank of the expert group sees the ``/dev/shm`` of its first rank and it has
    ``nbytes`` free; else why not. Rank 0 writes a file with a random token and every rank reads
    it back (ranks on other hosts do not see it)."""
    _, group = _groups()
    path = token = error = None
    if group.rank_in_group == 0:
        try:
            if not os.path.isdir(SHM_DIR):
                raise RuntimeError(f"{SHM_DIR} is not mounted")
            free = shutil.disk_usage(SHM_DIR).free
            if free < nbytes:
                raise RuntimeError(
                    f"{SHM_DIR} has {free / 1e9:.2f} GB free, the tables need {nbytes / 1e9:.2f} GB"
                )
            token = secrets.token_hex(16)
            with tempfile.NamedTemporaryFile(
                "w", prefix="deepinfer_engram_probe_", dir=SHM_DIR, delete=False
            ) as f:
                f.write(token)
                path = f.name
        except (OSError, RuntimeError) as exc:  # reported to every rank, which then falls back together
            error = f"{type(exc).__name__}: {exc}"
    path, token, error = group.broadcast_object((path, token, error), src=0)
    seen = error is None
    if seen:
        try:
            with open(path) as f:
                seen = f.read() == token
        except OSError:
            seen = False
    seen_by = _all_gather_object(group, seen)
    if group.rank_in_group == 0 and path is not None:
        os.unlink(path)
    if error is not None:
        return error
    blind = [rank for rank, ok in enumerate(seen_by) if not ok]
    if blind:
        return f"expert-group ranks {blind} do not share /dev/shm with rank 0 (another host)"
    return None


# ---------------------------------------------------------------- host rows
def _map_shared(group, nbytes: list[int], tag: str) -> tuple[list[torch.Tensor], bool]:
    """Byte tensors of ``nbytes`` each, in ``/dev/shm`` files that rank 0 of ``group`` creates and
    every rank maps (``MAP_SHARED``); the files are unlinked once all ranks mapped them, so the
    memory goes with the last mapping. Returns the tensors and whether this rank writes them."""
    writer = group.rank_in_group == 0
    paths, error = [], None
    if writer:
        try:
            for n in nbytes:
                with tempfile.NamedTemporaryFile(
                    prefix=f"deepinfer_engram_{tag}_", dir=SHM_DIR, delete=False
                ) as f:
                    f.truncate(n)
                    paths.append(f.name)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    paths, error = group.broadcast_object((paths, error), src=0)
    if error is not None:
        raise RuntimeError(f"Engram shared memory: the first rank could not create its files: {error}")
    out = []
    for path, n in zip(paths, nbytes):
        with open(path, "r+b") as f:
            mapping = mmap.mmap(f.fileno(), n, flags=mmap.MAP_SHARED)
        # numpy keeps the mapping alive, torch keeps the array alive.
        out.append(torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8)))
    group.barrier()  # every rank mapped: the names can go
    if writer:
        for path in paths:
            os.unlink(path)
    return out, writer


def _cuda_register(t: torch.Tensor) -> int | None:
    """Page-lock ``t``'s host memory for device access (``cudaHostRegister``); returns the pointer
    to unregister (None for an empty tensor)."""
    if t.numel() == 0:
        return None
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    result = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(getattr(result, "value", result)) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of Engram rows failed: {result}")
    return ptr


def _cuda_unregister(registered: list[tuple[int, torch.Tensor]]) -> None:
    # Each entry holds its tensor, so the memory outlives its registration.
    for ptr, _ in registered:
        torch.cuda.cudart().cudaHostUnregister(ptr)


def device_view(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` reading ``t``'s registered host memory (unified virtual addressing).

    vLLM's ``get_cuda_view_from_cpu_tensor`` where vLLM's CUDA extension is loaded (it asks the
    driver for the device pointer); else a view through ``__cuda_array_interface__`` of the host
    pointer, which is the device pointer of registered memory where the device reports
    ``canUseHostPointerForRegisteredMem`` (x86-64 Linux with a current driver). On a CPU device the
    tensor itself (tests run the same code on host tensors)."""
    if device.type == "cpu" or t.numel() == 0:
        return t if device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype, device=device)
    op = getattr(getattr(torch.ops, "_C", None), "get_cuda_view_from_cpu_tensor", None)
    if op is not None:
        try:
            return op(t)
        except (RuntimeError, AttributeError):
            pass
    flat = t.view(torch.uint8)
    interface = SimpleNamespace(
        __cuda_array_interface__={
            "shape": tuple(flat.shape),
            "typestr": "|u1",
            "data": (flat.data_ptr(), False),
            "strides": None,
            "version": 3,
        },
        owner=t,  # torch keeps this object, and so the host tensor, as long as the view
    )
    return torch.as_tensor(interface, device=device).view(t.dtype)


def _rows_as_words(t: torch.Tensor) -> torch.Tensor:
    """``[n, w]`` one-byte rows viewed as the widest integers dividing ``w`` bytes (a row gather
    then moves 8 bytes per element, not 1)."""
    width = t.shape[-1] * t.element_size()
    for dtype in (torch.int64, torch.int32, torch.int16):
        if width % dtype.itemsize == 0 and t.is_contiguous():
            return t.view(torch.uint8).view(dtype)
    return t.view(torch.uint8)


class HostRows:
    """One Engram table's rows on this rank in host memory: E4M3 values ``[n, dim]`` and UE8M0
    scales ``[n, dim / 32]``, each in its own allocation (private, or a ``/dev/shm`` mapping shared
    by the data-parallel ranks of the host). ``writer``: whether this rank loads them (a rank that
    attached to a shared copy does not)."""

    def __init__(
        self, rows: int, dim: int, scale_dtype: torch.dtype, placement: EngramPlacement, tag: str = "table"
    ):
        shapes = ((rows, dim, torch.float8_e4m3fn), (rows, dim // 32, scale_dtype))
        nbytes = [n * w for n, w, _ in shapes]
        if placement.shared and rows > 0:
            dp, _ = _groups()
            flats, self.writer = _map_shared(dp, nbytes, tag)
        else:
            flats, self.writer = [torch.empty(n, dtype=torch.uint8, device="cpu") for n in nbytes], True
        self.weight, self.scale = (f.view(dtype).view(n, w) for f, (n, w, dtype) in zip(flats, shapes))
        self.shared = placement.shared and rows > 0
        self.transfer = placement.transfer
        if placement.transfer == "uva" and torch.cuda.is_available():
            registered = [(_cuda_register(t), t) for t in (self.weight, self.scale)]
            weakref.finalize(
                self, _cuda_unregister, [r for r in registered if r[0] is not None]
            ).atexit = False
        self._views: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale))

    def views(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Row-word views of the values and scales readable on ``device`` (``uva``)."""
        if device not in self._views:
            self._views[device] = tuple(
                _rows_as_words(device_view(t.view(torch.uint8), device)) for t in (self.weight, self.scale)
            )
        return self._views[device]


# ------------------------------------------------------------- the transfer
class _NullStream:
    """Host execution: work is done when issued."""

    def wait_stream(self, *args) -> None:
        pass


class Pending:
    """One table's rows of a step, on their way to the device."""

    def __init__(self, weight, scale, event, keep):
        self.weight, self.scale, self._event, self._keep = weight, scale, event, keep

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' values and scales on the device; the current stream waits for their transfer
        (not for later tables')."""
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
            self._event = None
        self._keep = None  # the host staging and indices may be reused from here
        return self.weight, self.scale


class RowTransfer:
    """Issues the step's row gathers and copies of every host table, in order, on one side stream
    (host execution on a CPU device: done when issued). ``rows_moved`` counts rows brought to the
    device (what a test checks, and a worker reports)."""

    def __init__(self, transfer: str):
        if transfer not in TRANSFERS:
            raise ValueError(f"transfer {transfer!r}: expected one of {TRANSFERS}")
        self.transfer = transfer
        self._stream = None
        self.rows_moved = 0

    def _side_stream(self, device: torch.device):
        if device.type == "cpu":
            return None
        if self._stream is None:  # created in the worker, where torch.cuda names the device's streams
            self._stream = torch.cuda.Stream()
        return self._stream

    def issue(
        self, host: HostRows, local: torch.Tensor, owned: torch.Tensor, device: torch.device
    ) -> Pending:
        """Rows ``local`` (this rank's row ids, ``[N, cols]``, in range) of ``host`` to ``device``;
        rows not ``owned`` arrive as zero bytes. ``local``/``owned`` live on the host for ``copy``,
        on the device for ``uva``."""
        shape = tuple(local.shape)
        flat, keep = local.reshape(-1), ~owned.reshape(-1)
        dim, sdim = host.weight.shape[1], host.scale.shape[1]
        weight = torch.empty((*shape, dim), dtype=host.weight.dtype, device=device)
        scale = torch.empty((*shape, sdim), dtype=host.scale.dtype, device=device)
        self.rows_moved += flat.numel()
        if host.weight.shape[0] == 0:  # a shard without rows: every row is another rank's
            weight.view(torch.uint8).zero_()
            scale.view(torch.uint8).zero_()
            return Pending(weight, scale, None, None)
        outs = [_rows_as_words(t.view(-1, t.shape[-1])) for t in (weight, scale)]
        stream = self._side_stream(device)
        event = None
        if self.transfer == "copy":
            pin = _pin_memory()
            staged = []
            for src, out in zip((host.weight, host.scale), outs):
                rows = torch.empty(out.shape, dtype=out.dtype, pin_memory=pin)
                torch.index_select(_rows_as_words(src), 0, flat, out=rows)
                rows[keep] = 0
                staged.append(rows)
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())  # the outputs were allocated there
                with torch.cuda.stream(stream):
                    for rows, out in zip(staged, outs):
                        out.copy_(rows, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
            else:
                for rows, out in zip(staged, outs):
                    out.copy_(rows)
            kept = (staged, flat, keep)
        else:
            sources = host.views(device)
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())  # hashes and outputs come from there
                with torch.cuda.stream(stream):
                    for src, out in zip(sources, outs):
                        torch.index_select(src, 0, flat, out=out)
                        out.masked_fill_(keep.unsqueeze(1), 0)
                    event = torch.cuda.Event()
                    event.record(stream)
            else:
                for src, out in zip(sources, outs):
                    torch.index_select(src, 0, flat, out=out)
                    out.masked_fill_(keep.unsqueeze(1), 0)
            kept = (flat, keep)
        return Pending(weight, scale, event, kept)


def _pin_memory() -> bool:
    from vllm.utils.platform_utils import is_pin_memory_available

    return is_pin_memory_available()


# ------------------------------------------------------------- host windows
def step_windows(model, input_batch, num_scheduled_tokens) -> torch.Tensor | None:
    """The step's n-gram windows on the host (raw ids at ``p - s``, -1 before the start) for a model
    that hashes its Engram rows there (``copy`` transfer), from vLLM's ``InputBatch`` (every
    request's token ids and computed-token count, host arrays the runner keeps); None for any other
    model. The tokens are laid out as vLLM's runner lays them out (``_prepare_inputs``)."""
    depth = getattr(model, "engram_host_window_depth", 0)
    if not depth:
        return None
    n = np.asarray(num_scheduled_tokens, dtype=np.int64)
    req = np.repeat(np.arange(n.shape[0]), n)
    first = np.repeat(np.cumsum(n) - n, n)
    positions = input_batch.num_computed_tokens_cpu[req] + (np.arange(req.shape[0]) - first)
    return engram_history_windows(
        input_batch.token_ids_cpu_tensor, torch.from_numpy(req), torch.from_numpy(positions), depth
    )


def dummy_windows(model, num_tokens: int) -> torch.Tensor | None:
    """Windows of a dummy batch (vLLM's profiling, warm-up and idle data-parallel steps, whose
    outputs are discarded): every slot before the start, so the host hashes the pad n-grams."""
    depth = getattr(model, "engram_host_window_depth", 0)
    return torch.full((num_tokens, depth), -1, dtype=torch.int64) if depth else None


# ------------------------------------------------------------------ planning
def host_plan(arch: V41Arch, tp: int, dp: int, ranks_per_host: int, shared: bool) -> dict[str, int]:
    """Host bytes of the Engram rows with ``cpu_offload``: ``per_rank`` (private memory of one rank,
    the largest; 0 with a shared copy), ``mapped_per_rank`` (what a rank reads from: its own rows,
    or its TP shard of the host's shared copy) and ``per_host`` (the rows of the host's
    ``ranks_per_host`` ranks; with ``shared`` every TP shard on the host once)."""
    dim = arch.engram_head_dim
    width = dim + dim // 32

    def rows(parts: int, ranks: range) -> int:
        return sum(
            hi - lo
            for n in arch.engram_num_embeddings
            for lo, hi in (split_evenly(n, parts, r) for r in ranks)
        )

    if shared:
        mapped = rows(tp, range(1)) * width
        return {
            "per_rank": 0,
            "mapped_per_rank": mapped,
            "per_host": rows(tp, range(min(tp, ranks_per_host))) * width,
        }
    moe = tp * dp
    per_rank = rows(moe, range(1)) * width
    return {
        "per_rank": per_rank,
        "mapped_per_rank": per_rank,
        "per_host": rows(moe, range(min(moe, ranks_per_host))) * width,
    }
