"""Per-signature plans of the plain attention forward and backward, and of the FP8 forward: the eager path's host
time.

A call without softcap, ALiBi, bias, dropout or block mask is decided by its signature alone: the shapes,
strides, dtypes and devices of its tensors, causal / window, the layout and whether the tensors are 16-byte
aligned.  The first call of a signature takes the generic path's decisions (``prefer_hopper``,
``prefer_gluon_bwd``, the configs) and binds its launches once; later calls allocate the outputs and launch.
At 1k tokens the generic path's host time per fwd+bwd was about the kernels' time on an H100 host
(bench/NOTES.md, "Host time of short calls").

Invariants: a plan is used only while every dispatch hook below is the package's own (a test or tool that
patches one takes the generic path on every call) and the switches' values are part of the key; a plan is
made only where the generic path would make exactly the plan's launches with the plan's arguments (the
runtime modules' ``*_args`` helpers are shared by both paths); a plan's launches take only the addresses of its
tensors (shapes and strides are static), so it runs on the op's tensors in the op's layout; the scale is checked
per call (positive and finite: the kernels' fast path).
"""

from __future__ import annotations

import threading

import torch

from flashtile.ops.autograd import _bhnd, _check_op_stats, _check_op_tensors, _out_like
from flashtile.runtime import common, fa2_bwd, fa2_fwd, fa3_bwd, fa3_fwd, fa3_gluon, fa3_gluon_bwd, launch

__all__ = ["forward_plan", "backward_plan", "fp8_plan", "clear"]

# (module, attribute) of every function the generic plain path dispatches or launches through
_HOOK_NAMES = (
    (launch, "launch"), (launch, "launcher"),
    (fa3_fwd, "prefer_hopper"), (fa3_fwd, "_prefer"), (fa3_fwd, "hopper_wins"), (fa3_fwd, "use_gluon"),
    (fa3_fwd, "forward_checked"), (fa3_fwd, "launch"), (fa3_fwd, "fa3_config"), (fa3_fwd, "ensure_allocator"),
    (fa3_fwd, "_check"), (fa3_fwd, "descriptor_grid_fits"), (fa3_fwd, "forward_plan"),
    (fa3_gluon, "gluon_launch"), (fa3_gluon, "gluon_config"), (fa3_gluon, "sm_count"), (fa3_gluon, "_check"),
    (fa3_gluon, "ensure_allocator"),
    (fa2_fwd, "fa2_forward"), (fa2_fwd, "fwd_config"), (fa2_fwd, "plain_forward"),
    (fa3_gluon_bwd, "prefer_gluon_bwd"), (fa3_gluon_bwd, "backward_into"), (fa3_gluon_bwd, "_launch_all"),
    (fa3_gluon_bwd, "gluon_bwd_config"), (fa3_gluon_bwd, "group_loop_wins"), (fa3_gluon_bwd, "gluon_bwd_wins"),
    (fa3_gluon_bwd, "descriptor_grid_fits"), (fa3_gluon_bwd, "_check"), (fa3_gluon_bwd, "backward_plan"),
    (fa3_bwd, "prefer_hopper_bwd"), (fa3_bwd, "hopper_bwd_wins"), (fa3_bwd, "descriptor_grid_fits"),
    (fa3_bwd, "fa3_backward"),
    (fa2_bwd, "fa2_backward"), (fa2_bwd, "bwd_config"), (fa2_bwd, "plain_backward"), (fa2_bwd, "_bwd_launches"),
    (fa2_bwd, "pdl_supported"), (fa2_bwd, "_wide"), (fa2_bwd, "launch"), (fa2_bwd, "launcher"),
)
# and those the FP8 forward's generic path adds (checked for FP8 plans only: plain calls do not pay for them)
_FP8_HOOK_NAMES = _HOOK_NAMES + (
    (fa3_fwd, "prefer_hopper_fp8"), (fa3_fwd, "fa3_forward_fp8"), (fa3_fwd, "_gluon_fp8_cfg"),
    (fa3_fwd, "use_gluon_fp8"), (fa3_fwd, "fa3_fp8_config"), (fa3_fwd, "fp8_forward_plan"),
    (fa3_fwd, "_fp8_route"), (fa3_fwd, "launch_args"), (fa3_fwd, "launch_dynamic"),
    (fa3_gluon, "fp8_v_operand"), (fa3_gluon, "fp8_v_args"), (fa3_gluon, "gluon_fp8_config"),
    (fa3_gluon, "gluon_args"), (fa3_gluon, "gluon_dynamic"), (fa3_gluon, "gluon_launcher"),
)


