"""Memory safety and flash-attn fidelity of ``flash_attn_with_kvcache`` (flashtile/ops/kvcache.py).

No value in ``cache_seqlens`` or ``block_table``, however it was written (``.numpy()``,
``.data``, a CUDA-graph replay), makes a kernel or the append touch memory outside its
tensors: the caches are slices of larger tensors whose guard regions hold NaN, so a read
outside shows up as a non-finite output and a write outside as a changed guard.
``flashtile.check_errors()`` then raises naming the argument.
"""

from __future__ import annotations

import inspect
import math
import threading

import pytest
import torch
from tests._cuda import capture
from tests._oracle import assert_close
from test_kvcache import logical, oracle, rand

import flashtile
from flashtile.runtime import decode as decode_module
from flashtile.ops.kvcache import check_errors, flash_attn_with_kvcache

B, HQ, HK, D, PAGE, MAX_PAGES, N_NEW = 2, 4, 2, 16, 16, 3, 1
CAP = MAX_PAGES * PAGE


@pytest.fixture(autouse=True)
def _clean_error_word():
    decode_module.take_errors()  # a test starts with no recorded error and must leave none
    yield
    check_errors()


def guarded_contiguous(device, seed=0):
    """(big, cache) with cache = big[:, :CAP]: the columns after CAP are a NaN guard."""
    big = rand(B, CAP + PAGE, HK, D, device=device, seed=seed)
    big[:, CAP:] = float("nan")
    return big, big[:, :CAP]


def guarded_pool(device, seed=0):
    """(big, pool, table): pool = big[1:-1], guard pages big[0] and big[-1] hold NaN; the table
    maps element b's logical pages to a permutation of the pool's pages."""
    num_pages = B * MAX_PAGES + 1
    big = rand(num_pages + 2, PAGE, HK, D, device=device, seed=seed)
    big[0] = float("nan")
    big[-1] = float("nan")
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))[: B * MAX_PAGES]
    return big, big[1:-1], perm.view(B, MAX_PAGES).to(device=device, dtype=torch.int32)


def _guards_intact(big, paged):
    guard = torch.cat([big[0].flatten(), big[-1].flatten()]) if paged else big[:, CAP:].flatten()
    return bool(torch.isnan(guard).all())


# --------------------------------------------------------------------------- #
# defect 4: bad values written behind the version counter's back
# --------------------------------------------------------------------------- #
BAD_VALUES = [
    ("cache_seqlens", "over", lambda t: CAP + 5),
    ("cache_seqlens", "just over", lambda t: CAP - N_NEW + 1),
    ("cache_seqlens", "negative", lambda t: -1),
    ("cache_seqlens", "int32 min", lambda t: -(2**31)),
    ("block_table", "num_pages", lambda t: t),
    ("block_table", "negative", lambda t: -1),
    ("block_table", "huge", lambda t: 1_000_000),
]


