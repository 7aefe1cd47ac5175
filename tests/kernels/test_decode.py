"""Tests of the split-KV decoding kernels (flashtile/kernels/decode.py) and their host side
(flashtile/runtime/decode.py).

Oracle: tests/_oracle.py's float64 ``attention_ref`` with per-element key lengths
(``lens``), independent of flashtile; the kernel's (B, N, H, d) inputs are transposed.
On CPU the kernels run in Triton's interpreter, so caches are <= 150 keys and tiles are
16 keys (many tiles, ragged tails, empty splits).  Tolerances: the table of
tests/_oracle.py (``assert_close``: out at its dtype, the fp32 LSE at fp32; -inf matched
exactly, no NaN).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtile.kernels import decode as kernels_module
from flashtile.runtime import decode as decode_module
from flashtile.runtime.decode import (
    FLAG_ABOVE,
    FLAG_BELOW,
    FLAG_OVERFLOW,
    MAX_SPLITS,
    default_unified_range,
    flash_decode,
    num_splits_heuristic,
)
from tests._oracle import assert_close, attention_ref


def make(b, n, hq, hk, d, dtype=torch.float32, device="cpu", nq=1, seed=0):
    """q (B, Nq, Hq, d) and a contiguous cache (B, N, Hk, d)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, hq, d, generator=g)
    k = torch.randn(b, n, hk, d, generator=g)
    v = torch.randn(b, n, hk, d, generator=g)
    return (x.to(device=device, dtype=dtype) for x in (q, k, v))


