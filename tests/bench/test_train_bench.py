"""`flashtile bench train`'s layouts and a smoke run of the whole routine on the tiny model (CPU: interpreter)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from flashtile.bench.train import INFERENCE_ROUNDS, document_rows, run_train_bench  # noqa: E402


def test_document_rows_fill_every_row():
    rows = document_rows(3, 8192, seed=4)
    assert len(rows) == 3
    for row in rows:
        assert sum(row) == 8192 and min(row) >= 1
        assert len(row) > 1  # mixed lengths: no row is a single document
    assert len({n for row in rows for n in row}) > 3


def test_quick_run(tmp_path):
    """Every measurement runs; packed flashtile (varlen) and padded SDPA compute the same first-step
    loss; unpadded steps agree too; greedy decoding gives the same tokens; the JSON is written."""
    steps = []
    payload = run_train_bench(
        tmp_path, quick=True, providers=("flashtile", "sdpa"), batch=1, seqlen=32, unpadded_seqlens=(32,),
        unpadded_tokens=32, prompt=12, new_tokens=2, warmup=0, reps=1, progress=steps.append,
    )
    # the inference rounds alternate which provider goes first
    order = [s.split(": ")[1] for s in steps if s.startswith("inference round")]
    assert order == ["flashtile", "sdpa", "sdpa", "flashtile", "flashtile", "sdpa"][:2 * INFERENCE_ROUNDS]
    packed = {r["provider"]: r for r in payload["train_packed"]}
    assert "error" not in packed["flashtile"] and "error" not in packed["sdpa"], packed
    assert packed["sdpa"]["microbatches"] >= 1 and payload["documents"]["count"] > 1
    assert packed["flashtile"]["loss"] == pytest.approx(packed["sdpa"]["loss"], rel=1e-5)
    un = {r["provider"]: r for r in payload["train_unpadded"]}
    assert un["flashtile"]["loss"] == pytest.approx(un["sdpa"]["loss"], rel=1e-5)
    inf = {r["provider"]: r for r in payload["inference"]}
    assert inf["flashtile"]["tokens"] == inf["sdpa"]["tokens"]
    assert inf["flashtile"]["rounds"] == inf["sdpa"]["rounds"] == INFERENCE_ROUNDS
    assert inf["flashtile"]["prefill_ms"] > 0
    assert set(payload["ratios"]) >= {"train_packed", "train_unpadded_32", "prefill", "decode"}
    saved = json.loads(open(payload["path"]).read())
    assert saved["train_packed"][0]["provider"] == "flashtile"


def test_inference_rounds_merge_by_median():
    """Each inference time is the median over the rounds, the peak the largest; an error in any round is the
    provider's result."""
    from flashtile.bench.train import _median_rounds

    rows = [dict(provider="flashtile", prefill_ms=p, prefill_tokens_per_s=1e3 / p, generate_ms=g,
                 decode_ms_per_token=g / 10, peak_gib=m, tokens=[[1, 2]]) for p, g, m in ((5, 50, 1.0), (9, 40, 2.0),
                                                                                          (7, 90, 1.5))]
    got = _median_rounds(rows)
    assert (got["prefill_ms"], got["generate_ms"], got["decode_ms_per_token"], got["peak_gib"]) == (7, 50, 5.0, 2.0)
    assert got["rounds"] == 3 and got["tokens"] == [[1, 2]]
    assert _median_rounds([rows[0], dict(provider="flashtile", error="boom")]) == dict(provider="flashtile",
                                                                                      error="boom")


def test_bad_options_raise(tmp_path):
    with pytest.raises(ValueError, match="providers"):
        run_train_bench(tmp_path, quick=True, providers=("nope",))
    with pytest.raises(ValueError, match="size"):
        run_train_bench(tmp_path, size="huge")
    with pytest.raises(ValueError, match="shape"):
        run_train_bench(tmp_path, quick=True, seqlens=3)


@pytest.mark.gpu
def test_gpu_quick_run_all_providers(tmp_path):
    """On a GPU the tiny model runs the providers (bf16; FlexAttention's compile is left to the real
    run, for time): packed flashtile and the padded SDPA backends agree on the first-step loss."""
    payload = run_train_bench(tmp_path, size="tiny", providers=("flashtile", "sdpa", "sdpa-flash", "sdpa-cudnn"),
                              batch=2, seqlen=512, unpadded_seqlens=(256, 512), unpadded_tokens=1024, prompt=128,
                              new_tokens=8, warmup=1, reps=2)
    losses = {r["provider"]: r["loss"] for r in payload["train_packed"] if "loss" in r}
    assert {"flashtile", "sdpa"} <= set(losses), payload["train_packed"]
    for p, v in losses.items():
        assert v == pytest.approx(losses["flashtile"], rel=2e-2), (p, losses)
    assert all(r.get("peak_gib") for r in payload["train_packed"] if "loss" in r)