@pytest.mark.parametrize("writer", ["numpy", "data"])
@pytest.mark.parametrize("arg, what, value", BAD_VALUES, ids=[f"{a}-{w}" for a, w, _ in BAD_VALUES])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_bad_values_touch_nothing_outside(device, writer, arg, what, value, paged):
    if device != "cpu" and writer == "numpy":
        pytest.skip(".numpy() needs a CPU tensor")
    if arg == "block_table" and not paged:
        pytest.skip("no block table on a contiguous cache")
    if paged:
        big, k_cache, table = guarded_pool(device, seed=1)
        v_big, v_cache, _ = guarded_pool(device, seed=1)
        v_big.copy_(big.flip(-1))  # same guards, other values
    else:
        big, k_cache = guarded_contiguous(device, seed=1)
        v_big, v_cache = guarded_contiguous(device, seed=2)
        table = None
    num_pages = k_cache.shape[0]
    q = rand(B, 1, HQ, D, device=device, seed=3)
    k_new, v_new = rand(B, N_NEW, HK, D, device=device, seed=4), rand(B, N_NEW, HK, D, device=device, seed=5)
    lens = torch.tensor([20, 30], dtype=torch.int32, device=device)
    kw = dict(cache_seqlens=lens, block_table=table, causal=True, num_splits=2)
    flash_attn_with_kvcache(q, k_cache, v_cache, **kw)  # a valid call first (the old memo remembered it)
    check_errors()

    good_table = None if table is None else table.clone()
    target = lens if arg == "cache_seqlens" else table
    index = (1,) if arg == "cache_seqlens" else (1, 1)  # element 1's page 1 is in use (30 + 1 keys > 16)
    bad = value(num_pages)
    if writer == "numpy":
        target.numpy()[index] = bad
    else:
        target.data[index] = bad
    before_k, before_v = big.clone(), v_big.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kw)

    assert torch.isfinite(out).all(), "a kernel read outside the cache (NaN guard)"
    assert _guards_intact(big, paged) and _guards_intact(v_big, paged), "a write landed outside the cache"
    # element 0 is untouched by the bad value: its append and its attention are exact
    k_full = logical(k_cache, good_table) if paged else k_cache
    v_full = logical(v_cache, good_table) if paged else v_cache
    assert torch.equal(k_full[0, 20 : 20 + N_NEW], k_new[0]) and torch.equal(v_full[0, 20 : 20 + N_NEW], v_new[0])
    ref, _ = oracle(q[:1], k_full[:1], v_full[:1], [20 + N_NEW], causal=True)
    assert_close(out[:1], ref, torch.float32, device, "out of the valid element")
    if arg == "cache_seqlens":  # a bad length appends nothing: element 1's cache is unchanged
        assert torch.equal(k_full[1], (logical(before_k[1:-1], good_table) if paged else before_k[:, :CAP])[1])
    with pytest.raises(ValueError, match=arg):
        flashtile.check_errors()
    flashtile.check_errors()  # cleared


def test_graph_replay_style_write_after_valid_calls(device):
    """Many valid calls, then a bad table entry written through .data (no version bump), then valid
    again: only the call that saw the bad entry records an error."""
    big, pool, table = guarded_pool(device, seed=7)
    q = rand(B, 2, HQ, D, device=device, seed=8)
    lens = torch.tensor([40, 17], dtype=torch.int32, device=device)
    for _ in range(2):
        flash_attn_with_kvcache(q, pool, pool, cache_seqlens=lens, block_table=table, causal=True)
    check_errors()
    good = int(table[0, 2])
    table.data[0, 2] = pool.shape[0]
    out = flash_attn_with_kvcache(q, pool, pool, cache_seqlens=lens, block_table=table, causal=True)
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="block_table"):
        check_errors()
    table.data[0, 2] = good
    out = flash_attn_with_kvcache(q, pool, pool, cache_seqlens=lens, block_table=table, causal=True)
    check_errors()
    kf = logical(pool, table)
    ref, _ = oracle(q, kf, kf, [40, 17], causal=True)
    assert_close(out, ref, torch.float32, device, "out")


# --------------------------------------------------------------------------- #
# defect 8: int64 lengths past int32
# --------------------------------------------------------------------------- #
def test_int64_seqlens_do_not_wrap(device):
    """2**32 + 5 used to be truncated to 5: it is out of range, clamped and reported."""
    big, k_cache = guarded_contiguous(device, seed=9)
    v_big, v_cache = guarded_contiguous(device, seed=10)
    q = rand(B, 1, HQ, D, device=device, seed=11)
    k_new, v_new = rand(B, 1, HK, D, device=device, seed=12), rand(B, 1, HK, D, device=device, seed=13)
    before = k_cache.clone()
    lens = torch.tensor([2**32 + 5, 7], dtype=torch.int64, device=device)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens)
    assert torch.isfinite(out).all() and _guards_intact(big, False) and _guards_intact(v_big, False)
    assert torch.equal(k_cache[0], before[0]), "the huge length must not append at position 5"
    assert torch.equal(k_cache[1, 7], k_new[1, 0])
    ref, _ = oracle(q[1:], k_cache[1:], v_cache[1:], [8], causal=False)
    assert_close(out[1:], ref, torch.float32, device, "out of the valid element")
    with pytest.raises(ValueError, match="cache_seqlens"):
        check_errors()
    with pytest.raises(ValueError, match="cache too small"):  # an int is checked on the host
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=2**32 + 5)


