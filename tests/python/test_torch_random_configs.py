"""Randomized configurations through the FLA drop-in (libkda.torch.chunk_kda, autograd) against a
float64 autograd reference built from libkda.torch's FLA-style naive helpers: mixed dtypes per
argument (g and beta in float32 next to bf16/fp16 q, k, v, as FLA's layers pass them),
non-contiguous (head-first transposed) inputs, cu_seqlens, gate in kernel (softplus or lower
bound, A_log as [HV] or FLA's [1, 1, HV, 1]), l2norm and beta sigmoid in kernel, initial and final
states, both residual policies (disable_recompute), chunk sizes 32 / 64 and scales. A fixed seed
per case names a reproducible configuration. 12 in CI; KDA_LARGE_TESTS=1 runs 150.

dA_log sums T K gate-gradient terms per head, which can cancel (docs/PYTHON.md, "Precision of
dA_log"): it is held to the dg bound times sum |terms| instead of SPEC.md's bound on the sum."""

import os

import numpy as np
import pytest
from conftest import dA_log_terms, torch_rel

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
kt = pytest.importorskip("libkda.torch", reason="libkda.torch could not be imported")
F = torch.nn.functional
F64 = torch.float64

COUNT = 150 if os.environ.get("KDA_LARGE_TESTS") else 12
LOW_PRECISION = (torch.bfloat16, torch.float16)


def grad_bound(dtype, name):
    """SPEC.md section 4 bounds for gradients; fp32 ddt_bias, a sum over tokens, at 2.5x as in
    test_random_configs.py (measured up to 1.3e-4 here)."""
    if dtype not in LOW_PRECISION:
        return 2.5e-4 if name == "ddt_bias" else 1e-4
    return 2e-2 if name in ("dg", "dbeta", "dA_log", "ddt_bias") else 8e-3


def config(seed):
    rng = np.random.default_rng(7000 + seed)
    dtype = [torch.float32, torch.bfloat16, torch.float16][int(rng.integers(0, 3))]
    H = int(rng.choice([1, 2, 3]))
    c = dict(dtype=dtype, g_dtype=[torch.float32, dtype][int(rng.integers(0, 2))],
             beta_dtype=[torch.float32, dtype][int(rng.integers(0, 2))], H=H, HV=H * int(rng.choice([1, 2])),
             K=int(rng.choice([16, 32, 60, 64, 100, 128])), V=int(rng.choice([16, 32, 64, 96, 128])),
             varlen=bool(rng.integers(0, 2)), T=int(rng.integers(1, 300)), gate_in_kernel=bool(rng.integers(0, 2)),
             l2norm=bool(rng.integers(0, 2)), beta_sigmoid=bool(rng.integers(0, 2)),
             head_first_storage=bool(rng.integers(0, 2)), initial_state=bool(rng.integers(0, 2)),
             output_final_state=bool(rng.integers(0, 2)), disable_recompute=bool(rng.integers(0, 2)),
             chunk_size=int(rng.choice([32, 64])), scale=[None, 0.1, 1.0][int(rng.integers(0, 3))],
             A_log_fla_shape=bool(rng.integers(0, 2)))
    c["lower_bound"] = c["gate_in_kernel"] and bool(rng.integers(0, 2))
    c["B"] = 1 if c["varlen"] else int(rng.integers(1, 3))
    cu = None
    if c["varlen"] and c["T"] > 1:
        cuts = rng.choice(np.arange(1, c["T"]), size=min(int(rng.integers(1, 5)), c["T"] - 1), replace=False)
        cu = torch.tensor(np.concatenate([[0], np.sort(cuts), [c["T"]]]), dtype=torch.long)
    elif c["varlen"]:
        cu = torch.tensor([0, c["T"]], dtype=torch.long)
    return c, cu


def inputs(c, cu, seed):
    """The leaves, in FLA's layouts and the configuration's dtypes."""
    torch.manual_seed(seed)
    B, T, H, HV, K, V = c["B"], c["T"], c["H"], c["HV"], c["K"], c["V"]

    def make(shape, dtype, f=lambda x: x):
        if c["head_first_storage"]:  # [B, H, T, D] storage seen as [B, T, H, D]: strided
            return f(torch.randn(shape[0], shape[2], shape[1], shape[3])).transpose(1, 2).to(dtype)
        return f(torch.randn(*shape)).to(dtype)

    x = dict(q=make((B, T, H, K), c["dtype"]), k=make((B, T, H, K), c["dtype"]), v=make((B, T, HV, V), c["dtype"]))
    if not c["l2norm"]:  # normalized outside, as FLA's layers do without the in-kernel l2norm
        x["q"] = F.normalize(x["q"].float(), dim=-1).to(c["dtype"])
        x["k"] = F.normalize(x["k"].float(), dim=-1).to(c["dtype"])
    if c["gate_in_kernel"]:
        x["g"] = make((B, T, HV, K), c["g_dtype"])
        x["A_log"] = torch.log(torch.empty((1, 1, HV, 1) if c["A_log_fla_shape"] else (HV,)).uniform_(1, 16))
        x["dt_bias"] = torch.randn(HV * K) * 0.5
    else:
        x["g"] = make((B, T, HV, K), c["g_dtype"], lambda t: F.logsigmoid(t) / 16)
    beta = torch.randn(B, T, HV) if c["beta_sigmoid"] else torch.rand(B, T, HV)
    x["beta"] = beta.to(c["beta_dtype"])
    if c["initial_state"]:
        x["initial_state"] = torch.randn(len(cu) - 1 if cu is not None else B, HV, K, V) * 0.1
    return {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}


