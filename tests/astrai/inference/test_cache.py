"""`make_attn_meta`, the one AttnMeta builder: positions, slots, lengths and page tables by hand, with padding."""

import pytest
import torch

from astrai.inference.cache import NULL_PAGE, make_attn_meta


def test_ragged_step_metadata_by_hand():
    # request 0: 3 cached + 2 new tokens on pages [5, 2] (page size 4); request 1: 0 cached + 3 new on page [7]
    meta = make_attn_meta([[5, 2], [7]], [3, 0], [2, 3], page_size=4, device="cpu")
    assert meta.positions.tolist() == [3, 4, 0, 1, 2]
    assert meta.slot_mapping.tolist() == [5 * 4 + 3, 2 * 4 + 0, 28, 29, 30]
    assert meta.cu_seqlens_q.tolist() == [0, 2, 5] and meta.seq_lens.tolist() == [5, 3]
    assert meta.block_table.tolist() == [[5, 2], [7, NULL_PAGE]]
    assert meta.block_table.dtype == torch.int32 and meta.cu_seqlens_q.dtype == torch.int32
    assert meta.positions.dtype == torch.int64 and meta.slot_mapping.dtype == torch.int64


def test_padding_rows_write_nowhere_and_attend_to_nothing():
    meta = make_attn_meta([[3]], [6], [1], page_size=8, device="cpu", decode=True, rows=4, width=3)
    assert meta.positions.tolist() == [6, 0, 0, 0]
    assert meta.slot_mapping.tolist() == [3 * 8 + 6, -1, -1, -1]
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4] and meta.seq_lens.tolist() == [7, 0, 0, 0]
    assert meta.block_table.tolist() == [[3, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]


def test_decode_metadata_needs_one_token_per_request():
    with pytest.raises(ValueError, match="exactly one new token"):
        make_attn_meta([[1]], [0], [2], page_size=4, device="cpu", decode=True)
