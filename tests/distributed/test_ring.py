"""Ring (and Ulysses) attention over spawned gloo ranks on CPU, against one process and the float64 oracle.

Spawning costs seconds per process, so each group of 2 or 4 ranks runs every case of its size
once (``tests/distributed/_worker.py``); the parent checks each case's gathered out, lse, dq,
dk, dv against ``flash_attn_func`` on the full sequence and against ``attention_ref``.
The ``multigpu`` tests at the end run NCCL on 2 / 4 GPUs at realistic shapes.
"""

from __future__ import annotations

import socket

import pytest
import torch

from tests._oracle import assert_close, attention_ref_grads
from tests.distributed._worker import full_inputs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, stages: list, tmp_path, backend: str = "gloo") -> dict:
    """Run ``stages`` ((group size, cases) pairs) on ``world`` spawned ranks: {(size, group index): results}."""
    import torch.multiprocessing as mp

    from tests.distributed import _worker

    path = str(tmp_path / "ring")
    mp.spawn(_worker.run, args=(world, _free_port(), stages, path, backend), nprocs=world, join=True)
    return {(size, g): torch.load(f"{path}.{size}.{g}") for size, _ in stages for g in range(world // size)}


def _case(name, fn="ring", *, layout, seqlen, hq=2, hk=2, d=16, seed=0, **kw):
    return dict(name=name, fn=fn, layout=layout, seqlen=seqlen, batch=1, hq=hq, hk=hk, d=d, seed=seed, **kw)


CASES_2 = [
    _case("zigzag-causal", layout="zigzag", seqlen=16, causal=True),
    _case("contiguous-odd-gqa", layout="contiguous", seqlen=14, hq=4, hk=2, softcap=3.0, api="kvpacked", seed=1),
    _case("zigzag-window-gqa", layout="zigzag", seqlen=16, hq=4, hk=1, window=(5, 2), seed=2),
    _case("contiguous-causal-window", layout="contiguous", seqlen=12, causal=True, window=(3, 0),
          deterministic=True, api="qkvpacked", seed=3),
    _case("zigzag-causal-mqa-ulysses", fn="ulysses", layout="zigzag", seqlen=16, hq=4, hk=1, causal=True, seed=4),
    _case("zigzag-causal-window-dropout", layout="zigzag", seqlen=16, causal=True, window=(6, 0), dropout=0.3,
          seed=8),
    _case("unequal-shards", layout="zigzag", seqlen=16, causal=True, expect_error="unequal"),
    _case("options-differ", layout="zigzag", seqlen=16, causal=True, expect_error="softcap"),
    _case("alibi-on-one-rank", layout="zigzag", seqlen=16, causal=True, expect_error="alibi"),
    _case("ulysses-odd-heads", fn="ulysses", layout="zigzag", seqlen=16, hq=3, hk=1, expect_error="heads"),
    _case("double-backward", layout="zigzag", seqlen=16, causal=True, double_backward=True, seed=9),
    _case("ulysses-dropout-same-heads", fn="ulysses", layout="contiguous", seqlen=16, hq=4, hk=4, dropout=0.5,
          same_heads=True, seed=31),
]
CASES_2 += [  # packed batches: global lengths, each a multiple of 2P (zigzag) or P (contiguous); empty sequences
    _case("varlen-zigzag-causal-gqa", fn="ring-varlen", layout="zigzag", seqlen=0, hq=4, hk=2, causal=True, seed=20,
          lens_q=[16, 0, 8, 24]),
    _case("varlen-contiguous-softcap", fn="ring-varlen", layout="contiguous", seqlen=0, softcap=3.0, seed=21,
          lens_q=[6, 10, 2]),
    _case("varlen-zigzag-window", fn="ring-varlen", layout="zigzag", seqlen=0, window=(5, 2), seed=22,
          lens_q=[16, 12, 4]),
    _case("varlen-contiguous-causal-cross", fn="ring-varlen", layout="contiguous", seqlen=0, causal=True, seed=23,
          lens_q=[4, 8, 6], lens_k=[8, 12, 2]),
    _case("varlen-zigzag-odd", fn="ring-varlen", layout="zigzag", seqlen=0, seed=24, lens_q=[6, 8],
          expect_error="even"),
    _case("varlen-dropout-on-one-rank", fn="ring-varlen", layout="contiguous", seqlen=0, seed=30, lens_q=[4, 8],
          expect_error="dropout"),
    _case("varlen-lengths-differ", fn="ring-varlen", layout="contiguous", seqlen=0, seed=28, lens_q=[4, 8],
          expect_error="lengths"),
    _case("varlen-ulysses-lengths-differ", fn="ulysses-varlen", layout="contiguous", seqlen=0, seed=29, hq=2, hk=2,
          lens_q=[4, 8], expect_error="lengths"),
    _case("varlen-ulysses-zigzag-causal-mqa", fn="ulysses-varlen", layout="zigzag", seqlen=0, hq=4, hk=1,
          causal=True, seed=26, lens_q=[16, 0, 8, 12]),
    _case("varlen-ulysses-contiguous-window-alibi", fn="ulysses-varlen", layout="contiguous", seqlen=0, hq=4,
          hk=2, window=(3, 2), alibi=[0.5, 0.25, 0.125, 0.0625], seed=27, lens_q=[6, 10], lens_k=[8, 4]),
]
CASES_4 = [
    _case("zigzag-causal-gqa", layout="zigzag", seqlen=24, hq=4, hk=2, causal=True, seed=5),
    _case("contiguous-window-mesh", layout="contiguous", seqlen=20, window=(4, 4), mesh=True, seed=6),
    _case("varlen-zigzag-causal-window", fn="ring-varlen", layout="zigzag", seqlen=0, hq=4, hk=1, causal=True,
          window=(6, 0), seed=25, lens_q=[16, 8, 0, 24]),
    _case("contiguous-window-alibi-ulysses", fn="ulysses", layout="contiguous", seqlen=20, hq=4, hk=4,
          window=(4, 4), alibi=[0.5, 0.25, 0.125, 1.0], seed=7),
]


def _ring_keep_mask(case: dict, world: int, states: list) -> torch.Tensor:
    """The (B, Hq, N, N) dropout keep-mask a ring call used: every kernel call's mask, rebuilt from its
    rank's Philox state and the call's counter range, placed at the call's global positions."""
    from flashtile.distributed.plan import step_plan
    from flashtile.distributed.ring import MAX_CALLS
    from flashtile.ops.validate import check_window, unbind_window
    from flashtile.reference.ring import shard_positions
    from flashtile.runtime.common import dropout_keep_mask

    b, n, hq, layout, p = case["batch"], case["seqlen"], case["hq"], case["layout"], case["dropout"]
    per = n // world
    left, right = unbind_window(*check_window(case.get("causal", False), case.get("window", (-1, -1))), n, n)
    keep = torch.zeros(b, hq, n, n, dtype=torch.bool)
    for rank, (seed, offset) in enumerate(states):
        for src in range(world):
            for index, c in enumerate(step_plan(layout, world, rank, src, per, per, left, right)):
                start = offset + ((rank * world + src) * MAX_CALLS + index) * b * hq * per * per
                mask = dropout_keep_mask(seed, start, b, hq, c.r1 - c.r0, c.c1 - c.c0, p, "cpu")
                rows = shard_positions(n, world, rank, layout)[c.r0:c.r1]
                cols = shard_positions(n, world, src, layout)[c.c0:c.c1]
                keep[:, :, rows[:, None], cols[None, :]] = mask
    return keep


def _ulysses_keep_mask(case: dict, world: int, states: list) -> torch.Tensor:
    """The (B, Hq, N, N) keep-mask of a Ulysses call: rank r's head group drew its state in stream r."""
    from flashtile.ops.autograd import stream_seed
    from flashtile.runtime.common import dropout_keep_mask

    b, n, hq, p = case["batch"], case["seqlen"], case["hq"], case["dropout"]
    hh = hq // world
    return torch.cat([dropout_keep_mask(stream_seed(seed, rank), offset, b, hh, n, n, p, "cpu")
                      for rank, (seed, offset) in enumerate(states)], dim=1)


def _check(case: dict, got: tuple, device: str = "cpu", keep: torch.Tensor | None = None) -> None:
    """Gathered (out, lse, dq, dk, dv) against flash_attn_func on the full sequence and the float64 oracle.

    fp32 on CPU: the interpreter's fp32 tolerance for both.  bf16 on a GPU: close to flash_attn_func at
    the bf16 tolerance, and within 2x its error (+ 2e-3 of max|ref|: the partial outputs are rounded to
    bf16 before they merge) against the oracle."""
    from flashtile import flash_attn_func

    q, k, v, dout = full_inputs(case, device)
    kw = dict(causal=case.get("causal", False), window_size=case.get("window", (-1, -1)),
              softcap=case.get("softcap", 0.0))
    alibi = torch.tensor(case["alibi"], dtype=torch.float32, device=device) if case.get("alibi") else None
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out, lse = flash_attn_func(*leaves, return_lse=True, alibi_slopes=alibi, **kw)
    out.backward(dout)
    single = (out, lse, *(x.grad for x in leaves))
    bhnd = lambda x: x.transpose(1, 2)  # noqa: E731
    ref = attention_ref_grads(bhnd(q), bhnd(k), bhnd(v), bhnd(dout), causal=kw["causal"], window=kw["window_size"],
                              softcap=kw["softcap"], alibi=alibi, keep=keep, dropout_p=case.get("dropout", 0.0))
    ref = (bhnd(ref[0]), ref[1], *(bhnd(g) for g in ref[2:]))
    for what, a, s, r in zip(("out", "lse", "dq", "dk", "dv"), got, single, ref):
        a = a.to(s.device)
        if keep is None:  # with dropout the single-process call draws other masks: the oracle alone
            assert_close(a, s, what=f"{case['name']} {what} vs flash_attn_func")
        if s.dtype == torch.float32:
            assert_close(a, r, dtype=torch.float32, what=f"{case['name']} {what} vs float64 oracle")
        else:
            err = lambda x: float((x.double() - r).abs().max() / r.abs().max())  # noqa: E731
            assert err(a) <= 2 * err(s) + 2e-3, f"{case['name']} {what}: {err(a):.2e} vs one GPU {err(s):.2e}"


def _check_varlen(case: dict, got: tuple, device: str = "cpu") -> None:
    """Gathered packed (out, lse, dq, dk, dv) against flash_attn_varlen_func on the full batch and, per sequence,
    the float64 oracle: fp32 tolerance on the CPU (the interpreter); bf16 on a GPU, within 2x the single call's
    error (+ 2e-3 of max|ref|) against the oracle, as :func:`_check`."""
    from flashtile import flash_attn_varlen_func
    from tests.distributed._worker import packed_inputs

    (q, k, v, dout), cu_q, cu_k = packed_inputs(case, device)
    got = tuple(x.to(device) for x in got)
    kw = dict(causal=case.get("causal", False), window_size=case.get("window", (-1, -1)),
              softcap=case.get("softcap", 0.0))
    alibi = torch.tensor(case["alibi"], dtype=torch.float32, device=device) if case.get("alibi") else None
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    lens_q, lens_k = case["lens_q"], case.get("lens_k", case["lens_q"])
    out, lse = flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True,
                                      alibi_slopes=alibi, **kw)
    out.backward(dout)
    single = (out, lse, *(x.grad for x in leaves))
    for what, a, s in zip(("out", "lse", "dq", "dk", "dv"), got, single):
        assert_close(a, s, what=f"{case['name']} {what} vs flash_attn_varlen_func")
    oq, ok = cu_q.tolist(), cu_k.tolist()
    for i in range(len(lens_q)):
        if lens_q[i] == 0:
            continue
        rows, cols = slice(oq[i], oq[i + 1]), slice(ok[i], ok[i + 1])
        seq = lambda x, r: x[r].unsqueeze(0).transpose(1, 2)  # noqa: E731 - (1, H, N, d)
        ref = attention_ref_grads(seq(q, rows), seq(k, cols), seq(v, cols), seq(dout, rows), causal=kw["causal"],
                                  window=kw["window_size"], softcap=kw["softcap"], alibi=alibi)
        mine = (seq(got[0], rows), got[1][:, rows].unsqueeze(0), seq(got[2], rows), seq(got[3], cols),
                seq(got[4], cols))
        theirs = (seq(single[0], rows), single[1][:, rows].unsqueeze(0), seq(single[2], rows), seq(single[3], cols),
                  seq(single[4], cols))
        for what, a, s1, r in zip(("out", "lse", "dq", "dk", "dv"), mine, theirs, ref):
            if lens_k[i] == 0 and what in ("dk", "dv"):
                continue
            if a.dtype == torch.float32:
                assert_close(a, r, dtype=torch.float32, what=f"{case['name']} sequence {i} {what} vs float64 oracle")
            else:
                err = lambda x: float((x.double() - r).abs().max() / r.abs().max())  # noqa: E731
                assert err(a) <= 2 * err(s1) + 2e-3, f"{case['name']} seq {i} {what}: {err(a):.2e} vs {err(s1):.2e}"


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """One spawn of 4 ranks: the 2-rank cases on groups {0, 1} and {2, 3} side by side, then the
    4-rank cases on all of them."""
    return _spawn(4, [(2, CASES_2), (4, CASES_4)], tmp_path_factory.mktemp("ring"))


@pytest.mark.parametrize("pair", [0, 1], ids=["ranks01", "ranks23"])
@pytest.mark.parametrize("case", [c for c in CASES_2 if not (c.get("expect_error") or c.get("double_backward"))],
                         ids=lambda c: c["name"])
def test_two_ranks(spawned, case, pair):
    got = spawned[(2, pair)]
    if case["fn"].endswith("-varlen"):
        _check_varlen(case, got[case["name"]])
        return
    keep = None
    if case.get("dropout"):
        mask = _ulysses_keep_mask if case["fn"] == "ulysses" else _ring_keep_mask
        keep = mask(case, 2, got[case["name"] + ":philox"])
    _check(case, got[case["name"]], keep=keep)


@pytest.mark.parametrize("pair", [0, 1])
def test_unequal_shards_raise_on_every_rank(spawned, pair):
    kind, msg = spawned[(2, pair)]["unequal-shards"]
    assert kind == "ValueError" and "every rank" in msg and "q, k, v" in msg


@pytest.mark.parametrize("pair", [0, 1])
def test_options_that_differ_between_ranks_raise_on_every_rank(spawned, pair):
    kind, msg = spawned[(2, pair)]["options-differ"]
    assert kind == "ValueError" and "softcap" in msg


@pytest.mark.parametrize("pair", [0, 1])
@pytest.mark.parametrize("name", ["alibi-on-one-rank", "varlen-dropout-on-one-rank"])
def test_a_refusal_on_one_rank_raises_on_every_rank(spawned, pair, name):
    """An option the ring refuses (ALiBi, the packed ring's dropout) passed by one rank only: the agreement fails on
    every rank before that rank's refusal, so no rank waits alone in a collective."""
    kind, msg = spawned[(2, pair)][name]
    assert kind == "ValueError" and "every rank" in msg


@pytest.mark.parametrize("pair", [0, 1])
def test_ulysses_head_groups_drop_independently(spawned, pair):
    """Ranks seeded alike (as here) run Ulysses' head groups with the same local head indices: their dropout
    seeds differ by rank (``philox_stream``), so heads with equal inputs on different ranks keep different
    elements (identical outputs before), while each group's call is still dropout through the kernels."""
    out = spawned[(2, pair)]["ulysses-dropout-same-heads"][0]  # (B, N, H, d), heads 0-1 on rank 0, 2-3 on rank 1
    assert (out[:, :, 0] - out[:, :, 1]).abs().max() > 1e-3  # within a rank: the head index already differs
    # (the same case in test_two_ranks: out, lse and the gradients against the oracle with these masks)
    assert (out[:, :, 0] - out[:, :, 2]).abs().max() > 1e-3
    assert (out[:, :, 1] - out[:, :, 3]).abs().max() > 1e-3


@pytest.mark.parametrize("pair", [0, 1])
def test_double_backward_raises(spawned, pair):
    """dq of the ring taken with create_graph=True and a constant upstream gradient: differentiating it again
    raises (the ring's backward is first-order only) rather than treating dq as a constant."""
    kind, msg = spawned[(2, pair)]["double-backward"]
    assert kind == "RuntimeError" and "no double backward" in msg


@pytest.mark.parametrize("pair", [0, 1])
def test_ulysses_heads_not_divisible_raise(spawned, pair):
    kind, msg = spawned[(2, pair)]["ulysses-odd-heads"]
    assert kind == "ValueError" and msg.startswith("q:") and "multiple of 2" in msg


@pytest.mark.parametrize("case", CASES_4, ids=lambda c: c["name"])
def test_four_ranks(spawned, case):
    if case["fn"].endswith("-varlen"):
        _check_varlen(case, spawned[(4, 0)][case["name"]])
    else:
        _check(case, spawned[(4, 0)][case["name"]])


@pytest.mark.parametrize("pair", [0, 1])
@pytest.mark.parametrize("name", ["varlen-lengths-differ", "varlen-ulysses-lengths-differ"])
def test_varlen_lengths_that_differ_between_ranks_raise_on_every_rank(spawned, pair, name):
    """One rank's sequences cut elsewhere with the same totals: the lengths' CRC differs, every rank raises."""
    kind, msg = spawned[(2, pair)][name]
    assert kind == "ValueError" and "every rank" in msg and "crc32 of the q lengths" in msg


@pytest.mark.parametrize("pair", [0, 1])
def test_varlen_odd_local_lengths_raise_on_every_rank(spawned, pair):
    kind, msg = spawned[(2, pair)]["varlen-zigzag-odd"]
    assert kind == "ValueError" and msg.startswith("cu_seqlens_q:") and "even" in msg and "[0]" in msg


# --------------------------------------------------------------------------- #
# NCCL on 2 / 4 GPUs, bf16, realistic shapes (pytest -m multigpu)
# --------------------------------------------------------------------------- #
def _gpu_cases(world):
    big = dict(seqlen=4096, hq=8, hk=2, d=128, dtype="bfloat16")
    return [
        _case(f"nccl{world}-zigzag-causal", layout="zigzag", causal=True, seed=10, **big),
        _case(f"nccl{world}-contiguous", layout="contiguous", seed=11, **big),
        _case(f"nccl{world}-zigzag-window", layout="zigzag", window=(1000, 0), causal=True, seed=12, **big),
        _case(f"nccl{world}-ulysses-causal", fn="ulysses", layout="zigzag", causal=True, seed=13,
              **{**big, "hk": world}),
        _case(f"nccl{world}-varlen-zigzag-causal", fn="ring-varlen", layout="zigzag", causal=True, seed=14,
              lens_q=[1024, 0, 2048, 512, 256], **{**big, "seqlen": 0}),
        _case(f"nccl{world}-ulysses-varlen-causal", fn="ulysses-varlen", layout="zigzag", causal=True, seed=15,
              lens_q=[1024, 512, 2048], **{**big, "seqlen": 0}),
    ]


@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4])
def test_nccl_bf16_matches_one_gpu(world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    cases = _gpu_cases(world)
    got = _spawn(world, [(world, cases)], tmp_path, backend="nccl")[(world, 0)]
    for case in cases:
        (_check_varlen if case["fn"].endswith("-varlen") else _check)(case, got[case["name"]], device="cuda")
