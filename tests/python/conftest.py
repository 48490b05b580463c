"""Shared helpers for the libkda Python tests: input generation and the SPEC.md section 4 metric."""

import ctypes
import os
import sys
import zlib

import ml_dtypes
import numpy as np
import pytest

import libkda

BF16 = np.dtype(ml_dtypes.bfloat16)


def _map_large_blocks():
    """After a large block is freed, glibc raises its mmap threshold (up to 32 MB). From then on,
    a loop that allocates and frees a few MB per step grows the heap instead of reusing it. The
    float64 reference recurrences at D = 256 do this: 2 GB of resident memory for 1024 tokens
    even under no_grad. Under KDA_LARGE_TESTS=1 that went past the 24 GB of this machine class.
    A fixed 1 MB threshold (M_MMAP_THRESHOLD = -3) maps such blocks and unmaps them on free. That
    costs page faults on every such block, so it is set for the large set only. With it,
    test_fla_cases.py's large set peaked at 8.0 GB in 635 s; without it, on the same code, at
    20.0 GB in 287 s."""
    if os.environ.get("KDA_LARGE_TESTS") and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)
        except (OSError, AttributeError):  # not glibc: its allocator has its own policy
            pass


_map_large_blocks()

# SPEC.md section 4 bounds for o and the final state.
BOUND = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 5e-3, BF16: 5e-3}


def metric(out, ref):
    """SPEC.md section 4: rel = rms(out - ref) / rms(ref), max abs error, finiteness."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, f"shape {out.shape} != reference shape {ref.shape}"
    finite = bool(np.isfinite(out).all())
    diff = out - ref
    rms_ref = float(np.sqrt(np.mean(ref * ref))) if ref.size else 0.0
    rms_diff = float(np.sqrt(np.mean(diff * diff))) if ref.size else 0.0
    rel = rms_diff / rms_ref if rms_ref > 0 else rms_diff
    max_abs = float(np.max(np.abs(diff))) if ref.size else 0.0
    return {"rel": rel, "max_abs": max_abs, "finite": finite, "rms_ref": rms_ref}


def dA_log_terms(g_raw, dt_bias, lower_bound, dg):
    """The terms whose sum over tokens and key channels is dA_log, from the raw gate and its
    gradient dg (both [..., HV, K], leading dims are tokens): dA_log = sum_tk dg_tk (d gamma /
    d A_log) / (d gamma / d g_raw). With z = g_raw + dt_bias, that ratio is z for the lower-bound
    gate (gamma = lb sigmoid(e^A_log z)) and softplus(z) / sigmoid(z) for the softplus gate
    (gamma = -e^A_log softplus(z)). Returns (tokens, HV, K) float64."""
    g = np.asarray(g_raw, np.float64)
    z = g.reshape(-1, *g.shape[-2:]) + np.asarray(dt_bias, np.float64).reshape(g.shape[-2:])
    ratio = z if lower_bound else np.logaddexp(0.0, z) * (1.0 + np.exp(-z))
    return np.asarray(dg, np.float64).reshape(z.shape) * ratio


def torch_rel(ref, out):
    """metric's rel of two torch tensors (SPEC.md section 4; absolute where ref is exactly 0)."""
    return metric(out.detach().double().numpy(), ref.detach().double().numpy())["rel"]


def assert_close(out, ref, bound, name="o"):
    """Asserts rel <= bound and all-finite; the failure message carries the whole metric."""
    m = metric(out, ref)
    msg = (f"{name}: rel={m['rel']:.3e} (bound {bound:.1e}) max_abs={m['max_abs']:.3e} "
           f"finite={m['finite']} rms_ref={m['rms_ref']:.3e}")
    print(msg)
    assert m["finite"] and m["rel"] <= bound, msg


def assert_bitwise(a, b, name="o"):
    assert a.dtype == b.dtype and a.shape == b.shape, f"{name}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    ua = np.ascontiguousarray(a).view(np.uint8)
    ub = np.ascontiguousarray(b).view(np.uint8)
    if not np.array_equal(ua, ub):
        m = metric(a.astype(np.float64), b.astype(np.float64))
        raise AssertionError(f"{name}: not bitwise equal (max_abs={m['max_abs']:.3e}, rel={m['rel']:.3e})")


def make_inputs(rng, B=1, T=64, H=2, HV=None, K=32, V=32, dtype=np.float32, gate="log",
                l2norm=False, beta_sigmoid=False, extreme=()):
    """FLA batch-first inputs. gate: "log" (log decay <= 0) or "raw" (the raw gate for
    use_gate_in_kernel). extreme: log-decay values (e.g. 0.0, -1000.0) planted at random
    positions, about 1 in 200 entries each. Without l2norm, q and k rows are unit-norm."""
    HV = H if HV is None else HV
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    if not l2norm:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        q /= np.linalg.norm(q, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, HV, V))
    if gate == "log":
        g = -np.exp(rng.normal(-2.5, 1.5, (B, T, HV, K)))
        flat = g.reshape(-1)
        for value in extreme:
            flat[rng.choice(flat.size, size=max(1, flat.size // 200), replace=False)] = value
    else:
        g = rng.standard_normal((B, T, HV, K))
    if beta_sigmoid:
        beta = rng.standard_normal((B, T, HV))
    else:
        beta = rng.uniform(0.0, 1.0, (B, T, HV))
    cast = lambda x: x.astype(dtype)
    return dict(q=cast(q), k=cast(k), v=cast(v), g=cast(g), beta=cast(beta))


@pytest.fixture
def rng(request):
    # A per-test seed, stable across runs and processes.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def poison_outputs(monkeypatch):
    """Fresh outputs start as NaN, so a value the library forgot to write shows up."""

    def alloc(shape, dtype):
        out = np.empty(shape, dtype=dtype)
        out[...] = np.nan
        return out

    monkeypatch.setattr(libkda, "_alloc", alloc)