def reference(c, cu, x):
    """float64 autograd through the gate, the l2norm and the token-by-token recurrence."""
    r = {n: t.detach().to(F64).requires_grad_(True) for n, t in x.items()}
    q, k = (F.normalize(r["q"], dim=-1), F.normalize(r["k"], dim=-1)) if c["l2norm"] else (r["q"], r["k"])
    g = r["g"]
    if c["gate_in_kernel"]:
        A = r["A_log"].reshape(-1)
        g = (kt.naive_kda_lowerbound_gate(g, A, r["dt_bias"], -5.0, output_dtype=F64) if c["lower_bound"] else
             kt.naive_kda_gate(g, A, r["dt_bias"], output_dtype=F64))
    beta = r["beta"].sigmoid() if c["beta_sigmoid"] else r["beta"]
    h0 = r.get("initial_state")
    bounds = [(0, c["T"])] if cu is None else list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    outs, states = [], []
    for i, (s, e) in enumerate(bounds):
        h = None if h0 is None else (h0 if cu is None else h0[i:i + 1])
        o, ht = kt.naive_recurrent_kda(q[:, s:e], k[:, s:e], r["v"][:, s:e], g[:, s:e], beta[:, s:e], scale=c["scale"],
                                       initial_state=h, output_final_state=True)
        outs.append(o)
        states.append(ht)
    return r, torch.cat(outs, 1), torch.cat(states, 0)


@pytest.mark.parametrize("seed", range(COUNT))
def test_chunk_kda_matches_float64_autograd(seed):
    c, cu = config(seed)
    x = inputs(c, cu, seed)
    kw = dict(scale=c["scale"], initial_state=x.get("initial_state"), output_final_state=c["output_final_state"],
              use_qk_l2norm_in_kernel=c["l2norm"], use_gate_in_kernel=c["gate_in_kernel"],
              use_beta_sigmoid_in_kernel=c["beta_sigmoid"], cu_seqlens=cu, chunk_size=c["chunk_size"],
              disable_recompute=c["disable_recompute"])
    if c["gate_in_kernel"]:
        kw.update(A_log=x["A_log"], dt_bias=x["dt_bias"])
        if c["lower_bound"]:
            kw.update(lower_bound=-5.0, safe_gate=True)
    o, ht = kt.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    assert o.dtype == c["dtype"] and o.shape == (c["B"], c["T"], c["HV"], c["V"])
    assert (ht is not None) == c["output_final_state"]
    torch.manual_seed(10_000 + seed)
    # cotangents representable in o's / the state's dtype, so the kernel and the reference see the same values
    do = torch.randn(o.shape).to(o.dtype).to(F64)
    dht = torch.randn(c["HV"] * c["K"] * c["V"] * (len(cu) - 1 if cu is not None else c["B"])).to(F64)
    loss = (o.to(F64) * do).sum()
    if ht is not None:
        loss = loss + (ht.to(F64) * dht.reshape(ht.shape)).sum()
    loss.backward()

    r, ro, rht = reference(c, cu, x)
    rloss = (ro * do).sum()
    if ht is not None:
        rloss = rloss + (rht * dht.reshape(rht.shape)).sum()
    rloss.backward()

    out_bound = 5e-3 if c["dtype"] in LOW_PRECISION else 1e-5
    failures = []
    errs = {"o": (torch_rel(ro, o), out_bound)}
    if ht is not None:
        errs["final_state"] = (torch_rel(rht, ht), out_bound)
    grad_names = dict(q="dq", k="dk", v="dv", g="dg", beta="dbeta", initial_state="dh0", A_log="dA_log",
                      dt_bias="ddt_bias")
    for n, leaf in x.items():
        name = grad_names[n]
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape and leaf.grad.dtype == leaf.dtype, name
        if name == "dA_log":  # a cancelling sum: the per-term bound times sum |terms| (module docstring)
            terms = dA_log_terms(x["g"].detach().to(F64).numpy(), x["dt_bias"].detach().numpy(), c["lower_bound"],
                                 r["g"].grad.numpy())
            scale = torch.from_numpy(np.abs(terms).sum(axis=(0, 2)))  # (HV)
            err = (leaf.grad.detach().to(F64).reshape(-1) - r[n].grad.reshape(-1)).abs()
            bound = grad_bound(c["dtype"], "dg") * scale + 1e-6  # 1e-6: rounding residue where every term is 0
            if bool((err > bound).any()):
                failures.append(f"dA_log: |error| {err.tolist()} > {bound.tolist()} (dg bound x sum|terms| + 1e-6)")
            continue
        errs[name] = (torch_rel(r[n].grad, leaf.grad), grad_bound(c["dtype"], name))
    failures += [f"{n}: rel={e:.3e} (bound {b})" for n, (e, b) in errs.items() if not e <= b]
    assert not failures, f"{failures} | seed {seed}: {c}"
