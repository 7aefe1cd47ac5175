"""Custom ops and autograd for FlashAttention-2: ``flashtile::flash_attn_fwd`` / ``flash_attn_bwd``.

Forward (FA2 paper, Algorithm 1) returns ``out`` and the row log-sum-exp
``L_i = m_i + log l_i``; backward (FA2 paper, Algorithm 2) recomputes
``P_ij = exp(S_ij - L_i)`` tile by tile from the saved ``q, k, v, out, L`` and
computes ``D_i = rowsum(dO_i * O_i)``, ``dS = P * (dP - D)``.  Nothing of size
Nq x Nk is saved between the two, which is the point of the algorithm.

Both are ``torch.library.custom_op`` s with fake (meta) implementations, so
``torch.compile(fullgraph=True)`` traces a call as one opaque node, and the
backward is attached with ``register_autograd``.  Python objects cannot cross
an op boundary, so a :class:`~flashtile.reference.masks.BlockMask` travels as
its bool tensor plus its two block sizes and is rebuilt inside.

Layouts: with ``seq_major=True`` q/k/v are (B, N, H, d) (flash-attn) and the
op returns ``out`` / ``dq, dk, dv`` contiguous in that layout; otherwise
(B, H, N, d) (SDPA), with ``out`` a view of (B, N, H, d) storage as torch's flash
backend returns it.  The kernels see ``x.transpose(1, 2)`` views either way.

Dropout randomness: the forward op draws ``rng_state = [seed, offset]``, an
int64 tensor *on the device*, with one ``torch.randint`` on the device's
default generator, *inside* the op; the kernels read it through a pointer and
autograd saves it for the backward, which regenerates the identical keep-mask
(FA1 paper, Algorithm 2 line 14 / Algorithm 4 line 13: only the RNG state is
stored).  torch's RNG ops are CUDA-graph safe (each replay draws new values
into the same tensor), nothing reads the state on the host (no sync), and
``torch.manual_seed`` replays it.  Drawing inside the op rather than in the
Python wrapper keeps a compiled graph from freezing one seed as a constant;
the op is tagged ``nondeterministic_seeded`` so graph passes neither merge nor
recompute it.  :func:`next_philox_state` tells which pair the next call will
draw.  Without dropout ``rng_state`` is a CPU tensor of zeros (no device work).
"""

import contextlib
import contextvars
import functools
import math
from typing import Optional

import torch

from flashtile.reference.masks import BlockMask
from flashtile.runtime.common import check_device_mode, on_tensor_device

__all__ = ["flash_attn_fwd", "flash_attn_bwd", "flash_attn_varlen_fwd", "flash_attn_varlen_bwd", "attention", "varlen_attention", "next_philox_state"]

_SEED_MASK = (1 << 62) - 1  # seeds stay positive int64 (they travel in an int64 tensor)


# --------------------------------------------------------------------------- #
# Philox state from torch's default generators
# --------------------------------------------------------------------------- #
# a stream index added to every drawn seed (``philox_stream``): ranks whose generators are seeded alike still draw
# independent keep-masks for different work (Ulysses' head groups); 0 outside
_STREAM = contextvars.ContextVar("flashtile_philox_stream", default=0)
_STREAM_STRIDE = 0x9E3779B97F4A7C15 & _SEED_MASK  # odd: distinct streams map to distinct seeds modulo 2^62


def _philox(device: torch.device) -> torch.Tensor:
    """The int64 [seed, offset] of one dropout call, drawn on ``device`` from its default generator.

    One RNG kernel, no host sync, CUDA-graph safe.  Each call draws a fresh seed (and offset), so
    calls use independent Philox streams; the kernels count elements from the offset in 64 bits.
    Inside :func:`philox_stream` the seed is moved by the stream's index.
    """
    rng = torch.randint(0, _SEED_MASK, (2,), dtype=torch.int64, device=device)
    stream = _STREAM.get()
    if stream:
        rng[0] = stream_seed(rng[0], stream)
    return rng


def stream_seed(seed, stream: int):
    """The seed (an int or an int64 tensor) a draw of ``seed`` becomes in stream ``stream``."""
    return (seed + stream * _STREAM_STRIDE % (_SEED_MASK + 1)) & _SEED_MASK


