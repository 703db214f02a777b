"""KV hand-off speed: a prompt's pages read from a prefill pool into a decode pool, through NIXL
and through the prefill pool mapped into the decode side (CUDA IPC or a memory file: the
decode worker's own page copy, disagg.direct), against a plain device copy of the same bytes,
in the same run.

Decode-side transfers (one over NIXL, one mapping where the pool maps) and a prefill pool at a
model's KV shape; for each prompt length, each transfer's wall time from posting to its end
(polled as the engine polls) and the page checksums on both sides (they must agree), beside
torch's copy of the same pages within the decode pool (index_copy). --processes 2 (the
default) puts the prefill pool in a second process, as deployed (CUDA IPC maps only another
process's memory). First each transfer's probe says which route it takes (disagg.probe).
Prints a table and the command; --json writes its rows (model, tokens, transport, gb_per_s).
Without NIXL installed, the mapped copy alone (mapping.attach + direct.Copies, as the decode
worker runs it; no probe) beside the device copy.
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

from frugal.disagg import direct, mapping
from frugal.disagg.nixl import NixlTransfer, import_nixl
from frugal.worker.kv_pool import KVPool


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--parts", type=int, default=2, help="1: MLA's latent cache")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", default="512,2048,8192")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--processes", type=int, default=2, choices=[1, 2],
                   help="2: the prefill pool and its agent in a second process, as deployed")
    p.add_argument("--pages", default="scattered", choices=["scattered", "contiguous"],
                   help="the prompt's pages every other one (as after churn) or in a run")
    p.add_argument("--model", default="", help="a label for the JSON rows (the KV shape's model)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    num_pages = 2 * -(-max(lengths) // args.page_size) + 8
    shape = (args.layers, num_pages, args.page_size, args.kv_heads, args.head_dim,
             getattr(torch, args.dtype), args.device, args.parts)
    decode_pool = KVPool(*shape)
    try:
        import_nixl()
        nixl = True
    except RuntimeError:
        nixl = False
    if args.processes == 1 and nixl:
        prefill_pool = KVPool(*shape, shareable=True)
        prefill_pool.storage.view(torch.uint8).random_()
        prefill = NixlTransfer(prefill_pool, "bench-prefill")
        meta, remote_sums, progress = prefill.metadata(), prefill_pool.checksums, \
            prefill.notifications
    else:
        here, there = mp.get_context("spawn").Pipe()
        child = mp.get_context("spawn").Process(target=_serve_pool, args=(shape, there, nixl),
                                                daemon=True)
        child.start()
        there.close()  # (a child that dies before it answers: EOFError here, not a hang)
        meta = here.recv()

        def remote_sums(pages):
            here.send(pages)
            return here.recv()

        def progress():
            return None
    print(f"$ python {' '.join(sys.argv)}")
    if nixl:
        movers, routes = _nixl_movers(decode_pool, meta, progress)
    else:
        print("NIXL is not installed: the mapped copy alone (no probe)")
        movers, routes = _mapped_mover(decode_pool, meta, args.device), {
            "mapped": "the prefill pool mapped here (no probe: NIXL not installed)"}
    names = list(movers)
    print("\n| tokens | MiB | " + " | ".join(f"{n} ms | {n} GB/s | {n} start ms" for n in names)
          + " | device copy GB/s | checksums equal |")
    print("|---|---|" + "---|---|---|" * len(names) + "---|---|")
    rows = []
    for n in lengths:
        src, dst, count = _pages(args, n)
        nbytes = count * decode_pool.chunk_bytes * args.layers * args.parts
        times, ok = {name: [] for name in names}, True
        starts = {name: [] for name in names}  # (host time of the start call alone)
        want = remote_sums(src)
        for name, (start_move, finished, _) in movers.items():
            for r in range(args.repeats + 1):
                decode_pool.storage.zero_()
                _sync(args.device)
                start = time.perf_counter()
                start_move(f"r{n}-{r}", dst, src)
                starts[name].append(time.perf_counter() - start)
                while not finished():
                    progress()
                _sync(args.device)
                times[name].append(time.perf_counter() - start)
                ok = ok and decode_pool.checksums(dst) == want
        took = {name: statistics.median(t[1:]) for name, t in times.items()}
        began = {name: statistics.median(t[1:]) for name, t in starts.items()}
        copy = _device_copy(args, decode_pool, src, dst)
        print(f"| {n} | {nbytes / 2**20:.1f} | " + " | ".join(
            f"{took[x] * 1e3:.2f} | {nbytes / took[x] / 1e9:.1f} | {began[x] * 1e3:.3f}"
            for x in names)
            + f" | {nbytes / copy / 1e9:.1f} | {ok} |")
        rows += [{"model": args.model, "tokens": n, "gb_per_s": nbytes / took[x] / 1e9,
                  "transport": movers[x][2], "checksums_equal": ok,
                  "start_ms": began[x] * 1e3} for x in names]
        rows.append({"model": args.model, "tokens": n, "transport": "device copy",
                     "gb_per_s": nbytes / copy / 1e9})
    movers.clear()  # (a mapping let go before the prefill process ends)
    _sync(args.device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "routes": routes, "rows": rows}, f,
                      indent=1)


def _nixl_movers(pool: KVPool, meta: dict, progress) -> tuple[dict, dict]:
    """{name: (start(key, dst, src), finished(), label)} of a NIXL read and of a read through
    the prefill pool mapped here (where it maps), and each one's route as its probe found it."""
    transfers = {"NIXL": NixlTransfer(pool, "bench-decode", map_peers=False),
                 "mapped": NixlTransfer(pool, "bench-decode-mapped")}
    movers, routes = {}, {}
    for name, transfer in transfers.items():
        transfer.connect(meta, "local")
        if name == "mapped" and not transfer.maps("bench-prefill"):
            print("the prefill pool does not map here (CUDA IPC maps another process's "
                  "memory: --processes 2); NIXL alone")
            continue
        transfer.start_probe("bench-prefill", "local")
        while (route := transfer.prober.result(30.0)) is None:
            progress()
        print(route.describe() + (" (slow)" if route.slow else ""))
        routes[name] = route.describe()
        label = f"{name}: {route.kind}" + (f" ({', '.join(sorted(route.transports))})"
                                           if route.transports else "")
        movers[name] = (lambda key, dst, src, t=transfer: t.read(key, dst, "bench-prefill",
                                                                 src, b"done"),
                        transfer.done, label)
    return movers, routes


