"""Forward TFLOP/s when batch·heads·q-tiles is small (few programs per SM).  GPU only.

Usage: python bench/scripts/small_grid.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from flashtile.bench.attention import _sdpa_fn  # noqa: E402
from flashtile.bench.common import median_ms  # noqa: E402
from flashtile.runtime import fa2_fwd  # noqa: E402

d, n, h = 128, 2048, 16
orig = fa2_fwd.fwd_config
for b in (1, 2, 4, 8):
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    flops = 4 * b * h * n * n * d
    row = [f"B={b}"]
    for cfg in (None, (128, 64, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (64, 64, 8, 3)):
        fa2_fwd.fwd_config = orig if cfg is None else (lambda *a, _c=cfg, **kw: _c)
        ms = median_ms(lambda: fa2_fwd.fa2_forward(qt, kt, vt, softmax_scale=d**-0.5))
        row.append(f"{cfg or 'default'}: {flops / ms / 1e9:.0f}")
    fa2_fwd.fwd_config = orig
    fl = _sdpa_fn("sdpa-flash")
    row.append(f"sdpa-flash {flops / median_ms(lambda: fl(q, k, v, False)) / 1e9:.0f}")
    print(" | ".join(row), flush=True)
