#!/usr/bin/env python3
"""libkda next to the peers that run on this machine, in one run: FLA's own CPU-runnable KDA
implementations from its `fla-core` package (PyPI), called as a FLA user on a CPU would.

- `fla naive_recurrent_kda`: FLA's token-by-token torch recurrence (the algorithm of the native
  CPU peers, ggml's and ik_llama.cpp's operators, in torch);
- `fla naive_chunk_kda`: FLA's chunked torch reference (the chunk form libkda computes);
- `libkda`: libkda.torch (FLA's `chunk_kda` / vLLM's `fused_recurrent_kda` signatures) on the
  fused CPU kernels.
FLA's Triton kernels (chunk_kda, fused_recurrent_kda) need a GPU and are not in this table.

Workloads (SPEC.md section 5): the small training shape (B=1, H=8, T=1024, K=V=128, bf16, raw
gate in kernel with lower_bound=-5, qk l2norm) forward and forward + backward, and a decode batch
(64 sequences x 32 heads, one token, fp32 state pool updated in place). The peers get the same
computation: F.normalize on q and k and FLA's `naive_kda_lowerbound_gate` before the reference,
and for decode the new states copied back into the pool.

Each (workload, implementation) runs in two fresh processes. One measures the peak memory of a
single call above what the process held before it: Linux VmHWM after resetting it through
/proc/self/clear_refs, with glibc told to serve every block of 64 KB or more by mmap
(MALLOC_MMAP_THRESHOLD_) so that memory freed while building the inputs cannot be reused
unseen. The other, with the default allocator, times one warm-up and --iters calls (median, min,
max). Ratios are libkda's speed-up over each peer in the same run.

`--workloads forward-representative` adds SPEC.md's representative shape (B=1, H=32, T=8192) for
the forward alone (FLA's references then take seconds a call; the issue's ik_llama.cpp figure,
about 350 ms, is at this shape). Forward + backward at that shape would need tens of GB for the
autograd graph of FLA's recurrence, so it is not offered.

usage: python3 bench/peers.py [--iters N] [--json FILE] [--workloads forward,train,decode,forward-representative]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

from report import peers_table  # bench/report.py, beside this script

# (sequences N, tokens T, heads H) of each workload; K = V = 128 throughout.
WORKLOAD_SHAPES = {"forward": (1, 1024, 8), "train": (1, 1024, 8), "decode": (64, 1, 32),
                   "forward-representative": (1, 8192, 32)}
WORKLOADS = tuple(WORKLOAD_SHAPES)
DEFAULT_WORKLOADS = "forward,train,decode"
IMPLS = ("libkda", "fla-naive-chunk", "fla-naive-recurrent")


def status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def build(workload, impl):
    """Inputs and a zero-argument call for one (workload, implementation)."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla: "Triton is not supported on current platform, roll back to CPU"
        from fla.ops.kda.gate import naive_kda_lowerbound_gate
        from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

    import libkda.torch as kt

    F = torch.nn.functional
    gen = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16
    lower_bound = -5.0
    (N, T, H), K, V = WORKLOAD_SHAPES[workload], 128, 128

    def rnd(*shape, dtype=bf16):
        return torch.randn(*shape, generator=gen).to(dtype)

    q, k, v, g = rnd(N, T, H, K), rnd(N, T, H, K), rnd(N, T, H, V), rnd(N, T, H, K)
    beta = torch.rand(N, T, H, generator=gen).to(bf16)
    A_log = torch.rand(H, generator=gen) * 2 - 1
    dt_bias = torch.randn(H * K, generator=gen) * 0.5
    state = torch.randn(N, H, K, V, generator=gen) * 0.1  # fp32

    def peer_inputs(q, k, g):
        return F.normalize(q.float(), dim=-1), F.normalize(k.float(), dim=-1), naive_kda_lowerbound_gate(
            g, A_log, dt_bias, lower_bound=lower_bound)

    def forward(q, k, v, g, beta, A_log, dt_bias, state):
        if impl == "libkda":
            return kt.chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=state,
                                output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                lower_bound=lower_bound, safe_gate=True)
        qn, kn, decay = peer_inputs(q, k, g)
        ref = naive_chunk_kda if impl == "fla-naive-chunk" else naive_recurrent_kda
        return ref(qn, kn, v, decay, beta, initial_state=state, output_final_state=True)

    if workload.startswith("forward"):
        def call():
            with torch.no_grad():
                forward(q, k, v, g, beta, A_log, dt_bias, state)
        return call

    if workload == "train":
        do = rnd(N, T, H, V)
        dht = torch.randn(N, H, K, V, generator=gen)
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta, A_log, dt_bias, state)]

        def call():
            for t in leaves:
                t.grad = None
            o, s = forward(*leaves)
            torch.autograd.backward([o, s], [do, dht])
        return call

    # decode: one token for each of N sequences against an fp32 pool, updated in place
    pool = state.clone()
    slots = torch.arange(N, dtype=torch.int32)
    if impl == "libkda":
        def call():
            kt.fused_recurrent_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=lower_bound,
                                   ssm_state_indices=slots, inplace_final_state=True)
        return call

    def call():
        with torch.no_grad():
            _, new = forward(q, k, v, g, beta, A_log, dt_bias, pool)
            pool.copy_(new)
    return call


