"""Direct tests of the shared argument checks (flashtile.reference._checks).

Checked: every bad input raises the documented exception with the
argument's name in the message; good inputs come back in the documented
form; and forward and backward accept the same dropout masks, a lower-rank
(or 4-D with lower-rank inputs) mask giving exactly the result of the
explicitly expanded one.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashtile.reference import _checks as checks
from flashtile.reference.attention import flash_attn2, standard_attention
from flashtile.reference.backward import flash_attn_backward, standard_attention_backward

F64 = torch.float64
SHAPE = (2, 3, 4, 5)  # (B, Hq, Nq, Nk)

BAD = [
    ("softmax_scale", TypeError, lambda: checks.softmax_scale(True, 4)),
    ("softmax_scale", TypeError, lambda: checks.softmax_scale("0.5", 4)),
    ("softmax_scale", ValueError, lambda: checks.softmax_scale(math.inf, 4)),
    ("softcap", ValueError, lambda: checks.softcap(-1.0)),
    ("softcap", ValueError, lambda: checks.softcap(math.nan)),
    ("softcap", TypeError, lambda: checks.softcap(None)),
    ("phi", TypeError, lambda: checks.check_real(torch.ones(2), "phi")),
    ("phi", ValueError, lambda: checks.check_real(torch.tensor(math.nan), "phi")),
    ("num_splits", TypeError, lambda: checks.positive_int(2.0, "num_splits")),
    ("num_splits", TypeError, lambda: checks.positive_int(True, "num_splits")),
    ("num_splits", ValueError, lambda: checks.positive_int(0, "num_splits")),
    ("dtype", TypeError, lambda: checks.compute_dtype(torch.int32)),
    ("dtype", TypeError, lambda: checks.compute_dtype("float64")),
    ("alibi_slopes", TypeError, lambda: checks.alibi_slopes([0.5, 0.25, 0.1], 2, 3, F64)),
    ("alibi_slopes", TypeError, lambda: checks.alibi_slopes(torch.ones(3, dtype=torch.long), 2, 3, F64)),
    ("alibi_slopes", ValueError, lambda: checks.alibi_slopes(torch.ones(2), 2, 3, F64)),
    ("alibi_slopes", ValueError, lambda: checks.alibi_slopes(torch.ones(3, 2), 2, 3, F64)),
    ("dropout_p", ValueError, lambda: checks.dropout(1.0, None, SHAPE)),
    ("dropout_p", ValueError, lambda: checks.dropout(-0.1, None, SHAPE)),
    ("dropout_p", TypeError, lambda: checks.dropout(None, None, SHAPE)),
    ("dropout_mask", ValueError, lambda: checks.dropout(0.1, None, SHAPE)),
    ("dropout_mask", TypeError, lambda: checks.dropout(0.1, torch.ones(4, 5), SHAPE)),
    ("dropout_mask", ValueError, lambda: checks.dropout(0.1, torch.ones(4, 6, dtype=torch.bool), SHAPE)),
    ("block_sizes", ValueError, lambda: checks.block_sizes(4)),
    ("block_sizes", ValueError, lambda: checks.block_sizes((0, 4))),
    ("block_sizes", ValueError, lambda: checks.block_sizes((4, 2.0))),
    ("block_sizes", ValueError, lambda: checks.block_sizes((True, 4))),
    ("lse", TypeError, lambda: checks.tensor_like(torch.zeros(2, 3, dtype=torch.long), "lse", (2, 3), F64)),
    ("lse", ValueError, lambda: checks.tensor_like(torch.zeros(2, 4), "lse", (2, 3), F64)),
]


@pytest.mark.parametrize("name,exc,call", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_names_the_argument(name, exc, call):
    with pytest.raises(exc, match=name):
        call()


def test_good_inputs_pass_through():
    assert checks.check_real(2, "x") == 2.0 and isinstance(checks.check_real(2, "x"), float)
    assert checks.check_real(np.float32(0.5), "x") == 0.5
    assert checks.check_real(torch.tensor(-1.5), "x") == -1.5
    assert checks.check_real(0, "x", minimum=0.0) == 0.0
    assert checks.softmax_scale(None, 16) == 0.25
    assert checks.softmax_scale(-2, 16) == -2.0  # any finite scale, sign included
    assert checks.softcap(0) == 0.0
    assert checks.positive_int(np.int64(3), "n") == 3
    assert checks.compute_dtype(None) is None and checks.compute_dtype(torch.float16) is torch.float16
    assert checks.block_sizes((np.int64(2), 3)) == (2, 3)
    assert checks.alibi_slopes(None, 2, 3, F64) is None
    h = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float32)
    per_head = checks.alibi_slopes(h, 2, 3, F64)
    assert per_head.shape == (2, 3) and per_head.dtype == F64
    assert torch.equal(per_head, h.to(F64).expand(2, 3))
    bh = torch.rand(2, 3, dtype=F64)
    assert torch.equal(checks.alibi_slopes(bh, 2, 3, None), bh)
    assert checks.dropout(0, None, SHAPE) == (0.0, None)
    mask = torch.rand(4, 5) > 0.5
    p, keep = checks.dropout(0.25, mask, SHAPE)
    assert p == 0.25 and keep.shape == SHAPE and torch.equal(keep[1, 2], mask)
    x = torch.zeros(2, 3)
    assert checks.tensor_like(x, "lse", (2, 3), None) is x


# ---------------------------------------------------------------------------
# Forward and backward share one dropout-mask rule


def _inputs():
    g = torch.Generator().manual_seed(11)
    h, nq, nk, d = 2, 6, 7, 4
    q = torch.randn(h, nq, d, generator=g, dtype=F64)
    k = torch.randn(h, nk, d, generator=g, dtype=F64)
    v = torch.randn(h, nk, d, generator=g, dtype=F64)
    dout = torch.randn(h, nq, d, generator=g, dtype=F64)
    keep = torch.rand(nq, nk, generator=g) > 0.3
    return q, k, v, dout, keep


def _expanded(mask, q, k):
    """The (H, Nq, Nk) mask of the inputs' rank, materialised (no broadcasting left)."""
    h, nq, nk = q.shape[0], q.shape[1], k.shape[1]
    return torch.broadcast_to(mask, (1, h, nq, nk))[0].clone()