# --------------------------------------------------------------------------- #
# defect 3: non-contiguous cache_seqlens
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_strided_seqlens(device, dtype, paged):
    lens = torch.tensor([3, 0, 20, 0], dtype=dtype, device=device)[::2]  # [3, 20], stride 2
    q = rand(B, 1, HQ, D, device=device, seed=14)
    k_new, v_new = rand(B, 1, HK, D, device=device, seed=15), rand(B, 1, HK, D, device=device, seed=16)
    if paged:
        _, k_cache, table = guarded_pool(device, seed=17)
        _, v_cache, _ = guarded_pool(device, seed=18)
    else:
        (_, k_cache), (_, v_cache), table = guarded_contiguous(device, 17), guarded_contiguous(device, 18), None
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, block_table=table)
    k_full = logical(k_cache, table) if paged else k_cache
    v_full = logical(v_cache, table) if paged else v_cache
    assert torch.equal(k_full[1, 20], k_new[1, 0]) and torch.equal(k_full[0, 3], k_new[0, 0])
    ref, _ = oracle(q, k_full, v_full, [4, 21], causal=False)
    assert_close(out, ref, torch.float32, device, "out (append)")
    # without an append the kernel reads the strided lengths itself
    after = torch.tensor([4, 0, 21, 0], dtype=dtype, device=device)[::2]
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=after, block_table=table)
    assert_close(out, ref, torch.float32, device, "out (no append)")
    check_errors()


# --------------------------------------------------------------------------- #
# defect 2: inference mode
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "inference_tensors"])
def test_inference_mode(device, mode):
    def make():
        _, pool, table = guarded_pool(device, seed=19)
        q = rand(B, 1, HQ, D, device=device, seed=20)
        k_new, v_new = rand(B, 1, HK, D, device=device, seed=21), rand(B, 1, HK, D, device=device, seed=22)
        lens = torch.tensor([5, 33], dtype=torch.int32, device=device)
        return pool, pool.clone(), table, q, k_new, v_new, lens

    def call(t):
        k_pool, v_pool, table, q, k_new, v_new, lens = t
        out = flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, cache_seqlens=lens, block_table=table)
        out2 = flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lens + 1, block_table=table)  # memo hit
        return out, out2

    if mode == "inference_mode":
        with torch.inference_mode():
            t = make()
            out, out2 = call(t)
    elif mode == "no_grad":
        t = make()
        with torch.no_grad():
            out, out2 = call(t)
    else:
        with torch.inference_mode():
            t = make()
        assert t[0].is_inference() and t[-1].is_inference()
        out, out2 = call(t)
    k_pool, v_pool, table, q, k_new, v_new, lens = t
    kf, vf = logical(k_pool, table), logical(v_pool, table)
    assert torch.equal(kf[1, 33], k_new[1, 0])
    ref, _ = oracle(q, kf, vf, [6, 34], causal=False)
    assert_close(out, ref, torch.float32, device, "out")
    assert torch.equal(out, out2)
    check_errors()


