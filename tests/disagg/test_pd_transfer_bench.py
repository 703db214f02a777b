"""benchmarks/pd_transfer.py runs end to end on a CPU, with NIXL and without it: every transport
it times moves the prompt's pages intact (its JSON says so), beside the device copy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "pd_transfer.py"
ARGS = ["--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--tokens", "40,100",
        "--repeats", "1", "--model", "tiny"]
HIDE_NIXL = ("import runpy, sys; import frugal.disagg.nixl as n\n"
             "def absent(): raise RuntimeError('no NIXL')\n"
             "n.import_nixl = absent; sys.argv = sys.argv[1:]\n"
             "runpy.run_path(sys.argv[0], run_name='__main__')")


def run(tmp_path: Path, *prefix: str) -> dict:
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, *prefix, str(SCRIPT), *ARGS, "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())


def test_nixl_and_the_mapped_copy_beside_a_device_copy(tmp_path):
    pytest.importorskip("nixl_cu13")
    rows = run(tmp_path)["rows"]
    kinds = {row["transport"].split(":")[0] for row in rows}
    assert kinds == {"NIXL", "mapped", "device copy"}, rows
    assert all(row.get("checksums_equal", True) for row in rows), rows
    assert sorted({row["tokens"] for row in rows}) == [40, 100]


def test_without_nixl_the_mapped_copy_alone(tmp_path):
    report = run(tmp_path, "-c", HIDE_NIXL)
    rows = report["rows"]
    assert [row["transport"] for row in rows] == ["mapped: memfd", "device copy"] * 2, rows
    assert all(row.get("checksums_equal", True) and row["gb_per_s"] > 0 for row in rows)
    assert list(report["routes"]) == ["mapped"]
