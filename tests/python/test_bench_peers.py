"""The main job's peer comparison (bench/peers.py, run by scripts/bench.sh) runs and reports:
one decode workload, one timed call, its JSON read back by bench/report.py; and the torch
per-call overhead script (bench/torch_overhead.py) still calls the bindings as they are. Timings
are not checked (performance lives in benchmarks); that each row is there and well formed is."""

import json
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def test_peers_bench_writes_a_row_per_implementation_and_report_reads_it(tmp_path):
    out = tmp_path / "peers.json"
    run = subprocess.run([sys.executable, str(BENCH / "peers.py"), "--iters", "1", "--workloads", "decode",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| decode: N=64 T=1 H=32" in run.stdout, run.stdout
    records = json.loads(out.read_text())
    assert [r["path"] for r in records] == ["libkda", "fla-naive-recurrent"]
    for r in records:
        assert r["suite"] == "peers" and r["median_ms"] > 0 and r["min_ms"] <= r["median_ms"] <= r["max_ms"], r
        assert r["peak_bytes"] >= 0, r
    report = subprocess.run([sys.executable, str(BENCH / "report.py"), str(out), "--out", str(tmp_path / "report")],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    text = (tmp_path / "report.md").read_text()
    assert "### peers (bench/peers.py)" in text and "fla-naive-recurrent" in text, text


def test_peers_bench_rejects_an_unknown_workload():
    run = subprocess.run([sys.executable, str(BENCH / "peers.py"), "--workloads", "prefill"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "unknown workload 'prefill'" in run.stderr, run.stderr


def test_torch_overhead_bench_times_every_path():
    """bench/torch_overhead.py calls the raw bindings with hand-built descriptor tuples; when
    raw_forward gained the v_new descriptor the script broke unnoticed until a later run."""
    pytest.importorskip("torch")
    run = subprocess.run([sys.executable, str(BENCH / "torch_overhead.py"), "--runs", "1", "--number", "20"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for path in ("raw_decode (prebuilt descriptors)", "libkda.torch.fused_recurrent_kda_fwd",
                 "torch.ops.libkda.decode (dispatcher)", "numpy libkda.kda_decode",
                 "raw_forward (prebuilt descriptors)", "libkda.torch.chunk_kda"):
        assert path in run.stdout and " us " in run.stdout, run.stdout
