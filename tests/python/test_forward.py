"""Fixed-length chunked forward vs the fp64 oracle (SPEC.md sections 1, 2 and 4)."""

import numpy as np
import pytest
from conftest import BF16, BOUND, assert_bitwise, assert_close, make_inputs

import libkda

DTYPES = [np.dtype(np.float32), BF16, np.dtype(np.float16)]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


def both(inputs, **kw):
    o, s = libkda.chunk_kda(**inputs, output_final_state=True, **kw)
    ro, rs = libkda.naive_recurrent_kda(**inputs, output_final_state=True, **kw)
    return o, s, ro, rs


def check(inputs, bound, **kw):
    o, s, ro, rs = both(inputs, **kw)
    assert o.dtype == inputs["q"].dtype and s.dtype == np.float32
    assert ro.dtype == np.float64 and rs.dtype == np.float64
    assert_close(o, ro, bound, "o")
    assert_close(s, rs, bound, "final_state")
    return o, s


@pytest.mark.parametrize("path", ["fused", "staged"])
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fixed_length_vs_oracle(rng, dtype, chunk_size, path):
    # Grouped value heads (HV = 2 H), K != V, T not a multiple of any chunk size.
    x = make_inputs(rng, B=2, T=150, H=2, HV=4, K=32, V=48, dtype=dtype)
    o, _ = check(x, BOUND[dtype], chunk_size=chunk_size, path=path)
    assert o.shape == (2, 150, 4, 48)


@pytest.mark.parametrize("path", ["fused", "staged"])
@pytest.mark.parametrize(
    "gate",
    ["log", "softplus", "softplus_no_dt_bias", "softplus_dt_bias_2d", "lower_bound",
     "lower_bound_no_A_log"],
)
def test_gate_modes(rng, gate, path):
    HV, K = 4, 32
    x = make_inputs(rng, B=1, T=130, H=2, HV=HV, K=K, V=32, gate="log" if gate == "log" else "raw")
    kw = {}
    if gate != "log":
        kw["use_gate_in_kernel"] = True
        kw["A_log"] = np.log(rng.uniform(1.0, 16.0, HV)).astype(np.float32)
        kw["dt_bias"] = rng.standard_normal(HV * K).astype(np.float32)
    if gate == "softplus_no_dt_bias":
        del kw["dt_bias"]
    if gate == "softplus_dt_bias_2d":
        kw["dt_bias"] = kw["dt_bias"].reshape(HV, K)
    if gate.startswith("lower_bound"):
        kw["lower_bound"] = -5.0
    if gate == "lower_bound_no_A_log":
        del kw["A_log"]
    check(x, 1e-5, path=path, **kw)