@contextlib.contextmanager
def philox_stream(index: int):
    """Dropout calls within draw their seeds in stream ``index`` (an int >= 0): the same generator state gives
    different, independent seeds in different streams (a rank's index where every rank is seeded alike but does
    different work)."""
    token = _STREAM.set(int(index))
    try:
        yield
    finally:
        _STREAM.reset(token)


def next_philox_state(device: torch.device | str) -> tuple[int, int]:
    """The ``(philox_seed, philox_offset)`` the next dropout call on ``device`` will use.

    Does not advance the generator: draws as :func:`_philox` does, then restores the
    generator's state (a host sync; for tests).  Tests feed the pair to
    :func:`flashtile.runtime.common.dropout_keep_mask` to rebuild the exact keep-mask of the
    call and check it against a float64 oracle.
    """
    device = torch.device(device)
    if device.type == "cuda":
        state = torch.cuda.get_rng_state(device)
        rng = _philox(device)
        torch.cuda.set_rng_state(state, device)
    else:
        state = torch.get_rng_state()
        rng = _philox(device)
        torch.set_rng_state(state)
    seed, offset = rng.tolist()
    return seed, offset


# --------------------------------------------------------------------------- #
# The two ops
# --------------------------------------------------------------------------- #
_on_tensor_device = on_tensor_device


def _bhnd(x: torch.Tensor, seq_major: bool) -> torch.Tensor:
    """The kernels' (B, H, N, d) view of a tensor in the op's layout."""
    return x.transpose(1, 2) if seq_major else x


def _out_like(q: torch.Tensor, seq_major: bool) -> torch.Tensor:
    """The output in (B, N, H, d) storage either way: with ``seq_major=False`` a (B, H, N, d) view of
    it, the layout torch's flash / cuDNN SDPA backends return (the transpose(1, 2) models apply next is free)."""
    if seq_major:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    b, h, n, d = q.shape
    return torch.empty((b, n, h, d), dtype=q.dtype, device=q.device).transpose(1, 2)


def _check_op_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_major: bool) -> None:
    """What the kernels index by, for a direct call of the op (the public functions run ops.validate first, and
    the Hopper paths trust them): 4-D q, k, v of one dtype and device, k and v of one shape, q's batch and head
    dim (1..256), Hq a multiple of Hk.  Tuple comparisons: well under a microsecond."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"q, k, v must be 4-D with k and v of one shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must share dtype and device, got {q.dtype}, {k.dtype}, {v.dtype} on {q.device}, "
                         f"{k.device}, {v.device}")
    if q.get_device() < 0:  # CPU tensors only through the interpreter (a compiled launch cannot read them)
        check_device_mode(q.device)
    h_ax = 2 if seq_major else 1
    hk = k.shape[h_ax]
    if (k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or not 1 <= q.shape[3] <= 256 or hk == 0
            or q.shape[h_ax] % hk):
        raise ValueError(f"k, v {tuple(k.shape)} must match q {tuple(q.shape)} in batch and head_dim (<= 256), "
                         "with q's heads a multiple of theirs")


def _check_op_options(q, k, seq_major: bool, bias, alibi_slopes, block_mask, mask_block_q: int,
                      mask_block_k: int) -> None:
    """A direct call's optional tensors as ops.validate checks them for the public functions: ALiBi slopes of
    shape (Hq,) or (B, Hq), a floating bias broadcasting to (B, Hq, Nq, Nk), a block mask of 16-multiple blocks."""
    if bias is None and alibi_slopes is None and block_mask is None:
        return
    from flashtile.ops import validate

    b, hq, nq, d = _bhnd(q, seq_major).shape
    hk, nk = _bhnd(k, seq_major).shape[1:3]
    dims = validate.AttnDims(b, hq, hk, nq, nk, d)
    if alibi_slopes is not None:
        validate.check_alibi(alibi_slopes, q, dims)
    if bias is not None:
        full = (b, hq, nq, nk)
        if (not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or bias.device != q.device
                or bias.dim() > 4 or any(m not in (1, f) for m, f in zip(reversed(bias.shape), reversed(full)))):
            raise ValueError(f"bias must be a floating tensor on q's device broadcasting to (B, Hq, Nq, Nk) = {full}, "
                             f"got {getattr(bias, 'shape', type(bias).__name__)}")
    if block_mask is not None:
        validate.check_block_mask(_block_mask(block_mask, mask_block_q, mask_block_k), dims)


def _check_op_stats(q, out, lse, seq_major: bool) -> None:
    """A direct backward call's ``out`` (q's shape, dtype, device) and ``lse`` (contiguous float32 (B, Hq, Nq)):
    the kernels read them at q's row offsets."""
    b, hq, nq, _ = _bhnd(q, seq_major).shape
    if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must have q's shape {tuple(q.shape)}, dtype {q.dtype} and device {q.device}, "
                         f"got {getattr(out, 'shape', type(out).__name__)}")
    if (not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (b, hq, nq) or lse.dtype != torch.float32
            or lse.device != q.device or not lse.is_contiguous()):
        raise ValueError(f"lse must be a contiguous float32 tensor of shape (B, Hq, Nq) = {(b, hq, nq)} on q's "
                         f"device, got {getattr(lse, 'shape', type(lse).__name__)}")


