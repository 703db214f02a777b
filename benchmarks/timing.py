"""CUDA-graph timing shared by the micro-benchmarks."""

from __future__ import annotations

import torch


def graph_time(calls: list) -> float:
    """Median ms per call of replaying all `calls` in one CUDA graph."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return sorted(times)[len(times) // 2]
