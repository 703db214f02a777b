"""A KV pool served by another process, for the tests of pools mapped across processes
(disagg.mapping, disagg.direct); the `pool_peer` fixture (conftest) holds one for the package."""

import multiprocessing as mp

import torch

from frugal.disagg import mapping
from frugal.worker.kv_pool import KVPool

SHAPE = (3, 12, 16, 2, 8, torch.bfloat16, "cpu")  # layers, pages, page size, heads, dim
CPU = torch.device("cpu")


def serve_pool(pipe) -> None:
    """A prefill side in its own process: a shareable pool of random bytes, its description and
    every page's checksum sent, kept alive until the other side is done."""
    pool = KVPool(*SHAPE, shareable=True)
    pool.storage.view(torch.uint8).random_()
    pipe.send((mapping.describe(pool.storage, pool.memfd),
               pool.checksums(list(range(pool.num_pages)))))
    pipe.recv()


def start_peer():
    """(process, pipe, description, checksums) of a pool served by another process (send it
    anything through the pipe to end it)."""
    here, there = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(target=serve_pool, args=(there,), daemon=True)
    child.start()
    desc, sums = here.recv()
    return child, here, desc, sums