def _block_mask(mask: Optional[torch.Tensor], mask_block_q: int, mask_block_k: int) -> Optional[BlockMask]:
    return None if mask is None else BlockMask(mask, (mask_block_q, mask_block_k))


@torch.library.custom_op(
    "flashtile::flash_attn_fwd", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def flash_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor],
    block_mask: Optional[torch.Tensor],
    mask_block_q: int,
    mask_block_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    seq_major: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention forward (the FA2 kernel, or a Hopper kernel where ``runtime.fa3_fwd.prefer_hopper`` says):
    ``(out, lse, rng_state)``.

    out: q's shape and dtype in (B, N, H, d) storage; lse: (B, Hq, Nq) float32, natural
    log, -inf on rows with no allowed key; rng_state: int64 [seed, offset] on
    q's device (CPU zeros without dropout).  ``deterministic`` is only read by the backward;
    it is an input here so that autograd's setup_context can save it.
    """
    return _fwd_impl(q, k, v, bias, alibi_slopes, block_mask, mask_block_q, mask_block_k, softmax_scale, causal,
                     window_left, window_right, softcap, dropout_p, deterministic, seq_major)


@_on_tensor_device
def _fwd_impl(q, k, v, bias, alibi_slopes, block_mask, mask_block_q, mask_block_k, softmax_scale, causal,
              window_left, window_right, softcap, dropout_p, deterministic, seq_major, rng_state=None):
    """Body of ``flashtile::flash_attn_fwd`` (also called directly by the eager path).

    ``rng_state``: dropout's [seed, offset] chosen by the caller (ring attention gives each of its
    kernel calls its own counter range); None draws one."""
    from flashtile.ops.plan import forward_plan
    from flashtile.runtime.fa2_fwd import fa2_forward
    from flashtile.runtime.fa3_fwd import forward_checked, prefer_hopper

    if (bias is None and alibi_slopes is None and block_mask is None and dropout_p == 0 and softcap == 0
            and rng_state is None):
        plan = forward_plan(q, k, v, causal, (window_left, window_right), seq_major, softmax_scale)
        if plan is not None:  # its signature passed the checks below when it was planned
            out, lse = plan(q, k, v, softmax_scale)
            return out, lse, torch.zeros(2, dtype=torch.int64)
    _check_op_tensors(q, k, v, seq_major)
    _check_op_options(q, k, seq_major, bias, alibi_slopes, block_mask, mask_block_q, mask_block_k)
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    qb, kb, vb = _bhnd(q, seq_major), _bhnd(k, seq_major), _bhnd(v, seq_major)
    b, hq, nq, _ = qb.shape
    rng = None if dropout_p == 0 else rng_state if rng_state is not None else _philox(q.device)
    out = _out_like(q, seq_major)
    plain = bias is None and alibi_slopes is None and block_mask is None and dropout_p == 0 and softcap == 0
    if prefer_hopper(qb, kb, vb, causal=causal, window=(window_left, window_right), plain=plain):
        # ops.validate (or _check_op_tensors) checked shapes, dtypes, devices, GQA and the scale; prefer_hopper
        # the head dim, the device's capability and the strides
        _, lse = forward_checked(qb, kb, vb, softmax_scale, causal, _bhnd(out, seq_major))
        return out, lse, torch.zeros(2, dtype=torch.int64)
    _, lse = fa2_forward(
        qb, kb, vb,
        softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
        softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, dropout_p=dropout_p, rng_state=rng,
        block_mask=_block_mask(block_mask, mask_block_q, mask_block_k), out=_bhnd(out, seq_major),
    )
    return out, lse, rng if rng is not None else torch.zeros(2, dtype=torch.int64)


@flash_attn_fwd.register_fake
def _flash_attn_fwd_fake(q, k, v, bias, alibi_slopes, block_mask, mask_block_q, mask_block_k, softmax_scale, causal,
                         window_left, window_right, softcap, dropout_p, deterministic, seq_major):
    b, hq, nq = _bhnd(q, seq_major).shape[:3]
    out = _out_like(q, seq_major)
    lse = torch.empty((b, hq, nq), dtype=torch.float32, device=q.device)
    return out, lse, torch.empty(2, dtype=torch.int64, device=q.device if dropout_p > 0 else "cpu")


@torch.library.custom_op("flashtile::flash_attn_bwd", mutates_args=())
def flash_attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    rng_state: torch.Tensor,
    bias: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor],
    block_mask: Optional[torch.Tensor],
    mask_block_q: int,
    mask_block_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    seq_major: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward (FA2's kernels, the Gluon Hopper one where ``runtime.fa3_gluon_bwd.prefer_gluon_bwd`` says,
    or the Triton Hopper ones where ``runtime.fa3_bwd.prefer_hopper_bwd`` says):
    ``(dq, dk, dv)`` contiguous in the layout and dtype of q, k, v.

    Replays the forward's dropout from ``rng_state`` (read on the device); ``deterministic=True``
    asks the kernel for a fixed accumulation order (bitwise-reproducible dQ).
    """
    return _bwd_impl(dout, q, k, v, out, lse, rng_state, bias, alibi_slopes, block_mask, mask_block_q, mask_block_k,
                     softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic, seq_major)


