"""Per-call overhead of the libkda.torch ops for decode-sized calls, against the raw C++ binding
(docs/PYTHON.md, "Zero copy and per-call overhead"). Run after `pip install .` with torch:

    python3 bench/torch_overhead.py [--runs 5] [--number 2000]

Prints, per path, the best per-call time (minimum over runs of the best of 9 timeit loops of
--number calls) in microseconds and the difference to the raw call.
"""

import argparse
import timeit

import torch

import libkda
import libkda.torch as kt
from libkda import _libkda


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--number", type=int, default=2000, help="calls per timeit loop")
    args = ap.parse_args()
    torch.manual_seed(0)
    N, H, K, V, S = 1, 1, 16, 16, 4
    q = torch.randn(N, 1, H, K)
    k = torch.nn.functional.normalize(torch.randn(N, 1, H, K), dim=-1)
    v = torch.randn(N, 1, H, V)
    g = -torch.rand(N, 1, H, K)
    beta = torch.rand(N, 1, H)
    pool = torch.randn(S, H, K, V)
    idx = torch.tensor([2] * N, dtype=torch.int32)
    o = torch.empty(N, 1, H, V)
    d, nan = kt._desc, float("nan")
    descs = (d(q), d(k), d(v), d(g), d(beta), None, None, d(pool), d(idx), None, d(o))
    # raw_forward's tensors: q k v g beta A_log dt_bias cu_seqlens segment_ids initial_state
    # initial_state_indices o final_state chunk_states v_new (python/src/raw.cpp)
    fdescs = (d(q), d(k), d(v), d(g), d(beta), None, None, None, None, None, None, d(o), None, None, None)
    arrays = [x.numpy() for x in (q, k, v, g, beta, pool, idx)]

    def desc_alloc_raw():
        out = torch.empty(N, 1, H, V)  # kept alive for the call: the descriptor holds a raw pointer
        _libkda.raw_decode((d(q), d(k), d(v), d(g), d(beta), None, None, d(pool), d(idx), None, d(out)),
                           nan, nan, 0, 0)

    paths = {
        "raw_decode (prebuilt descriptors)": lambda: _libkda.raw_decode(descs, nan, nan, 0, 0),
        "descriptors + empty + raw_decode": desc_alloc_raw,
        "libkda.torch.fused_recurrent_kda_fwd": lambda: kt.fused_recurrent_kda_fwd(
            q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx),
        "torch.ops.libkda.decode (dispatcher)": lambda: torch.ops.libkda.decode.default(
            q, k, v, g, beta, None, None, pool, idx, None, None, None, 0),
        "numpy libkda.kda_decode": lambda: libkda.kda_decode(*arrays),
        "raw_forward (prebuilt descriptors)": lambda: _libkda.raw_forward(0, fdescs, 0, nan, nan, 0, 64, 0, 0),
        "libkda.torch.chunk_kda": lambda: kt.chunk_kda(q, k, v, g, beta),
    }
    best = {}
    for _ in range(args.runs):
        for name, fn in paths.items():
            for _ in range(300):
                fn()
            t = min(timeit.repeat(fn, number=args.number, repeat=9)) / args.number * 1e6
            best[name] = min(best.get(name, t), t)
    for name, t in best.items():
        base = best["raw_forward (prebuilt descriptors)" if "chunk" in name or "forward" in name
                    else "raw_decode (prebuilt descriptors)"]
        print(f"{name:40s} {t:7.2f} us   (+{t - base:5.2f} us)")


if __name__ == "__main__":
    main()