# masks for 3-D (H, N, d) inputs: (Nq, Nk) below the input rank, (1, H, Nq, Nk)
# above it (the backward used to reject this one), and a per-column (Nk,) mask
MASKS = {
    "2d": lambda keep, h: keep,
    "4d": lambda keep, h: keep.expand(1, h, *keep.shape),
    "1d": lambda keep, h: keep[0],
}


@pytest.mark.parametrize("kind", list(MASKS))
def test_forward_dropout_mask_broadcasts_like_an_expanded_mask(kind):
    q, k, v, _, keep = _inputs()
    mask = MASKS[kind](keep, q.shape[0])
    full = _expanded(mask, q, k)
    for fn in (standard_attention, flash_attn2):
        got = fn(q, k, v, dropout_p=0.3, dropout_mask=mask)
        want = fn(q, k, v, dropout_p=0.3, dropout_mask=full)
        assert torch.equal(got.out, want.out) and torch.equal(got.lse, want.lse)


@pytest.mark.parametrize("kind", list(MASKS))
def test_backward_accepts_the_forward_masks(kind):
    q, k, v, dout, keep = _inputs()
    mask = MASKS[kind](keep, q.shape[0])
    full = _expanded(mask, q, k)
    fwd = standard_attention(q, k, v, dropout_p=0.3, dropout_mask=mask)
    for got, want in (
        (flash_attn_backward(q, k, v, fwd.out, dout, fwd.lse, dropout_p=0.3, dropout_mask=mask, block_sizes=(4, 4)),
         flash_attn_backward(q, k, v, fwd.out, dout, fwd.lse, dropout_p=0.3, dropout_mask=full, block_sizes=(4, 4))),
        (standard_attention_backward(q, k, v, dout, dropout_p=0.3, dropout_mask=mask),
         standard_attention_backward(q, k, v, dout, dropout_p=0.3, dropout_mask=full)),
    ):
        for a, b in zip(got[:3], want[:3]):
            assert a.shape == b.shape and torch.equal(a, b)