@_on_tensor_device
def _bwd_impl(dout, q, k, v, out, lse, rng_state, bias, alibi_slopes, block_mask, mask_block_q, mask_block_k,
              softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic, seq_major):
    """Body of ``flashtile::flash_attn_bwd`` (also called directly by the eager path)."""
    from flashtile.ops.plan import backward_plan
    from flashtile.runtime import fa3_gluon_bwd
    from flashtile.runtime.fa2_bwd import fa2_backward
    from flashtile.runtime.fa3_bwd import fa3_backward, prefer_hopper_bwd

    if (bias is None and alibi_slopes is None and block_mask is None and dropout_p == 0 and softcap == 0
            and isinstance(dout, torch.Tensor)):
        plan = backward_plan(dout, q, k, v, out, lse, causal, (window_left, window_right), deterministic, seq_major,
                             softmax_scale)
        if plan is not None:  # its signature passed the checks below when it was planned
            return plan(dout, q, k, v, out, lse, softmax_scale)
    if not isinstance(dout, torch.Tensor) or dout.shape != out.shape or dout.dtype != out.dtype \
            or dout.device != out.device:  # autograd guarantees it; a direct call of the op may not
        raise ValueError(f"dout must have out's shape {tuple(out.shape)}, dtype {out.dtype} and device {out.device}, "
                         f"got {getattr(dout, 'shape', type(dout).__name__)}")
    _check_op_tensors(q, k, v, seq_major)
    _check_op_stats(q, out, lse, seq_major)
    _check_op_options(q, k, seq_major, bias, alibi_slopes, block_mask, mask_block_q, mask_block_k)
    if dout.stride(-1) != 1:  # autograd may hand over an expanded or transposed gradient
        dout = dout.contiguous()
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    plain = bias is None and alibi_slopes is None and block_mask is None and dropout_p == 0 and softcap == 0
    dob, qb, kb, vb = _bhnd(dout, seq_major), _bhnd(q, seq_major), _bhnd(k, seq_major), _bhnd(v, seq_major)
    # the Gluon backward only with its switch on (runtime.fa3_gluon_bwd.ENABLED; FLASHTILE_GLUON_BWD=0 turns it off)
    if fa3_gluon_bwd.ENABLED and fa3_gluon_bwd.prefer_gluon_bwd(
        qb, kb, vb, dob, causal=causal, window=(window_left, window_right), plain=plain, deterministic=deterministic
    ):
        # the forward checked and produced q, k, v, out, lse; dout has out's shape, dtype and device (checked above)
        fa3_gluon_bwd.backward_into(dob, qb, kb, vb, _bhnd(out, seq_major), lse, _bhnd(dq, seq_major),
                                    _bhnd(dk, seq_major), _bhnd(dv, seq_major), softmax_scale, causal)
        return dq, dk, dv
    if prefer_hopper_bwd(qb, kb, vb, dob, causal=causal, window=(window_left, window_right), plain=plain):
        fa3_backward(dob, qb, kb, vb, _bhnd(out, seq_major), lse, softmax_scale=softmax_scale, causal=causal,
                     deterministic=deterministic, dq=_bhnd(dq, seq_major), dk=_bhnd(dk, seq_major),
                     dv=_bhnd(dv, seq_major))
        return dq, dk, dv
    fa2_backward(
        _bhnd(dout, seq_major), _bhnd(q, seq_major), _bhnd(k, seq_major), _bhnd(v, seq_major),
        _bhnd(out, seq_major), lse,
        softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
        softcap=softcap, alibi_slopes=alibi_slopes, bias=bias,
        dropout_p=dropout_p, rng_state=rng_state if dropout_p > 0 else None,
        block_mask=_block_mask(block_mask, mask_block_q, mask_block_k), deterministic=deterministic,
        dq=_bhnd(dq, seq_major), dk=_bhnd(dk, seq_major), dv=_bhnd(dv, seq_major),
    )
    return dq, dk, dv


