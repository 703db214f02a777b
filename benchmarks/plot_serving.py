"""Plot `vllm bench serve` results (files TAG_c<C>.json, as the vLLM peer kit writes them): output
tok/s and median TPOT by concurrency, one line per tag, and print the table of those runs.
   python benchmarks/plot_serving.py RESULTS_DIR --tags frugal_x,vllm_x --output plot.png
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def load(results: Path, tag: str) -> dict[int, dict]:
    runs = {}
    for path in results.glob(f"{tag}_c*.json"):
        m = re.fullmatch(re.escape(tag) + r"_c(\d+)\.json", path.name)
        if m:
            runs[int(m.group(1))] = json.loads(path.read_text())
    return dict(sorted(runs.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("results", type=Path)
    p.add_argument("--tags", required=True, help="comma-separated tags (frugal_..., vllm_...)")
    p.add_argument("--output", required=True, help="PNG to write")
    p.add_argument("--title", default="")
    a = p.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tput, tpot) = plt.subplots(1, 2, figsize=(10, 4))
    for tag in a.tags.split(","):
        runs = load(a.results, tag)
        cs = list(runs)
        tput.plot(cs, [runs[c]["output_throughput"] for c in cs], marker="o", label=tag)
        tpot.plot(cs, [runs[c]["median_tpot_ms"] for c in cs], marker="o", label=tag)
        for c, r in runs.items():
            print(f"| {tag} | {c} | {r['output_throughput']:.1f} | {r['median_ttft_ms']:.1f} | "
                  f"{r['median_tpot_ms']:.2f} | {r['p99_itl_ms']:.1f} |")
    for ax, what in ((tput, "output tok/s"), (tpot, "median TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(a.title)
    fig.tight_layout()
    fig.savefig(a.output, dpi=110)


if __name__ == "__main__":
    main()
