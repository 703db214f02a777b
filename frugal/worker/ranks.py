"""Tensor parallelism's other ranks: one process each, mirroring rank 0's model calls.

`start` (on rank 0, from the engine) spawns ranks 1..N-1 and joins them in one torch.distributed
group (Gloo on CPU, NCCL on GPUs: rank r on cuda:r). Each builds the same Worker with its
share of the model (frugal.parallel) and then serves: rank 0's runner broadcasts each model call
(a batch's forward, or logits of hidden rows) before making it, the others make the same call,
and the collectives inside meet. Only rank 0 schedules and samples.

The group lives and dies as one. Rank 0 watches the other ranks' processes (`lost`: the engine
dies when one exits, see AsyncEngine) and `stop` never leaves one behind, nor hangs on a broken
group. A rank > 0 exits as soon as rank 0's process is gone (`exit_with_parent`): a collective
on a dead peer may wait for TIMEOUT (NCCL), and a SIGKILLed rank 0 runs no clean-up.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from frugal.config import EngineConfig
from frugal.loader import Checkpoint, open_checkpoint
from frugal.model_config import first_layers
from frugal.parallel import Parallel

logger = logging.getLogger("frugal")
TIMEOUT = datetime.timedelta(minutes=10)  # a rank that stops answering fails the others then
STOP_S = 30.0  # what telling the ranks to stop, and then their exit, may take each
KILL_S = 5.0  # what a rank gets to be reaped after SIGKILL
LEAVE_S = 5.0  # what leaving the group may take (it may hang on a broken one)
EXIT_GRACE_S = 1.0  # see lost
PARENT_POLL_S = 0.25  # how often a rank > 0 looks for rank 0 (see exit_with_parent)


def load_checkpoint(config: EngineConfig) -> Checkpoint:
    checkpoint = open_checkpoint(config.model, config.load_format, config.seed,
                                 config.quantization, config.dummy_init)
    if config.num_layers is not None:
        checkpoint.config = first_layers(checkpoint.config, config.num_layers)
    return checkpoint


def _join(config: EngineConfig, rank: int, size: int, address: str) -> Parallel:
    device = config.resolved_device()
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                            init_method=address, rank=rank, world_size=size, timeout=TIMEOUT)
    return Parallel(rank, size)


def start(config: EngineConfig) -> tuple[Parallel, list[multiprocessing.Process]]:
    """Spawn the other ranks and join the group as rank 0 (see the module docstring). The
    processes are ranks 1..N-1 in order."""
    size = config.tensor_parallel_size
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=serve, args=(config, rank, size, address, os.getpid()),
                               daemon=True, name=f"frugal-tp{rank}") for rank in range(1, size)]
    for worker in workers:
        worker.start()
    return _join(config, 0, size, address), workers


def lost(workers: list[multiprocessing.Process],
         error: BaseException | None = None) -> str | None:
    """Why the group can run no more model calls, or None: a rank's process has exited, or
    `error` (what a step raised on rank 0) is a distributed error (NCCL's; Gloo raises a plain
    RuntimeError when a peer is gone). Cheap without error, and safe from any thread.

    With an error, a rank that is exiting gets EXIT_GRACE_S to be seen doing so: a killed rank's
    sockets close, failing rank 0's collective, a moment before its exit status can be read."""
    if not workers:
        return None
    if error is not None and all(w.is_alive() for w in workers):
        multiprocessing.connection.wait([w.sentinel for w in workers], EXIT_GRACE_S)
    gone = [f"tensor-parallel rank {rank} (pid {w.pid}) exited with code {w.exitcode}"
            for rank, w in enumerate(workers, 1) if not w.is_alive()]
    if gone:
        return "; ".join(gone)
    if isinstance(error, dist.DistError):
        return f"a collective failed: {error!r}"
    return None


def stop(parallel: Parallel, workers: list[multiprocessing.Process], leave: bool = True) -> None:
    """Tell the other ranks to exit, wait for them (those that do not exit are killed) and leave
    the group. Returns with every rank process joined, within 2 STOP_S + KILL_S + LEAVE_S.

    A group that lost a rank is told nothing (a collective on it fails, or hangs): the ranks
    left are killed. leave=False: a step that never returned may still be inside a collective on
    this group, so the group is not touched: the ranks are killed, which (on Gloo) fails that
    collective, and a later call with leave=True leaves the group. Leaving is bounded, as
    destroy_process_group may hang on a broken group."""
    told = leave and lost(workers) is None and _bounded(
        lambda: parallel.broadcast(("stop", None)), STOP_S, "telling the ranks to stop")
    deadline = time.monotonic() + STOP_S
    for worker in workers:
        if told:
            worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():  # (a rank runs no clean-up of its own: nothing is lost)
            worker.kill()
    for worker in workers:
        worker.join(KILL_S)
    if leave and dist.is_initialized():
        _bounded(dist.destroy_process_group, LEAVE_S, "leaving the process group")


def _bounded(call: Callable[[], object], timeout: float, what: str) -> bool:
    """call() on a thread of its own, waited for at most timeout s: whether it returned."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:
            failed.append(e)

    thread = threading.Thread(target=run, name="frugal-tp-stop", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive() or failed:
        logger.warning("%s %s", what, f"failed: {failed[0]!r}" if failed
                       else f"did not return in {timeout:g} s")
        return False
    return True


def exit_with_parent(parent: int) -> None:
    """Exit this process (status 1) as soon as the process `parent` is gone, from a daemon
    thread polling os.getppid() (an orphan is adopted by another process). Unlike
    PR_SET_PDEATHSIG it does not fire when merely the thread that spawned this one exits."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        logger.error("rank 0 (pid %d) is gone: exiting", parent)
        os._exit(1)  # (the main thread may be blocked in a collective)

    threading.Thread(target=watch, name="frugal-parent-watch", daemon=True).start()


def serve(config: EngineConfig, rank: int, size: int, address: str, parent: int) -> None:
    """A rank > 0: build its runner, then make rank 0's calls until told to stop (or rank 0,
    the process `parent`, is gone). A failed call raises: this process exits, and rank 0
    sees it (see lost)."""
    from frugal.worker.model_runner import to_device
    from frugal.worker.worker import Worker

    exit_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to act on (it stops us)
    parallel = _join(config, rank, size, address)
    runner = Worker(config, load_checkpoint(config), parallel).runner
    while True:
        kind, args = parallel.broadcast()
        if kind == "stop":
            break
        if kind == "model":
            runner.run_model(*to_device(args, runner.device))
        elif kind == "logits":
            runner.compute_logits(args.to(runner.device))
    dist.destroy_process_group()