# --------------------------------------------------------------------------- #
# defect 9: threads
# --------------------------------------------------------------------------- #
def test_threads_decode_concurrently(device, monkeypatch):
    """Several threads decode at once with overlapping and distinct signatures, starting from
    empty caches (the call memo and the launch caches are shared and filled concurrently):
    every result is right.  Triton's interpreter patches ``triton.language`` globally while a
    kernel runs, so under it only the kernel bodies are serialised; all host code runs
    concurrently."""
    from flashtile.ops import kvcache

    if device == "cpu":
        from triton.runtime import interpreter

        run, lock = interpreter.GridExecutor.__call__, threading.Lock()

        def serialised(self, *args, **kwargs):
            with lock:
                return run(self, *args, **kwargs)

        monkeypatch.setattr(interpreter.GridExecutor, "__call__", serialised)
    monkeypatch.setattr(kvcache, "_CALLS", {})
    decode_module._decode_launch.cache_clear()
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def worker(i: int) -> None:
        try:
            nq = 1 + i % 2
            k_cache = rand(B, 32 + 16 * (i % 2), HK, D, device=device, seed=100 + i)
            v_cache = rand(*k_cache.shape, device=device, seed=200 + i)
            q = rand(B, nq, HQ, D, device=device, seed=300 + i)
            lens = torch.tensor([5 + i, 17 + i], dtype=torch.int32, device=device)
            barrier.wait()
            outs = [flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True, num_splits=2)
                    for _ in range(2)]
            results[i] = (outs, q, k_cache, v_cache, lens)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(results) == [0, 1, 2, 3]
    for i, (outs, q, k_cache, v_cache, lens) in results.items():
        ref, _ = oracle(q, k_cache, v_cache, lens.tolist(), causal=True)
        for out in outs:
            assert_close(out, ref, torch.float32, device, f"thread {i}")


def test_call_memo_mutation_is_locked(monkeypatch):
    """Concurrent inserts past the memo's bound neither raise nor exceed it."""
    from flashtile.ops import kvcache

    monkeypatch.setattr(kvcache, "_CALLS", {})
    monkeypatch.setattr(kvcache, "_CALLS_MAX", 8)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for j in range(2000):
                kvcache._remember((i, j), None)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(kvcache._CALLS) <= 8


# --------------------------------------------------------------------------- #
# defect 6 (part): device keying
# --------------------------------------------------------------------------- #
def test_launch_and_error_word_keyed_by_device():
    """The same signature on two devices gives two launches and two error words ('meta' stands in
    for a second device: building a launch touches no memory)."""
    launches, words = [], []
    try:
        for dev in ("cpu", "meta"):
            q = torch.empty(B, 1, HQ, D, device=dev)
            k = torch.empty(B, 64, HK, D, device=dev)
            launches.append(decode_module.decode_launch(q, k, k, None, None, left=-1, right=-1, softcap=0.0,
                                                        unified=False, num_splits=2)[1])
            words.append(decode_module.error_flags(torch.device(dev)))
    finally:
        decode_module._ERRORS.pop(("meta", None), None)  # a meta word cannot be read by check_errors
    assert launches[0] is not launches[1]
    assert launches[0].err.device.type == "cpu" and launches[1].err.device.type == "meta"
    assert words[0] is not words[1] and words[0] is decode_module.error_flags(torch.device("cpu"))


# --------------------------------------------------------------------------- #
# flash-attn 2.x signature
# --------------------------------------------------------------------------- #
FLASH_ATTN_2 = [
    ("q", inspect.Parameter.empty), ("k_cache", inspect.Parameter.empty), ("v_cache", inspect.Parameter.empty),
    ("k", None), ("v", None), ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
    ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None), ("softmax_scale", None),
    ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("rotary_interleaved", True),
    ("alibi_slopes", None), ("num_splits", 0), ("return_softmax_lse", False),
]


def test_signature_is_flash_attn_2():
    params = list(inspect.signature(flash_attn_with_kvcache).parameters.values())
    positional = [p for p in params if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == FLASH_ATTN_2
    assert all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in params[len(positional):])


