"""Engram rows in host memory (``model_executor.engram_host``, vLLM's ``engram_config``).

In-process: the model with its rows in host memory, each step's rows brought to device buffers by
either transfer (``copy``: hashed on the host from the step's windows; ``uva``: hashed on the device,
read through a view of host memory), gives the logits of the rows-in-device-memory model bit for bit,
through chunked prefill and decode of two requests, in fp32 and bf16; a transfer that leaves the
device buffers unfilled changes them. The CPU platform itself keeps the rows as parameters and says
so. Two gloo processes (``engram_host_ranks.py``): the shared host copy, the split rows and the
fallbacks.

The CPU stands in for the device here: the platform is told which transfer it declares, as
DeepInfer's Ascend platform does (``engram_host_transfer``); device buffers are separate tensors.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from deepinfer_vllm.model_executor import engram_host
from deepinfer_vllm.ops.engram import engram_history_windows

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from v41_harness import PagedHarness

# Two requests: prompts in chunks (interleaved, a chunk that is not the first), then decode.
_A = [(7 * i + 3) % 997 for i in range(40)]
_B = [(11 * i + 5) % 997 for i in range(23)]
STEPS = [
    [("a", _A[:17]), ("b", _B[:9])],
    [("b", _B[9:]), ("a", _A[17:])],
    [("a", [5]), ("b", [7])],
    [("a", [11]), ("b", [13])],
]


def _with_windows(harness: PagedHarness, chunks) -> tuple:
    """``harness.prepare`` plus what DeepInfer's runner adds for the host hash: each token's window
    of raw ids, read from the host's copy of every request's ids (``engram_history_windows``)."""
    ids, positions, metadata = harness.prepare(chunks)
    depth = harness.model.engram_host_window_depth
    if depth:
        table = torch.full((len(chunks), 1024), -1, dtype=torch.int32)
        rows, pos = [], []
        for i, (rid, new) in enumerate(chunks):
            tokens = harness.requests[rid].tokens
            table[i, : len(tokens)] = torch.tensor(tokens)
            rows += [i] * len(new)
            pos += range(len(tokens) - len(new), len(tokens))
        windows = engram_history_windows(table, torch.tensor(rows), torch.tensor(pos), depth)
        for meta in metadata.values():
            meta.engram_windows = windows
    return ids, positions, metadata


def _run(harness: PagedHarness) -> list[torch.Tensor]:
    harness.reset()
    return [harness.run(_with_windows(harness, chunks)) for chunks in STEPS]


@pytest.fixture
def platform_transfer(monkeypatch):
    """Make the (CPU) platform declare a transfer, as DeepInfer's Ascend platform declares ``copy``."""
    import vllm.platforms

    def declare(transfer: str) -> None:
        monkeypatch.setattr(
            type(vllm.platforms.current_platform), "engram_host_transfer", transfer, raising=False
        )

    return declare


@pytest.fixture(scope="module")
def device_logits(tiny_checkpoint):
    return {dtype: _run(PagedHarness(tiny_checkpoint, dtype=dtype)) for dtype in ("float32", "bfloat16")}


@pytest.mark.parametrize("transfer, dtype", [("copy", "float32"), ("copy", "bfloat16"), ("uva", "float32")])
def test_rows_in_host_memory_equal_rows_in_device_memory(
    tiny_checkpoint, device_logits, platform_transfer, transfer, dtype
):
    platform_transfer(transfer)
    harness = PagedHarness(tiny_checkpoint, dtype=dtype)
    model = harness.model
    table = model.layers[1].engram.embed
    assert model.engram_placement.host and model.engram_placement.transfer == transfer
    # The rows live in host buffers of their own; the parameters the loader filled are views of them.
    assert table.host is not None and table.weight.data_ptr() == table.host.weight.data_ptr()
    assert table.scale.data_ptr() == table.host.scale.data_ptr()
    assert model.engram_runtime.report()["device_bytes"] == 0
    got = _run(harness)
    for step, (a, b) in enumerate(zip(got, device_logits[dtype])):
        assert torch.equal(a, b), f"step {step}"
    tokens = sum(len(new) for chunks in STEPS for _, new in chunks)
    assert model.engram_runtime.transfer.rows_moved == tokens * model.arch.engram_n_columns
    assert model.engram_host_window_depth == (model.arch.engram_max_ngram_size if transfer == "copy" else 0)


def test_unfilled_device_buffers_change_the_logits(
    tiny_checkpoint, device_logits, platform_transfer, monkeypatch
):
    """The comparison can fail: rows that never reach their device buffers (zeros there) give other
    logits from the first step on."""
    platform_transfer("copy")
    issue = engram_host.RowTransfer.issue

    def unfilled(self, host, local, owned, device):
        pending = issue(self, host, local, owned, device)
        pending.weight.view(torch.uint8).zero_()
        return pending

    monkeypatch.setattr(engram_host.RowTransfer, "issue", unfilled)
    got = _run(PagedHarness(tiny_checkpoint, dtype="float32"))
    assert not any(torch.equal(a, b) for a, b in zip(got, device_logits["float32"]))


def test_a_step_without_host_windows_is_refused(tiny_checkpoint, platform_transfer):
    platform_transfer("copy")
    harness = PagedHarness(tiny_checkpoint, dtype="float32")
    with pytest.raises(RuntimeError, match="engram_windows"):
        harness.step([("a", _A[:5])])