def _mapped_mover(pool: KVPool, desc: dict, device: str) -> dict:
    """{"mapped": (start, finished, label)}: the prefill pool (described by mapping.describe)
    mapped here and copied from as the decode worker does (direct.Copies); a failed copy
    raises."""
    remote = mapping.attach(desc, pool.num_bytes, pool.storage.device)
    copies = direct.Copies(pool)

    def finished() -> bool:
        ended = copies.done()
        for _, error in ended:
            if error is not None:
                raise RuntimeError(f"the mapped copy failed: {error}")
        return bool(ended)

    label = "mapped: " + ("cuda_ipc" if device.startswith("cuda") else "memfd")
    return {"mapped": (lambda key, dst, src: copies.start(key, dst, remote, src, lambda: None),
                       finished, label)}


def _pages(args, n: int) -> tuple[list[int], list[int], int]:
    """(source pages, destination pages, how many) of an n-token prompt."""
    count = -(-n // args.page_size)
    if args.pages == "scattered":
        return list(range(1, 2 * count, 2)), list(range(0, 2 * count, 2)), count
    return list(range(count)), list(range(count, 2 * count)), count


def _device_copy(args, pool: KVPool, src: list[int], dst: list[int]) -> float:
    """Median seconds of torch's copy of src pages to dst pages within pool."""
    copies = []
    s, d = (torch.tensor(x, device=args.device) for x in (src, dst))
    for _ in range(args.repeats + 1):
        _sync(args.device)
        start = time.perf_counter()
        pool.storage.index_copy_(2, d, pool.storage.index_select(2, s))
        _sync(args.device)
        copies.append(time.perf_counter() - start)
    return statistics.median(copies[1:])


def _serve_pool(shape, pipe, nixl: bool) -> None:
    """The prefill side in its own process: a random pool, its NIXL metadata (else its
    mapping.describe) sent, then its checksums on request while its agent is polled (a NIXL
    read needs this side's progress)."""
    pool = KVPool(*shape, shareable=True)
    pool.storage.view(torch.uint8).random_()
    _sync(shape[6])
    transfer = NixlTransfer(pool, "bench-prefill") if nixl else None
    pipe.send(transfer.metadata() if nixl else mapping.describe(pool.storage, pool.memfd))
    try:
        while True:
            if transfer is not None:
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