def test_positional_call_and_window_conventions(device):
    k_cache, v_cache = rand(B, 40, HK, D, device=device, seed=30), rand(B, 40, HK, D, device=device, seed=31)
    q = rand(B, 3, HQ, D, device=device, seed=32)
    lens = torch.tensor([25, 40], dtype=torch.int32, device=device)
    # every flash-attn 2.x argument positionally, in order
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, None, None, None, None, lens, None, None, None,
                                       None, True, (6, 0), 0.0, True, None, 0, True)
    ref_out, ref_lse = oracle(q, k_cache, v_cache, [25, 40], causal=True, window=(6, 0))
    assert_close(out, ref_out, torch.float32, device, "out")
    assert_close(lse, ref_lse, torch.float32, device, "lse")
    # causal with a right bound > 0: flash-attn sets it to 0; a window given as an int tensor
    for window in ((6, 3), torch.tensor([6, 3]), [6, 0]):
        got = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True, window_size=window)
        assert torch.equal(got, out), window
    # default causal=False: token 0 sees the whole cache
    got = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, window_size=torch.tensor([-1, -1]))
    ref_out, _ = oracle(q, k_cache, v_cache, [25, 40], causal=False)
    assert_close(got, ref_out, torch.float32, device, "out (causal=False)")
    # return_lse stays an alias of return_softmax_lse
    _, lse2 = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True, window_size=(6, 0),
                                      return_lse=True)
    assert torch.equal(lse2, lse)


# --------------------------------------------------------------------------- #
# GPU
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
def test_gpu_bad_values_inside_cuda_graph():
    """A captured decoding step (append + attend, paged); between replays bad values are written into
    the captured cache_seqlens / block_table: no replay touches the guards or gives NaN, each bad
    replay is reported by check_errors, and good values afterwards give the eager answer."""
    torch.cuda.synchronize()
    check_errors()
    num_pages = B * MAX_PAGES + 1
    big_k = torch.randn(num_pages + 2, PAGE, HK, D, device="cuda").bfloat16()
    big_v = torch.randn_like(big_k)
    for big in (big_k, big_v):
        big[0] = float("nan")
        big[-1] = float("nan")
    k_pool, v_pool = big_k[1:-1], big_v[1:-1]
    table = torch.randperm(num_pages, device="cuda")[: B * MAX_PAGES].view(B, MAX_PAGES).int()
    q = torch.randn(B, 1, HQ, D, device="cuda").bfloat16()
    k_new, v_new = torch.randn(B, 1, HK, D, device="cuda").bfloat16(), torch.randn(B, 1, HK, D, device="cuda").bfloat16()
    lens = torch.tensor([5, 20], dtype=torch.int32, device="cuda")

    def step():
        return flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, cache_seqlens=lens, block_table=table,
                                       num_splits=2)

    graph, static_out = capture(step)
    torch.cuda.synchronize()
    check_errors()
    good_table = table.clone()
    for name, write in [
        ("cache_seqlens", lambda: lens.fill_(CAP + 7)),
        ("cache_seqlens", lambda: lens.fill_(-3)),
        ("block_table", lambda: table.fill_(num_pages)),
        ("block_table", lambda: table.fill_(-1)),
        ("block_table", lambda: table.fill_(2**31 - 1)),
    ]:
        lens.copy_(torch.tensor([5, 20], dtype=torch.int32))
        table.copy_(good_table)
        write()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(static_out.float()).all(), name
        for big in (big_k, big_v):
            assert torch.isnan(big[0].float()).all() and torch.isnan(big[-1].float()).all(), name
        with pytest.raises(ValueError, match=name):
            check_errors()
    lens.copy_(torch.tensor([5, 20], dtype=torch.int32))
    table.copy_(good_table)
    graph.replay()
    k_snap, v_snap = k_pool.clone(), v_pool.clone()
    eager = flash_attn_with_kvcache(q, k_snap, v_snap, k_new, v_new, cache_seqlens=lens, block_table=table,
                                    num_splits=2)
    assert torch.equal(static_out, eager)
    check_errors()


