"""``engram_history_windows``: a token's n-gram window of raw ids read from a host table of every
request's ids, as the model's paged token history returns it on the device."""

from __future__ import annotations

import pytest
import torch

from deepinfer_vllm.ops.engram import engram_history_windows


def test_windows_read_each_requests_ids_back_from_the_position():
    table = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 0, 0]], dtype=torch.int32)
    rows = torch.tensor([0, 0, 1, 1])
    positions = torch.tensor([0, 3, 2, 1])
    got = engram_history_windows(table, rows, positions, 3)
    assert got.dtype == torch.int64
    assert got.tolist() == [[10, -1, -1], [13, 12, 11], [22, 21, 20], [21, 20, -1]]


def test_a_position_outside_the_table_is_refused():
    table = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="position 4 outside the token table"):
        engram_history_windows(table, torch.tensor([0]), torch.tensor([4]), 2)
