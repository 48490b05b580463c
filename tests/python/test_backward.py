"""The backward (SPEC.md section 2, chunk backward; section 3, saved-state and rematerialized
residuals) against the fp64 adjoint oracle, which is itself checked by finite differences."""

import numpy as np
import pytest
from conftest import BF16, BOUND, assert_bitwise, assert_close, make_inputs

import libkda

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
DTYPES = [F32, BF16, F16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
RESIDUALS = ["saved", "remat", "saved+v_new"]
GRADS = ["dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"]
INPUT_OF = {"dq": "q", "dk": "k", "dv": "v", "dg": "g", "dbeta": "beta"}


def grad_bound(dtype, name):
    """SPEC.md section 4 gradient bounds."""
    if dtype == F32:
        return 1e-4
    return 8e-3 if name in ("dq", "dk", "dv", "dh0") else 2e-2


def gate_kw(rng, gate, HV, K):
    """Options for a gate mode: "log" (log decay), "softplus" (raw gate, A_log + dt_bias),
    "lower_bound" (raw gate, lower_bound=-5, A_log + dt_bias)."""
    if gate == "log":
        return {}
    kw = dict(use_gate_in_kernel=True,
              A_log=np.log(rng.uniform(0.5, 4.0, HV)).astype(np.float32),
              dt_bias=(0.5 * rng.standard_normal((HV, K))).astype(np.float32))
    if gate == "lower_bound":
        kw["lower_bound"] = -5.0
    return kw


def cotangents(rng, x, dtype, final_shape=None):
    do = rng.standard_normal(x["v"].shape).astype(dtype)
    dht = None if final_shape is None else rng.standard_normal(final_shape).astype(np.float32)
    return do, dht


def check_vs_oracle(x, do, dht=None, residuals="saved", **kw):
    """Runs chunk_kda_fwd_bwd and the oracle; checks o, final_state and every gradient
    (presence, dtype, shape, SPEC.md 4 bound). Returns (result, oracle result)."""
    dtype = x["q"].dtype
    r = libkda.chunk_kda_fwd_bwd(**x, do=do, dht=dht, residuals=residuals, **kw)
    ref = libkda.naive_recurrent_kda_bwd(**x, do=do, dht=dht, residuals=residuals, **kw)
    assert_close(r["o"], ref["o"], BOUND[dtype], "o")
    if dht is not None or kw.get("output_final_state"):
        assert r["final_state"].dtype == np.float32
        assert_close(r["final_state"], ref["final_state"], BOUND[dtype], "final_state")
    else:
        assert r["final_state"] is None and ref["final_state"] is None
    for name in GRADS:
        if name == "dh0":
            given = kw.get("initial_state") is not None
        elif name in ("dA_log", "ddt_bias"):
            given = kw.get(name[1:]) is not None
        else:
            given = True
        if not given:
            assert r[name] is None and ref[name] is None, f"{name} should be None"
            continue
        want_dtype = x[INPUT_OF[name]].dtype if name in INPUT_OF else F32
        shape = (x[INPUT_OF[name]].shape if name in INPUT_OF else
                 kw["initial_state"].shape if name == "dh0" else kw[name[1:]].shape)
        assert r[name].dtype == want_dtype, f"{name}: dtype {r[name].dtype}, expected {want_dtype}"
        assert ref[name].dtype == np.float64, f"oracle {name}: dtype {ref[name].dtype}"
        assert r[name].shape == shape and ref[name].shape == shape, f"{name}: shape {r[name].shape}"
        assert_close(r[name], ref[name], grad_bound(dtype, name), name)
    return r, ref


def assert_same_grads(a, b, what):
    for name in ["o", "final_state"] + [n for n in GRADS if n in a or n in b]:
        if a[name] is None or b[name] is None:
            assert a[name] is None and b[name] is None, f"{what}: {name}"
        else:
            assert_bitwise(a[name], b[name], f"{what}: {name}")


# ---------------------------------------------------------------------------------------------
# Gradients vs the oracle, across dtypes, input transforms, shapes and options.


@pytest.mark.parametrize("residuals", RESIDUALS)
@pytest.mark.parametrize("gate", ["log", "softplus", "lower_bound"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gate_modes(rng, dtype, gate, residuals):
    HV, K = 2, 32
    x = make_inputs(rng, B=2, T=90, H=2, K=K, V=32, dtype=dtype, gate="raw" if gate != "log" else "log")
    do, dht = cotangents(rng, x, dtype, (2, HV, K, 32))
    h0 = rng.standard_normal((2, HV, K, 32)).astype(np.float32)
    check_vs_oracle(x, do, dht, residuals, initial_state=h0, **gate_kw(rng, gate, HV, K))


@pytest.mark.parametrize("residuals", RESIDUALS)
@pytest.mark.parametrize("l2norm", [False, True])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_qk_l2norm(rng, dtype, l2norm, residuals):
    # Without l2norm, make_inputs gives unit-norm q and k; with it, raw rows of any norm.
    x = make_inputs(rng, B=1, T=100, H=2, K=32, V=32, dtype=dtype, l2norm=l2norm)
    if l2norm:
        x["q"] = (x["q"].astype(np.float32) * 3.0).astype(dtype)
        x["k"] = (x["k"].astype(np.float32) * 5.0).astype(dtype)
    do, _ = cotangents(rng, x, dtype)
    check_vs_oracle(x, do, None, residuals, use_qk_l2norm_in_kernel=l2norm)


@pytest.mark.parametrize("residuals", RESIDUALS)
@pytest.mark.parametrize("allow_neg_eigval", [False, True])
def test_beta_sigmoid(rng, allow_neg_eigval, residuals):
    x = make_inputs(rng, B=2, T=80, H=2, K=32, V=32, beta_sigmoid=True)
    do, _ = cotangents(rng, x, F32)
    check_vs_oracle(x, do, None, residuals, use_beta_sigmoid_in_kernel=True,
                    allow_neg_eigval=allow_neg_eigval)


@pytest.mark.parametrize("residuals", RESIDUALS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grouped_heads_k_ne_v(rng, dtype, residuals):
    # H=2, HV=4: dq and dk sum over each group of two value heads. K=32, V=48.
    B, H, HV, K, V = 2, 2, 4, 32, 48
    x = make_inputs(rng, B=B, T=75, H=H, HV=HV, K=K, V=V, dtype=dtype, gate="raw", l2norm=True,
                    beta_sigmoid=True)
    do, dht = cotangents(rng, x, dtype, (B, HV, K, V))
    h0 = rng.standard_normal((B, HV, K, V)).astype(np.float32)
    check_vs_oracle(x, do, dht, residuals, initial_state=h0, use_qk_l2norm_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                    **gate_kw(rng, "lower_bound", HV, K))


@pytest.mark.parametrize("residuals", RESIDUALS)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_state_v_first(rng, dtype, residuals):
    B, HV, K, V = 2, 2, 32, 48
    x = make_inputs(rng, B=B, T=70, H=2, K=K, V=V, dtype=dtype)
    h0_k = rng.standard_normal((B, HV, K, V)).astype(np.float32)
    dht_k = rng.standard_normal((B, HV, K, V)).astype(np.float32)
    do, _ = cotangents(rng, x, dtype)
    vf = lambda s: np.ascontiguousarray(s.transpose(0, 1, 3, 2))
    r, _ = check_vs_oracle(x, do, vf(dht_k), residuals, initial_state=vf(h0_k), state_v_first=True)
    assert r["dh0"].shape == (B, HV, V, K) and r["final_state"].shape == (B, HV, V, K)
    # The same problem K-first: the same gradients, dh0 and final state transposed.
    rk = libkda.chunk_kda_fwd_bwd(**x, do=do, dht=dht_k, initial_state=h0_k, residuals=residuals)
    for name in ["o", "dq", "dk", "dv", "dg", "dbeta"]:
        assert_bitwise(r[name], rk[name], f"V-first vs K-first: {name}")
    assert_bitwise(vf(r["dh0"]), rk["dh0"], "V-first vs K-first: dh0")
    assert_bitwise(vf(r["final_state"]), rk["final_state"], "V-first vs K-first: final_state")


@pytest.mark.parametrize("residuals", RESIDUALS)
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_chunk_sizes_initial_state_dht(rng, chunk_size, residuals):
    B, HV, K, V = 1, 2, 32, 32
    x = make_inputs(rng, B=B, T=150, H=2, K=K, V=V, gate="raw")
    do, dht = cotangents(rng, x, F32, (B, HV, K, V))
    h0 = rng.standard_normal((B, HV, K, V)).astype(np.float32)
    check_vs_oracle(x, do, dht, residuals, initial_state=h0, chunk_size=chunk_size,
                    **gate_kw(rng, "softplus", HV, K))


def test_extreme_log_decay(rng):
    # g = 0 and g = -1000 (exact zeros after exp), SPEC.md section 2 numerical rules.
    x = make_inputs(rng, B=1, T=130, H=2, K=32, V=32, extreme=(0.0, -1000.0))
    do, dht = cotangents(rng, x, F32, (1, 2, 32, 32))
    h0 = rng.standard_normal((1, 2, 32, 32)).astype(np.float32)
    check_vs_oracle(x, do, dht, "saved", initial_state=h0)


def test_dht_only_and_output_final_state(rng):
    x = make_inputs(rng, B=1, T=40, H=1, K=16, V=16)
    do, dht = cotangents(rng, x, F32, (1, 1, 16, 16))
    # dht alone turns the final state on; output_final_state alone returns it with no dht.
    r, _ = check_vs_oracle(x, np.zeros_like(do), dht)
    assert np.all(r["dq"] == 0) and np.any(r["dk"] != 0)  # q only reaches o
    r, _ = check_vs_oracle(x, do, None, output_final_state=True)
    assert r["final_state"].shape == (1, 1, 16, 16)


# ---------------------------------------------------------------------------------------------
# Packed sequences.


@pytest.mark.parametrize("residuals", RESIDUALS)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_cu_seqlens(rng, dtype, residuals):
    # Boundaries off every chunk edge, an empty segment in the middle and one at the end.
    cu = np.array([0, 15, 15, 100, 171, 230, 230], dtype=np.int64)
    N, HV, K, V = 6, 4, 32, 32
    x = make_inputs(rng, B=1, T=230, H=2, HV=HV, K=K, V=V, dtype=dtype, gate="raw", l2norm=True)
    do, dht = cotangents(rng, x, dtype, (N, HV, K, V))
    h0 = rng.standard_normal((N, HV, K, V)).astype(np.float32)
    r, _ = check_vs_oracle(x, do, dht, residuals, cu_seqlens=cu, initial_state=h0, chunk_size=32,
                           use_qk_l2norm_in_kernel=True, **gate_kw(rng, "lower_bound", HV, K))
    # Empty segments: dh0 = dht.
    for n in (1, 5):
        np.testing.assert_array_equal(r["dh0"][n], dht[n])


@pytest.mark.parametrize("residuals", RESIDUALS)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_segment_ids_padding(rng, poison_outputs, dtype, residuals):
    # Fresh outputs (o, states, gradients) start as NaN: anything left unwritten shows up.
    B, T, H, HV, K, V, max_seg = 2, 160, 2, 4, 32, 32, 4
    ids = np.zeros((B, T), dtype=np.int32)
    ids[0, :37] = 1
    ids[0, 37:110] = 2
    ids[0, 110:141] = 3          # 19 padding tokens at the tail, slot 4 unused
    ids[1, :120] = 1
    ids[1, 120:] = 2             # no padding, slots 3 and 4 unused
    x = make_inputs(rng, B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype, gate="raw", beta_sigmoid=True)
    do, dht = cotangents(rng, x, dtype, (B, max_seg, HV, K, V))
    # Padding-token inputs are garbage (NaN, Inf) and must reach nothing (SPEC.md 4 isolation).
    for name, bad in zip(x, [np.nan, np.inf, np.nan, -np.inf, np.nan]):
        x[name][0, 141:] = bad
    do[0, 141:] = np.nan
    h0 = rng.standard_normal((B, max_seg, HV, K, V)).astype(np.float32)
    kw = dict(segment_ids=ids, max_num_segments=max_seg, initial_state=h0,
              use_beta_sigmoid_in_kernel=True, **gate_kw(rng, "softplus", HV, K))
    r, _ = check_vs_oracle(x, do, dht, residuals, **kw)
    # Padding tokens: every token gradient exactly 0 (and o too).
    for name in ["o", "dq", "dk", "dv", "dg", "dbeta"]:
        pad = r[name][0, 141:].astype(np.float32)
        assert np.all(pad == 0.0), f"{name}: padding-token gradient not 0: {pad[pad != 0][:5]}"
    # Unused slots: dh0 = dht.
    np.testing.assert_array_equal(r["dh0"][0, 3], dht[0, 3])
    np.testing.assert_array_equal(r["dh0"][1, 2:], dht[1, 2:])


@pytest.mark.parametrize("residuals", RESIDUALS)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_cu_seqlens_trailing_padding(rng, poison_outputs, dtype, residuals):
    # Tokens after cu_seqlens[-1] (FLA's graph-mode buffers) are padding: every gradient of them
    # exactly 0, whatever their inputs and cotangent; the rest bitwise those of the buffer cut
    # at cu_seqlens[-1], and within SPEC.md 4 of the oracle.
    cu = np.array([0, 37, 37, 110], dtype=np.int32)
    end, HV, K, V = 110, 4, 32, 32
    x = make_inputs(rng, B=1, T=160, H=2, HV=HV, K=K, V=V, dtype=dtype, gate="raw", beta_sigmoid=True)
    do, dht = cotangents(rng, x, dtype, (3, HV, K, V))
    for name, bad in zip(x, [np.nan, np.inf, np.nan, -np.inf, np.nan]):
        x[name][0, end:] = bad
    do[0, end:] = np.nan
    h0 = rng.standard_normal((3, HV, K, V)).astype(np.float32)
    kw = dict(initial_state=h0, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True,
              **gate_kw(rng, "lower_bound", HV, K))
    r = libkda.chunk_kda_fwd_bwd(**x, do=do, dht=dht, cu_seqlens=cu, residuals=residuals, **kw)
    for name in ["o", "dq", "dk", "dv", "dg", "dbeta"]:
        pad = r[name][0, end:].astype(np.float32)
        assert np.all(pad == 0.0), f"{name}: padding-token value not 0: {pad[pad != 0][:5]}"
    cut = {name: arr[:, :end] for name, arr in x.items()}
    rc, _ = check_vs_oracle(cut, do[:, :end], dht, residuals, cu_seqlens=cu, **kw)
    for name in ["o", "dq", "dk", "dv", "dg", "dbeta"]:
        assert_bitwise(r[name][:, :end], rc[name], name)
    for name in ["final_state", "dh0", "dA_log", "ddt_bias"]:
        assert_bitwise(r[name], rc[name], name)
    np.testing.assert_array_equal(r["dh0"][1], dht[1])  # the empty sequence: dh0 = dht


@pytest.mark.parametrize("residuals", RESIDUALS)
def test_packed_equals_separate_calls(rng, residuals):
    # Batch invariance (SPEC.md 4): each packed sequence's gradients are bitwise those of the
    # sequence run alone. dA_log and ddt_bias sum over all tokens, so only close.
    cu = np.array([0, 15, 100, 171, 240], dtype=np.int32)
    HV, K, V = 4, 32, 48
    x = make_inputs(rng, B=1, T=240, H=2, HV=HV, K=K, V=V, gate="raw", l2norm=True, beta_sigmoid=True)
    do, dht = cotangents(rng, x, F32, (4, HV, K, V))
    h0 = rng.standard_normal((4, HV, K, V)).astype(np.float32)
    kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, chunk_size=32,
              residuals=residuals, **gate_kw(rng, "lower_bound", HV, K))
    r = libkda.chunk_kda_fwd_bwd(**x, do=do, dht=dht, cu_seqlens=cu, initial_state=h0, **kw)
    dA_log = np.zeros(HV)
    ddt_bias = np.zeros((HV, K))
    for n in range(len(cu) - 1):
        a, b = cu[n], cu[n + 1]
        xs = {name: arr[:, a:b] for name, arr in x.items()}
        rn = libkda.chunk_kda_fwd_bwd(**xs, do=do[:, a:b], dht=dht[n:n + 1], initial_state=h0[n:n + 1], **kw)
        for name in ["o", "dq", "dk", "dv", "dg", "dbeta"]:
            assert_bitwise(r[name][:, a:b], rn[name], f"{name} of segment {n}")
        assert_bitwise(r["final_state"][n:n + 1], rn["final_state"], f"final_state of segment {n}")
        assert_bitwise(r["dh0"][n:n + 1], rn["dh0"], f"dh0 of segment {n}")
        dA_log += rn["dA_log"]
        ddt_bias += rn["ddt_bias"]
    assert_close(r["dA_log"], dA_log, 1e-6, "dA_log")
    assert_close(r["ddt_bias"], ddt_bias, 1e-6, "ddt_bias")


# ---------------------------------------------------------------------------------------------
# Residual policies and layouts.


@pytest.mark.parametrize("num_threads", [1, None], ids=["1thread", "allthreads"])
@pytest.mark.parametrize("path", ["fused", "staged"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_saved_equals_remat_bitwise(rng, dtype, path, num_threads):
    cu = np.array([0, 40, 40, 133, 200], dtype=np.int32)
    HV, K, V = 4, 32, 48
    x = make_inputs(rng, B=1, T=200, H=2, HV=HV, K=K, V=V, dtype=dtype, gate="raw", l2norm=True,
                    beta_sigmoid=True)
    do, dht = cotangents(rng, x, dtype, (4, HV, K, V))
    h0 = rng.standard_normal((4, HV, K, V)).astype(np.float32)
    kw = dict(cu_seqlens=cu, initial_state=h0, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              chunk_size=32, path=path, num_threads=num_threads, **gate_kw(rng, "softplus", HV, K))
    saved = libkda.chunk_kda_fwd_bwd(**x, do=do, dht=dht, residuals="saved", **kw)
    for other in ("remat", "saved+v_new", "remat+v_new"):
        r = libkda.chunk_kda_fwd_bwd(**x, do=do, dht=dht, residuals=other, **kw)
        assert_same_grads(saved, r, f"saved vs {other}")


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("residuals", RESIDUALS)
def test_saved_residual(rng, poison_outputs, monkeypatch, residuals, state_v_first):
    # "saved": the forward writes fp32 chunk_states [NC, HV, K, V] ([NC, HV, V, K] V-first), NC
    # counted segment by segment, and the backward reads exactly that buffer; "remat": none.
    seen = []
    backward = libkda._libkda.backward

    def spy(**kw):
        seen.append(kw["chunk_states"])
        return backward(**kw)

    monkeypatch.setattr(libkda._libkda, "backward", spy)
    cu = np.array([0, 15, 15, 100], dtype=np.int32)   # 1 + 0 + 3 chunks of 32
    HV, K, V = 2, 16, 24
    x = make_inputs(rng, B=1, T=100, H=1, HV=HV, K=K, V=V)
    do, _ = cotangents(rng, x, F32)
    h0 = rng.standard_normal((3, HV, K, V)).astype(np.float32)
    vf = (lambda s: s.swapaxes(-1, -2)) if state_v_first else (lambda s: s)
    r = libkda.chunk_kda_fwd_bwd(**x, do=do, cu_seqlens=cu, initial_state=np.ascontiguousarray(vf(h0)),
                                 chunk_size=32, residuals=residuals, state_v_first=state_v_first)
    assert len(seen) == 1
    if residuals == "remat":
        assert seen[0] is None
        return
    states, code = seen[0]
    assert code == "f32" and states.shape == (4,) + ((HV, V, K) if state_v_first else (HV, K, V))
    # The state entering each chunk is the oracle's final state of the segment's prefix.
    for c, (seg, start) in enumerate([(0, 0), (2, 15), (2, 47), (2, 79)]):
        xs = {n: a[:, cu[seg]:start] for n, a in x.items()}
        _, want = libkda.naive_recurrent_kda(**xs, initial_state=h0[seg:seg + 1], output_final_state=True)
        assert_close(vf(states[c]), want[0], 1e-5, f"chunk_states[{c}]")
    assert np.isfinite(r["dq"]).all()


@pytest.mark.parametrize("residuals", ["saved+v_new", "remat+v_new"])
def test_v_new_residual(rng, monkeypatch, residuals):
    # "+v_new": the forward also writes every token's delta v_new_t = beta_t (v_t - S~_t^T k_t)
    # (float32, o's shape; S~_t the state before token t, decayed by its gate) and the backward
    # reads that buffer. Checked here against deltas rebuilt from the oracle's prefix states.
    seen = []
    backward = libkda._libkda.backward

    def spy(**kw):
        seen.append((kw["chunk_states"], kw["v_new"]))
        return backward(**kw)

    monkeypatch.setattr(libkda._libkda, "backward", spy)
    cu = np.array([0, 15, 15, 100], dtype=np.int32)
    HV, K, V = 2, 16, 24
    x = make_inputs(rng, B=1, T=100, H=1, HV=HV, K=K, V=V)
    do, _ = cotangents(rng, x, F32)
    h0 = rng.standard_normal((3, HV, K, V)).astype(np.float32)
    libkda.chunk_kda_fwd_bwd(**x, do=do, cu_seqlens=cu, initial_state=h0, chunk_size=32, residuals=residuals)
    assert len(seen) == 1
    states, (v_new, code) = seen[0]
    assert (states is None) == residuals.startswith("remat")
    assert code == "f32" and v_new.shape == x["v"].shape
    for seg, t in [(0, 0), (0, 14), (2, 15), (2, 16), (2, 47), (2, 48), (2, 99)]:
        xs = {n: a[:, cu[seg]:t] for n, a in x.items()}
        _, S = libkda.naive_recurrent_kda(**xs, initial_state=h0[seg:seg + 1], output_final_state=True)
        S = np.exp(x["g"][0, t])[:, :, None] * S[0]  # (HV, K, V), decayed by token t's gate
        k = x["k"][0, t, 0]
        want = x["beta"][0, t][:, None] * (x["v"][0, t] - np.einsum("hkv,k->hv", S, k))
        assert_close(v_new[0, t], want, 1e-5, f"v_new at token {t}")


@pytest.mark.parametrize("residuals", RESIDUALS)
def test_head_first_views(rng, residuals):
    # Non-contiguous (head-first storage, batch-first view) inputs give the same bits.
    def head_first(a):
        perm = (2, 0, 1) if a.ndim == 3 else (2, 0, 1, 3)
        inv = np.argsort(perm)
        view = np.ascontiguousarray(a.transpose(perm)).transpose(inv)
        assert not view.flags.c_contiguous
        return view

    x = make_inputs(rng, B=2, T=70, H=2, HV=4, K=16, V=24, dtype=BF16)
    do, _ = cotangents(rng, x, BF16)
    r1 = libkda.chunk_kda_fwd_bwd(**x, do=do, residuals=residuals)
    r2 = libkda.chunk_kda_fwd_bwd(**{n: head_first(a) for n, a in x.items()}, do=head_first(do),
                                  residuals=residuals)
    assert_same_grads(r1, r2, "head-first views")


# ---------------------------------------------------------------------------------------------
# The oracle itself: central finite differences of naive_recurrent_kda in float64.


def _fd_case(rng, gate):
    B, T, H, HV, K, V = 1, 6, 1, 2, 3, 2
    x = dict(q=rng.standard_normal((B, T, H, K)), k=rng.standard_normal((B, T, H, K)),
             v=rng.standard_normal((B, T, HV, V)), g=rng.standard_normal((B, T, HV, K)),
             beta=rng.standard_normal((B, T, HV)))
    kw = dict(initial_state=rng.standard_normal((B, HV, K, V)), use_qk_l2norm_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, use_gate_in_kernel=True,
              A_log=np.log(rng.uniform(0.5, 2.0, HV)), dt_bias=0.5 * rng.standard_normal(HV * K))
    if gate == "lower_bound":
        kw["lower_bound"] = -5.0
    do = rng.standard_normal((B, T, HV, V))
    dht = rng.standard_normal((B, HV, K, V))
    return x, kw, do, dht


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_oracle_finite_differences(rng, gate):
    x, kw, do, dht = _fd_case(rng, gate)
    ref = libkda.naive_recurrent_kda_bwd(**x, do=do, dht=dht, **kw)
    assert all(ref[n].dtype == np.float64 for n in ["o", "final_state"] + GRADS)

    def loss(xx, kk):
        o, s = libkda.naive_recurrent_kda(**xx, output_final_state=True, **kk)
        return float(np.sum(o * do) + np.sum(s * dht))

    eps = 1e-6
    params = [(n, "x") for n in x] + [("initial_state", "kw"), ("A_log", "kw"), ("dt_bias", "kw")]
    grad_name = {"initial_state": "dh0", "A_log": "dA_log", "dt_bias": "ddt_bias"}
    for name, where in params:
        base = x[name] if where == "x" else kw[name]
        fd = np.zeros_like(base)
        for i in np.ndindex(base.shape):
            vals = []
            for sign in (1, -1):
                pert = base.copy()
                pert[i] += sign * eps
                xx = {**x, name: pert} if where == "x" else x
                kk = {**kw, name: pert} if where == "kw" else kw
                vals.append(loss(xx, kk))
            fd[i] = (vals[0] - vals[1]) / (2 * eps)
        g = ref[grad_name.get(name, "d" + name)]
        err = np.max(np.abs(g - fd)) / max(1.0, np.max(np.abs(fd)))
        print(f"{name}: max err {err:.2e}")
        assert err < 1e-7, f"oracle d{name} vs finite differences: {err:.3e}"


# ---------------------------------------------------------------------------------------------
# Errors.


@pytest.fixture
def small(rng):
    x = make_inputs(rng, B=1, T=40, H=2, K=16, V=16)
    return x, rng.standard_normal((1, 40, 2, 16)).astype(np.float32)


@pytest.mark.parametrize("fn", [libkda.chunk_kda_fwd_bwd, libkda.naive_recurrent_kda_bwd],
                         ids=["chunk", "oracle"])
def test_bad_residuals(small, fn):
    x, do = small
    for bad in ["rematerialize", "", None, 1]:
        with pytest.raises(ValueError, match=r"'residuals'") as info:
            fn(**x, do=do, residuals=bad)
        assert repr(bad) in str(info.value)


@pytest.mark.parametrize("fn", [libkda.chunk_kda_fwd_bwd, libkda.naive_recurrent_kda_bwd],
                         ids=["chunk", "oracle"])
@pytest.mark.parametrize("residuals", RESIDUALS)
def test_bad_do_and_dht(small, fn, residuals):
    x, do = small
    with pytest.raises(ValueError, match=r"'(d_o|do)'.*\[1, 40, 2, 16\]"):
        fn(**x, do=do[:, :39], residuals=residuals)
    with pytest.raises(ValueError, match=r"'(d_o|do)'"):
        fn(**x, do=do[..., :8], residuals=residuals)
    with pytest.raises(ValueError, match=r"'(d_o|do)'"):
        fn(**x, do=do.tolist(), residuals=residuals)
    with pytest.raises(ValueError, match=r"'(d_final_state|dht)'"):
        fn(**x, do=do, dht=np.zeros((1, 2, 16, 8), np.float32), residuals=residuals)


def test_bad_forward_input_names_it(small):
    x, do = small
    with pytest.raises(ValueError, match=r"'g'"):
        libkda.chunk_kda_fwd_bwd(**{**x, "g": x["g"][..., :8]}, do=do)
    with pytest.raises(ValueError, match=r"'A_log'"):
        libkda.chunk_kda_fwd_bwd(**x, do=do, A_log=np.zeros(2, np.float32))