@pytest.mark.parametrize("splits", [0, 1, 3])
@pytest.mark.parametrize("kind", ["tensor", "int", "paged", "none"])
def test_empty_batch_launches_nothing(device, kind, splits):
    """q of batch 0: empty out / lse of the right shapes, no launch (nor append), whatever the split count."""
    e = lambda *shape: torch.zeros(*shape, device=device)  # noqa: E731
    paged = kind == "paged"
    kc, vc = (rand(4, PAGE, HK, D, device=device, seed=95) for _ in range(2)) if paged else (e(0, 64, HK, D), e(0, 64, HK, D))
    kv = {} if kind == "none" else dict(k=e(0, N_NEW, HK, D), v=e(0, N_NEW, HK, D))
    seqlens = {"tensor": torch.zeros(0, dtype=torch.int32, device=device), "int": 3, "paged": 3, "none": None}[kind]
    table = torch.zeros(0, 2, dtype=torch.int32, device=device) if paged else None
    before = kc.clone()
    out, lse = flash_attn_with_kvcache(e(0, 1, HQ, D), kc, vc, cache_seqlens=seqlens, block_table=table,
                                       num_splits=splits, return_lse=True, **kv)
    assert out.shape == (0, 1, HQ, D) and lse.shape == (0, HQ, 1)
    assert torch.equal(kc, before)


@pytest.mark.parametrize("lens", ["tensor", "int", "none"])
def test_debug_checks_the_block_table_for_every_kind_of_lengths(device, lens):
    """debug=True reads the used block-table entries whether cache_seqlens is a tensor, an int or None, and
    raises naming block_table before the append writes anything."""
    _, pool, table = guarded_pool(device)
    table[0, 1] = pool.shape[0] + 5  # used by element 0 (length 20 after the append; every page with None)
    before = pool.clone()
    q = rand(B, 1, HQ, D, device=device, seed=90)
    kv = {} if lens == "none" else dict(k=rand(B, N_NEW, HK, D, device=device, seed=91),
                                        v=rand(B, N_NEW, HK, D, device=device, seed=92))
    seqlens = {"tensor": torch.tensor([19, 19], dtype=torch.int32, device=device), "int": 19, "none": None}[lens]
    with pytest.raises(ValueError, match=r"block_table\[0, 1\]"):
        flash_attn_with_kvcache(q, pool, pool.clone(), cache_seqlens=seqlens, block_table=table, debug=True, **kv)
    assert torch.equal(pool, before)


