"""Tile configurations of the fused MoE kernels by shape, as measured fastest on a GPU.

benchmarks/tune_moe.py times candidate configurations of both paths (moe_gemv's small-batch
GEMV and moe's sorted grouped GEMM) for each expert matrix of a model and each number of slots
(tokens x top_k, in powers of two), and writes the fastest into moe_configs.json beside this
file under the GPU's name ("NVIDIA H200"): as vLLM's fused_moe tables
(configs/E=..,N=..,device_name=...json) do, with the GPU's compute capability beside them. A
shape without an entry of its own GPU takes that of another GPU of the same capability in the
table (the same SMs: the same tiles fit, and a tile fast on one is near the fastest on the
other; an H200 takes an H100's prompt tiles, an H100 NVL or H800 those tuned on either), else
the kernel's defaults (the tuner keeps a tile only where it beats what lookup gives). Entries
are checked before use: one that breaks a kernel's constraint (a quantized tile within one
scale's inputs, or holding whole groups of them) is ignored.
"""

from __future__ import annotations

import functools
import json
import pathlib

import torch

TABLE = pathlib.Path(__file__).with_name("moe_configs.json")
CAPABILITY = "capability"  # a GPU's field beside its entries: "9.0" (sm_90, Hopper)
FIELDS = {"gemv": ("BLOCK_N", "BLOCK_K", "num_warps"),
          "sorted": ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")}
# fields an entry may leave out, with the values they take: GEMV PREFETCH (INT4 K steps loaded
# ahead) and STAGES (the K loop software-pipelined by Triton in that many stages; 1: not), the
# first value their default; the sorted path's BLOCK_M (rows of a block, all of one expert;
# without it moe.rows_per_block's 16 or 64)
OPTIONAL = {"gemv": {"PREFETCH": (0, 1, 2), "STAGES": (1, 2, 3, 4)},
            "sorted": {"BLOCK_M": (16, 32, 64, 128)}}


def bucket(slots: int) -> int:
    """The power of two at or above slots (the table's rows)."""
    return 1 << max(slots - 1, 0).bit_length()


def key(path: str, mode: int, n: int, k: int, slots: int) -> str:
    """path 'gemv' or 'sorted'; mode: the weights' form (ops.triton.moe's MODE); n, k: the
    matrix's outputs and inputs (gate_up: n the expert's intermediate size, gated)."""
    return f"{path} mode={mode} N={n} K={k} slots={bucket(slots)}"


@functools.cache
def _table() -> dict:
    try:
        return json.loads(TABLE.read_text())
    except FileNotFoundError:
        return {}


@functools.cache
def device_name(device: torch.device) -> str | None:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


@functools.cache
def capability(device: torch.device) -> str | None:
    """"major.minor" of a CUDA device, None elsewhere."""
    if device.type != "cuda":
        return None
    return "{}.{}".format(*torch.cuda.get_device_capability(device))


def entry(name: str | None, arch: str | None, entry_key: str) -> dict | None:
    """GPU `name`'s own entry (compute capability arch), else the first of another GPU of
    that capability, unchecked."""
    if name is None:
        return None
    table = _table()
    if entry_key in table.get(name, {}):
        return table[name][entry_key]
    if arch is None:
        return None
    return next((entries[entry_key] for other, entries in table.items()
                 if other != name and entries.get(CAPABILITY) == arch
                 and entry_key in entries), None)


def tiles_scales(mode: int, block_k: int, scale_k: int, k: int) -> bool:
    """Whether a K tile of block_k inputs suits the weights' scales over scale_k inputs: within
    one scale's inputs, or holding whole groups of them (float weights: any tile)."""
    return mode == 0 or scale_k >= k or scale_k % block_k == 0 or block_k % scale_k == 0


def lookup(device: torch.device, path: str, mode: int, n: int, k: int, slots: int,
           scale_k: int) -> dict | None:
    """The tuned configuration for this shape on this device, or None. scale_k: inputs a
    scale covers (a quantized tile must stay within them)."""
    found = entry(device_name(device), capability(device), key(path, mode, n, k, slots))
    if found is None or not fields_valid(path, found):
        return None
    if path == "gemv" and not gemv_tile(mode, found["BLOCK_K"]):
        return None
    return found if tiles_scales(mode, found["BLOCK_K"], scale_k, k) else None


def fields_valid(path: str, entry: dict) -> bool:
    """Whether an entry names every field of its path, and optional ones only with the values
    they take."""
    optional = OPTIONAL[path]
    return (set(FIELDS[path]) <= set(entry) <= {*FIELDS[path], *optional}
            and all(entry[f] in values for f, values in optional.items() if f in entry))


def gemv_tile(mode: int, block_k: int) -> bool:
    """Whether moe_gemv takes a K tile of block_k inputs: INT4 sums per 32 inputs; W8A8 FP8
    rounds its inputs per 128; the other forms sum the 16 bytes a thread loads at once (16
    inputs at most) before accumulating."""
    if mode == 3:
        return w8a8_tile("gemv", block_k)
    return block_k % 32 == 0 if mode == 2 else block_k >= 16


def w8a8_tile(path: str, block_k: int, block_n: int = 0, block_m: int = 0) -> bool:
    """Whether W8A8 experts' kernels (mode 3) take a tile: K steps of whole 128-input groups
    (their inputs round per 128); on the sorted path one group a step and, in blocks of under
    64 rows (block_m), 64 outputs or more (the FP8 MMA's 64-row side)."""
    if path == "gemv":
        return block_k % 128 == 0
    return block_k == 128 and (block_m >= 64 or block_n >= 64)
