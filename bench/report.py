#!/usr/bin/env python3
"""Turns one or more kda-bench (and bench/peers.py) JSON files into a markdown table and PNG plots.

    python3 bench/report.py bench-results/*.json --out bench-results/report

writes report.md (every record, one table per suite, plus the machine limits of each file) and,
when the files hold the scaling suite, scaling.png (latency and time per token vs T, fused vs
staged). Plots need matplotlib (`pip install matplotlib`); without it only the table is written.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections import defaultdict


def load(paths: list[str]) -> list[dict]:
    records = []
    for p in paths:
        with open(p) as f:
            for r in json.load(f):
                r["file"] = pathlib.Path(p).name
                records.append(r)
    return records


def fmt_rate(r: dict) -> str:
    if r.get("gbps"):
        side = r.get("side_by_side_stream_gbps", 0)
        side_pct = f"; {100 * r['gbps'] / side:.0f}% of the stream beside it" if side else ""
        return f"{r['gbps']:.1f} GB/s ({r.get('pct_of_limit', 0):.0f}%{side_pct})"
    side_ms = r.get("side_by_side_forward_ms", 0)
    side = f"; {r['median_ms'] / side_ms:.2f}x the forward timed beside it" if side_ms else ""
    return f"{r.get('gflops', 0):.1f} GFLOP/s ({r.get('pct_of_limit', 0):.0f}%{side})"


def peers_table(records: list[dict]) -> list[str]:
    """bench/peers.py's records: libkda next to FLA's CPU-runnable implementations."""
    lines = ["", "### peers (bench/peers.py)", "",
             "| workload | implementation | median ms | min ms | max ms | peak MB | libkda faster by |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in records:
        faster = "-" if r["path"] == "libkda" else f"{r['libkda_speedup']:.1f}x"
        lines.append(f"| {r['shape']} | {r['path']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['max_ms']:.2f} | "
                     f"{r['peak_bytes'] / 2**20:.1f} | {faster} |")
    return lines


def table(records: list[dict]) -> str:
    peers = [r for r in records if r["suite"] == "peers"]
    records = [r for r in records if r["suite"] != "peers"]
    lines = []
    limits = {(r["file"], json.dumps(r.get("limits", {}), sort_keys=True)) for r in records}
    for file, lim in sorted(limits):
        l = json.loads(lim)
        lines.append(f"- `{file}`: fp32 FMA {l.get('fp32_fma_gflops', 0):.1f} GFLOP/s, bf16 dot "
                     f"{l.get('bf16_dot_gflops', 0):.1f} GFLOP/s, memory {l.get('bandwidth_gbps', 0):.1f} GB/s")
    by_suite = defaultdict(list)
    for r in records:
        by_suite[r["suite"]].append(r)
    for suite, rs in by_suite.items():
        lines += ["", f"### {suite}", "",
                  "| path | shape | dtype | median ms | min ms | max ms | rate (% of limit) | peak MB | residual MB | speed-up |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rs:
            sp = f"{r['speedup_vs_baseline']:.2f}x" if r.get("speedup_vs_baseline") else "-"
            lines.append(f"| {r['path']} | {r['shape']} | {r['dtype']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | "
                         f"{r['max_ms']:.2f} | {fmt_rate(r)} | {r['peak_bytes'] / 2**20:.1f} | "
                         f"{r.get('residual_bytes', 0) / 2**20:.1f} | {sp} |")
    if peers:
        lines += peers_table(peers)
    return "\n".join(lines) + "\n"


def plot(records: list[dict], out: pathlib.Path) -> bool:
    scaling = [r for r in records if r["suite"] == "scaling" and r.get("tokens")]
    if not scaling:
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report.py: matplotlib is not installed; wrote the table only", file=sys.stderr)
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for path in sorted({r["path"] for r in scaling}):
        rs = sorted((r for r in scaling if r["path"] == path), key=lambda r: r["tokens"])
        t = [r["tokens"] for r in rs]
        ax1.plot(t, [r["median_ms"] for r in rs], marker="o", label=path)
        ax2.plot(t, [1e3 * r["median_ms"] / r["tokens"] for r in rs], marker="o", label=path)
    for ax, ylabel in ((ax1, "median latency (ms)"), (ax2, "time per token (us)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax1.set_yscale("log")
    shape = scaling[0]["shape"].split(" T=")[0]
    fig.suptitle(f"KDA forward vs T ({scaling[0]['dtype']}, {shape}, H/K/V as in the records)")
    fig.tight_layout()
    fig.savefig(out.with_name("scaling.png"), dpi=110)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="kda-bench --json output files")
    ap.add_argument("--out", default="bench-results/report", help="output prefix (default bench-results/report)")
    args = ap.parse_args()
    records = load(args.json)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table(records))
    print(f"wrote {out.with_suffix('.md')}")
    if plot(records, out):
        print(f"wrote {out.with_name('scaling.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
