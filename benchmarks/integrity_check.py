"""Micro-benchmark: the KV-cache integrity check (ops.check_kv_pages, Triton) on one GPU.

Every request's page table is compared with the pages' tags (all pass, as in normal serving).
Page 16; times are medians of CUDA-graph replays of 20 calls (as the engine runs it, first in
every decode graph).
   python benchmarks/integrity_check.py
"""

from __future__ import annotations

import torch
from timing import graph_time

from frugal.ops.triton.integrity import check_kv_pages

SHAPES = [(1, 4096), (8, 4096), (64, 4096), (64, 16384), (256, 4096)]
PAGE = 16


def bench(batch: int, seq_len: int) -> float:
    dev = "cuda"
    pages_per = -(-seq_len // PAGE)
    num_pages = batch * pages_per
    tags = torch.randint(1, 2**31 - 1, (num_pages,), device=dev, dtype=torch.int32)
    table = torch.randperm(num_pages, device=dev).to(torch.int32).view(batch, pages_per)
    expected = tags[table.long()]
    lens = torch.full((batch,), seq_len, device=dev, dtype=torch.int32)
    cu = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    slots = torch.zeros(batch, device=dev, dtype=torch.int64)
    status = check_kv_pages(table, expected, tags, lens, cu, slots, PAGE)
    assert int(status[:, 0].sum()) == 0
    return graph_time([lambda: check_kv_pages(table, expected, tags, lens, cu, slots, PAGE)]
                      * 20)


def main() -> None:
    print(f"{torch.cuda.get_device_name()} | page {PAGE} | CUDA-graph replay medians\n")
    print("| requests | tokens each | pages checked | µs |")
    print("|---|---|---|---|")
    for batch, seq_len in SHAPES:
        ms = bench(batch, seq_len)
        print(f"| {batch} | {seq_len} | {batch * -(-seq_len // PAGE)} | {ms * 1e3:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