@pytest.mark.parametrize("path", ["fused", "staged"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_zero_log_decay(rng, dtype, path):
    # g = 0 entries: no decay at all in that channel and step (SPEC.md 2, numerical rules).
    x = make_inputs(rng, B=1, T=150, H=2, K=32, V=32, dtype=dtype, extreme=(0.0,))
    check(x, BOUND[dtype], path=path)


@pytest.mark.parametrize("path", ["fused", "staged"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_very_negative_log_decay_finite(rng, dtype, path):
    # g = -1000 entries (exp underflows to exactly 0): never Inf/NaN, and 16-bit inputs meet
    # their bound. fp32 is held to 1e-4 here; see test_very_negative_log_decay_fp32_bound.
    x = make_inputs(rng, B=1, T=150, H=2, K=32, V=32, dtype=dtype, extreme=(0.0, -1000.0))
    check(x, max(BOUND[dtype], 1e-4), path=path)


@pytest.mark.parametrize("path", ["fused", "staged"])
def test_very_negative_log_decay_fp32_bound(path):
    for seed in range(4):
        x = make_inputs(np.random.default_rng(seed), B=1, T=128, H=1, K=32, V=32,
                        extreme=(-1000.0,))
        o, s = libkda.chunk_kda(**x, output_final_state=True, path=path)
        ro, rs = libkda.naive_recurrent_kda(**x, output_final_state=True)
        assert_close(o, ro, 1e-5, f"o (seed {seed})")
        assert_close(s, rs, 1e-5, f"final_state (seed {seed})")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("l2norm", [False, True])
def test_qk_l2norm(rng, l2norm, dtype):
    # Without l2norm the inputs carry unit-norm k; with it, raw q and k of any norm.
    x = make_inputs(rng, B=1, T=100, H=2, K=64, V=32, dtype=dtype, l2norm=l2norm)
    if l2norm:
        x["q"] = (x["q"].astype(np.float32) * 3.0).astype(dtype)
        x["k"] = (x["k"].astype(np.float32) * 5.0).astype(dtype)
    check(x, BOUND[dtype], use_qk_l2norm_in_kernel=l2norm)


@pytest.mark.parametrize("allow_neg_eigval", [False, True])
def test_beta_sigmoid(rng, allow_neg_eigval):
    x = make_inputs(rng, B=2, T=90, H=2, K=32, V=32, beta_sigmoid=True)
    check(x, 1e-5, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=allow_neg_eigval)


def test_all_transforms_together_bf16(rng):
    # The representative training configuration (SPEC.md 5), small: bf16, raw gate in kernel
    # with lower_bound=-5, qk l2norm in kernel, beta logits.
    HV, K = 4, 64
    x = make_inputs(rng, B=1, T=200, H=4, K=K, V=64, dtype=BF16, gate="raw", l2norm=True,
                    beta_sigmoid=True)
    check(x, 5e-3, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0,
          A_log=np.log(rng.uniform(1, 16, HV)).astype(np.float32),
          dt_bias=rng.standard_normal(HV * K).astype(np.float32),
          use_beta_sigmoid_in_kernel=True)


@pytest.mark.parametrize("path", ["fused", "staged"])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_initial_state_and_layout(rng, state_v_first, path):
    B, HV, K, V = 2, 2, 32, 48
    x = make_inputs(rng, B=B, T=70, H=2, K=K, V=V)
    h0_kfirst = rng.standard_normal((B, HV, K, V)).astype(np.float32)
    h0 = np.ascontiguousarray(h0_kfirst.transpose(0, 1, 3, 2)) if state_v_first else h0_kfirst
    o, s = check(x, 1e-5, initial_state=h0, state_v_first=state_v_first, path=path)
    assert s.shape == ((B, HV, V, K) if state_v_first else (B, HV, K, V))
    # The same problem in the other layout gives the same numbers, transposed.
    o2, s2 = libkda.chunk_kda(**x, initial_state=h0_kfirst, output_final_state=True, path=path)
    assert_bitwise(o, o2, "o")
    assert_bitwise(s.transpose(0, 1, 3, 2) if state_v_first else s, s2, "final_state")


@pytest.mark.parametrize("h0_dtype", [np.float16, BF16], ids=["fp16", "bf16"])
def test_initial_state_dtypes(rng, h0_dtype):
    x = make_inputs(rng, B=1, T=40, H=2, K=16, V=16)
    h0 = rng.standard_normal((1, 2, 16, 16)).astype(h0_dtype)
    check(x, 1e-5, initial_state=h0)


def test_explicit_scale(rng):
    x = make_inputs(rng, B=1, T=50, H=2, K=32, V=32)
    o, _ = check(x, 1e-5, scale=0.37)
    o_default, _ = libkda.chunk_kda(**x)
    o_explicit, _ = libkda.chunk_kda(**x, scale=32 ** -0.5)
    assert_close(o_default, o_explicit, 1e-6)


def test_final_state_only_when_requested(rng):
    x = make_inputs(rng, B=1, T=20, H=1, K=8, V=8)
    for fn in (libkda.chunk_kda, libkda.naive_recurrent_kda):
        o, s = fn(**x)
        assert s is None and o.shape == (1, 20, 1, 8)
        o, s = fn(**x, output_final_state=False)
        assert s is None
        o, s = fn(**x, output_final_state=True)
        assert s is not None and s.shape == (1, 1, 8, 8)


def test_fused_vs_staged_and_threads(rng):
    x = make_inputs(rng, B=2, T=200, H=2, K=32, V=32)
    o1, s1 = libkda.chunk_kda(**x, output_final_state=True, path="fused", num_threads=1)
    o2, s2 = libkda.chunk_kda(**x, output_final_state=True, path="fused", num_threads=None)
    assert_bitwise(o1, o2)
    assert_bitwise(s1, s2, "final_state")
    o3, s3 = libkda.chunk_kda(**x, output_final_state=True, path="staged")
    assert_close(o3, o1, 1e-5)
    assert_close(s3, s1, 1e-5, "final_state")


def test_long_sequence(rng):
    # The one T = 1000 case: many chunks, state carried across all of them.
    x = make_inputs(rng, B=1, T=1000, H=2, K=64, V=64, dtype=BF16)
    check(x, 5e-3)


def test_oracle_accepts_float64(rng):
    x = make_inputs(rng, B=1, T=30, H=1, K=8, V=8, dtype=np.float64)
    o, s = libkda.naive_recurrent_kda(**x, output_final_state=True)
    o32, s32 = libkda.naive_recurrent_kda(**{n: a.astype(np.float32) for n, a in x.items()},
                                          output_final_state=True)
    assert_close(o32, o, 1e-6)


def test_empty_sequence(rng):
    x = make_inputs(rng, B=1, T=0, H=2, K=8, V=8)
    h0 = rng.standard_normal((1, 2, 8, 8)).astype(np.float32)
    o, s = libkda.chunk_kda(**x, initial_state=h0, output_final_state=True)
    assert o.shape == (1, 0, 2, 8)
    np.testing.assert_array_equal(s, h0)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_bf16_dot_products_option(rng, chunk_size):
    """bf16_dot_products=False keeps the state products in fp32: at chunk size 16 the fused path
    then computes exactly what the staged path (always fp32 products) does. Both settings stay
    within the bf16 bound of the oracle."""
    x = make_inputs(rng, B=1, T=150, H=2, HV=4, K=32, V=48, dtype=BF16)
    ref_o, ref_s = libkda.naive_recurrent_kda(**x, output_final_state=True)
    for bf16_products in (True, False):
        o, s = libkda.chunk_kda(**x, output_final_state=True, chunk_size=chunk_size,
                                bf16_dot_products=bf16_products)
        assert_close(o, ref_o, BOUND[BF16])
        assert_close(s, ref_s, BOUND[BF16], "final_state")
    if chunk_size == 16:
        o_f, s_f = libkda.chunk_kda(**x, output_final_state=True, chunk_size=16, bf16_dot_products=False)
        o_s, s_s = libkda.chunk_kda(**x, output_final_state=True, chunk_size=16, path="staged")
        assert_bitwise(o_f, o_s)
        assert_bitwise(s_f, s_s, "final_state")


@pytest.mark.parametrize("path", ["fused", "staged"])
@pytest.mark.parametrize("cuts", [(64, 128), (37, 100, 101), (1,)], ids=["aligned", "unaligned", "one-token"])
def test_prefill_continues_across_calls(rng, cuts, path):
    """A sequence run in pieces, each call starting from the state the previous one ended on,
    gives the whole run's outputs and final state (to fp32 rounding: the chunk boundaries move)
    and stays within the oracle bound; pieces of one token included."""
    T = 150
    x = make_inputs(rng, B=2, T=T, H=2, HV=4, K=32, V=48)
    h0 = rng.standard_normal((2, 4, 32, 48)).astype(np.float32)
    whole_o, whole_s = libkda.chunk_kda(**x, initial_state=h0, output_final_state=True, path=path)
    bounds = (0, *cuts, T)
    state, outs = h0, []
    for a, b in zip(bounds[:-1], bounds[1:]):
        piece = {n: arr[:, a:b] for n, arr in x.items()}
        o, state = libkda.chunk_kda(**piece, initial_state=state, output_final_state=True, path=path)
        outs.append(o)
    o = np.concatenate(outs, axis=1)
    assert_close(o, whole_o, 1e-5, "o")
    assert_close(state, whole_s, 1e-5, "final_state")
    ro, rs = libkda.naive_recurrent_kda(**x, initial_state=h0, output_final_state=True)
    assert_close(o, ro, BOUND[np.dtype(np.float32)], "o vs oracle")
    assert_close(state, rs, BOUND[np.dtype(np.float32)], "final_state vs oracle")