def run_one(workload, impl, mode, iters):
    """In this (fresh) process: one call's peak memory (mode "memory") or the timed calls."""
    call = build(workload, impl)
    if mode == "memory":
        import ctypes
        import gc

        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        before = status_kb("VmRSS")
        reset_peak_rss()
        call()
        return {"peak_extra_mb": (status_kb("VmHWM") - before) / 1024.0}
    call()  # warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "iters": iters}


def child(workload, impl, mode, iters):
    env = dict(os.environ)
    if mode == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", workload, impl, mode, "--iters",
                          str(iters)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        raise RuntimeError(f"peers.py: {workload} / {impl} ({mode}) failed (exit {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def shape_of(workload):
    N, T, H = WORKLOAD_SHAPES[workload]
    if workload == "decode":
        return f"N={N} T={T} H={H} K=V=128 bf16, fp32 pool in place"
    return f"B={N} T={T} H={H} K=V=128 bf16, gate in kernel (lower_bound=-5), qk l2norm" + (
        ", fwd+bwd" if workload == "train" else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--workloads", default=DEFAULT_WORKLOADS)
    ap.add_argument("--one", nargs=3, metavar=("WORKLOAD", "IMPL", "MODE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.iters < 1:
        ap.error(f"--iters: expected at least 1, got {a.iters}")
    if a.one:
        print(json.dumps(run_one(*a.one, a.iters)))
        return 0
    workloads = [w for w in a.workloads.split(",") if w]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"--workloads: unknown workload {w!r} (expected some of {', '.join(WORKLOADS)})")
    records = []
    for w in workloads:
        for impl in IMPLS:
            if w == "decode" and impl == "fla-naive-chunk":
                continue  # FLA's chunk reference asserts T % 64 == 0: it has no decode
            print(f"[peers] {w} {impl} ...", file=sys.stderr, flush=True)
            try:
                r = {"workload": w, "impl": impl, **child(w, impl, "memory", 1), **child(w, impl, "time", a.iters)}
            except RuntimeError as e:
                print(e, file=sys.stderr)
                return 1
            records.append(r)
    ours = {r["workload"]: r["median_ms"] for r in records if r["impl"] == "libkda"}
    # kda-bench's record keys where they apply, so bench/report.py reads both
    keep = [{"suite": "peers", "path": r["impl"], "shape": f"{r['workload']}: {shape_of(r['workload'])}",
             "dtype": "bf16", "median_ms": r["median_ms"], "min_ms": r["min_ms"], "max_ms": r["max_ms"],
             "peak_bytes": int(r["peak_extra_mb"] * 2**20), "iters": r["iters"],
             "libkda_speedup": r["median_ms"] / ours[r["workload"]], "threads": os.cpu_count()} for r in records]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(keep, f, indent=1)
    print(f"\nlibkda against FLA's CPU-runnable implementations (fla-core), {os.cpu_count()} CPUs, "
          f"median of {a.iters} after a warm-up; peak = memory one call adds above its inputs")
    print("\n".join(peers_table(keep)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