@flash_attn_bwd.register_fake
def _flash_attn_bwd_fake(dout, q, k, v, out, lse, rng_state, bias, alibi_slopes, block_mask, mask_block_q, mask_block_k,
                         softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic,
                         seq_major):
    return (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
        torch.empty(v.shape, dtype=v.dtype, device=v.device),
    )


# --------------------------------------------------------------------------- #
# Autograd
# --------------------------------------------------------------------------- #
def _setup_context(ctx, inputs, output) -> None:
    q, k, v, bias, alibi_slopes, block_mask = inputs[:6]
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, bias, alibi_slopes, block_mask)
    ctx.options = inputs[6:]
    # the LSE is returned for inspection (flash-attn's softmax_lse); like flash-attn, it carries no gradient
    ctx.mark_non_differentiable(lse, rng_state)


def _grads(ctx, dout, bwd):
    q, k, v, out, lse, rng_state, bias, alibi_slopes, block_mask = ctx.saved_tensors
    dq, dk, dv = bwd(dout, q, k, v, out, lse, rng_state, bias, alibi_slopes, block_mask, *ctx.options)
    # no gradient for bias, alibi_slopes, block_mask (the wrappers refuse ones that require it) nor options
    return (dq, dk, dv, None, None, None) + (None,) * len(ctx.options)


def _backward(ctx, dout, _dlse, _drng):
    return _grads(ctx, dout, flash_attn_bwd)