def oracle(q, k, v, lens, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """float64 attention in the kernel's layouts: q (B, Nq, Hq, d), caches (B, N, Hk, d) holding element
    b's keys in [0, lens[b]) -> out (B, Nq, Hq, d), lse (B, Hq, Nq), on q's device."""
    lens = torch.as_tensor(lens).to(q.device, torch.long)
    # slots at or past lens[b] are never read: zero them so garbage there cannot reach the oracle's 0 * v
    unused = (torch.arange(k.shape[1], device=q.device).view(1, -1) >= lens.view(-1, 1)).view(*lens.shape, -1, 1, 1)
    k64, v64 = (x.to(q.device, torch.float64).masked_fill(unused, 0.0).transpose(1, 2) for x in (k, v))
    out, lse = attention_ref(
        q.transpose(1, 2), k64, v64, lens=lens, causal=causal, window=window_size, softcap=softcap, alibi=alibi_slopes
    )
    return out.transpose(1, 2), lse


def paged(k, v, page_size, seed=0, spare=3):
    """Scatter a contiguous cache (B, N, Hk, d) into a pool of pages in random order.

    Returns (k_pool, v_pool, block_table): the pool has ``spare`` extra pages of
    garbage so unused physical pages exist, and logical page p of element b sits
    at a random physical page."""
    b, n, hk, d = k.shape
    per = -(-n // page_size)
    total = b * per + spare
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(total, generator=g)[: b * per].view(b, per)
    k_pool = torch.randn(total, page_size, hk, d, generator=g).to(device=k.device, dtype=k.dtype)
    v_pool = torch.randn(total, page_size, hk, d, generator=g).to(device=v.device, dtype=v.dtype)
    for i in range(b):
        for p in range(per):
            rows = slice(p * page_size, min(n, (p + 1) * page_size))
            cnt = rows.stop - rows.start
            k_pool[perm[i, p], :cnt] = k[i, rows]
            v_pool[perm[i, p], :cnt] = v[i, rows]
    return k_pool, v_pool, perm.to(device=k.device, dtype=torch.int32)


# --------------------------------------------------------------------------- #
# Flash-Decoding: splits, layouts, lengths
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_splits_ragged_gqa(device, num_splits):
    """Split counts from 1 to more splits than tiles (and keys of the short
    elements); ragged lengths 40, 0, 1; GQA Hq = 4 Hk; Nq = 3 causal."""
    q, k, v = make(3, 40, 8, 2, 32, device=device, nq=3)
    lens = torch.tensor([40, 0, 1], dtype=torch.int32, device=device)
    out, lse = flash_decode(q, k, v, lens, causal=True, num_splits=num_splits)
    ref_out, ref_lse = oracle(q, k, v, lens, causal=True)
    assert_close(out, ref_out, what="out")
    assert_close(lse, ref_lse, what="lse")
    # L = 0 sees nothing; L = 1 with Nq = 3 causal: tokens 0, 1 see no key, token 2 sees key 0
    assert torch.all(lse[1] == -math.inf) and torch.all(out[1] == 0)
    assert torch.all(lse[2, :, :2] == -math.inf) and torch.isfinite(lse[2, :, 2]).all()


def test_fused_merge_leaves_counters_zero(device, monkeypatch):
    """Eagerly, the split that arrives last merges and resets its tile's counter: two launches
    sharing one counter buffer (as launches on one stream do) both merge, and leave it at zero.
    A missing reset would leave the second launch with no last arrival and ``out`` unwritten."""
    shared = torch.zeros(64, dtype=torch.int32, device=device)
    monkeypatch.setattr(decode_module, "arrival_counters", lambda dev, n: shared[:n])
    q, k, v = make(3, 70, 8, 2, 32, device=device, nq=2, seed=9)
    lens = torch.tensor([70, 33, 5], dtype=torch.int32, device=device)
    ref_out, ref_lse = oracle(q, k, v, lens, causal=True)
    for _ in range(2):
        out, lse = flash_decode(q, k, v, lens, causal=True, num_splits=4)
        assert int(shared.count_nonzero()) == 0
        assert_close(out, ref_out, what="out")
        assert_close(lse, ref_lse, what="lse")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy reports the intended overflow
@pytest.mark.parametrize("unified", [False, True])
def test_graph_capture_path_two_kernels(device, monkeypatch, unified):
    """While a CUDA graph is captured the merge is a second kernel (no counters): the same
    answer as the fused launch, flags included.  Capture is simulated so the interpreter
    runs that path; MQA with Nq = 5 gives 5 packed rows, more than one merge program."""
    q, k, v = make(2, 90, 4, 1, 16, device=device, nq=5, seed=11)
    q[1] *= 200.0  # with unified_max=0 element 1's splits fall back
    lens = torch.tensor([90, 41], dtype=torch.int32, device=device)
    kw = dict(causal=True, num_splits=3, unified_max=0.0 if unified else None, return_recomputed=True)
    fused = flash_decode(q, k, v, lens, **kw)
    monkeypatch.setattr(decode_module, "_capturing", lambda dev: True)
    monkeypatch.setattr(decode_module, "arrival_counters", lambda dev, n: pytest.fail("counters used in capture"))
    graphed = flash_decode(q, k, v, lens, **kw)
    ref_out, ref_lse = oracle(q, k, v, lens, causal=True)
    for got, want in zip(graphed, fused):
        assert torch.equal(got, want)
    assert_close(graphed[0], ref_out, what="out")
    assert_close(graphed[1], ref_lse, what="lse")
    assert int(graphed[2][1].count_nonzero()) == (graphed[2][1].numel() if unified else 0)


@pytest.mark.parametrize("page_size", [16, 32])
def test_paged_scattered_pages(device, page_size):
    """Pages in random physical order (with spare garbage pages) give the
    contiguous cache's result; ragged lengths including 0 and 1; MQA."""
    q, k, v = make(3, 100, 4, 1, 64, device=device, nq=2, seed=1)
    lens = torch.tensor([100, 1, 0], dtype=torch.int32, device=device)
    k_pool, v_pool, table = paged(k, v, page_size, seed=page_size)
    out, lse = flash_decode(q, k_pool, v_pool, lens, block_table=table, causal=True, num_splits=4)
    ref_out, ref_lse = oracle(q, k, v, lens, causal=True)
    assert_close(out, ref_out, what="out")
    assert_close(lse, ref_lse, what="lse")


@pytest.mark.parametrize(
    "nq, causal, window, softcap, alibi_shape",
    [
        (4, True, (20, 0), 0.0, None),  # sliding window over a longer cache: the window is split, not the cache
        (2, False, (-1, -1), 4.0, "b"),  # softcap then per-(batch, head) ALiBi
        (1, False, (6, 3), 0.0, "h"),  # look-ahead past the end of the cache, per-head ALiBi
        (3, True, (-1, 0), 2.0, None),
    ],
)
def test_masks_and_mods(device, nq, causal, window, softcap, alibi_shape):
    b, hq, hk = 2, 4, 2
    q, k, v = make(b, 150, hq, hk, 16, device=device, nq=nq, seed=nq)
    lens = torch.tensor([150, 37], dtype=torch.int32, device=device)
    alibi = None
    if alibi_shape is not None:
        alibi = torch.rand(b, hq) if alibi_shape == "b" else torch.rand(hq)
        alibi = alibi.to(device)
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi)
    out, lse = flash_decode(q, k, v, lens, num_splits=3, **kw)
    ref_out, ref_lse = oracle(q, k, v, lens, **kw)
    assert_close(out, ref_out, what="out")
    assert_close(lse, ref_lse, what="lse")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_mqa(device, dtype):
    q, k, v = make(2, 70, 4, 1, 32, dtype=dtype, device=device, nq=2, seed=3)
    lens = torch.tensor([70, 45], dtype=torch.int32, device=device)
    out, lse = flash_decode(q, k, v, lens, causal=True, num_splits=2)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = oracle(q, k, v, lens, causal=True)
    assert_close(out, ref_out, what="out")
    assert_close(lse, ref_lse, what="lse")


@settings(max_examples=4, deadline=None)
@given(
    splits=st.integers(1, 12),
    lens=st.lists(st.integers(0, 60), min_size=1, max_size=2),
    nq=st.integers(1, 4),
    causal=st.booleans(),
)
def test_split_invariance_property(splits, lens, nq, causal):
    """Any split count gives the exact softmax (the merge is exact), for any lengths."""
    b = len(lens)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a fixture cannot feed @given
    q, k, v = make(b, 60, 2, 1, 16, nq=nq, seed=splits, device=device)
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    out, lse = flash_decode(q, k, v, seq, causal=causal, num_splits=splits)
    ref_out, ref_lse = oracle(q, k, v, seq, causal=causal)
    assert_close(out, ref_out, what="out")
    assert_close(lse, ref_lse, what="lse")


# --------------------------------------------------------------------------- #
# FlashDecoding++: unified max, flags, fallback
# --------------------------------------------------------------------------- #
def test_unified_max_no_fallback(device):
    """phi = 0 with scores of size ~ sqrt(d) / sqrt(d): all in range, no row recomputed."""
    q, k, v = make(2, 90, 8, 2, 32, device=device, nq=2, seed=4)
    lens = torch.tensor([90, 17], dtype=torch.int32, device=device)
    out, lse, flags = flash_decode(q, k, v, lens, causal=True, num_splits=3, unified_max=0.0, return_recomputed=True)
    assert int(flags.count_nonzero()) == 0
    ref_out, ref_lse = oracle(q, k, v, lens, causal=True)
    assert_close(out, ref_out, what="out")
    assert_close(lse, ref_lse, what="lse")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy reports the intended overflow
def test_unified_max_forced_fallback(device):
    """Element 0: scores ~ +-600 leave the range above and below phi = 0 (bits 1, 2);
    element 1: in range but |v| = 1e30 overflows num (bit 4); element 2: clean.
    Flagged elements are recomputed exactly; the clean one keeps its fast result."""
    q, k, v = make(3, 50, 4, 2, 16, device=device, nq=1, seed=5)
    q[0] *= 150.0
    v[1] *= 1e30
    lens = torch.tensor([50, 33, 20], dtype=torch.int32, device=device)
    phi = -40.0  # exp(s + 40) ~ e^40: with |v| = 1e30 the products pass fp32's 3e38
    out, lse, flags = flash_decode(q, k, v, lens, num_splits=2, unified_max=phi, return_recomputed=True)
    assert torch.all(flags[0] & FLAG_ABOVE) and torch.any(flags[0] & FLAG_BELOW)
    assert torch.all(flags[1] == FLAG_OVERFLOW)
    assert int(flags[2].count_nonzero()) == 0
    ref_out, ref_lse = oracle(q, k, v, lens)
    for i in range(3):
        scale = 1e30 if i == 1 else 1.0
        assert_close(out[i] / scale, ref_out[i] / scale, what=f"out[{i}]")
        assert_close(lse[i], ref_lse[i], what=f"lse[{i}]")


def test_unified_max_narrow_range_rows(device):
    """A user range [-1, 50] around phi = 0 flags rows with a score below -1: only those
    rows carry flags, yet every row of their elements is exact after the fallback."""
    q, k, v = make(2, 40, 4, 4, 16, device=device, nq=1, seed=6)
    lens = torch.tensor([40, 40], dtype=torch.int32, device=device)
    q[1] *= 0.01  # element 1: every score within +-0.5: never flagged
    out, lse, flags = flash_decode(
        q, k, v, lens, num_splits=3, unified_max=0.0, safe_range=(-1.0, 50.0), return_recomputed=True
    )
    assert torch.all(flags[0] == FLAG_BELOW) and int(flags[1].count_nonzero()) == 0
    ref_out, ref_lse = oracle(q, k, v, lens)
    assert_close(out, ref_out, what="out")
    assert_close(lse, ref_lse, what="lse")


def test_default_unified_range():
    lo, hi = default_unified_range(torch.bfloat16, 1000)
    assert lo == pytest.approx(math.log(torch.finfo(torch.float32).tiny) + math.log(16))
    assert hi == pytest.approx(math.log(torch.finfo(torch.float32).max) - math.log(16) - math.log(1000))
    lo16, hi16 = default_unified_range(torch.float16, 1000)
    assert hi16 == pytest.approx(math.log(65504.0) - math.log(16)) and lo16 > lo
    # the P tile must survive rounding to fp16 at the top of the range
    assert math.isfinite(torch.tensor(math.exp(hi16), dtype=torch.float16).item())


# --------------------------------------------------------------------------- #
# split heuristic and argument checks
# --------------------------------------------------------------------------- #
def test_num_splits_heuristic():
    # 132 SMs, 64-key tiles: one element with 8 kv heads at 32k keys -> floor(132 / 8) = 16 splits,
    # 512 tiles: 32 tiles each, none empty
    assert num_splits_heuristic(8, 1, 32768, 132) == 16
    # at most one split per tile: a 1k cache (16 tiles) allows 16, with 128-key tiles 8
    assert num_splits_heuristic(8, 1, 1024, 132) == 16
    assert num_splits_heuristic(8, 1, 1024, 132, block_n=128) == 8
    # 8 elements x 8 kv heads: floor(132 / 64) = 2 (one program per SM)
    assert num_splits_heuristic(64, 1, 131072, 132) == 2
    # balanced: 3000 keys = 47 tiles, floor(132 / 8) = 16 -> ceil(47 / 3) = 16; 40 tiles -> 14 (ceil(40/3))
    assert num_splits_heuristic(8, 1, 47 * 64, 132) == 16
    assert num_splits_heuristic(8, 1, 40 * 64, 132) == 14
    # a grid with as many programs as SMs, or more, is not split
    assert num_splits_heuristic(64 * 8, 1, 4096, 132) == 1
    assert num_splits_heuristic(132, 1, 4096, 132) == 1
    # a paged cache aims at two programs per SM: floor(264 / 8) = 33 -> balanced over 512 tiles: 32;
    # past one wave, ceil(4 * 132 / P): 2 splits for P = 512, 1 for P = 1024
    assert num_splits_heuristic(8, 1, 32768, 132, per_sm=2) == 32
    assert num_splits_heuristic(64, 1, 131072, 132, per_sm=2) == 4
    assert num_splits_heuristic(64 * 8, 1, 4096, 132, per_sm=2) == 2
    assert num_splits_heuristic(128 * 8, 1, 4096, 132, per_sm=2) == 1
    # a one-tile cache never splits; huge grids of tiny problems neither
    assert num_splits_heuristic(1, 1, 64, 132) == 1
    assert num_splits_heuristic(1, 1, 10**7, 10**4) == MAX_SPLITS
    for programs in (1, 3, 8, 40, 300):
        for seqlen in (1000, 1 << 20):
            s = num_splits_heuristic(programs, 1, seqlen, 132)
            tiles = -(-seqlen // 64)
            per = -(-tiles // s)
            assert 1 <= s <= MAX_SPLITS and (s - 1) * per < tiles, "no empty split"
            assert programs * s <= max(programs, 132), "at most one program per SM, or no split"
            s2 = num_splits_heuristic(programs, 1, seqlen, 132, per_sm=2)
            assert programs * s2 <= max(2 * programs, 4 * 132), "paged: at most two waves of two programs per SM"
    # fill: a grid past per_sm programs per SM is split to about fill programs per SM
    assert num_splits_heuristic(64 * 8, 1, 16384, 132, fill=4) == 2  # ceil(528 / 512)
    assert num_splits_heuristic(32 * 8, 1, 16384, 132, fill=4) == 3  # ceil(528 / 256)
    assert num_splits_heuristic(128 * 8, 1, 16384, 132, fill=4) == 1
    assert num_splits_heuristic(8, 1, 32768, 132, fill=4) == 16  # within one program per SM: unchanged


@pytest.fixture
def restore_tuning():
    """Put every DECODE_TUNING entry back after the test."""
    from flashtile.runtime.decode import DECODE_TUNING, set_decode_tuning

    saved = dict(DECODE_TUNING)
    yield
    for kind, tuning in saved.items():
        set_decode_tuning(kind, tuning)


def test_decode_splits_reads_the_tuning_of_the_cache_dtype(restore_tuning):
    """decode_splits is num_splits_heuristic with the knobs of the cache kind's DECODE_TUNING entry:
    the defaults give the measured contiguous (one program per SM) and paged (two) counts; changing
    the "fp8" entry moves FP8 caches only, and block_n / per_sm / fill act as in the heuristic."""
    from flashtile.runtime.decode import DECODE_TUNING, DecodeTuning, decode_splits, set_decode_tuning

    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    for b, n in ((1, 32768), (8, 4096), (64, 16384), (3, 1000)):
        for dt, t in ((bf16, DECODE_TUNING["default"]), (fp8, DECODE_TUNING["fp8"])):
            want = num_splits_heuristic(b * 8, 1, n, 132, t.block_n, t.per_sm, t.fill)
            assert decode_splits(b, 8, n, dt, 132) == want
            want = num_splits_heuristic(b * 8, 1, n, 132, t.block_n, t.per_sm_paged, t.fill)
            assert decode_splits(b, 8, n, dt, 132, paged=True) == want
    assert decode_splits(64, 8, 16384, bf16, 132) == 2  # the measured B64 default: fill 4
    set_decode_tuning("default", DecodeTuning())
    set_decode_tuning("fp8", DecodeTuning())
    assert decode_splits(1, 8, 1024, bf16, 132, d=64) == 8  # 128-key tiles at d <= 64: 8 tiles
    set_decode_tuning("fp8", block_n=128, per_sm=2)
    assert decode_splits(1, 8, 32768, fp8, 132) == 32  # floor(264 / 8) = 33 over 256 tiles -> 32
    assert decode_splits(1, 8, 1024, fp8, 132) == 8  # 8 tiles of 128 keys
    assert decode_splits(1, 8, 32768, bf16, 132) == 16  # the default entry is untouched
    set_decode_tuning("default", fill=4)
    assert decode_splits(64, 8, 16384, bf16, 132) == 2
    assert decode_splits(8, 8, 16384, bf16, 132) == 2  # within one program per SM: fill does not apply


def test_set_decode_tuning_replans_and_checks(restore_tuning):
    """set_decode_tuning forgets memoised plans and launches (a new block_n reaches the next plan and the
    op's memoised call), returns the previous entry, and rejects bad kinds, types and values by name."""
    from flashtile.ops import kvcache
    from flashtile.runtime.decode import DECODE_TUNING, DecodeTuning, set_decode_tuning

    dev = torch.device("cpu")
    set_decode_tuning("fp8", DecodeTuning())  # from the knobs' neutral values, whatever the table's defaults
    before = decode_module.decode_plan(1, 1, 32, 8, 128, None, 32768, 0, dev, True)
    kvcache._CALLS[("sentinel",)] = None
    old = set_decode_tuning("fp8", per_sm=4)
    assert old == DecodeTuning() and DECODE_TUNING["fp8"].per_sm == 4
    assert ("sentinel",) not in kvcache._CALLS
    after = decode_module.decode_plan(1, 1, 32, 8, 128, None, 32768, 0, dev, True)
    # the interpreter's 8 "SMs", 8 kv heads: one program per SM, then four
    assert (before.n_splits, after.n_splits) == (1, 4)
    assert decode_module.decode_plan(1, 1, 32, 8, 128, None, 32768, 0, dev, False).n_splits == before.n_splits
    with pytest.raises(ValueError, match="kind must be one of"):
        set_decode_tuning("fp16", per_sm=2)
    with pytest.raises(TypeError, match="tuning must be a DecodeTuning"):
        set_decode_tuning("fp8", (64, 4, 3, 1, 2))
    for bad, name in ((dict(block_n=96), "block_n"), (dict(num_warps=0), "num_warps"), (dict(per_sm=1.5), "per_sm"),
                      (dict(fill=-1), "fill"), (dict(num_stages=True), "num_stages")):
        with pytest.raises(ValueError, match=name):
            set_decode_tuning("fp8", **bad)
    with pytest.raises(TypeError, match="f16_mma must be a bool"):
        set_decode_tuning("fp8", f16_mma=1)
    assert DECODE_TUNING["fp8"].per_sm == 4  # a rejected change leaves the entry as it was


def _kernel_params(kernel) -> tuple[str, ...]:
    return tuple(inspect.signature(kernel.fn).parameters)


@pytest.mark.parametrize(
    "paged_, unified, alibi, splits",
    [(False, False, False, 1), (False, True, True, 3), (True, False, True, 2), (True, True, False, 4)],
)
def test_launch_arguments_match_kernel_parameters(monkeypatch, paged_, unified, alibi, splits):
    """The kernels are launched with positional argument tuples.  Every bound launch names its
    arguments: the names equal the kernel's parameters in order, the values bound once sit under
    the right names, and ``__call__`` passes each per-call value in its named slot (eagerly, and
    the split + merge pair used while a graph is captured).  CPU, nothing is launched."""
    b, nq, hq, hk, d, page = 2, 3, 4, 2, 24, 16
    q = torch.randn(b, nq, hq, d)
    k = torch.randn(7, page, hk, d) if paged_ else torch.randn(b, 40, hk, d)
    v = torch.randn_like(k)
    table = torch.zeros(b, 3, dtype=torch.int32) if paged_ else None
    lens = torch.tensor([9, 0, 20, 0], dtype=torch.int64)[::2]  # int64, stride 2
    slopes = torch.rand(b, hq) if alibi else None
    alibi_t = decode_module.alibi_args(slopes) if alibi else None
    plan, launch = decode_module.decode_launch(
        q, k, v, table, alibi_t, left=5, right=0, softcap=1.0, unified=unified, num_splits=splits,
        seqlens_k=lens, seqlen_add=2,
    )
    assert set(launch.arguments) == ({"fused"} if splits == 1 else {"fused", "split", "merge"})
    for label, args in launch.arguments.items():
        assert args.names() == _kernel_params(args.kernel), label
    static = dict(launch.arguments["fused"].static)
    capacity = 3 * page if paged_ else 40
    want = dict(
        stride_qb=q.stride(0), stride_qm=q.stride(1), stride_qh=q.stride(2),
        stride_kn=k.stride(1), stride_vn=v.stride(1),
        stride_bt_b=table.stride(0) if paged_ else 0, stride_sl=2,
        stride_alibi_b=slopes.stride(0) if alibi else 0, stride_alibi_h=slopes.stride(1) if alibi else 0,
        stride_ob=nq * hq * d, stride_om=hq * d, stride_oh=d,
        n_heads_q=hq, n_heads_k=hk, kv_group=hq // hk, seqlen_q=nq, head_dim=d, n_splits=plan.n_splits,
        window_left=5, window_right=0, seqlen_add=2, num_pages=k.shape[0],
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=plan.block_d, PAGED=paged_,
        PAGE_SIZE=page if paged_ else 1, HAS_LEFT=True, HAS_RIGHT=True, HAS_SOFTCAP=True, HAS_ALIBI=alibi,
        UNIFIED=unified, EVEN_D=False, WRITE_OUT=splits == 1, FUSED=splits > 1,
        MERGE_M=plan.merge_m, MERGE_S=plan.merge_s,
    )
    assert {name: static[name] for name in want} == want

    recorded = {}
    for label in ("fused", "split", "merge"):
        monkeypatch.setattr(launch, label, lambda *a, label=label: recorded.__setitem__(label, a))
    out, lse = torch.empty(b, nq, hq, d), torch.empty(b, hq, nq)
    flags = torch.empty(b, hq, nq, dtype=torch.int32) if unified else None
    phi = (0.5, -3.0, 4.0) if unified else None
    call = (q, k, v, lens, table, slopes, out, lse, flags, 0.25, 1.0, phi)
    launch(*call)
    monkeypatch.setattr(decode_module, "_capturing", lambda dev: True)
    launch(*call)
    dyn = dict(zip(decode_module.SPLIT_DYNAMIC, recorded["fused"]))
    expect = dict(
        Q=q, K=k, V=v, BlockTable=table if paged_ else lens, SeqlensK=lens, Out=out, LSE=lse, Err=launch.err,
        Flags=flags if unified else lse,
    )
    if alibi:
        expect["Alibi"] = slopes
    assert all(dyn[name] is value for name, value in expect.items())
    assert (dyn["sm_scale"], dyn["softcap"]) == (0.25, 1.0)
    # per call: the caches' batch (page) and head strides and the capacity
    assert [dyn[n] for n in ("stride_kb", "stride_kh", "stride_vb", "stride_vh", "capacity")] == [
        k.stride(0), k.stride(2), v.stride(0), v.stride(2), capacity]
    if unified:
        log2e = 1 / math.log(2)
        assert [dyn[n] for n in ("phi2", "lo2", "hi2")] == pytest.approx([0.5 * log2e, -3.0 * log2e, 4.0 * log2e])
    if splits > 1:
        assert recorded["split"][:6] == recorded["fused"][:6]
        merge = dict(zip(decode_module.MERGE_DYNAMIC, recorded["merge"]))
        assert merge["Out"] is out and merge["LSE"] is lse and merge["Work"] is recorded["split"][6]
        assert dict(launch.arguments["merge"].static)["n_splits"] == plan.n_splits

    app = decode_module.append_launch(k, v, q[:, :2, :hk], q[:, :2, :hk], lens, table)
    assert app.arguments.names() == _kernel_params(app.arguments.kernel)
    assert dict(app.arguments.static)["stride_knn"] == q.stride(1) and dict(app.arguments.static)["n_new"] == 2
    got = []
    monkeypatch.setattr(app, "launcher", lambda *a: got.append(a))
    app(k, v, q, q, lens, table)
    named = dict(zip(decode_module.APPEND_DYNAMIC, got[0]))
    assert named["K"] is k and named["V"] is v and named["SeqlensK"] is lens and named["Err"] is app.err
    assert named["BlockTable"] is (table if paged_ else lens)


def test_flash_decode_goes_through_the_op_checks(device):
    """flash_decode has no checks of its own: a bad argument raises the public op's error,
    naming the op's argument (the op's tests cover each check); only safe_range, which the op
    does not take, is checked here."""
    from flashtile.ops import kvcache

    q, k, v = make(2, 32, 4, 2, 16, device=device)
    lens = torch.tensor([32, 5], dtype=torch.int32, device=device)
    calls = []
    real = kvcache.prepare_call

    def spy(*args):
        calls.append(args)
        return real(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kvcache, "prepare_call", spy)
        flash_decode(q, k, v, lens, causal=True, num_splits=2)
    assert len(calls) == 1 and calls[0][0] is q and calls[0][5] is lens
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_decode(q, k, v, lens[:1])
    with pytest.raises(ValueError, match="num_splits"):
        flash_decode(q, k, v, lens, num_splits=MAX_SPLITS + 1)
    with pytest.raises(ValueError, match="safe_range"):
        flash_decode(q, k, v, lens, unified_max=0.0, safe_range=(2.0, 1.0))


@pytest.mark.parametrize("unified", [False, True])
def test_untrusted_lengths_clamped_and_reported(device, unified):
    """Lengths are read on the device and never trusted: int64 values past int32 do not wrap
    (2**32 + 5 is not 5), lengths past the capacity are clamped to it (the NaN guard after the
    cache stays unread), negative ones to 0; a strided tensor is read at its stride; the error
    word records ERR_SEQLENS."""
    from flashtile.ops.kvcache import check_errors

    check_errors()
    q, k, v = make(4, 40, 4, 2, 16, device=device, seed=21)
    big_k = torch.full((4, 56, 2, 16), math.nan, device=device)
    big_v = big_k.clone()
    big_k[:, :40], big_v[:, :40] = k, v
    kc, vc = big_k[:, :40], big_v[:, :40]
    lens = torch.tensor([2**32 + 5, 0, 45, 0, -3, 0, 17, 0], dtype=torch.int64, device=device)[::2]
    kw = dict(num_splits=2, unified_max=0.0 if unified else None)
    out, lse = flash_decode(q, kc, vc, lens, **kw)
    ref_out, ref_lse = oracle(q, k, v, torch.tensor([40, 40, 0, 17]))
    assert_close(out, ref_out, what="out")
    assert_close(lse, ref_lse, what="lse")
    with pytest.raises(ValueError, match="cache_seqlens"):
        check_errors()
    out, _ = flash_decode(q, kc, vc, torch.tensor([40, 3, 0, 17], dtype=torch.int64, device=device), **kw)
    check_errors()  # in-range lengths record nothing


def test_absent_pages_masked_and_reported(device):
    """Block-table entries outside [0, num_pages) are absent pages: never read (the pool's NaN
    guard pages stay unread), contribute nothing, and record ERR_BLOCK_TABLE."""
    from flashtile.ops.kvcache import check_errors

    check_errors()
    q, k, v = make(2, 64, 4, 2, 16, device=device, nq=2, seed=22)
    k_pool, v_pool, table = paged(k, v, 16, seed=3)
    guard = torch.full((1, *k_pool.shape[1:]), math.nan, device=device)
    big_k, big_v = torch.cat([guard, k_pool, guard]), torch.cat([guard, v_pool, guard])
    kp, vp = big_k[1:-1], big_v[1:-1]
    lens = torch.tensor([64, 50], dtype=torch.int32, device=device)
    bad = table.clone()
    bad[0, 1] = -1
    bad[1, 2] = kp.shape[0]
    out, lse = flash_decode(q, kp, vp, lens, block_table=bad, causal=True, num_splits=3)
    # the reference: the same keys with the absent pages' keys removed (their scores are -inf)
    keep = torch.ones(2, 64, dtype=torch.bool)
    keep[0, 16:32] = False
    keep[1, 32:48] = False
    for b in range(2):
        kb, vb = k[b : b + 1, keep[b]], v[b : b + 1, keep[b]]
        n_keep = int(keep[b, : int(lens[b])].sum())
        ref_o, ref_l = oracle(q[b : b + 1], kb, vb, torch.tensor([n_keep]), causal=False)
        # causal with Nq = 2: token 0 does not see the last key (it is kept in both elements)
        ref_c, ref_lc = oracle(q[b : b + 1, :1], kb[:, : n_keep - 1], vb[:, : n_keep - 1], torch.tensor([n_keep - 1]))
        assert_close(out[b : b + 1, 1:], ref_o[:, 1:], what=f"out {b}, token 1")
        assert_close(out[b : b + 1, :1], ref_c, what=f"out {b}, token 0")
    assert torch.isfinite(lse).all()
    with pytest.raises(ValueError, match="block_table"):
        check_errors()


@pytest.mark.parametrize("paged_", [False, True])
def test_append_kernel_writes_only_in_range(device, paged_):
    """The append kernel alone: rows of an element with an out-of-range length, or of an absent
    page, are not written (the caches equal the expected ones, guards included) and set their bit."""
    decode_module.take_errors()
    b, n, hk, d, page = 4, 32, 2, 16, 16
    _, k, v = make(b, n, hk, hk, d, device=device, seed=23)
    k_new = torch.randn(b, 2, hk, d, generator=torch.Generator().manual_seed(1)).to(device)
    v_new = -k_new
    lens = torch.tensor([3, 31, -1, 15], dtype=torch.int32, device=device)  # 31 + 2 > 32, -1 < 0
    table = None
    if paged_:
        k_pool, v_pool, table = paged(k, v, page, seed=4)
        table[3, 1] = k_pool.shape[0]  # element 3 writes positions 15 (page 0) and 16 (absent page 1)
        kc, vc = k_pool, v_pool
    else:
        kc, vc = k, v
    expect_k, expect_v = kc.clone(), vc.clone()
    for e, pos in ((0, 3), (0, 4), (3, 15)):
        i = pos - int(lens[e])
        if paged_:
            expect_k[int(table[e, pos // page]), pos % page] = k_new[e, i]
            expect_v[int(table[e, pos // page]), pos % page] = v_new[e, i]
        else:
            expect_k[e, pos], expect_v[e, pos] = k_new[e, i], v_new[e, i]
    if not paged_:  # element 3's positions 15, 16 are both in range without pages
        expect_k[3, 16], expect_v[3, 16] = k_new[3, 1], v_new[3, 1]
    decode_module.append_launch(kc, vc, k_new, v_new, lens, table)(kc, vc, k_new, v_new, lens, table)
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v)
    bits = dict((dev.type, bits) for dev, bits in decode_module.take_errors())[torch.device(device).type]
    want = kernels_module.ERR_SEQLENS | (kernels_module.ERR_BLOCK_TABLE if paged_ else 0)
    assert bits == want
    assert not decode_module.take_errors()  # cleared


def test_take_errors_clears_only_the_bits_it_read(device):
    """The clear is an atomic AND with the words read: a bit set after the read (a kernel on another stream) is
    still there for the next check; the words read come back to 0."""
    decode_module.take_errors()
    buf = decode_module.error_flags(torch.device(device))
    buf.copy_(torch.tensor([0b1011, 0b100], dtype=torch.int32))
    kernels_module._clear_error_bits_kernel[(1,)](buf, ~0b0011, ~0)  # as if 0b1000 arrived after a read of 0b0011
    assert buf.tolist() == [0b1000, 0b100]
    buf.copy_(torch.tensor([-(2**31) | 1, 2], dtype=torch.int32))  # bit 31 too
    assert decode_module.take_errors() == [(buf.device, -(2**31) | 3)]
    assert buf.tolist() == [0, 0]
    # through take_errors: a bit that arrives between its read and its clear stays
    clear = decode_module._clear_error_bits_kernel

    class Late:
        def __getitem__(self, grid):
            def launch(err, keep0, keep1):
                err[0] |= 0b10000  # the late kernel's bit
                clear[grid](err, keep0, keep1)
            return launch

    buf.copy_(torch.tensor([0b1, 0], dtype=torch.int32))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode_module, "_clear_error_bits_kernel", Late())
        assert decode_module.take_errors() == [(buf.device, 0b1)]
    assert buf.tolist() == [0b10000, 0]
    assert decode_module.take_errors() == [(buf.device, 0b10000)]


# --------------------------------------------------------------------------- #
# GPU: realistic decoding shapes
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@pytest.mark.parametrize("batch, cache, paged_", [(1, 32768, False), (4, 8192, True), (8, 4096, False), (8, 4096, True)])
def test_gpu_realistic(batch, cache, paged_):
    q, k, v = make(batch, cache, 32, 8, 128, dtype=torch.bfloat16, device="cuda", nq=1, seed=batch)
    lens = torch.randint(cache // 2, cache + 1, (batch,), dtype=torch.int32, device="cuda")
    lens[0] = cache
    ref_out, ref_lse = oracle(q, k, v, lens, causal=True)
    if paged_:
        kp, vp, table = paged(k, v, 256)
        out, lse = flash_decode(q, kp, vp, lens, block_table=table, causal=True)
    else:
        out, lse = flash_decode(q, k, v, lens, causal=True)
    assert_close(out, ref_out, what="out")
    assert_close(lse, ref_lse, what="lse")
    out_pp, lse_pp = flash_decode(q, k, v, lens, causal=True, unified_max=0.0)
    assert_close(out_pp, ref_out, what="out (unified max)")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch, cache, splits, nq, hk", [(1, 4096, 64, 1, 8), (8, 2048, 128, 4, 8), (4, 1024, 16, 4, 1)]  # MQA: 2 row tiles
)
def test_gpu_fused_merge_is_race_free(batch, cache, splits, nq, hk):
    """The last-arriving split merges its tile: if any partial were read before it was
    visible, or a counter were not left at zero, results would differ between runs or
    from the oracle.  Many splits and row tiles per launch; 30 launches alternating
    between two streams with no synchronisation between them (each stream has its own
    counters, and launches on the two streams run concurrently), compared bitwise with
    the serial result; then FlashDecoding++ with some splits falling back on the device:
    the same bits every run."""
    q, k, v = make(batch, cache, 32, hk, 128, dtype=torch.bfloat16, device="cuda", nq=nq, seed=splits)
    lens = torch.randint(64, cache + 1, (batch,), dtype=torch.int32, device="cuda")  # ragged, no empty rows
    ref_out, ref_lse = oracle(q, k, v, lens, causal=True)
    first, first_lse = flash_decode(q, k, v, lens, causal=True, num_splits=splits)
    assert_close(first, ref_out, what="out")
    assert_close(first_lse, ref_lse, what="lse")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    streams = (torch.cuda.current_stream(), side)
    concurrent = []
    for i in range(30):  # no sync in this loop: the two streams' launches overlap on the device
        with torch.cuda.stream(streams[i % 2]):
            concurrent.append(flash_decode(q, k, v, lens, causal=True, num_splits=splits))
    torch.cuda.synchronize()
    for i, (out, lse) in enumerate(concurrent):
        assert torch.equal(out, first) and torch.equal(lse, first_lse), f"concurrent launch {i} differs from serial"
    assert all(int(c.count_nonzero()) == 0 for c in decode_module._COUNTERS.values())
    q[0] *= 300.0  # FlashDecoding++ with element 0's splits falling back on the device
    ref_out, ref_lse = oracle(q, k, v, lens, causal=True)
    first, first_lse, first_flags = flash_decode(
        q, k, v, lens, causal=True, num_splits=splits, unified_max=0.0, return_recomputed=True
    )
    assert int(first_flags[0].count_nonzero()) > 0 and int(first_flags[1:].count_nonzero()) == 0
    assert_close(first, ref_out, what="out (unified max)")
    assert_close(first_lse, ref_lse, what="lse (unified max)")
    for _ in range(10):
        out, lse, flags = flash_decode(
            q, k, v, lens, causal=True, num_splits=splits, unified_max=0.0, return_recomputed=True
        )
        assert torch.equal(out, first) and torch.equal(lse, first_lse) and torch.equal(flags, first_flags)


def test_append_and_merge_grids_within_cuda_limits(monkeypatch):
    """Appending 70k new tokens (a long prefill through the cache) or merging 8 q heads x 9k query tokens
    per kv head keeps axes y and z at or below 65535 (CUDA's limit; axis x takes 2^31 - 1)."""
    monkeypatch.setattr(decode_module, "_ERRORS", {})  # the meta device's error word stays out of check_errors
    k_cache = torch.empty(1, 80000, 1, 16, device="meta")
    k = torch.empty(1, 70000, 1, 16, device="meta")
    lens = torch.zeros(1, dtype=torch.int32, device="meta")
    grid = decode_module.append_launch(k_cache, k_cache, k, k, lens, None).launcher._grid
    assert grid[0] == 70000 and max(grid[1:]) <= 65535
    assert decode_module.fold_grid(8 * 9000, 70000)[1:] == (65535, 2)


def test_feature_arguments_sit_in_their_named_slots(monkeypatch):
    """With every optional input on (ragged q, batch index, leftpad, rotary), the bound launches name
    the kernels' parameters in order, the feature values bound once sit under their names, and the
    per-call tensors (cache_batch_idx, cache_leftpad, cu_seqlens_q, cos, sin) reach their slots in the
    split, merge and append launches.  CPU, nothing is launched."""
    b, max_q, hq, hk, d = 3, 4, 4, 2, 16
    q = torch.randn(7, hq, d)  # ragged: total_q 7
    k = torch.randn(5, 40, hk, d)
    lens = torch.zeros(b, dtype=torch.int32)
    rot = decode_module.Rotary(4, 64, torch.float32, False, True)
    feats = decode_module.KVFeatures(batch_idx=True, leftpad=True, varlen_q=(b, max_q), rotary=rot)
    plan, launch = decode_module.decode_launch(q, k, k, None, None, left=-1, right=0, softcap=0.0, unified=False,
                                               num_splits=2, seqlens_k=lens, seqlen_add=1, features=feats)
    for label, args in launch.arguments.items():
        assert args.names() == _kernel_params(args.kernel), label
    static = dict(launch.arguments["fused"].static)
    want = dict(stride_qb=0, stride_qm=q.stride(0), stride_qh=q.stride(1), stride_ob=0, stride_om=hq * d, seqlen_q=max_q,
                n_cache_batch=5, total_q=7, rot_half=4, seqlen_ro=64, HAS_BATCH_IDX=True, HAS_LEFTPAD=True,
                VARLEN_Q=True, ROTARY=True, ROT_INTERLEAVED=False, ROT_PER_TOKEN=True)
    assert {name: static[name] for name in want} == want
    assert dict(launch.arguments["merge"].static)["VARLEN_Q"] and dict(launch.arguments["merge"].static)["total_q"] == 7
    extra = tuple(torch.zeros(n, dtype=torch.int32) for n in (b, b, b + 1)) + (torch.rand(64, 4), torch.rand(64, 4))
    recorded = {}
    for label in ("fused", "split", "merge"):
        monkeypatch.setattr(launch, label, lambda *a, label=label: recorded.__setitem__(label, a))
    out, lse = torch.empty(7, hq, d), torch.empty(hq, 7)
    monkeypatch.setattr(decode_module, "_capturing", lambda dev: True)
    launch(q, k, k, lens, None, None, out, lse, None, 0.25, 0.0, None, extra=extra)
    dyn = dict(zip(decode_module.SPLIT_DYNAMIC, recorded["split"]))
    names = ("CacheBatchIdx", "LeftPad", "CuSeqlensQ", "RotCos", "RotSin")
    assert all(dyn[n] is t for n, t in zip(names, extra))
    assert dict(zip(decode_module.MERGE_DYNAMIC, recorded["merge"]))["CuSeqlensQ"] is extra[2]
    app = decode_module.append_launch(k, k, k[:b, :1], k[:b, :1], lens, None, features=feats)
    assert app.arguments.names() == _kernel_params(app.arguments.kernel)
    got = []
    monkeypatch.setattr(app, "launcher", lambda *a: got.append(a))
    app(k, k, k[:b, :1], k[:b, :1], lens, None, batch_idx=extra[0], cos=extra[3], sin=extra[4])
    named = dict(zip(decode_module.APPEND_DYNAMIC, got[0]))
    assert named["CacheBatchIdx"] is extra[0] and named["RotCos"] is extra[3] and named["RotSin"] is extra[4]
    assert dict(app.arguments.static)["HAS_BATCH_IDX"] and dict(app.arguments.static)["rot_half"] == 4


def test_plans_are_keyed_on_the_tuning_entry(restore_tuning, monkeypatch):
    """A plan memoised under an old entry is never returned for a new one, even when nothing clears the memo
    (a thread that planned while the table changed); every change bumps the generation in the ops' memo keys;
    out-of-range knobs are refused by name before any launch."""
    from flashtile.runtime.decode import DecodeTuning, set_decode_tuning, tuning_generation

    dev = torch.device("cpu")
    set_decode_tuning("fp8", DecodeTuning())
    before = decode_module.decode_plan(1, 1, 32, 8, 128, None, 32768, 0, dev, True)
    monkeypatch.setattr(decode_module._decode_plan, "cache_clear", lambda: None)
    gen = tuning_generation()
    set_decode_tuning("fp8", per_sm=4)
    assert tuning_generation() == gen + 1
    after = decode_module.decode_plan(1, 1, 32, 8, 128, None, 32768, 0, dev, True)
    assert (before.n_splits, after.n_splits) == (1, 4)
    for bad, name in ((dict(block_n=512), "block_n"), (dict(num_warps=32), "num_warps"), (dict(num_stages=7), "num_stages"),
                      (dict(per_sm=33), "per_sm"), (dict(fill=65), "fill")):
        with pytest.raises(ValueError, match=name):
            set_decode_tuning("fp8", **bad)


def test_fp8_tiles_hold_at_most_16k_elements(monkeypatch):
    """The FP8 entry's 128-key tiles (256 at d <= 64) stay within 16K elements per K / V tile at d = 256."""
    from flashtile.runtime.decode import DECODE_TUNING, decode_config

    monkeypatch.setattr(decode_module, "interpreting", lambda device=None: False)  # the compiled path's tiles
    gpu = "cuda"
    for d, want in ((64, 2 * DECODE_TUNING["fp8"].block_n), (128, DECODE_TUNING["fp8"].block_n), (256, 64)):
        block_n = decode_config(d, 4, None, gpu, fp8=True)[1]
        assert block_n * max(16, 1 << (d - 1).bit_length()) <= 16384 and block_n == min(want, 16384 // max(16, 1 << (d - 1).bit_length()))


def test_aligned_launch_rejects_unaligned_cache_strides(monkeypatch):
    """A launch bound with KV_ALIGNED (its kernel rounds the per-call batch / head strides down to multiples
    of 16) called with a cache whose head stride is not one raises a ValueError naming that cache, before
    anything is launched; an aligned cache of another length goes through.  CPU, nothing is launched."""
    b, hq, hk, d = 2, 4, 2, 16
    q, k, v = make(b, 32, hq, hk, d)
    lens = torch.full((b,), 32, dtype=torch.int32)
    plan, launch = decode_module.decode_launch(q, k, v, None, None, left=-1, right=-1, softcap=0.0, unified=False,
                                               num_splits=1, seqlens_k=lens)
    assert dict(launch.arguments["fused"].static)["KV_ALIGNED"]
    launched = []
    monkeypatch.setattr(launch, "fused", lambda *a: launched.append(a))
    out, lse = torch.empty(b, 1, hq, d), torch.empty(b, hq, 1)
    _, k33, v33 = make(b, 33, hq, hk, d)  # another length, strides still multiples of 16
    launch(q, k33, v33, lens, None, None, out, lse, None, 0.25, 0.0, None)
    assert len(launched) == 1
    odd = torch.randn(b, hk, 33, d + 1)[..., :d].transpose(1, 2)  # head stride 33 * 17, batch stride hk * 33 * 17
    for name, kc, vc in (("k_cache", odd, v33), ("v_cache", k33, odd)):
        with pytest.raises(ValueError, match=name):
            launch(q, kc, vc, lens, None, None, out, lse, None, 0.25, 0.0, None)
    assert len(launched) == 1
