"""The tile table of the fused MoE kernels (ops.triton.moe_configs): the committed entries, and
the lookup's fallback to a GPU of the same compute capability."""

import json

import pytest
import torch

moe_configs = pytest.importorskip("frugal.ops.triton.moe_configs")


def test_committed_table_holds_valid_tiles():
    """Every entry of moe_configs.json (written on a GPU by benchmarks/tune_moe.py) names its
    path's fields, in powers of two the kernels take, and suits its form's scales."""
    table = json.loads(moe_configs.TABLE.read_text())
    assert table, "no tuned tiles committed"
    scale_k = {0: 1, 1: 128, 2: 32}
    for entries in table.values():
        assert entries.pop(moe_configs.CAPABILITY) == "9.0"  # (every GPU tuned: Hopper)
        for key, entry in entries.items():
            path, mode, n, k, slots = key.split()
            assert moe_configs.fields_valid(path, entry), key
            assert all(v > 0 and v & (v - 1) == 0 for f, v in entry.items()
                       if f in set(moe_configs.FIELDS[path]) - {"num_stages"}), key
            mode, k = int(mode.split("=")[1]), int(k.split("=")[1])
            assert moe_configs.tiles_scales(mode, entry["BLOCK_K"], scale_k[mode], k), key
            assert path != "gemv" or moe_configs.gemv_tile(mode, entry["BLOCK_K"]), key
        # a sorted gate_up entry's rows a block are its down partner's (one alignment; an
        # entry without BLOCK_M was tuned at rows_per_block's 16 or 64)
        for key, entry in entries.items():
            path, mode, n, k, slots = key.split()
            partner = entries.get(" ".join((path, mode, k.replace("K", "N"),
                                            n.replace("N", "K"), slots)))
            if path == "sorted" and partner is not None and "BLOCK_M" in entry:
                rows = entry["BLOCK_M"]
                assert partner.get("BLOCK_M", rows if rows in (16, 64) else None) == rows, key


def test_a_gpu_without_an_entry_takes_one_of_its_architecture(monkeypatch):
    """A shape the GPU has no entry for takes that of another GPU of the same compute
    capability (the first in the table), its own entry first; another architecture's never."""
    k, other = moe_configs.key("sorted", 0, 768, 2048, 8192), moe_configs.key("gemv", 0, 8, 8, 1)
    tile = {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}
    table = {"GPU A": {"capability": "9.0", k: tile},
             "GPU B": {"capability": "9.0", k: {**tile, "BLOCK_N": 64}},
             "GPU C": {"capability": "8.0", other: {"BLOCK_N": 8, "BLOCK_K": 64,
                                                    "num_warps": 1}}}
    monkeypatch.setattr(moe_configs, "_table", lambda: table)
    gpu = {"name": "", "capability": ""}
    monkeypatch.setattr(moe_configs, "device_name", lambda device: gpu["name"])
    monkeypatch.setattr(moe_configs, "capability", lambda device: gpu["capability"])

    def found(key):
        path, mode, n, kk, slots = key.split()
        return moe_configs.lookup(torch.device("cpu"), path, int(mode[5:]), int(n[2:]),
                                  int(kk[2:]), int(slots[6:]), 1)

    for name, arch, want in (("GPU B", "9.0", 64), ("GPU D", "9.0", 128), ("GPU A", "9.0", 128),
                             ("GPU E", "8.0", None), ("GPU C", "8.0", None)):
        gpu.update(name=name, capability=arch)
        got = found(k)
        assert (got and got["BLOCK_N"]) == want, name
    gpu.update(name="GPU D", capability="9.0")
    assert found(other) is None  # (GPU C's entry is another architecture's)
    gpu.update(name="GPU E", capability="8.0")
    assert found(other)["BLOCK_N"] == 8