flash_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def _first_order_only(backward):
    """``backward`` run without grad, its gradients made to raise if differentiated whenever the backward builds a
    graph (``create_graph``): once_differentiable does so only when the upstream gradient needs grad, and with a
    constant one returned dq, dk, dv detached from q, k, v (a gradient penalty's term silently dropped)."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not (torch.is_grad_enabled() and any(ctx.needs_input_grad)
                and any(isinstance(x, torch.Tensor) for x in outputs)):  # all None: nothing to guard
            return outputs
        err = torch._C._functions.DelayedError(b"flashtile attention has no double backward (create_graph=True "
                                               b"through it); use torch's math SDPA for higher-order gradients",
                                               len(outputs))
        aliases = [x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                   for x in outputs]
        return err(*aliases)

    return wrapper


class _EagerAttention(torch.autograd.Function):
    """The same forward/backward without the custom-op dispatcher, for eager calls.

    ``torch.library`` dispatch costs ~60 us of host time per call (measured on
    the CPU with the kernel stubbed out), which is longer than the whole
    kernel for short sequences; outside ``torch.compile`` nothing needs the op
    boundary, so eager calls take this path and compiled graphs the op."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _fwd_impl(*inputs)
        _setup_context(ctx, inputs, output)
        # lse and rng_state carry no gradient: no zero tensors made for them per backward (a fill kernel)
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    @_first_order_only
    def backward(ctx, dout, _dlse, _drng):
        if dout is None:  # out's gradient undefined (materialisation off): nothing flows back
            return (None,) * (6 + len(ctx.options))
        return _grads(ctx, dout, _bwd_impl)


def _pick_op(compiled, eager, direct, q, k, v):
    """The op a call runs: ``compiled`` (the custom op) under torch.compile, ``eager`` (the autograd Function)
    when q, k or v needs a gradient, else ``direct`` (the forward without autograd's bookkeeping; bias, ALiBi
    and masks never take gradients)."""
    if torch.compiler.is_compiling():
        return compiled
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return eager
    return direct


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    seq_major: bool,
    softmax_scale: float,
    causal: bool,
    window: tuple[int, int],
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    block_mask: BlockMask | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Differentiable attention on already-validated arguments: ``(out, lse, rng_state)``.

    ``window`` is the normalised (left, right) (causal already folded in as
    right = 0); ``bias`` an expanded (B, Hq, Nq, Nk) view.  Callers are the
    public functions, which run :mod:`flashtile.ops.validate` first.
    """
    mask, (mask_block_q, mask_block_k) = (None, (0, 0)) if block_mask is None else (
        block_mask.mask.to(q.device), block_mask.block_size
    )
    op = _pick_op(flash_attn_fwd, _EagerAttention.apply, _fwd_impl, q, k, v)
    return op(
        q, k, v, bias, alibi_slopes, mask, mask_block_q, mask_block_k,
        float(softmax_scale), bool(causal), int(window[0]), int(window[1]),
        float(softcap), float(dropout_p), bool(deterministic), bool(seq_major),
    )


# --------------------------------------------------------------------------- #
# Packed (variable-length) batches: flashtile::flash_attn_varlen_fwd / _bwd
# --------------------------------------------------------------------------- #
@torch.library.custom_op(
    "flashtile::flash_attn_varlen_fwd", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def flash_attn_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    block_table: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed forward (FA2's kernel or the Hopper one): ``(out, lse, rng_state)``; out (total_q, Hq, d), lse
    (Hq, total_q) float32."""
    return _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, max_seqlen_q, max_seqlen_k,
                            softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic)


@_on_tensor_device
def _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic):
    """Body of ``flashtile::flash_attn_varlen_fwd``, and the one place a packed forward picks its kernel:
    the Hopper forward where ``runtime.fa3_fwd.prefer_hopper_varlen`` says, else the FA2 kernel."""
    from flashtile.runtime.fa2_fwd import fa2_forward
    from flashtile.runtime.fa3_fwd import fa3_varlen_forward, prefer_hopper_varlen

    plain = block_table is None and alibi_slopes is None and dropout_p == 0 and softcap == 0
    if prefer_hopper_varlen(q, k, v, causal=causal, window=(window_left, window_right), plain=plain,
                            max_seqlen_k=max_seqlen_k, n_seqs=cu_seqlens_q.shape[0] - 1):
        out, lse = fa3_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale=softmax_scale, causal=causal)
        return out, lse, torch.zeros(2, dtype=torch.int64)
    rng = _philox(q.device) if dropout_p > 0 else None
    out, lse = fa2_forward(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_state=rng,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        block_table=block_table,
    )
    return out, lse, rng if rng is not None else torch.zeros(2, dtype=torch.int64)


