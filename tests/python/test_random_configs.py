"""Randomized configurations against the fp64 oracles: the fused forward + backward (both
residual policies) and the pool decode, over K, V, heads, T, chunk size, dtype, gate mode,
l2norm, beta sigmoid and packed sequences drawn at random. A fixed seed per case, so a failure
names a reproducible configuration. A small set runs in CI; KDA_LARGE_TESTS=1 runs 150 of each."""
import os

import numpy as np
import pytest
from conftest import BF16, dA_log_terms, make_inputs, metric

import libkda

COUNT = 150 if os.environ.get("KDA_LARGE_TESTS") else 12
# SPEC.md section 4 gradient bounds (the gate's chain and dA_log/ddt_bias sums: 2.5x).
GRAD_BOUND = {np.dtype(np.float32): 1e-4, np.dtype(np.float16): 8e-3, BF16: 8e-3}
OUT_BOUND = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 5e-3, BF16: 5e-3}


def training_config(seed):
    rng = np.random.default_rng(1000 + seed)
    c = dict(K=int(rng.choice([8, 16, 24, 32, 40, 64, 100, 128])), V=int(rng.choice([8, 16, 20, 32, 48, 64, 128])),
             H=int(rng.choice([1, 2])), T=int(rng.integers(1, 200)), chunk=int(rng.choice([16, 32, 64])),
             dtype=[np.dtype(np.float32), BF16, np.dtype(np.float16)][int(rng.integers(0, 3))],
             gate=str(rng.choice(["log", "raw"])), l2norm=bool(rng.integers(0, 2)),
             beta_sigmoid=bool(rng.integers(0, 2)), lower_bound=bool(rng.integers(0, 2)))
    c["HV"] = c["H"] * int(rng.choice([1, 2]))
    c["varlen"] = bool(rng.integers(0, 2)) and c["T"] > 3
    return c, rng


def as_oracle(x):
    return x if x.dtype == np.float32 else np.asarray(x, np.float64)


def training_case(seed):
    """The configuration of `seed`, its inputs, options, initial state, cotangents and the fp64
    adjoint's result."""
    c, rng = training_config(seed)
    x = make_inputs(rng, B=1, T=c["T"], H=c["H"], HV=c["HV"], K=c["K"], V=c["V"], dtype=c["dtype"], gate=c["gate"],
                    l2norm=c["l2norm"], beta_sigmoid=c["beta_sigmoid"])
    opts = dict(use_qk_l2norm_in_kernel=c["l2norm"], use_beta_sigmoid_in_kernel=c["beta_sigmoid"],
                chunk_size=c["chunk"])
    if c["gate"] == "raw":
        opts.update(use_gate_in_kernel=True, A_log=rng.uniform(0, 1, c["HV"]).astype(np.float32),
                    dt_bias=rng.uniform(-0.5, 0.5, c["HV"] * c["K"]).astype(np.float32))
        if c["lower_bound"]:
            opts["lower_bound"] = -5.0
    n = 1
    if c["varlen"]:
        cuts = np.sort(rng.choice(np.arange(1, c["T"]), size=min(3, c["T"] - 1), replace=False))
        opts["cu_seqlens"] = np.concatenate([[0], cuts, [c["T"]]]).astype(np.int64)
        n = len(opts["cu_seqlens"]) - 1
    h0 = (rng.standard_normal((n, c["HV"], c["K"], c["V"])) * 0.1).astype(np.float32)
    do = rng.standard_normal((1, c["T"], c["HV"], c["V"])).astype(c["dtype"])
    dht = (rng.standard_normal(h0.shape) * 0.1).astype(np.float32)
    ref = libkda.naive_recurrent_kda_bwd(**{k: as_oracle(a) for k, a in x.items()}, do=as_oracle(do), dht=dht,
                                         initial_state=h0, **opts)
    return c, x, opts, h0, do, dht, ref


@pytest.mark.parametrize("seed", range(COUNT))
def test_forward_backward_matches_oracle(seed):
    c, x, opts, h0, do, dht, ref = training_case(seed)
    for residuals in ("saved", "remat"):
        out = libkda.chunk_kda_fwd_bwd(**x, do=do, dht=dht, initial_state=h0, output_final_state=True,
                                       residuals=residuals, **opts)
        for name in ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"):
            if ref.get(name) is None:
                assert out.get(name) is None, name
                continue
            if name in ("o", "final_state"):
                bound = OUT_BOUND[c["dtype"]]
            else:
                bound = GRAD_BOUND[c["dtype"]] * (2.5 if name in ("dg", "dA_log", "ddt_bias") else 1.0)
            m = metric(out[name], ref[name])
            assert m["finite"] and m["rel"] <= bound, f"{residuals} {name}: rel={m['rel']:.3e} (bound {bound}) | {c}"


