"""KV hand-off speed: one NIXL READ of a prompt's pages between two pools, against a plain
device copy of the same bytes, in the same run.

Two NixlTransfer agents (a prefill pool and a decode pool) in one process at a model's KV shape;
for each prompt length, the READ's wall time from posting to DONE (polled as the engine polls)
and the page checksums on both sides (they must agree), beside torch's copy of the same pages
(index_copy within the pool) on the same device. --processes 2 puts the prefill pool in a
second process, as deployed. First the decode side's probe read says which route UCX took
(disagg.probe). Prints a table and the command; --json writes its rows (model, tokens,
transport, gb_per_s) for NIXL and the device copy.
   python benchmarks/pd_transfer.py --device cuda --layers 32 --kv-heads 8 --head-dim 128
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time

import torch

from frugal.disagg.nixl import NixlTransfer
from frugal.worker.kv_pool import KVPool


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", default="512,2048,8192")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--processes", type=int, default=1, choices=[1, 2],
                   help="2: the prefill pool and its agent in a second process, as deployed")
    p.add_argument("--pages", default="scattered", choices=["scattered", "contiguous"],
                   help="the prompt's pages every other one (as after churn) or in a run")
    p.add_argument("--model", default="", help="a label for the JSON rows (the KV shape's model)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    lengths = [int(t) for t in args.tokens.split(",")]
    num_pages = 2 * -(-max(lengths) // args.page_size) + 8
    shape = (args.layers, num_pages, args.page_size, args.kv_heads, args.head_dim, dtype,
             args.device)
    decode_pool = KVPool(*shape)
    decode = NixlTransfer(decode_pool, "bench-decode")
    if args.processes == 1:
        prefill_pool = KVPool(*shape)
        prefill_pool.storage.view(torch.uint8).random_()
        prefill = NixlTransfer(prefill_pool, "bench-prefill")
        meta, remote_sums = prefill.metadata(), prefill_pool.checksums
    else:
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        child = ctx.Process(target=_serve_pool, args=(shape, there), daemon=True)
        child.start()
        meta = here.recv()
        prefill = None

        def remote_sums(pages):
            here.send(pages)
            return here.recv()
    decode.connect(meta, "local")
    decode.start_probe("bench-prefill", "local")
    while (route := decode.prober.result(30.0)) is None:
        if prefill is not None:
            prefill.notifications()
    pools = [None, decode_pool]  # pools[1]: the decode side
    print(f"$ python {' '.join(sys.argv)}")
    print(route.describe() + ("" if not route.slow else " (slow)") + "\n")
    print("| tokens | MiB | NIXL READ ms | NIXL GB/s | device copy GB/s | checksums equal |")
    print("|---|---|---|---|---|---|")
    rows = []
    for n in lengths:
        count = -(-n // args.page_size)
        if args.pages == "scattered":
            src, dst = list(range(1, 2 * count, 2)), list(range(0, 2 * count, 2))
        else:
            src, dst = list(range(count)), list(range(count, 2 * count))
        nbytes = count * decode_pool.chunk_bytes * args.layers * 2
        reads, copies = [], []
        for r in range(args.repeats + 1):
            pools[1].storage.zero_()
            _sync(args.device)
            start = time.perf_counter()
            decode.read(f"r{n}-{r}", dst, "bench-prefill", src, b"done")
            while not decode.done():
                if prefill is not None:
                    prefill.notifications()
            _sync(args.device)
            reads.append(time.perf_counter() - start)
            if prefill is not None:
                prefill.notifications()
            ok = pools[1].checksums(dst) == remote_sums(src)
            s, d = (torch.tensor(x, device=args.device) for x in (src, dst))
            _sync(args.device)
            start = time.perf_counter()
            pools[1].storage.index_copy_(2, d, pools[1].storage.index_select(2, s))
            _sync(args.device)
            copies.append(time.perf_counter() - start)
        read, copy = statistics.median(reads[1:]), statistics.median(copies[1:])
        print(f"| {n} | {nbytes / 2**20:.1f} | {read * 1e3:.2f} | {nbytes / read / 1e9:.1f} | "
              f"{nbytes / copy / 1e9:.1f} | {ok} |")
        rows += [{"model": args.model, "tokens": n, "transport": f"NIXL: {route.kind}",
                  "gb_per_s": nbytes / read / 1e9, "checksums_equal": ok},
                 {"model": args.model, "tokens": n, "transport": "device copy",
                  "gb_per_s": nbytes / copy / 1e9}]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "route": route.describe(), "rows": rows},
                      f, indent=1)


def _serve_pool(shape, pipe) -> None:
    """The prefill side in its own process: a random pool, its metadata sent, then its
    checksums on request while its agent is polled (a read needs this side's progress)."""
    pool = KVPool(*shape)
    pool.storage.view(torch.uint8).random_()
    transfer = NixlTransfer(pool, "bench-prefill")
    pipe.send(transfer.metadata())
    try:
        while True:
            transfer.notifications()
            if pipe.poll(0.0005):
                pipe.send(pool.checksums(pipe.recv()))
    except EOFError:  # the measuring side is done
        return


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