def test_append_refuses_caches_with_shared_elements(device):
    """With new k/v the caches are written in place: an expanded or self-overlapping k_cache / v_cache, or
    caches sharing elements, raise naming them before anything is written (also on the memoised path); a K/V
    pair interleaved in one allocation and a read-only expanded cache are fine."""
    k, v = rand(B, 1, HK, D, device=device, seed=80), rand(B, 1, HK, D, device=device, seed=81)
    q = rand(B, 1, HQ, D, device=device, seed=82)
    kc, vc = rand(B, CAP, HK, D, device=device, seed=83), rand(B, CAP, HK, D, device=device, seed=84)
    base = rand(1, CAP, HK, D, device=device, seed=85)
    snapshot = base.clone(), kc.clone(), vc.clone()
    lens = torch.tensor([4, 4], dtype=torch.int32, device=device)
    wide = rand(1, CAP + 1, HK, D, device=device, seed=87)
    rows = wide.view(-1).as_strided((B, CAP, HK, D), (HK * D, HK * D, D, 1))  # element b's row i is row i + b
    for name, caches in (("k_cache", (base.expand(B, -1, -1, -1), vc)), ("v_cache", (kc, base.expand(B, -1, -1, -1))),
                         ("k_cache", (rows, vc))):
        with pytest.raises(ValueError, match=name):
            flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=lens)
    flash_attn_with_kvcache(q, kc, vc.clone(), k, v, cache_seqlens=lens)  # the signature, memoised
    kc.copy_(snapshot[1])
    big = rand(B, CAP + 1, HK, D, device=device, seed=88)
    for caches in ((kc, kc), (big[:, :CAP], big[:, 1:])):
        with pytest.raises(ValueError, match="k_cache and v_cache share memory"):
            flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=lens)
    assert torch.equal(base, snapshot[0]) and torch.equal(kc, snapshot[1]) and torch.equal(vc, snapshot[2])
    pool = rand(4, PAGE, HK, D, device=device, seed=86)
    table = torch.tensor([[0, 1, 2], [3, 0, 1]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="k_cache has elements shared"):
        flash_attn_with_kvcache(q, pool[:1].expand(4, -1, -1, -1), pool.clone(), k, v, cache_seqlens=lens, block_table=table)
    # one (B, CAP, 2, HK, D) allocation holding K and V interleaved: distinct elements, appended exactly
    kv = torch.stack([snapshot[1], snapshot[2]], dim=2)
    out = flash_attn_with_kvcache(q, kv[:, :, 0], kv[:, :, 1], k, v, cache_seqlens=lens, return_lse=True)[0]
    kc2, vc2 = snapshot[1].clone(), snapshot[2].clone()
    ref = flash_attn_with_kvcache(q, kc2, vc2, k, v, cache_seqlens=lens)
    assert torch.equal(out, ref) and torch.equal(kv[:, :, 0], kc2) and torch.equal(kv[:, :, 1], vc2)
    # no new k/v: nothing is written, an expanded cache is read as it is
    shared = base.expand(B, -1, -1, -1)
    out = flash_attn_with_kvcache(q, shared, shared, cache_seqlens=lens)
    assert torch.equal(out, flash_attn_with_kvcache(q, shared.contiguous(), shared.contiguous(), cache_seqlens=lens))


@pytest.mark.parametrize("splits", [1, 2])
def test_row_stride_past_int32_in_a_tile(device, splits):
    """Key rows 2^28 elements apart (views of one lazily allocated storage of 2^31 + 32 elements): from key 8 on
    the tile's in-tile offsets pass 2^31, so they must be 64-bit (32-bit ones wrapped and read outside)."""
    d, n_keys, stride = 16, 10, 2**28
    store = torch.empty((n_keys - 1) * stride + 2 * d, dtype=torch.float16, device=device)  # pages touched: the rows
    kc = store.as_strided((1, n_keys, 1, d), (n_keys * stride, stride, d, 1))
    vc = store.as_strided((1, n_keys, 1, d), (n_keys * stride, stride, d, 1), d)
    g = torch.Generator().manual_seed(0)
    keys, vals = torch.randn(n_keys, d, generator=g).half(), torch.randn(n_keys, d, generator=g).half()
    for n in range(n_keys):
        kc[0, n, 0], vc[0, n, 0] = keys[n].to(device), vals[n].to(device)
    q = torch.randn(1, 1, 2, d, generator=g).half().to(device)
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n_keys, num_splits=splits, return_lse=True)
    s = q[0, 0].double().cpu() @ keys.double().T / math.sqrt(d)
    torch.testing.assert_close(out[0, 0].double().cpu(), torch.softmax(s, -1) @ vals.double(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse[0, :, 0].double().cpu(), torch.logsumexp(s, -1), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_cache_past_2_31_elements(paged):
    """Caches of 2**31 + 2**20 bf16 elements each (4.3 GB); the keys of element 1 (contiguous) or the
    pages it uses (paged) lie past element 2**31, and the append writes there."""
    torch.cuda.synchronize()
    check_errors()
    hk, d, page = 1, 128, 256
    rows = (2**31 + 2**20) // (hk * d)
    if paged:
        num_pages = rows // page
        k_pool = torch.empty(num_pages, page, hk, d, device="cuda", dtype=torch.bfloat16)
        v_pool = torch.empty_like(k_pool)
        table = torch.tensor([[0, 1, 2, 3], [num_pages - 4, num_pages - 3, num_pages - 2, num_pages - 1]],
                             dtype=torch.int32, device="cuda")
        b, cap_rows = 2, 4 * page
    else:
        b, cap_rows = 2, rows // 2
        k_pool = torch.empty(b, cap_rows, hk, d, device="cuda", dtype=torch.bfloat16)
        v_pool = torch.empty_like(k_pool)
        table = None
    assert k_pool.numel() > 2**31
    n = 3 * page - 5  # keys in use per element; all of element 1's lie past element 2**31
    start = 0 if paged else cap_rows - 4 * page  # contiguous: element 1's last 4 pages' worth of rows
    lens = torch.tensor([n, n], dtype=torch.int32, device="cuda")
    keys = torch.randn(b, n + 1, hk, d, device="cuda").bfloat16()
    vals = torch.randn(b, n + 1, hk, d, device="cuda").bfloat16()
    # write the used keys through the logical layout
    if paged:
        for e in range(b):
            for p in range(4):
                lo, hi = p * page, min((p + 1) * page, n)
                if lo < hi:
                    k_pool[int(table[e, p]), : hi - lo] = keys[e, lo:hi]
                    v_pool[int(table[e, p]), : hi - lo] = vals[e, lo:hi]
    else:
        k_pool[:, :n] = keys[:, :n]
        v_pool[:, :n] = vals[:, :n]
        lens = torch.tensor([n, start + n], dtype=torch.int32, device="cuda")
        k_pool[1, start : start + n] = keys[1, :n]
        v_pool[1, start : start + n] = vals[1, :n]
    q = torch.randn(b, 1, 8, d, device="cuda").bfloat16()
    # contiguous: element 1 sees only its last n + 1 keys (the rows before `start` are not initialised)
    out = flash_attn_with_kvcache(q, k_pool, v_pool, keys[:, n : n + 1], vals[:, n : n + 1], cache_seqlens=lens,
                                  block_table=table, window_size=(-1, -1) if paged else (n, -1))
    torch.cuda.synchronize()
    check_errors()
    # element 1's appended key landed past 2**31 elements, where the logical layout says
    if paged:
        pos = n
        assert int(table[1, pos // page]) * page * hk * d > 2**31
        got = k_pool[int(table[1, pos // page]), pos % page]
    else:
        got = k_pool[1, start + n]
        assert (1 * cap_rows + start + n) * hk * d > 2**31
    assert torch.equal(got, keys[1, n])
    for e in range(b):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[e : e + 1].float().transpose(1, 2), keys[e : e + 1].float().transpose(1, 2),
            vals[e : e + 1].float().transpose(1, 2), enable_gqa=True,
        ).transpose(1, 2)
        err = (out[e : e + 1].float() - ref).abs().max() / ref.abs().max()
        assert err < 2e-2, f"element {e}: max error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_second_device_while_first_is_current():
    """Tensors on cuda:1 while cuda:0 is current: the op runs under a guard for cuda:1."""
    torch.cuda.set_device(0)
    k = torch.randn(2, 512, 2, 64, device="cuda:1")
    q = torch.randn(2, 1, 4, 64, device="cuda:1")
    lens = torch.tensor([300, 512], dtype=torch.int32, device="cuda:1")
    out = flash_attn_with_kvcache(q, k, k, cache_seqlens=lens)
    assert out.device == q.device
    ref = torch.stack([
        torch.nn.functional.scaled_dot_product_attention(
            q[e : e + 1].transpose(1, 2), k[e : e + 1, :L].transpose(1, 2), k[e : e + 1, :L].transpose(1, 2),
            enable_gqa=True,
        ).transpose(1, 2)[0]
        for e, L in enumerate(lens.tolist())
    ])
    torch.testing.assert_close(out, ref, atol=5e-3, rtol=5e-3)  # TF32 products
    check_errors()