def _owned(names) -> tuple:
    """(module namespaces, attributes, the package's own objects) of the hooks: one C-level map per check."""
    return (tuple(vars(m) for m, _ in names), tuple(name for _, name in names), [getattr(m, n) for m, n in names])


_OWN = _owned(_HOOK_NAMES)
_FP8_OWN = _owned(_FP8_HOOK_NAMES)

_FWD: dict = {}
_BWD: dict = {}
_FP8: dict = {}
_LOCK = threading.Lock()
_MAX = 4096  # signatures kept per direction (a long-running server sees few; beyond this, start over)


def clear() -> None:
    """Forget every plan (the next call of each signature plans again)."""
    with _LOCK:
        _FWD.clear()
        _BWD.clear()
        _FP8.clear()


def _own_hooks(owned: tuple = _OWN) -> bool:
    namespaces, names, own = owned
    return list(map(dict.get, namespaces, names)) == own  # functions compare by identity


def _switches() -> tuple:
    """The module switches the generic path reads (benchmarks flip them): part of every key."""
    return (fa3_fwd.ENABLED, fa3_fwd.GLUON, fa3_fwd.GLUON_FP8, fa3_gluon.BIND_LAUNCH, fa3_gluon.HOST_DESC_MIN_WORK,
            fa3_gluon.DYNAMIC_MIN_KEYS, fa3_gluon.NARROW_TWO_WG_KEYS, fa3_gluon.NARROW_PERSISTENT_MAX_KEYS,
            fa3_gluon.FP8_DYNAMIC_MIN_KEYS, fa3_gluon_bwd.ENABLED,
            fa3_gluon_bwd.BIND_LAUNCH, fa3_bwd.ENABLED, common.HOPPER_TRITON)


def _remember(table: dict, key, plan) -> None:
    with _LOCK:
        if len(table) >= _MAX:
            table.clear()
        table[key] = plan


_NONE = object()  # a signature the generic path keeps (no plan)


def _fwd_key(q, k, v, causal: bool, window: tuple[int, int], seq_major: bool):
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            k.device, v.device, causal, window, seq_major, (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15,
            _switches())


class ForwardPlan:
    """The plain forward of one signature: ``plan(q, k, v, softmax_scale)`` -> ``(out, lse)``, out in the op's
    layout (``ops.autograd._out_like``), lse (B, Hq, Nq) float32."""

    __slots__ = ("_run", "_seq_major", "_lse_shape")

    def __init__(self, run, seq_major: bool, lse_shape: tuple) -> None:
        self._run, self._seq_major, self._lse_shape = run, seq_major, lse_shape

    def __call__(self, q, k, v, softmax_scale: float):
        out = _out_like(q, self._seq_major)
        lse = torch.empty(self._lse_shape, dtype=torch.float32, device=q.device)
        self._run(q, k, v, out, lse, softmax_scale)
        return out, lse


def forward_plan(q, k, v, causal: bool, window: tuple[int, int], seq_major: bool, softmax_scale: float):
    """The :class:`ForwardPlan` of a plain forward's signature (q, k, v in the op's layout, the device current),
    or None: the generic path runs it (hooks patched, a non-positive scale, no work, a layout the plans do not
    cover).  The op's tensor checks (``_check_op_tensors``) run before a signature is planned: they raise on
    what the kernels cannot take, and a signature with a plan passed them."""
    if not 0 < softmax_scale < float("inf") or not _own_hooks():
        return None
    key = _fwd_key(q, k, v, causal, window, seq_major)
    plan = _FWD.get(key)
    if plan is None:
        _check_op_tensors(q, k, v, seq_major)
        plan = _make_forward(q, k, v, causal, window, seq_major)
        _remember(_FWD, key, _NONE if plan is None else plan)
    return None if plan is _NONE else plan


