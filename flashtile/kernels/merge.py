"""Triton kernel of the LSE merge of two attention states (cascade / shared-prefix attention).

Jit code only; the host side is :func:`flashtile.ops.cascade.merge_attention_states`.  Two
states ``(o1, lse1)`` and ``(o2, lse2)`` of the same query rows over disjoint key sets merge
into the state over their union (the rule of :func:`flashtile.reference.decoding.merge_partials`
with two partials; the decode kernels' ``_merge_rows`` applies it to S split partials in their
workspace):

    lse = logaddexp(lse1, lse2),    o = e^{lse1 - lse} o1 + e^{lse2 - lse} o2

An empty state (lse = -inf) weighs 0; two empty states give o = 0, lse = -inf, never NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashtile.kernels._common import LOG2E

_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def merge_two_states(o1, l1, o2, l2):
    """``(o, lse)`` of two states: o1, o2 (R, D) fp32, l1, l2 (R,) fp32 natural-log LSEs (-inf: empty).

    Weights are taken against ``m = max(l1, l2)`` (the larger weighs 1, so nothing overflows
    whatever the difference); ``m = -inf`` (both empty) is replaced by 0 so exp(-inf - 0) = 0."""
    m = tl.maximum(l1, l2)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w1 = tl.math.exp2((l1 - m_safe) * _LOG2E)
    w2 = tl.math.exp2((l2 - m_safe) * _LOG2E)
    tot = w1 + w2
    live = tot > 0.0
    tot_safe = tl.where(live, tot, 1.0)
    o = (o1 * w1[:, None] + o2 * w2[:, None]) / tot_safe[:, None]
    lse = tl.where(live, m_safe + tl.log(tot_safe), float("-inf"))
    return o, lse


@triton.jit
def _merge_states_kernel(
    O1, L1, O2, L2, Out, LSE,
    stride_o1b, stride_o1n, stride_o1h, stride_l1b, stride_l1h, stride_l1n,
    stride_o2b, stride_o2n, stride_o2h, stride_l2b, stride_l2h, stride_l2n,
    stride_ob, stride_on, stride_oh, stride_lb, stride_lh, stride_ln,
    seqlen, n_heads, head_dim, n_rows,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """In a ``(ceil(rows / BLOCK_R),)`` grid, program r merges rows ``[r BLOCK_R, (r+1) BLOCK_R)``
    of the ``B·N·H`` rows (row = (b·N + n)·H + h); outputs (B, N, H, d) and LSEs (B, H, N) at any strides."""
    pid = tl.program_id(0)
    offs_r = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < n_rows
    h = offs_r % n_heads
    n = (offs_r // n_heads) % seqlen
    b = offs_r // (n_heads * seqlen)
    offs_d = tl.arange(0, BLOCK_D)
    m2 = r_ok[:, None] & (offs_d < head_dim)[None, :]
    l1 = tl.load(L1 + b * stride_l1b + h * stride_l1h + n * stride_l1n, mask=r_ok, other=float("-inf"))
    l2 = tl.load(L2 + b * stride_l2b + h * stride_l2h + n * stride_l2n, mask=r_ok, other=float("-inf"))
    o1 = tl.load(O1 + (b * stride_o1b + n * stride_o1n + h * stride_o1h)[:, None] + offs_d[None, :], mask=m2, other=0.0)
    o2 = tl.load(O2 + (b * stride_o2b + n * stride_o2n + h * stride_o2h)[:, None] + offs_d[None, :], mask=m2, other=0.0)
    o, lse = merge_two_states(o1.to(tl.float32), l1.to(tl.float32), o2.to(tl.float32), l2.to(tl.float32))
    tl.store(Out + (b * stride_ob + n * stride_on + h * stride_oh)[:, None] + offs_d[None, :],
             o.to(Out.dtype.element_ty), mask=m2)
    tl.store(LSE + b * stride_lb + h * stride_lh + n * stride_ln, lse, mask=r_ok)
