"""Two gloo ranks (data parallel 2, one host) look up Engram rows kept in host memory, each for its own
tokens (different counts), in every placement ``model_executor.engram_host`` makes, and compare the
decoded rows with one process holding the whole table in "device" memory (CPU tensors), bit for bit:

* ``shared``: ``dp_shared_memory``: one ``/dev/shm`` copy for both ranks, rows split over TP (one
  rank), each rank gathering its own tokens' rows; rank 0 loads the table, rank 1 is handed a
  different (wrong) table to load and must attach to rank 0's copy instead;
* ``copy``: rows split over the two ranks in private host memory, the row ids exchanged on the host
  (the ranks' CPU group) and rows copied to device buffers;
* ``uva``: the same split, row ids exchanged on the device and rows gathered through a device view
  of host memory (here the host tensors themselves: the CPU stands in for the device);
* ``device``: rows as device parameters (the plugin's path with ``cpu_offload=False``).

Also: the expert group decides together whether it can share (``/dev/shm`` too small, or a rank that
cannot see rank 0's ``/dev/shm``, as on another host: both fall back to private rows).

Rank 0 writes what both saw to a JSON file for ``test_engram_host.py``.
Run: ``python engram_host_ranks.py PORT OUT.json``.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROWS, DIM, COLS = 1000, 64, 6
TOKENS = (5, 9)  # per rank: the exchange pads to the longest


class Coordinator:
    """The parts of vLLM's ``GroupCoordinator`` the Engram placement and exchanges use (gloo)."""

    def __init__(self, size: int | None = None, rank: int | None = None):
        self.world_size = dist.get_world_size() if size is None else size
        self.rank_in_group = dist.get_rank() if rank is None else rank
        self.cpu_group = self.device_group = dist.group.WORLD

    def all_reduce(self, t):
        if self.world_size > 1:
            dist.all_reduce(t, group=self.cpu_group)
        return t

    def broadcast_object(self, obj=None, src: int = 0):
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.cpu_group)
        return box[0]

    def barrier(self):
        dist.barrier(group=self.cpu_group)


def _table(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A table in the released format: E4M3 rows, UE8M0 scales per 32."""
    from deepinfer_vllm.ops import quant

    g = torch.Generator().manual_seed(seed)
    values, scales = quant.quant_fp8_rows(torch.randn(ROWS, DIM, generator=g) * 3)
    return values.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu)


def _rows(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, ROWS, (TOKENS[rank], COLS), generator=g)


def _config(**engram):
    from vllm.config import EngramConfig

    return SimpleNamespace(engram_config=EngramConfig(**engram), additional_config={})


def _arch():
    return SimpleNamespace(engram_layer_ids=(1,), engram_num_embeddings=(ROWS,), engram_head_dim=DIM)


def _shm_files() -> list[str]:
    from deepinfer_vllm.model_executor.engram_host import SHM_DIR

    return sorted(f for f in os.listdir(SHM_DIR) if f.startswith("deepinfer_engram_"))


def _mapped_engram_files() -> list[str]:
    """The ``/dev/shm`` Engram files this process maps (their names stay in the maps once unlinked)."""
    with open("/proc/self/maps") as f:
        return sorted({line.split(None, 5)[5].strip() for line in f if "deepinfer_engram_" in line})


def run_mode(rank: int, mode: str) -> dict:
    import vllm.platforms

    from deepinfer_vllm.model_executor.engram_host import EngramPlacement, engram_placement
    from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout
    from deepinfer_vllm.model_executor.layers.v41_engram import EngramRuntime, EngramTable
    from deepinfer_vllm.ops import quant

    layout = ParallelLayout(dp_size=2, dp_rank=rank, expert_parallel=True)
    platform = type(vllm.platforms.current_platform)
    out: dict = {}
    if mode == "device":
        placement = EngramPlacement()
    else:
        platform.engram_host_transfer = "uva" if mode == "uva" else "copy"
        placement = engram_placement(
            _config(dp_shared_memory=mode == "shared"), _arch(), layout, torch.device("cpu")
        )
        del platform.engram_host_transfer
    out["placement"] = [placement.host, placement.transfer, placement.shared, placement.split]
    table = EngramTable(ROWS, DIM, layout, placement, tag=f"test{mode}")
    values, scales = _table(seed=1)
    if mode == "shared" and rank == 1:
        values, scales = _table(seed=2)  # a rank that attached must not load (and so overwrite) these
    for param, loaded in ((table.weight, values), (table.scale, scales)):
        param.weight_loader(param, loaded)
    runtime = EngramRuntime(None, None, {1: table}, placement, layout)
    runtime.loaded()
    if mode == "shared":
        dist.barrier()
        out["writer"] = table.host.writer
        out["mapped"] = _mapped_engram_files()
        out["left_in_shm"] = _shm_files()
        out["held_rows"] = table.weight.shape[0]
    ref_values, ref_scales = _table(seed=1)
    equal = []
    for step in range(3):
        rows = _rows(rank, step)
        for dtype in (torch.float32, torch.bfloat16):
            step_inputs = runtime.begin({1: rows}, torch.zeros(rows.shape[0], dtype=torch.bool))
            got = step_inputs.embeddings(1, table, dtype)
            want = quant.dequant_fp8_rows(ref_values[rows], ref_scales[rows], dtype)
            equal.append(bool(torch.equal(got, want)))
    out["equal"] = equal
    out["rows_moved"] = runtime.transfer.rows_moved if runtime.transfer is not None else 0
    return out


def fallbacks(rank: int) -> dict:
    """The group's shared-memory decision when it cannot share, on both ranks."""
    import vllm.platforms

    from deepinfer_vllm.model_executor import engram_host
    from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout

    layout = ParallelLayout(dp_size=2, dp_rank=rank, expert_parallel=True)
    platform = type(vllm.platforms.current_platform)
    platform.engram_host_transfer = "copy"
    out = {}
    # /dev/shm too small for the tables (they are larger than any /dev/shm here).
    big = SimpleNamespace(engram_layer_ids=(1,), engram_num_embeddings=(1 << 50,), engram_head_dim=DIM)
    p = engram_host.engram_placement(_config(dp_shared_memory=True), big, layout, torch.device("cpu"))
    out["too_small"] = [p.shared, p.split, "GB free" in p.note]
    # Rank 1 cannot read rank 0's /dev/shm (as on another host).
    if rank == 1:
        engram_host.open = lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError(a[0]))
    p = engram_host.engram_placement(_config(dp_shared_memory=True), _arch(), layout, torch.device("cpu"))
    if rank == 1:
        del engram_host.open
    out["other_host"] = [p.shared, p.split, "ranks [1] do not share /dev/shm" in p.note]
    dist.barrier()  # rank 0 removed its probe file
    out["left_in_shm"] = _shm_files()
    del platform.engram_host_transfer
    return out


def rank_main(rank: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import vllm.distributed

    coord = Coordinator()
    vllm.distributed.get_dp_group = lambda: coord
    vllm.distributed.get_ep_group = lambda: coord
    vllm.distributed.get_tp_group = lambda: Coordinator(1, 0)
    reports = {mode: run_mode(rank, mode) for mode in ("shared", "copy", "uva", "device")}
    reports["fallbacks"] = fallbacks(rank)
    gathered = [None, None]
    dist.all_gather_object(gathered, reports)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.barrier()  # neither rank leaves while the other still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    port, out_path = int(sys.argv[1]), sys.argv[2]
    mp.spawn(rank_main, args=(port, out_path), nprocs=2)
