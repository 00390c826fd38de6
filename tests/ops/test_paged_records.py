import pytest
import torch

from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.paged_records import (
    RecordFormat,
    read_records,
    split_page_regions,
    write_records,
    write_records_at_slots,
)


def _layer_view(buf, n, record, lead):
    """A layer view whose block stride exceeds the page (block-outermost packing)."""
    return buf[:, lead : lead + n * record].unflatten(1, (1, n, record))


def _padded_cache(num_blocks, n, record, pad, g):
    buf = torch.randint(0, 256, (num_blocks, n * record + pad), dtype=torch.uint8, generator=g)
    return buf, _layer_view(buf, n, record, pad // 2)


@pytest.mark.parametrize("fmt, dim", [("mxfp8", 64), ("nvfp4", 32), ("mxfp4", 64)])
def test_write_records_at_slots_matches_block_offset_writes(fmt, dim):
    g = torch.Generator().manual_seed(dim)
    rf = RecordFormat(fmt, dim)
    buf, cache = _padded_cache(5, 4, rf.record_bytes, 24, g)
    want_buf = buf.clone()
    want = _layer_view(want_buf, 4, rf.record_bytes, 12)
    x = torch.randn(9, dim, generator=g)
    slots = torch.randperm(20, generator=g)[:9]
    slots[[2, 5]] = -1
    write_records_at_slots(cache, fmt, slots, x)  # format by name: dim from x
    keep = slots >= 0
    write_records(want, rf, slots[keep] // 4, slots[keep] % 4, x[keep])
    assert torch.equal(buf, want_buf)  # skipped rows and page padding untouched
    values, scales = split_page_regions(cache, rf)
    q_values, q_scales = quant.quantize(fmt, x[keep])
    assert torch.equal(values[slots[keep] // 4, slots[keep] % 4], q_values)
    assert torch.equal(scales[slots[keep] // 4, slots[keep] % 4], q_scales)
    back = read_records(cache, rf, slots[keep] // 4, slots[keep] % 4, torch.float32)
    assert torch.equal(back, quant.dequantize(fmt, q_values, q_scales))


def test_write_records_at_slots_all_skipped_is_a_no_op():
    rf = RecordFormat("mxfp4", 32)
    buf, cache = _padded_cache(2, 2, rf.record_bytes, 6, torch.Generator().manual_seed(0))
    before = buf.clone()
    write_records_at_slots(cache.squeeze(1), rf, torch.full((3,), -1), torch.randn(3, 32))
    write_records_at_slots(cache, rf, torch.zeros(0, dtype=torch.int64), torch.randn(0, 32))
    assert torch.equal(buf, before)