# The configurations among seeds 150-5149 (beyond the large set) that miss SPEC.md's dA_log bound
# with bf16 products: 13 of the 852 bf16 raw-gate ones, every one a strongly cancelling sum
# (sum |terms| / |dA_log| of 185 to 5663 in some head; the bf16 error 3e-5 to 9e-4 of sum |terms|).
ILL_CONDITIONED = [331, 1132, 1141, 1472, 1566, 2136, 2442, 2630, 2904, 3512, 3606, 3839, 4576]


@pytest.mark.parametrize("seed", ILL_CONDITIONED)
def test_ill_conditioned_dA_log(seed):
    """dA_log sums T K gate-gradient terms per value head. Where they cancel, SPEC.md's relative
    bound on the sum asks for more than the terms' own precision: with bf16 state products each
    term is good to about 3e-3, so the sum is good to 3e-3 of sum |terms|, which can be far more
    than 2e-2 of the sum (up to 35% off here). The bf16 path is held to that term-scaled bound;
    with bf16_dot_products=False every term is fp32-exact and the sum meets the bound outright
    (docs/PYTHON.md, "Precision of dA_log")."""
    c, x, opts, h0, do, dht, ref = training_case(seed)
    terms = dA_log_terms(x["g"], opts["dt_bias"], "lower_bound" in opts, ref["dg"])
    # the formula is the oracle's own dA_log (checks dA_log_terms, not the kernel)
    np.testing.assert_allclose(terms.sum(axis=(0, 2)), ref["dA_log"], rtol=1e-6, atol=1e-12)
    scale = np.abs(terms).sum(axis=(0, 2))  # (HV) sum |terms|
    assert np.max(scale / np.abs(ref["dA_log"])) > 100, "not an ill-conditioned case"
    kw = dict(do=do, dht=dht, initial_state=h0, output_final_state=True, residuals="saved", **opts)
    bf16 = libkda.chunk_kda_fwd_bwd(**x, **kw)
    err = np.abs(np.asarray(bf16["dA_log"], np.float64) - ref["dA_log"])
    assert np.all(err <= 3e-3 * scale), f"bf16 products: |error| {err} > 3e-3 sum|terms| {3e-3 * scale} | {c}"
    fp32 = libkda.chunk_kda_fwd_bwd(**x, bf16_dot_products=False, **kw)
    m = metric(fp32["dA_log"], ref["dA_log"])
    assert m["finite"] and m["rel"] <= 1e-3, f"fp32 products: dA_log rel={m['rel']:.3e} (bound 1e-3) | {c}"


@pytest.mark.parametrize("seed", range(COUNT))
def test_pool_decode_matches_oracle(seed):
    rng = np.random.default_rng(2000 + seed)
    K, V = int(rng.choice([8, 16, 24, 40, 64, 128, 136])), int(rng.choice([8, 16, 20, 48, 128, 144, 256]))
    H = int(rng.choice([1, 2]))
    HV, N, T = H * int(rng.choice([1, 2])), int(rng.integers(1, 9)), int(rng.choice([1, 1, 2, 3]))
    dtype = [np.dtype(np.float32), BF16][int(rng.integers(0, 2))]
    v_first = bool(rng.integers(0, 2))
    x = make_inputs(rng, B=N, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype, gate="log", l2norm=True)
    slots = N + 3
    pool = (rng.standard_normal((slots, HV, V, K) if v_first else (slots, HV, K, V)) * 0.1).astype(np.float32)
    read = rng.permutation(slots)[:N].astype(np.int64)
    if N > 1 and rng.integers(0, 2):
        read[int(rng.integers(0, N))] = -1  # a padding row
    idx = read if T == 1 else np.repeat(read[:, None], T, 1)  # every token's state to the row's slot
    before = pool.copy()
    o = libkda.kda_decode(**x, state_pool=pool, slot_indices=idx, use_qk_l2norm_in_kernel=True, state_v_first=v_first)
    for row in range(N):
        if read[row] < 0:
            assert np.all(np.asarray(o[row], np.float64) == 0.0), "padding row output"
            continue
        ro, rht = libkda.naive_recurrent_kda(**{k: np.asarray(a[row:row + 1], np.float64) for k, a in x.items()},
                                             initial_state=before[read[row]][None], output_final_state=True,
                                             use_qk_l2norm_in_kernel=True, state_v_first=v_first)
        mo, ms = metric(o[row:row + 1], ro), metric(pool[read[row]][None], rht)
        tag = f"row {row}: K={K} V={V} H={H} HV={HV} N={N} T={T} {dtype} v_first={v_first}"
        assert mo["finite"] and mo["rel"] <= OUT_BOUND[dtype], f"o rel={mo['rel']:.3e} | {tag}"
        assert ms["finite"] and ms["rel"] <= 1e-5, f"state rel={ms['rel']:.3e} | {tag}"
    untouched = np.setdiff1d(np.arange(slots), read[read >= 0])
    assert np.array_equal(pool[untouched], before[untouched]), "an untouched slot was written"
