"""`frugal env` (and `frugal --version`): the versions this install runs on, the GPU it finds,
and the torch/triton pairs frugal is tested with."""

from __future__ import annotations

import argparse
import platform

# Where each pair was tested (README, "Install").
TESTED = {"GPU": "torch 2.11.0+cu130 with triton 3.6.0 (NVIDIA H200)",
          "CPU": "torch 2.13.0 (CPU build), triton 3.6.0 and 3.7.1 in its interpreter"}


def describe() -> list[str]:
    import torch

    from frugal import __version__

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed (the GPU kernels need it)"
    build = (f"CUDA {torch.version.cuda} build" if torch.version.cuda else
             f"ROCm {torch.version.hip} build" if getattr(torch.version, "hip", None) else
             "CPU-only build")
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        gpu = f"{len(gpus)} x {gpus[0]}" if len(set(gpus)) == 1 else ", ".join(gpus)
    else:
        gpu = "none (the CPU path runs: plain PyTorch ops)"
    return [f"frugal {__version__}", f"python {platform.python_version()}",
            f"torch {torch.__version__} ({build})", f"triton {triton_version}",
            f"GPU: {gpu}", *(f"tested on the {where}: {pair}" for where, pair in TESTED.items())]


class VersionAction(argparse.Action):
    """--version: describe() (imports torch only when asked)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print versions, GPU and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print("\n".join(describe()))
        parser.exit()


def add_env_parser(subparsers) -> None:
    p = subparsers.add_parser("env", help="versions of frugal, torch and triton, and the GPU")
    p.set_defaults(func=lambda args: print("\n".join(describe())) or 0)
