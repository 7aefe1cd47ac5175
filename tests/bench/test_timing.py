"""Timing helpers of flashtile.bench.common (GPU only: they time CUDA events)."""

import pytest
import torch

from flashtile.bench.common import median_ms, median_ms_clean_l2


@pytest.mark.gpu
def test_gpu_clean_l2_timer_times_the_call():
    """A 512 MB copy takes about as long with either flush (its own traffic dominates); a call
    doing twice the work takes about twice as long, so the timer measures the call, not the flush."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    src = torch.randn(64 << 20, device="cuda")  # 256 MB
    dst = torch.empty_like(src)
    one = median_ms_clean_l2(lambda: dst.copy_(src))
    two = median_ms_clean_l2(lambda: (dst.copy_(src), dst.copy_(src)))
    ref = median_ms(lambda: dst.copy_(src))
    assert 1.7 < two / one < 2.3
    assert 0.8 < one / ref < 1.25