def _make_forward(q, k, v, causal: bool, window: tuple[int, int], seq_major: bool):
    qb, kb, vb = _bhnd(q, seq_major), _bhnd(k, seq_major), _bhnd(v, seq_major)
    b, hq, nq, _ = qb.shape
    if b * hq * nq == 0 or kb.shape[2] == 0:
        return None
    out = _bhnd(_out_like(q, seq_major), seq_major)  # an example output: its strides are the signature's
    lse = torch.empty((b, hq, nq), dtype=torch.float32, device=q.device)
    if fa3_fwd.prefer_hopper(qb, kb, vb, causal=causal, window=window, plain=True):
        run = fa3_fwd.forward_plan(qb, kb, vb, out, lse, causal)
    else:
        run = fa2_fwd.plain_forward(qb, kb, vb, out, lse, *window)
        if run is None:
            return None
    return ForwardPlan(run, seq_major, (b, hq, nq))


def _bwd_key(dout, q, k, v, out, lse, causal: bool, window: tuple[int, int], seq_major: bool):
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), dout.shape, dout.stride(), out.shape,
            out.stride(), lse.shape, lse.stride(), q.dtype, k.dtype, v.dtype, dout.dtype, out.dtype, lse.dtype,
            q.device, k.device, v.device, dout.device, out.device, lse.device, causal, window, seq_major,
            (q.data_ptr() | k.data_ptr() | v.data_ptr() | dout.data_ptr() | out.data_ptr() | lse.data_ptr()) & 15,
            _switches())


class BackwardPlan:
    """The plain backward of one signature: ``plan(dout, q, k, v, out, lse, softmax_scale)`` -> ``(dq, dk, dv)``
    contiguous in the op's layout."""

    __slots__ = ("_run",)

    def __init__(self, run) -> None:
        self._run = run

    def __call__(self, dout, q, k, v, out, lse, softmax_scale: float):
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        self._run(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale)
        return dq, dk, dv


def backward_plan(dout, q, k, v, out, lse, causal: bool, window: tuple[int, int], deterministic: bool,
                  seq_major: bool, softmax_scale: float):
    """The :class:`BackwardPlan` of a plain backward's signature (the device current), or None (the generic
    path); the op's tensor checks as in :func:`forward_plan`."""
    if deterministic or not 0 < softmax_scale < float("inf") or not _own_hooks():
        return None
    key = _bwd_key(dout, q, k, v, out, lse, causal, window, seq_major)
    plan = _BWD.get(key)
    if plan is None:
        _check_op_tensors(q, k, v, seq_major)
        _check_op_stats(q, out, lse, seq_major)
        plan = _make_backward(dout, q, k, v, out, lse, causal, window, seq_major)
        _remember(_BWD, key, _NONE if plan is None else plan)
    return None if plan is _NONE else plan


def _make_backward(dout, q, k, v, out, lse, causal: bool, window: tuple[int, int], seq_major: bool):
    if dout.shape != out.shape or dout.dtype != out.dtype or dout.device != out.device or dout.stride(-1) != 1:
        return None  # the generic path raises or copies
    dob, qb, kb, vb, ob = (_bhnd(x, seq_major) for x in (dout, q, k, v, out))
    dq, dk, dv = (_bhnd(torch.empty(x.shape, dtype=x.dtype, device=x.device), seq_major) for x in (q, k, v))
    if fa3_gluon_bwd.ENABLED and fa3_gluon_bwd.prefer_gluon_bwd(qb, kb, vb, dob, causal=causal, window=window,
                                                                plain=True, deterministic=False):
        run = fa3_gluon_bwd.backward_plan(dob, qb, kb, vb, ob, lse, dq, dk, dv, causal)
        return None if run is None else BackwardPlan(run)
    if fa3_bwd.prefer_hopper_bwd(qb, kb, vb, dob, causal=causal, window=window, plain=True):
        return None  # the Triton Hopper backward: unplanned
    left, right = window[0], 0 if causal else window[1]
    run = fa2_bwd.plain_backward(dob, qb, kb, vb, ob, lse, dq, dk, dv, causal, left, right)
    return None if run is None else BackwardPlan(run)


