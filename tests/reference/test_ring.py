"""The float64 ring-attention twin against the dense oracle, and the zigzag layout's balance."""

import pytest
import torch

from flashtile.reference.ring import ring_attention, shard_positions
from tests._oracle import assert_close, attention_ref


@pytest.mark.parametrize(
    "world, layout, n, causal, window, hq, hk",
    [
        (2, "zigzag", 16, True, (-1, -1), 2, 2),
        (4, "zigzag", 24, True, (5, 0), 4, 2),
        (3, "contiguous", 15, False, (-1, -1), 2, 1),
        (4, "contiguous", 20, False, (3, 2), 2, 2),
        (4, "zigzag", 16, False, (0, 0), 2, 2),  # the diagonal only: most blocks are skipped
    ],
)
def test_ring_reference_matches_full_attention(world, layout, n, causal, window, hq, hk):
    g = torch.Generator().manual_seed(world * 100 + n)
    q = torch.randn(2, hq, n, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, hk, n, 8, generator=g, dtype=torch.float64) for _ in range(2))
    got = ring_attention(q, k, v, world, layout=layout, causal=causal, window_size=window, softcap=2.0)
    want_out, want_lse = attention_ref(q, k, v, causal=causal, window=window, softcap=2.0)
    assert_close(got.out, want_out, what="out")
    assert_close(got.lse, want_lse, what="lse")
    c = got.counts
    assert c.visited_blocks + c.skipped_blocks == world * world
    assert c.extras["kv_elements_sent"] == world * (world - 1) * 2 * 2 * hk * (n // world) * 8


def test_layouts_partition_the_sequence():
    for layout, n in (("zigzag", 24), ("contiguous", 12)):
        pos = torch.cat([shard_positions(n, 4 if layout == "zigzag" else 3, r, layout)
                         for r in range(4 if layout == "zigzag" else 3)])
        assert sorted(pos.tolist()) == list(range(n))


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    q = k = v = torch.randn(1, 1, 32, 4, dtype=torch.float64)
    zig = ring_attention(q, k, v, 4, layout="zigzag", causal=True).counts.extras["pairs_per_rank"]
    con = ring_attention(q, k, v, 4, layout="contiguous", causal=True).counts.extras["pairs_per_rank"]
    assert len(set(zig)) == 1 and sum(zig) == sum(con) == 32 * 33 // 2
    assert con == sorted(con) and con[0] < con[-1]


def test_bad_layout_and_lengths_raise():
    with pytest.raises(ValueError, match="layout"):
        shard_positions(8, 2, 0, "striped")
    with pytest.raises(ValueError, match="2 \\* world"):
        shard_positions(10, 2, 0, "zigzag")
