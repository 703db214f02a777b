"""`frugal bench offline`'s results drawn: `frugal bench plot` of saved JSONs."""

import argparse
import json
from dataclasses import asdict

from frugal.bench.result import Result, run_plot


def test_plot_draws_one_line_per_results_file(tmp_path):
    paths = []
    for name, tok_s in (("bf16_kv", 100.0), ("fp8_kv", 150.0)):
        rows = [asdict(Result("frugal", c, 1.0, 1.0, tok_s * c, 1.0, 1.0, 1.0, 1.0,
                              bound_tok_s=2 * tok_s * c)) for c in (1, 8)]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"workload": {"model": "m", "input_len": 8, "output_len": 4},
                                    "results": rows}))
        paths.append(str(path))
    png = tmp_path / "both.png"
    assert run_plot(argparse.Namespace(results=paths, plot=str(png))) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
