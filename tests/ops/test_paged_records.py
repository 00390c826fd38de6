import pytest
import torch

from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.paged_records import (
    RecordFormat,
    read_records,
    split_page_regions,
    store_paged,
    write_records,
)


def _layer_view(buf, n, record, lead):
    """A layer view whose block stride exceeds the page (block-outermost packing)."""
    return buf[:, lead : lead + n * record].unflatten(1, (1, n, record))


def _padded_cache(num_blocks, n, record, pad, g):
    buf = torch.randint(0, 256, (num_blocks, n * record + pad), dtype=torch.uint8, generator=g)
    return buf, _layer_view(buf, n, record, pad // 2)


@pytest.mark.parametrize("fmt, dim", [("mxfp8", 64), ("nvfp4", 32), ("mxfp4", 64)])
def test_store_paged_matches_block_offset_writes(fmt, dim):
    """Entry ``e`` of request ``r``: page ``table[r, e // N]``, record ``e % N``; rows not kept untouched."""
    g = torch.Generator().manual_seed(dim)
    rf = RecordFormat(fmt, dim)
    buf, cache = _padded_cache(6, 4, rf.record_bytes, 24, g)
    want_buf = buf.clone()
    want = _layer_view(want_buf, 4, rf.record_bytes, 12)
    table = torch.randperm(6, generator=g).view(2, 3).to(torch.int32)
    x = torch.randn(9, dim, generator=g)
    flat = torch.randperm(24, generator=g)[:9]
    req, entry = flat // 12, flat % 12
    keep = torch.ones(9, dtype=torch.bool)
    keep[[2, 5]] = False
    store_paged(cache, fmt, table, req, entry, x, keep)  # format by name: dim from x
    blocks = table[req, entry // 4].long()
    write_records(want, rf, blocks[keep], (entry % 4)[keep], x[keep])
    assert torch.equal(buf, want_buf)  # skipped rows and page padding untouched
    values, scales = split_page_regions(cache, rf)
    q_values, q_scales = quant.quantize(fmt, x[keep])
    b, o = blocks[keep], (entry % 4)[keep]
    assert torch.equal(values[b, o], q_values)
    assert torch.equal(scales[b, o], q_scales)
    back = read_records(cache, rf, b, o, torch.float32)
    assert torch.equal(back, quant.dequantize(fmt, q_values, q_scales))


def test_store_paged_nothing_kept_is_a_no_op():
    rf = RecordFormat("mxfp4", 32)
    buf, cache = _padded_cache(2, 2, rf.record_bytes, 6, torch.Generator().manual_seed(0))
    before = buf.clone()
    table = torch.tensor([[1, 0]])
    idx = torch.zeros(3, dtype=torch.int64)
    store_paged(cache.squeeze(1), rf, table, idx, idx, torch.randn(3, 32), torch.zeros(3, dtype=torch.bool))
    store_paged(cache, rf, table, idx[:0], idx[:0], torch.randn(0, 32))
    assert torch.equal(buf, before)