@flash_attn_varlen_fwd.register_fake
def _flash_attn_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, max_seqlen_q,
                                max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, dropout_p,
                                deterministic):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    return out, lse, torch.empty(2, dtype=torch.int64, device=q.device if dropout_p > 0 else "cpu")


@torch.library.custom_op("flashtile::flash_attn_varlen_bwd", mutates_args=())
def flash_attn_varlen_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    rng_state: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    block_table: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed FA2 backward: ``(dq, dk, dv)`` in the shapes and dtype of q, k, v (no paged K/V)."""
    return _varlen_bwd_impl(dout, q, k, v, out, lse, rng_state, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes,
                            max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                            dropout_p, deterministic)


@_on_tensor_device
def _varlen_bwd_impl(dout, q, k, v, out, lse, rng_state, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes,
                     max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, dropout_p,
                     deterministic):
    from flashtile.runtime import fa3_gluon_bwd
    from flashtile.runtime.fa2_bwd import fa2_backward

    if block_table is not None:  # the public functions refuse this before the forward; a direct op call lands here
        raise ValueError("block_table: the paged forward has no backward (call it under torch.no_grad())")
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    plain = alibi_slopes is None and dropout_p == 0 and softcap == 0
    if fa3_gluon_bwd.prefer_gluon_bwd_varlen(q, k, v, dout, causal=causal, window=(window_left, window_right),
                                             plain=plain, deterministic=deterministic, max_seqlen_k=max_seqlen_k,
                                             n_seqs=cu_seqlens_q.shape[0] - 1):
        return fa3_gluon_bwd.fa3_gluon_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                       max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale,
                                                       causal=causal)
    return fa2_backward(
        dout, q, k, v, out, lse,
        softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right), softcap=softcap,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_state=rng_state if dropout_p > 0 else None,
        deterministic=deterministic, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )


@flash_attn_varlen_bwd.register_fake
def _flash_attn_varlen_bwd_fake(dout, q, k, v, out, lse, rng_state, cu_seqlens_q, cu_seqlens_k, block_table,
                                alibi_slopes, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                                window_right, softcap, dropout_p, deterministic):
    return (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
        torch.empty(v.shape, dtype=v.dtype, device=v.device),
    )


def _varlen_setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, block_table, alibi_slopes = inputs[:7]
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, cu_q, cu_k, block_table, alibi_slopes)
    ctx.options = inputs[7:]
    ctx.mark_non_differentiable(lse, rng_state)


def _varlen_grads(ctx, dout, bwd):
    dq, dk, dv = bwd(dout, *ctx.saved_tensors, *ctx.options)
    return (dq, dk, dv) + (None,) * (4 + len(ctx.options))


def _varlen_backward(ctx, dout, _dlse, _drng):
    return _varlen_grads(ctx, dout, flash_attn_varlen_bwd)


flash_attn_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


class _EagerVarlenAttention(torch.autograd.Function):
    """:class:`_EagerAttention` for packed batches."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _varlen_fwd_impl(*inputs)
        _varlen_setup_context(ctx, inputs, output)
        ctx.set_materialize_grads(False)  # as _EagerAttention
        return output

    @staticmethod
    @_first_order_only
    def backward(ctx, dout, _dlse, _drng):
        if dout is None:
            return (None,) * (7 + len(ctx.options))
        return _varlen_grads(ctx, dout, _varlen_bwd_impl)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float,
    causal: bool,
    window: tuple[int, int],
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    block_table: torch.Tensor | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Differentiable packed attention on already-validated arguments: ``(out, lse, rng_state)``."""
    op = _pick_op(flash_attn_varlen_fwd, _EagerVarlenAttention.apply, _varlen_fwd_impl, q, k, v)
    return op(
        q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, int(max_seqlen_q), int(max_seqlen_k),
        float(softmax_scale), bool(causal), int(window[0]), int(window[1]), float(softcap), float(dropout_p),
        bool(deterministic),
    )