def test_forward_and_backward_reject_the_same_bad_mask():
    q, k, v, dout, keep = _inputs()
    bad = keep[:, :5]  # Nk mismatch
    with pytest.raises(ValueError, match="dropout_mask"):
        standard_attention(q, k, v, dropout_p=0.3, dropout_mask=bad)
    with pytest.raises(ValueError, match="dropout_mask"):
        standard_attention_backward(q, k, v, dout, dropout_p=0.3, dropout_mask=bad)


# --------------------------------------------------------------------------- #
# BlockMask: integer sizes, counts and strides; a block-level bool mask
# --------------------------------------------------------------------------- #
def test_block_mask_accepts_an_int_block_size_like_the_classmethods():
    from flashtile.reference.masks import BlockMask

    grid = torch.ones(2, 3, dtype=torch.bool)
    assert BlockMask(grid, 64).block_size == (64, 64)
    assert BlockMask(grid, np.int64(32)).block_size == (32, 32)
    assert BlockMask(grid, [16, np.int32(48)]).block_size == (16, 48)
    assert all(type(b) is int for b in BlockMask(grid, np.int64(32)).block_size)
    assert BlockMask(grid, 64).block_size == BlockMask.dense(128, 192, block_size=64).block_size


BLOCK_MASK_BAD = [
    # (argument named in the message, exception, call)
    ("block_size", TypeError, lambda B: B(torch.ones(2, 2, dtype=torch.bool), 64.0)),
    ("block_size", TypeError, lambda B: B(torch.ones(2, 2, dtype=torch.bool), (64.5, 64))),
    ("block_size", TypeError, lambda B: B(torch.ones(2, 2, dtype=torch.bool), (64, True))),
    ("block_size", ValueError, lambda B: B(torch.ones(2, 2, dtype=torch.bool), (64, 0))),
    ("block_size", ValueError, lambda B: B(torch.ones(2, 2, dtype=torch.bool), (16, 16, 16))),
    ("block_size", TypeError, lambda B: B(torch.ones(2, 2, dtype=torch.bool), "64")),
    ("BlockMask.mask", TypeError, lambda B: B(torch.ones(2, 2), 16)),
    ("from_element_mask", TypeError, lambda B: B(torch.ones(2, 2), 16)),  # the float mask error points there
    ("BlockMask.mask", ValueError, lambda B: B(torch.ones(4, dtype=torch.bool), 16)),
    ("allowed", TypeError, lambda B: B.from_element_mask(torch.ones(32, 32), 16)),
    ("allowed", ValueError, lambda B: B.from_element_mask(torch.ones(32, dtype=torch.bool), 16)),
    ("block_size", TypeError, lambda B: B.dense(128, 128, block_size=64.0)),
    ("block_size", TypeError, lambda B: B.causal(128, 128, block_size=(32.5, 32))),
    ("block_size", TypeError, lambda B: B.from_element_mask(torch.ones(32, 32, dtype=torch.bool), 16.0)),
    ("nq", TypeError, lambda B: B.dense(128.0, 128)),
    ("nk", ValueError, lambda B: B.dense(128, -1)),
    ("stride", TypeError, lambda B: B.strided(128, 128, stride=2.0, block_size=32)),
    ("stride", ValueError, lambda B: B.strided(128, 128, stride=0, block_size=32)),
    ("local_blocks", TypeError, lambda B: B.strided(128, 128, stride=2, local_blocks=1.5, block_size=32)),
    ("global_blocks", TypeError, lambda B: B.global_local(128, 128, global_blocks=1.0, block_size=32)),
    ("local_blocks", ValueError, lambda B: B.global_local(128, 128, local_blocks=-1, block_size=32)),
]


@pytest.mark.parametrize("name,exc,call", BLOCK_MASK_BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BLOCK_MASK_BAD)])
def test_block_mask_rejects_non_integer_sizes_and_bad_masks(name, exc, call):
    from flashtile.reference.masks import BlockMask

    with pytest.raises(exc, match=name):
        call(BlockMask)


def test_block_mask_classmethods_take_numpy_ints():
    from flashtile.reference.masks import BlockMask

    a = BlockMask.strided(np.int64(128), 128, stride=np.int64(2), block_size=np.int32(32), local_blocks=np.int64(1))
    b = BlockMask.strided(128, 128, stride=2, block_size=32, local_blocks=1)
    assert a.block_size == b.block_size and torch.equal(a.mask, b.mask)
