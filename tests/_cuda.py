"""CUDA-graph capture for the GPU tests: warm up on a side stream (compiles kernels, fills caches), then capture."""

from __future__ import annotations

from typing import Any, Callable

import torch


def capture(step: Callable[[], Any], warmup: int = 1) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``(graph, static outputs)``: ``step`` run ``warmup`` times outside the capture, then captured once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    return graph, static