def test_cpu_platform_keeps_rows_as_parameters_and_says_so(tiny_checkpoint, log_lines):
    """On the CPU platform ``cpu_offload`` (vLLM's default: on) does not apply: one log line, rows
    stay parameters, nothing is moved."""
    from vllm.engine.arg_utils import EngineArgs

    from deepinfer_vllm.configs import V41Arch
    from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout

    cfg = EngineArgs(model=tiny_checkpoint, engram_config={"dp_shared_memory": False}).create_engine_config()
    arch = V41Arch.from_config(cfg.model_config.hf_config)
    with log_lines(engram_host.__name__) as lines:
        placement = engram_host.engram_placement(cfg, arch, ParallelLayout(), torch.device("cpu"))
    assert not placement.host and placement.transfer is None
    assert len(lines) == 1, lines
    assert (
        "does not apply on CPU" in lines[0]
        and "cpu_offload=True" in lines[0]
        and "not applicable" in lines[0]
    )


def test_settings_are_vllms_engram_config(tiny_checkpoint):
    """vLLM's own field, as vLLM spells and checks it (an unknown field is refused by name); the
    plugin has no spelling of its own in ``additional_config``."""
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(model=tiny_checkpoint, engram_config={"cpu_offload": False}).create_engine_config()
    assert engram_host.engram_settings(cfg) == {
        "cpu_offload": False,
        "embedding_across_dp": False,
        "dp_shared_memory": False,  # vLLM resolves it: off with one data-parallel rank
        "use_thp": False,
    }
    with pytest.raises(Exception, match="cpu_offlaod"):
        EngineArgs(model=tiny_checkpoint, engram_config={"cpu_offlaod": True}).create_engine_config()
    wrong = SimpleNamespace(engram_config=None, additional_config={"engram_config": {"cpu_offload": True}})
    with pytest.raises(ValueError, match="vLLM's own engram_config"):
        engram_host.engram_settings(wrong)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from vllm.utils.network_utils import get_open_port

    out = tmp_path_factory.mktemp("engram_host") / "report.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "engram_host_ranks.py"), str(get_open_port()), str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["shared", "copy", "uva", "device"])
def test_two_ranks_gather_every_row_exactly(ranks, mode):
    """Each rank's rows, fp32 and bf16, three steps, equal one process holding the whole table."""
    for rank in ranks:
        assert rank[mode]["equal"] == [True] * 6
    host, transfer, shared, split = ranks[0][mode]["placement"]
    assert (host, transfer, shared, split) == {
        "shared": (True, "copy", True, "tp"),
        "copy": (True, "copy", False, "moe"),
        "uva": (True, "uva", False, "moe"),
        "device": (False, None, False, "moe"),
    }[mode]
    # Shared: each rank moves its own tokens' rows (5 and 9 tokens, 6 columns, 6 lookups); split:
    # every rank serves both ranks' tokens (each padded to 9).
    moved = [r[mode]["rows_moved"] for r in ranks]
    assert moved == {"shared": [180, 324], "device": [0, 0]}.get(mode, [648, 648])


def test_two_ranks_share_one_host_copy(ranks):
    """``dp_shared_memory``: both ranks map the same two files (values, scales), created by rank 0
    and already removed from ``/dev/shm`` (the memory goes with the last mapping); rank 1 attached
    instead of loading (it was handed another table and still reads rank 0's rows)."""
    first, second = (r["shared"] for r in ranks)
    assert first["writer"] and not second["writer"]
    assert len(first["mapped"]) == 2 and first["mapped"] == second["mapped"]
    assert all(
        m.startswith(f"{engram_host.SHM_DIR}/deepinfer_engram_") and m.endswith("(deleted)")
        for m in first["mapped"]
    )
    assert first["left_in_shm"] == second["left_in_shm"] == []
    assert first["held_rows"] == second["held_rows"] == 1000  # split over TP (one rank) only


def test_ranks_that_cannot_share_fall_back_together(ranks):
    """Too little ``/dev/shm``, or a rank that does not see rank 0's (another host): every rank keeps
    private rows split over the expert group, and the probe leaves no file behind."""
    for rank in ranks:
        fb = rank["fallbacks"]
        assert fb["too_small"] == [False, "moe", True]
        assert fb["other_host"] == [False, "moe", True]
        assert fb["left_in_shm"] == []


def test_runner_windows_follow_vllms_token_layout():
    """``step_windows`` lays the step's tokens out as vLLM's runner does (requests in batch order,
    each from its computed-token count) and reads every window from the host token table; a model
    that hashes on the device asks for none, and dummy batches get pad windows."""
    import numpy as np

    batch = SimpleNamespace(
        token_ids_cpu_tensor=torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0]], dtype=torch.int32),
        num_computed_tokens_cpu=np.array([4, 0]),
    )
    model = SimpleNamespace(engram_host_window_depth=3)
    got = engram_host.step_windows(model, batch, np.array([2, 3], dtype=np.int32))
    assert got.tolist() == [[5, 4, 3], [6, 5, 4], [7, -1, -1], [8, 7, -1], [9, 8, 7]]
    assert engram_host.step_windows(SimpleNamespace(engram_host_window_depth=0), batch, [2, 3]) is None
    assert engram_host.step_windows(None, batch, [2, 3]) is None
    assert engram_host.dummy_windows(model, 4).tolist() == [[-1, -1, -1]] * 4
