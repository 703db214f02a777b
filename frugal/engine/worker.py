"""Tensor parallelism's other ranks: one process each, mirroring rank 0's model calls.

`start` (on rank 0, from the engine) spawns ranks 1..N-1 and joins them in one torch.distributed
group (Gloo on CPU, NCCL on GPUs: rank r on cuda:r). Each builds the same ModelRunner with its
share of the model (frugal.parallel) and then serves: rank 0's runner broadcasts each model call
(a batch's forward, or logits of hidden rows) before making it, the others make the same call,
and the collectives inside meet. Only rank 0 schedules and samples.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import socket

import torch
import torch.distributed as dist

from frugal.config import EngineConfig
from frugal.layers.attention import AttentionMetadata
from frugal.loader import Checkpoint, open_checkpoint
from frugal.model_config import first_layers
from frugal.parallel import Parallel

logger = logging.getLogger("frugal")
TIMEOUT = datetime.timedelta(minutes=10)  # a rank that stops answering fails the others then


def to_device(x, device: str):
    """Tensors (in tuples and AttentionMetadata) moved to device ("cpu" for a broadcast)."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):
        return tuple(to_device(v, device) for v in x)
    if isinstance(x, AttentionMetadata):
        return AttentionMetadata(**{k: to_device(v, device) for k, v in vars(x).items()})
    return x


def load_checkpoint(config: EngineConfig) -> Checkpoint:
    checkpoint = open_checkpoint(config.model, config.load_format, config.seed,
                                 config.quantization)
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
    """Spawn the other ranks and join the group as rank 0 (see the module docstring)."""
    size = config.tensor_parallel_size
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=serve, args=(config, rank, size, address), daemon=True,
                               name=f"frugal-tp{rank}") for rank in range(1, size)]
    for worker in workers:
        worker.start()
    return _join(config, 0, size, address), workers


def stop(parallel: Parallel, workers: list[multiprocessing.Process]) -> None:
    """Tell the other ranks to exit, wait for them, and leave the group."""
    parallel.broadcast(("stop", None))
    for worker in workers:
        worker.join(timeout=30)
    dist.destroy_process_group()


def serve(config: EngineConfig, rank: int, size: int, address: str) -> None:
    """A rank > 0: build its runner, then make rank 0's calls until told to stop."""
    from frugal.engine.model_runner import ModelRunner

    parallel = _join(config, rank, size, address)
    runner = ModelRunner(config, load_checkpoint(config), parallel)
    while True:
        kind, args = parallel.broadcast()
        if kind == "stop":
            break
        if kind == "model":
            runner.run_model(*to_device(args, runner.device))
        elif kind == "logits":
            runner.compute_logits(args.to(runner.device))
    dist.destroy_process_group()