def _fp8_key(q, k, v, descales, causal: bool, window: tuple[int, int]):
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            k.device, v.device, *((ds.shape, ds.stride(), ds.dtype, ds.device) for ds in descales), causal, window,
            # the Hopper kernel's descriptors need q and k 16-byte aligned (V is copied; its launch keys its own)
            q.data_ptr() % 16 == 0, k.data_ptr() % 16 == 0, _switches())


class Fp8Plan:
    """The FP8 Hopper forward of one signature: ``plan(q, k, v, descales, softmax_scale)`` -> ``(out, lse)``, out
    (B, Nq, Hq, d) bfloat16, lse (B, Hq, Nq) float32, from e4m3 (B, N, H, d) q, k, v and (B, Hk) descales."""

    __slots__ = ("_run", "_out_shape", "_lse_shape", "_vt_shape")

    def __init__(self, run, out_shape: tuple, lse_shape: tuple, vt_shape: tuple) -> None:
        self._run, self._out_shape, self._lse_shape, self._vt_shape = run, out_shape, lse_shape, vt_shape

    def __call__(self, q, k, v, descales, softmax_scale: float):
        out = torch.empty(self._out_shape, dtype=torch.bfloat16, device=q.device)
        lse = torch.empty(self._lse_shape, dtype=torch.float32, device=q.device)
        vt = torch.empty(self._vt_shape, dtype=v.dtype, device=v.device)
        self._run(q, k, v, vt, out, lse, descales, softmax_scale)
        return out, lse


def fp8_plan(q, k, v, descales, causal: bool, window: tuple[int, int], softmax_scale: float):
    """The :class:`Fp8Plan` of an FP8 forward's signature without softcap or ALiBi (q, k, v e4m3 (B, N, H, d) and
    the (B, Hk) float32 descales as ``ops.fp8_attn.check_fp8_inputs`` returns them, the device current), or None:
    the generic path runs it (hooks patched, a scale the Hopper kernel does not take, no work, a kernel other than
    the FP8 Hopper one, V without unit stride on d)."""
    if not 0 < softmax_scale < float("inf") or not _own_hooks(_FP8_OWN):
        return None
    key = _fp8_key(q, k, v, descales, causal, window)
    plan = _FP8.get(key)
    if plan is None:
        plan = _make_fp8(q, k, v, descales, causal, window, softmax_scale)
        _remember(_FP8, key, _NONE if plan is None else plan)
    return None if plan is _NONE else plan


def _make_fp8(q, k, v, descales, causal: bool, window: tuple[int, int], softmax_scale: float):
    qb, kb, vb = (x.transpose(1, 2) for x in (q, k, v))
    b, hq, nq, _ = qb.shape
    if b * hq * nq == 0 or kb.shape[2] == 0 or vb.stride(3) != 1:
        return None  # no work (fa3_fwd.outputs fills them) or a V that fp8_v_operand copies first: generic
    if not fa3_fwd.prefer_hopper_fp8(qb, kb, causal=causal, window=window, plain=True, softmax_scale=softmax_scale):
        return None
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((b, hq, nq), dtype=torch.float32, device=q.device)
    run, vt_shape = fa3_fwd.fp8_forward_plan(qb, kb, vb, descales, out.transpose(1, 2), lse, causal)
    return Fp8Plan(run, tuple(q.shape), (b, hq, nq), tuple(vt_shape))
