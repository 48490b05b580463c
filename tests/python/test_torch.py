"""libkda.torch (issue 6): the PyTorch ops against the fp64 oracle (SPEC.md section 4 bounds),
torch.library.opcheck on every op, torch.compile of a small KDA layer, fp64 gradcheck, the decode
entry, zero-copy strided inputs and the error paths."""

import numpy as np
import pytest
from conftest import BF16, BOUND, assert_close

import libkda

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
kt = pytest.importorskip("libkda.torch", reason="libkda.torch could not be imported")

F32 = np.dtype(np.float32)
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NP_OF = {torch.float32: F32, torch.bfloat16: BF16, torch.float16: np.dtype(np.float16)}


def to_np(t):
    """A torch tensor as float64 numpy (bf16 values exactly)."""
    return t.detach().to(torch.float64).numpy()


def grad_bound(dtype, name):
    if dtype == torch.float32:
        return 1e-4
    return 8e-3 if name in ("dq", "dk", "dv", "dh0") else 2e-2


def make(seed, B=1, T=70, H=2, HV=None, K=16, V=8, dtype=torch.float32, gate="log", N=None, beta_logits=False):
    """FLA batch-first inputs as torch tensors (and A_log / dt_bias for the gate in kernel)."""
    g_ = torch.Generator().manual_seed(seed)
    HV = H if HV is None else HV
    rn = lambda *s: torch.randn(*s, generator=g_)
    q = rn(B, T, H, K)
    k = torch.nn.functional.normalize(rn(B, T, H, K), dim=-1)
    q = torch.nn.functional.normalize(q, dim=-1)
    v = rn(B, T, HV, V)
    if gate == "log":
        g = -torch.exp(rn(B, T, HV, K) - 2.5)
    else:
        g = rn(B, T, HV, K)
    beta = rn(B, T, HV) if beta_logits else torch.rand(B, T, HV, generator=g_)
    x = dict(q=q, k=k, v=v, g=g, beta=beta)
    x = {n: t.to(dtype) for n, t in x.items()}
    extra = {}
    if gate != "log":
        extra["A_log"] = torch.log(torch.rand(HV, generator=g_) * 3 + 0.5)
        extra["dt_bias"] = 0.5 * rn(HV * K)
        if gate == "lower_bound":
            extra["lower_bound"] = -5.0
    n_states = B if N is None else N
    h0 = rn(n_states, HV, K, V)
    return x, extra, h0


def oracle(x, extra, h0, do=None, dht=None, **kw):
    """The numpy fp64 oracle on the same (dtype-rounded) values."""
    xn = {n: to_np(t) for n, t in x.items()}
    en = {n: (to_np(t) if torch.is_tensor(t) else t) for n, t in extra.items()}
    kw = {n: (to_np(t) if torch.is_tensor(t) and t.is_floating_point() else
              (t.numpy() if torch.is_tensor(t) else t)) for n, t in kw.items()}
    h0n = None if h0 is None else to_np(h0)
    if do is None:
        return libkda.naive_recurrent_kda(**xn, **en, initial_state=h0n, output_final_state=True, **kw)
    return libkda.naive_recurrent_kda_bwd(**xn, do=to_np(do), dht=None if dht is None else to_np(dht), **en,
                                          initial_state=h0n, output_final_state=True, **kw)


FORWARD_CASES = {
    "fixed": dict(B=2),
    "gva": dict(B=1, H=1, HV=2),
    "gate_softplus": dict(gate="softplus"),
    "gate_lower_bound": dict(gate="lower_bound"),
}


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES), ids=list(TORCH_DTYPES))
@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_forward_vs_oracle(case, dtype):
    dt = TORCH_DTYPES[dtype]
    x, extra, h0 = make(1, dtype=dt, **FORWARD_CASES[case])
    kw = dict(use_gate_in_kernel=bool(extra))
    o, ht = kt.chunk_kda(**x, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, **kw, **extra)
    assert o.dtype == dt and o.shape == x["v"].shape
    assert ht.dtype == torch.float32 and ht.shape == h0.shape
    ro, rht = oracle(x, extra, h0, use_qk_l2norm_in_kernel=True, **kw)
    assert_close(to_np(o), ro, BOUND[NP_OF[dt]], "o")
    assert_close(to_np(ht), rht, BOUND[NP_OF[dt]], "final_state")


def test_forward_varlen_vfirst_beta_sigmoid():
    x, extra, _ = make(2, T=150, gate="softplus", beta_logits=True)
    cu = torch.tensor([0, 37, 37, 100, 150], dtype=torch.int32)  # an empty segment, unaligned boundaries
    h0 = torch.randn(4, 2, 8, 16, generator=torch.Generator().manual_seed(3))  # V-first [N, HV, V, K]
    o, ht = kt.chunk_kda(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu, state_v_first=True,
                         use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                         chunk_size=32, **extra)
    assert ht.shape == (4, 2, 8, 16)
    ro, rht = oracle(x, extra, h0, cu_seqlens=cu, state_v_first=True, use_gate_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    assert_close(to_np(o), ro, 1e-5, "o")
    assert_close(to_np(ht), rht, 1e-5, "final_state")
    # The empty segment's final state is its initial state.
    assert torch.equal(ht[1], h0[1])


@pytest.mark.parametrize("disable_recompute", [True, False], ids=["saved", "remat"])
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES), ids=list(TORCH_DTYPES))
def test_gradients_vs_oracle(dtype, disable_recompute):
    dt = TORCH_DTYPES[dtype]
    x, extra, h0 = make(4, T=90, H=1, HV=2, dtype=dt, gate="lower_bound", N=3)
    cu = torch.tensor([0, 20, 65, 90])
    leaves = {n: t.clone().requires_grad_() for n, t in {**x, **extra, "h0": h0}.items() if torch.is_tensor(t)}
    kw = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, lower_bound=-5.0)
    o, ht = kt.chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], A_log=leaves["A_log"],
                         dt_bias=leaves["dt_bias"], initial_state=leaves["h0"], output_final_state=True, cu_seqlens=cu,
                         disable_recompute=disable_recompute, **kw)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(o.shape, generator=gen).to(dt)
    dht = torch.randn(ht.shape, generator=gen)
    torch.autograd.backward((o, ht), (do, dht))
    ref = oracle(x, {"A_log": extra["A_log"], "dt_bias": extra["dt_bias"]}, h0, do=do, dht=dht, cu_seqlens=cu,
                 use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, lower_bound=-5.0)
    names = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "h0": "dh0", "A_log": "dA_log",
             "dt_bias": "ddt_bias"}
    for leaf, name in names.items():
        grad = leaves[leaf].grad
        assert grad is not None and grad.dtype == leaves[leaf].dtype and grad.shape == leaves[leaf].shape, name
        assert_close(to_np(grad), ref[name], grad_bound(dt, name), name)


def test_saved_and_remat_agree_bitwise():
    x, extra, h0 = make(6, T=100, gate="softplus")
    grads = []
    for disable_recompute in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x["q"], x["k"], x["v"], x["g"], x["beta"], h0)]
        o, ht = kt.chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, use_gate_in_kernel=True,
                             disable_recompute=disable_recompute, **extra)
        # the chunk states and every token's delta v_new (as FLA keeps h and v_new), or None (remat)
        saved_states, v_new = o.grad_fn.saved_tensors[-2:]
        if disable_recompute:
            assert saved_states is not None and saved_states.shape == (2, 2, 16, 8)  # [NC, HV, K, V]
            assert v_new is not None and v_new.shape == o.shape and v_new.dtype == torch.float32
        else:
            assert saved_states is None and v_new is None
        (o.square().sum() + ht.sum()).backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_head_first_views_are_read_in_place():
    """Head-first [H, B, T, K] tensors transposed to FLA's batch-first layout are strided views;
    the op reads them in place and gives bitwise the results of contiguous copies."""
    x, _, h0 = make(7, B=2, T=50)
    hf = {n: t.movedim(2, 0).contiguous() for n, t in x.items()}  # [H, B, T, ...] storage
    views = {n: t.movedim(0, 2) for n, t in hf.items()}  # batch-first views of it
    assert not views["q"].is_contiguous()
    o1, h1 = kt.chunk_kda(**views, initial_state=h0, output_final_state=True)
    o2, h2 = kt.chunk_kda(**x, initial_state=h0, output_final_state=True)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)


def test_return_intermediate_states():
    x, _, h0 = make(8, B=2, T=100)
    with torch.inference_mode():
        o, ht, h = kt.chunk_kda(**x, initial_state=h0, output_final_state=True, return_intermediate_states=True)
    assert h.shape == (2, 2, 2, 16, 8) and h.dtype == x["k"].dtype  # [B, NT, HV, K, V], input dtype (FLA)
    xn = {n: t.numpy() for n, t in x.items()}
    ro, rht, rh = libkda.chunk_kda(**xn, initial_state=h0.numpy(), output_final_state=True,
                                   return_intermediate_states=True)
    assert np.array_equal(h.reshape(-1, 2, 16, 8).numpy(), rh)
    assert torch.equal(h[:, 0], h0)  # the first chunk's entry is the initial state
    cu = torch.tensor([0, 30, 100])
    xv = {n: t[:1] for n, t in x.items()}
    with torch.inference_mode():
        _, _, hv = kt.chunk_kda(**xv, cu_seqlens=cu, return_intermediate_states=True)
    assert hv.shape == (1, 1 + 2, 2, 16, 8)  # ceil(30/64) + ceil(70/64) chunks
    # FLA asserts both: intermediate states are an inference-mode output, not a training residual.
    with pytest.raises(AssertionError, match="only allowed in inference mode"):
        kt.chunk_kda(**x, return_intermediate_states=True)
    with torch.inference_mode(), pytest.raises(AssertionError, match="disable_recompute=False"):
        kt.chunk_kda(**x, return_intermediate_states=True, disable_recompute=True)


def test_return_intermediate_states_in_input_dtype():
    """FLA returns h in the input dtype: bf16 inputs give bf16 h, the float32 states rounded."""
    x, _, h0 = make(8, B=2, T=100, dtype=torch.bfloat16)
    with torch.inference_mode():
        o, ht, h = kt.chunk_kda(**x, initial_state=h0, output_final_state=True, return_intermediate_states=True,
                                chunk_size=32)
    assert h.dtype == torch.bfloat16 and h.shape == (2, 4, 2, 16, 8) and ht.dtype == torch.float32
    xn = {n: t.to(torch.float32).numpy().astype(BF16) for n, t in x.items()}
    _, _, rh = libkda.chunk_kda(**xn, initial_state=h0.numpy(), output_final_state=True, chunk_size=32,
                                return_intermediate_states=True)
    assert torch.equal(h.reshape(-1, 2, 16, 8), torch.from_numpy(rh).to(torch.bfloat16))


def test_bf16_dot_products_reaches_the_kernel():
    """libkda's bf16_dot_products (not an FLA option) through chunk_kda's kwargs: the same
    results as the numpy binding with the same setting, forward and gradients."""
    x, _, h0 = make(31, T=90, dtype=torch.bfloat16)
    xn = {n: t.to(torch.float32).numpy().astype(BF16) for n, t in x.items()}
    for bf16_products in (True, False):
        o, ht = kt.chunk_kda(**x, initial_state=h0, output_final_state=True, bf16_dot_products=bf16_products)
        ro, rht = libkda.chunk_kda(**xn, initial_state=h0.numpy(), output_final_state=True,
                                   bf16_dot_products=bf16_products)
        assert torch.equal(o, torch.from_numpy(ro.astype(np.float32)).to(torch.bfloat16)), bf16_products
        assert np.array_equal(ht.numpy(), rht), bf16_products


def test_chunk_size_follows_fla():
    x, _, h0 = make(30, T=40)
    for bad in (16, 128, 0):
        with pytest.raises(ValueError, match="`chunk_size` must be either 32 or 64"):
            kt.chunk_kda(**x, chunk_size=bad)
    o, ht = kt.chunk_kda(**x, initial_state=h0, output_final_state=True, chunk_size=32)
    ro, rht = oracle(x, {}, h0)
    assert_close(to_np(o), ro, 1e-5, "o")
    assert_close(to_np(ht), rht, 1e-5, "final_state")
    # the numpy binding keeps chunk_size 16
    xn = {n: t.numpy() for n, t in x.items()}
    o16, _ = libkda.chunk_kda(**xn, chunk_size=16)
    assert_close(o16, oracle(x, {}, None)[0], 1e-5, "numpy o, chunk_size=16")


def test_gate_parameters_of_any_shape():
    """A_log with HV elements in any shape (FLA's [1, 1, HV, 1]) and dt_bias with HV * K: the
    results equal those of the flat shapes bitwise and the gradients come back in the caller's
    shapes; wrong element counts raise ValueError naming the argument."""
    x, extra, h0 = make(31, T=40, H=1, HV=2, gate="softplus")
    HV, K = 2, 16
    shaped = {"A_log": extra["A_log"].reshape(1, 1, HV, 1), "dt_bias": extra["dt_bias"].reshape(HV, K)}
    results = []
    for params in (extra, shaped, {"A_log": extra["A_log"].reshape(HV, 1), "dt_bias": extra["dt_bias"][None]}):
        leaves = {n: t.clone().requires_grad_() for n, t in params.items()}
        o, ht = kt.chunk_kda(**x, **leaves, initial_state=h0, output_final_state=True, use_gate_in_kernel=True)
        (o.square().sum() + ht.sum()).backward()
        for n, t in leaves.items():
            assert t.grad.shape == params[n].shape, n
        results.append((o, ht, leaves["A_log"].grad.reshape(-1), leaves["dt_bias"].grad.reshape(-1)))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    ro, _ = oracle(x, extra, h0, use_gate_in_kernel=True)
    assert_close(to_np(results[0][0]), ro, 1e-5, "o")
    # fused_recurrent_kda, and fused_recurrent_kda_fwd's decode path
    o_fr, _ = kt.fused_recurrent_kda(**x, **shaped, initial_state=h0, use_gate_in_kernel=True)
    assert torch.equal(o_fr, results[0][0])
    q, k, v, g, beta, pool = _decode_inputs(32, N=2, H=2, K=K)
    idx = torch.tensor([3, 1])
    outs = []
    for params in (extra, shaped):
        p = pool.clone()
        o, _ = kt.fused_recurrent_kda_fwd(q, k, v, g, beta, **params, initial_state=p, ssm_state_indices=idx,
                                          use_gate_in_kernel=True, state_v_first=True)
        outs.append((o, p))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    with pytest.raises(ValueError, match=r"'A_log': expected HV = 2 elements .*got shape \[1, 1, 3, 1\] \(3 "):
        kt.chunk_kda(**x, A_log=torch.zeros(1, 1, 3, 1), use_gate_in_kernel=True)
    with pytest.raises(ValueError, match=r"'dt_bias': expected HV \* K = 32 elements .*got shape \[2, 15\]"):
        kt.fused_recurrent_kda(**x, A_log=extra["A_log"], dt_bias=torch.zeros(2, 15), use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="'A_log': expected HV = 2 elements"):
        kt.fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=torch.zeros(3), initial_state=pool, ssm_state_indices=idx,
                                   use_gate_in_kernel=True, state_v_first=True)


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_fused_recurrent_kda_fwd_inplace_without_indices(varlen):
    """FLA: inplace_final_state=True without ssm_state_indices writes each sequence's final state
    into initial_state and returns it (even with output_final_state=False)."""
    x, extra, h0 = make(33, B=1 if varlen else 2, T=45, gate="lower_bound", N=3 if varlen else None)
    kw = dict(cu_seqlens=torch.tensor([0, 10, 10, 45])) if varlen else {}
    state = h0.clone()
    ptr = state.data_ptr()
    o, fs = kt.fused_recurrent_kda_fwd(**x, **extra, initial_state=state, output_final_state=False,
                                       inplace_final_state=True, use_gate_in_kernel=True, **kw)
    assert fs is state and state.data_ptr() == ptr
    ro, rht = oracle(x, extra, h0, use_gate_in_kernel=True, **kw)
    assert_close(to_np(o), ro, 1e-5, "o")
    assert_close(to_np(state), rht, 1e-5, "final_state (in place)")
    if varlen:
        assert torch.equal(state[1], h0[1])  # the empty segment keeps its state
    o2, fs2 = kt.fused_recurrent_kda_fwd(**x, **extra, initial_state=h0, output_final_state=True,
                                         inplace_final_state=False, use_gate_in_kernel=True, **kw)
    assert torch.equal(o, o2) and torch.equal(state, fs2) and fs2 is not h0


def test_reference_helpers_match_the_oracle():
    """fused_kda_gate / naive_kda_gate / naive_kda_lowerbound_gate (FLA's gate.py) and
    naive_recurrent_kda / naive_chunk_kda (FLA's naive.py) against float64 references."""
    gen = torch.Generator().manual_seed(34)
    B, T, H, HV, K, V = 2, 37, 1, 2, 8, 4
    g = 3 * torch.randn(B, T, HV, K, generator=gen)
    A_log = torch.randn(1, 1, HV, 1, generator=gen)
    dt_bias = torch.randn(HV * K, generator=gen)
    x = (g.double() + dt_bias.double().view(HV, K)).numpy()
    a = A_log.double().exp().view(HV, 1).numpy()
    for lb, ref in ((None, -a * np.logaddexp(0, x)), (-5.0, -5.0 / (1 + np.exp(-a * x)))):
        y = kt.fused_kda_gate(g, A_log, dt_bias, lower_bound=lb)
        assert y.dtype == torch.float32 and y.shape == g.shape
        assert_close(y.numpy(), ref, 1e-6, f"gate lower_bound={lb}")
        naive = (kt.naive_kda_gate(g, A_log, dt_bias) if lb is None else
                 kt.naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound=lb))
        assert torch.equal(y, naive)
    assert torch.equal(kt.fused_kda_gate(g, None, dt_bias), kt.fused_kda_gate(g, torch.zeros(HV), dt_bias))
    assert kt.fused_kda_gate(g.bfloat16(), A_log, output_dtype=torch.bfloat16).dtype == torch.bfloat16
    leaves = [t.double().requires_grad_() for t in (g[:1, :3], A_log, dt_bias)]
    assert torch.autograd.gradcheck(lambda *t: kt.fused_kda_gate(*t, lower_bound=-3.0, output_dtype=torch.float64),
                                    leaves)
    assert torch.autograd.gradcheck(lambda *t: kt.fused_kda_gate(*t, output_dtype=torch.float64), leaves)
    # the naive recurrences, GVA, T not a multiple of the chunk size
    xr, _, h0 = make(35, B=B, T=T, H=H, HV=HV, K=K, V=V)
    ro, rht = oracle(xr, {}, h0, scale=0.25)  # a scale exact in float32, as the oracle takes it
    for name, fn in (("recurrent", kt.naive_recurrent_kda),
                     ("chunk16", lambda *t, **kw: kt.naive_chunk_kda(*t, **kw, chunk_size=16))):
        o, ht = fn(*(t.double() for t in xr.values()), scale=0.25, initial_state=h0.double(),
                   output_final_state=True)
        assert o.dtype == torch.float64 and o.shape == xr["v"].shape and ht.shape == h0.shape
        assert_close(o.numpy(), ro, 1e-12, f"{name} o")
        assert_close(ht.numpy(), rht, 1e-12, f"{name} final_state")
        o32, none = fn(*xr.values(), scale=0.5)
        assert o32.dtype == torch.float32 and none is None
        assert_close(o32.numpy(), oracle(xr, {}, None, scale=0.5)[0], 1e-5, f"{name} o fp32")


def _decode_inputs(seed, N=3, T=1, H=2, K=16, V=8, slots=6):
    g_ = torch.Generator().manual_seed(seed)
    q = torch.randn(N, T, H, K, generator=g_)
    k = torch.nn.functional.normalize(torch.randn(N, T, H, K, generator=g_), dim=-1)
    v = torch.randn(N, T, H, V, generator=g_)
    g = -torch.rand(N, T, H, K, generator=g_)
    beta = torch.rand(N, T, H, generator=g_)
    pool = torch.randn(slots, H, V, K, generator=g_)  # V-first pool (vLLM's layout)
    return q, k, v, g, beta, pool


def test_decode_in_place_matches_numpy_and_chunk():
    q, k, v, g, beta, pool = _decode_inputs(9)
    idx = torch.tensor([4, -1, 0], dtype=torch.int32)  # row 1 is padding
    pool_np = pool.numpy().copy()
    ref = pool.clone()
    ptr = pool.data_ptr()
    o, fs = kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx,
                                       use_qk_l2norm_in_kernel=True, state_v_first=True)
    assert fs is pool and pool.data_ptr() == ptr  # updated in place
    o_np = libkda.kda_decode(q.numpy(), k.numpy(), v.numpy(), g.numpy(), beta.numpy(), pool_np, idx.numpy(),
                             use_qk_l2norm_in_kernel=True, state_v_first=True)
    assert np.array_equal(o.numpy(), o_np) and np.array_equal(pool.numpy(), pool_np)
    assert torch.equal(o[1], torch.zeros_like(o[1])) and torch.equal(pool[[1, 2, 3, 5]], ref[[1, 2, 3, 5]])
    # Against the chunked path on the gathered states (the same recurrence, SPEC.md bound).
    oc, hc = kt.chunk_kda(q[[0, 2]], k[[0, 2]], v[[0, 2]], g[[0, 2]], beta[[0, 2]], initial_state=ref[[4, 0]],
                          output_final_state=True, use_qk_l2norm_in_kernel=True, state_v_first=True)
    assert_close(o[[0, 2]].numpy(), oc.numpy(), 1e-5, "o")
    assert_close(pool[[4, 0]].numpy(), hc.numpy(), 1e-5, "state")


def test_decode_speculative_and_packed():
    q, k, v, g, beta, pool = _decode_inputs(10, N=2, T=3, slots=8)
    pool_np = pool.numpy().copy()
    idx = torch.tensor([[1, 2, 3], [4, 5, -1]])
    acc = torch.tensor([2, 1])
    packed = [x.reshape(1, 6, *x.shape[2:]) for x in (q, k, v, g, beta)]  # vLLM: [1, N*T, ...] + cu_seqlens
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    o, _ = kt.fused_recurrent_kda(*packed, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=acc,
                                  inplace_final_state=True, cu_seqlens=cu, state_v_first=True)
    assert o.shape == (1, 6, 2, 8)
    o_np = libkda.kda_decode(q.numpy(), k.numpy(), v.numpy(), g.numpy(), beta.numpy(), pool_np, idx.numpy(),
                             num_accepted_tokens=acc.numpy(), state_v_first=True)
    assert np.array_equal(o.reshape(2, 3, 2, 8).numpy(), o_np) and np.array_equal(pool.numpy(), pool_np)
    # Ragged rows (2 and 4 tokens) decode as separate equal-length calls would, bit for bit.
    ragged_pool, split_pool = pool.clone(), pool.clone()
    o_r, _ = kt.fused_recurrent_kda(*packed, initial_state=ragged_pool, ssm_state_indices=idx[:, 0],
                                    cu_seqlens=torch.tensor([0, 2, 6]), state_v_first=True)
    parts = [kt.fused_recurrent_kda(*(x[:, s:e] for x in packed), initial_state=split_pool,
                                    ssm_state_indices=idx[n:n + 1, 0], cu_seqlens=torch.tensor([0, e - s]),
                                    state_v_first=True)[0] for n, (s, e) in enumerate([(0, 2), (2, 6)])]
    assert torch.equal(o_r, torch.cat(parts, 1)) and torch.equal(ragged_pool, split_pool)


def test_double_backward_raises_instead_of_dropping_the_term():
    """The C++ backward has no derivative: gradients taken with create_graph=True are usable as
    values, but differentiating them again raises, rather than silently treating them as constants
    (a gradient penalty would be wrong without a word)."""
    x, _, _ = make(3, T=20)
    q = x["q"].clone().requires_grad_(True)
    v = x["v"].clone().requires_grad_(True)
    o, _ = kt.chunk_kda(q, x["k"], v, x["g"], x["beta"])
    gq, = torch.autograd.grad(o.square().sum(), q, create_graph=True)
    plain, = torch.autograd.grad(kt.chunk_kda(q, x["k"], v, x["g"], x["beta"])[0].square().sum(), q)
    assert torch.equal(gq.detach(), plain)
    with pytest.raises(RuntimeError, match="not differentiable"):
        (gq.square().sum() + v.sum()).backward()


@pytest.mark.parametrize("inplace", [True, False])
def test_decode_with_inputs_requiring_grad_raises_on_backward(inplace):
    """The pool decode is forward only, as FLA's decode kernel: with an input that requires grad,
    o is the same values, and a backward through it raises instead of giving no gradient."""
    q, k, v, g, beta, pool = _decode_inputs(14)
    idx = torch.tensor([4, -1, 0])
    kw = dict(ssm_state_indices=idx, state_v_first=True, inplace_final_state=inplace, output_final_state=True)
    want, _ = kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool.clone(), **kw)
    vr = v.clone().requires_grad_(True)
    got, _ = kt.fused_recurrent_kda_fwd(q, k, vr, g, beta, initial_state=pool.clone(), **kw)
    assert torch.equal(got.detach(), want)
    with pytest.raises(RuntimeError, match="not differentiable"):
        got.sum().backward()
    with torch.no_grad():  # the serving case: no autograd node at all
        plain, _ = kt.fused_recurrent_kda_fwd(q, k, vr, g, beta, initial_state=pool.clone(), **kw)
    assert not plain.requires_grad and torch.equal(plain, want)


@pytest.mark.parametrize("arg", ["q", "cu_seqlens", "initial_state", "A_log", "scale", "lower_bound"])
def test_non_tensor_arguments_are_type_errors_naming_them(arg):
    x, _, _ = make(4, T=20)
    kw = dict(use_gate_in_kernel=True, A_log=torch.zeros(2), lower_bound=-5.0)
    bad = {"q": np.zeros((1, 20, 2, 16), np.float32), "cu_seqlens": [0, 10, 20], "initial_state": [0.0],
           "A_log": 0.5, "scale": "0.5", "lower_bound": "x"}[arg]
    if arg == "q":
        x["q"] = bad
    else:
        kw[arg] = bad
    with pytest.raises(TypeError, match=f"argument '{arg}'"):
        kt.chunk_kda(**x, **kw)


@pytest.mark.parametrize("layout", ["unpacked", "packed", "ragged", "out_of_place"])
def test_decode_wider_index_tensors_use_their_first_columns(layout):
    """[N, T'] ssm_state_indices with T' above the tokens per sequence (vLLM keeps [N, num_spec + 1]
    whatever the step's tokens; FLA's kernel reads each row through its stride): the first columns
    are used, so o and the pool are bitwise the exact-width call's; a narrower tensor is refused
    with the pool untouched."""
    q, k, v, g, beta, pool = _decode_inputs(12, N=2, T=3, slots=10)
    idx = torch.tensor([[1, 2, 3], [4, 5, -1]])
    acc = torch.tensor([2, 3])
    wide = torch.cat([idx, torch.tensor([[-1, 9], [0, -1]])], 1)  # two extra columns, ignored
    kw = dict(state_v_first=True)
    if layout == "unpacked":
        tokens, kw = (q, k, v, g, beta), dict(kw, num_accepted_tokens=acc)
    elif layout in ("packed", "out_of_place"):
        tokens = tuple(x.reshape(1, 6, *x.shape[2:]) for x in (q, k, v, g, beta))
        kw = dict(kw, num_accepted_tokens=acc, cu_seqlens=torch.tensor([0, 3, 6]))
    else:  # rows of 2 and 4 tokens: [N, T'] with T' = 5 > 4
        tokens = tuple(x.reshape(1, 6, *x.shape[2:]) for x in (q, k, v, g, beta))
        idx = torch.tensor([[1, 2, -1, -1], [4, 5, 6, 7]])
        wide = torch.cat([idx, torch.tensor([[9], [-1]])], 1)
        kw = dict(kw, num_accepted_tokens=torch.tensor([1, 2]), cu_seqlens=torch.tensor([0, 2, 6]))
    if layout == "out_of_place":
        kw = dict(kw, inplace_final_state=False, output_final_state=True)
    exact_pool, wide_pool = pool.clone(), pool.clone()
    o_exact, s_exact = kt.fused_recurrent_kda_fwd(*tokens, initial_state=exact_pool, ssm_state_indices=idx, **kw)
    o_wide, s_wide = kt.fused_recurrent_kda_fwd(*tokens, initial_state=wide_pool, ssm_state_indices=wide, **kw)
    assert torch.equal(o_wide, o_exact) and torch.equal(wide_pool, exact_pool) and torch.equal(s_wide, s_exact)
    before = pool.clone()
    with pytest.raises(ValueError, match=r"'(ssm_state|slot)_indices'.*shape"):  # the op's or kda::decode's name
        kt.fused_recurrent_kda_fwd(*tokens, initial_state=pool, ssm_state_indices=idx[:, :1].expand(2, 1).clone(),
                                   **kw)
    assert torch.equal(pool, before)


def _opcheck(op, args):
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_opcheck_chunk_ops():
    x, extra, h0 = make(11, T=40, H=1, HV=2, K=8, V=4, gate="lower_bound", N=3, beta_logits=True)
    cu = torch.tensor([0, 10, 25, 40])
    flags = kt._GATE | kt._L2NORM | kt._BETA_SIGMOID | kt._V_FIRST
    h0 = h0.transpose(-1, -2).contiguous()
    req = lambda t: t.clone().requires_grad_()
    fwd_args = (req(x["q"]), req(x["k"]), req(x["v"]), req(x["g"]), req(x["beta"]), req(extra["A_log"]),
                req(extra["dt_bias"]), req(h0), cu, None, -5.0, flags, 16, True, True, True)
    _opcheck(torch.ops.libkda.chunk_kda_fwd.default, fwd_args)
    _opcheck(torch.ops.libkda.chunk_kda_fwd.default, fwd_args[:-1])  # save_v_new's default: False
    # fixed length, remat, no optional inputs
    xf, _, _ = make(12, B=2, T=33, K=8, V=4)
    _opcheck(torch.ops.libkda.chunk_kda_fwd.default,
             (xf["q"], xf["k"], xf["v"], xf["g"], xf["beta"], None, None, None, None, 0.3, None, 0, 32, False, False))
    o, fs, cs, vn = torch.ops.libkda.chunk_kda_fwd(*[a.detach() if torch.is_tensor(a) else a for a in fwd_args])
    assert vn.shape == o.shape and vn.dtype == torch.float32
    bwd_args = (x["q"], x["k"], x["v"], x["g"], x["beta"], extra["A_log"], extra["dt_bias"], h0, cu, cs, vn,
                torch.randn_like(o), torch.randn_like(fs), None, -5.0, flags, 16)
    _opcheck(torch.ops.libkda.chunk_kda_bwd.default, bwd_args)
    # remat (no chunk states, no v_new), no final-state cotangent
    _opcheck(torch.ops.libkda.chunk_kda_bwd.default, bwd_args[:9] + (None, None) + bwd_args[11:12] + (None,) + bwd_args[13:])
    # v_new with rematerialized states
    _opcheck(torch.ops.libkda.chunk_kda_bwd.default, bwd_args[:9] + (None,) + bwd_args[10:])


def test_opcheck_decode():
    q, k, v, g, beta, pool = _decode_inputs(13, N=2, T=2)
    idx = torch.tensor([[3, 1], [0, -1]])
    _opcheck(torch.ops.libkda.decode.default,
             (q, k, v, g, beta, None, None, pool, idx, torch.tensor([2, 1]), None, None, kt._V_FIRST))
    A_log, dt_bias = torch.zeros(2), torch.zeros(2 * 16)
    _opcheck(torch.ops.libkda.decode.default,
             (q, k, v, g, beta, A_log, dt_bias, pool, idx[:, 0], None, 0.25, -3.0, kt._GATE | kt._V_FIRST))


class _KDALayer(torch.nn.Module):
    """A small KDA layer: projections, the libkda op (gate and l2norm in kernel), output projection."""

    def __init__(self, D=32, H=2, K=16):
        super().__init__()
        self.H, self.K = H, K
        self.q_proj = torch.nn.Linear(D, H * K, bias=False)
        self.k_proj = torch.nn.Linear(D, H * K, bias=False)
        self.v_proj = torch.nn.Linear(D, H * K, bias=False)
        self.f_proj = torch.nn.Linear(D, H * K, bias=False)
        self.b_proj = torch.nn.Linear(D, H, bias=False)
        self.o_proj = torch.nn.Linear(H * K, D, bias=False)
        self.A_log = torch.nn.Parameter(torch.log(torch.empty(H).uniform_(1, 16)))
        self.dt_bias = torch.nn.Parameter(0.1 * torch.randn(H * K))

    def forward(self, x, cu_seqlens=None):
        B, T, _ = x.shape
        shape = (B, T, self.H, self.K)
        q = torch.nn.functional.silu(self.q_proj(x)).view(shape)
        k = torch.nn.functional.silu(self.k_proj(x)).view(shape)
        v = torch.nn.functional.silu(self.v_proj(x)).view(shape)
        g = self.f_proj(x).view(shape)
        beta = self.b_proj(x).sigmoid()
        o, ht = kt.chunk_kda(q, k, v, g, beta, A_log=self.A_log, dt_bias=self.dt_bias, use_qk_l2norm_in_kernel=True,
                             use_gate_in_kernel=True, output_final_state=True, cu_seqlens=cu_seqlens,
                             disable_recompute=True)
        return self.o_proj(o.reshape(B, T, -1)), ht


def test_torch_compile_layer_matches_eager():
    torch.manual_seed(0)
    layer = _KDALayer()
    x = torch.randn(1, 75, 32)
    cu = torch.tensor([0, 30, 75])

    def run(fn):
        layer.zero_grad()
        out, ht = fn(x, cu)
        (out.square().sum() + ht.sum()).backward()
        return out.detach(), ht.detach(), [p.grad.clone() for p in layer.parameters()]

    ref = run(layer)
    torch._dynamo.reset()
    got = run(torch.compile(layer, fullgraph=True))  # inductor; fullgraph: no graph breaks
    assert torch.equal(got[0], ref[0]) or torch.allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(got[1], ref[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(got[2], ref[2]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_gradcheck_fp64():
    """float64 inputs run the fp64 oracle forward and its exact adjoint."""
    gen = torch.Generator().manual_seed(14)
    B, T, H, K, V = 1, 6, 1, 3, 2
    shapes = [(B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, K), (B, T, H), (2, H, K, V), (H,), (H * K,)]
    xs = [torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_() for s in shapes]
    cu = torch.tensor([0, 2, 6])

    def f(q, k, v, g, beta, h0, A_log, dt_bias):
        return kt.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                            use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
                            use_beta_sigmoid_in_kernel=True)

    o, ht = f(*xs)
    assert o.dtype == torch.float64 and ht.dtype == torch.float64
    assert torch.autograd.gradcheck(f, xs)


def test_errors():
    x, _, _ = make(15, T=10)
    with pytest.raises(ValueError, match="'g'"):
        kt.chunk_kda(x["q"], x["k"], x["v"], x["g"][:, :, :, :4], x["beta"])
    with pytest.raises(ValueError, match="'q'"):
        kt.chunk_kda(x["q"].to(torch.int32), x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match="batch size is expected to be 1"):
        kt.chunk_kda(*(t.expand(2, *t.shape[1:]) for t in x.values()), cu_seqlens=torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        kt.chunk_kda(**x, allow_neg_eigval=True)
    with pytest.raises(ValueError, match="A_log"):
        kt.chunk_kda(**x, use_gate_in_kernel=True)
    meta = {n: t.to("meta") for n, t in x.items()}
    with pytest.raises(NotImplementedError, match="CPU backend only"):
        kt.chunk_kda(**meta)
    if torch.cuda.is_available():
        cuda = {n: t.cuda() for n, t in x.items()}
        with pytest.raises(NotImplementedError, match="no CUDA backend"):
            kt.chunk_kda(**cuda)
        with pytest.raises(NotImplementedError, match="no CUDA backend"):
            torch.ops.libkda.chunk_kda_fwd(*cuda.values(), None, None, None, None, None, None, 0, 64, False, False)


def test_eager_fast_path_matches_dispatcher():
    """The public functions skip the dispatcher in plain eager mode; the registered op gives
    bitwise the same results."""
    x, extra, h0 = make(16, T=30, gate="softplus")
    flags = kt._GATE
    o1, fs1, _, _ = torch.ops.libkda.chunk_kda_fwd(*x.values(), extra["A_log"], extra["dt_bias"], h0, None, None,
                                                   None, flags, 64, True, False)
    o2, fs2 = kt.chunk_kda(**x, initial_state=h0, output_final_state=True, use_gate_in_kernel=True, **extra)
    assert torch.equal(o1, o2) and torch.equal(fs1, fs2)
    assert kt._eager_ok(x["q"]) and not kt._eager_ok(x["q"].to("meta"))


def test_fused_kda_gate_older_signature():
    """Kimi Linear's Hugging Face modeling code and vLLM call fused_kda_gate(g [..., H * K], A_log,
    head_k_dim, g_bias=...): the same gate on the unflattened g; beta / threshold are torch's
    softplus parameters."""
    torch.manual_seed(5)
    H, K = 3, 8
    g = torch.randn(2, 7, H * K)
    A_log, dt_bias = torch.rand(H), torch.randn(H * K)
    want = kt.fused_kda_gate(g.unflatten(-1, (H, K)), A_log, dt_bias)
    assert torch.equal(kt.fused_kda_gate(g, A_log, K, g_bias=dt_bias), want)
    assert torch.equal(kt.fused_kda_gate(g, A_log, K, dt_bias), want)  # g_bias positional
    assert torch.equal(kt.fused_kda_gate(g, A_log, head_k_dim=K, g_bias=dt_bias), want)
    ref = -A_log.exp()[:, None] * torch.nn.functional.softplus(g.unflatten(-1, (H, K)) + dt_bias.view(H, K), beta=2.0,
                                                                 threshold=5.0)
    assert torch.allclose(kt.fused_kda_gate(g, A_log, K, g_bias=dt_bias, beta=2.0, threshold=5.0), ref)
    with pytest.raises(ValueError, match="not a multiple of head_k_dim 5"):
        kt.fused_kda_gate(g, A_log, 5)
    # beta / threshold positional, after g_bias
    assert torch.allclose(kt.fused_kda_gate(g, A_log, K, dt_bias, 2.0, 5.0), ref)


def test_fused_kda_gate_older_signature_with_b():
    """The variant fused_kda_gate(g, A, head_k_dim, g_bias=None, b=None, beta=1.0, threshold=20.0)
    returns (g_out, sigmoid(b)) when b [..., H] is given, by keyword or fifth positional; b's
    gradient flows through the sigmoid."""
    torch.manual_seed(6)
    H, K = 2, 8
    g = torch.randn(3, 5, H * K)
    A_log, g_bias = torch.rand(H), torch.randn(H * K)
    b = torch.randn(3, 5, H, dtype=torch.bfloat16, requires_grad=True)
    want = kt.fused_kda_gate(g, A_log, K, g_bias=g_bias)
    for out in (kt.fused_kda_gate(g, A_log, K, g_bias=g_bias, b=b), kt.fused_kda_gate(g, A_log, K, g_bias, b)):
        assert isinstance(out, tuple) and len(out) == 2
        assert torch.equal(out[0], want)
        assert out[1].dtype == torch.float32 and torch.equal(out[1], torch.sigmoid(b.float()))  # FLA's dtype
    ref = kt.fused_kda_gate(g, A_log, K, g_bias, None, 2.0, 5.0)  # b=None positional: beta, threshold follow
    assert torch.allclose(ref, kt.fused_kda_gate(g, A_log, K, g_bias=g_bias, beta=2.0, threshold=5.0))
    kt.fused_kda_gate(g, A_log, K, g_bias, b)[1].float().sum().backward()
    s = torch.sigmoid(b.detach().float())
    assert torch.allclose(b.grad.float(), s * (1 - s), rtol=1e-2, atol=1e-3)
    with pytest.raises(TypeError, match="older form"):
        kt.fused_kda_gate(g.unflatten(-1, (H, K)), A_log, b=b)


@pytest.mark.parametrize("function,keyword,value", [
    ("chunk_kda", "initial_state_indices", [1, 0]),
    ("chunk_kda", "retrieve_parent_token", [[-1, 0, 0]]),
    ("fused_recurrent_kda", "initial_state_indices", [1, 0]),
    ("fused_recurrent_kda_fwd", "retrieve_parent_token", [[-1, 0, 0]]),
])
def test_peer_keywords_that_change_the_computation_raise(function, keyword, value):
    """FLA's functions ignore keywords they do not know, and so do libkda's, except other stacks'
    keywords that would make the call compute something else (SGLang's pooled chunk_kda, vLLM's
    tree speculation): those raise TypeError naming the keyword, before anything is written."""
    x, _, _ = make(3, B=1, T=8, H=1, K=16, V=16)
    pool = torch.randn(2, 1, 16, 16)
    before = pool.clone()
    kwargs = {keyword: torch.tensor(value)}
    if function == "fused_recurrent_kda_fwd":  # the decode entry: one token per row, slot per row
        x = {n: t.reshape(t.shape[1], 1, *t.shape[2:]) for n, t in x.items()}
        kwargs.update(ssm_state_indices=torch.tensor([1, 0, 1, 0, 1, 0, 1, 0]))
        pool = torch.randn(2, 1, 16, 16)
        before = pool.clone()
    else:
        kwargs.update(cu_seqlens=torch.tensor([0, 4, 8]))
    with pytest.raises(TypeError, match=f"libkda.torch.{function}: keyword '{keyword}' is not supported"):
        getattr(kt, function)(**x, initial_state=pool, **kwargs)
    assert torch.equal(pool, before)


def test_decode_with_zero_length_sequences_and_a_short_cu_seqlens():
    """vLLM's CUDA-graph padding of a decode batch: sequences of no tokens anywhere in cu_seqlens
    (with a valid slot: that slot is untouched; with -1) and tokens after cu_seqlens[-1]: o and the
    pool are bitwise the equal-length call on the real rows, the trailing tokens' o is 0, in place
    and out of place (zero states for the trailing tokens)."""
    x, _, _ = make(5, B=1, T=6, H=2, K=16, V=16)
    pool = torch.randn(8, 2, 16, 16)
    real = dict(q=x["q"][:, :4], k=x["k"][:, :4], v=x["v"][:, :4], g=x["g"][:, :4], beta=x["beta"][:, :4])
    expect_pool = pool.clone()
    expect_o, _ = kt.fused_recurrent_kda_fwd(**real, initial_state=expect_pool, cu_seqlens=torch.arange(5),
                                             ssm_state_indices=torch.tensor([3, 5, 1, 6]))
    cu = torch.tensor([0, 1, 1, 2, 3, 4, 4])  # rows 1 and 5 empty; tokens 4 and 5 belong to no row
    slots = torch.tensor([3, 7, 5, 1, 6, -1])
    got_pool = pool.clone()
    o, _ = kt.fused_recurrent_kda_fwd(**x, initial_state=got_pool, cu_seqlens=cu, ssm_state_indices=slots)
    assert o.shape == (1, 6, 2, 16)
    assert torch.equal(o[:, :4], expect_o) and torch.equal(o[:, 4:], torch.zeros_like(o[:, 4:]))
    assert torch.equal(got_pool, expect_pool) and torch.equal(got_pool[7], pool[7])
    untouched = pool.clone()
    o2, states = kt.fused_recurrent_kda_fwd(**x, initial_state=untouched, cu_seqlens=cu, ssm_state_indices=slots,
                                            inplace_final_state=False, output_final_state=True)
    assert torch.equal(o2, o) and torch.equal(untouched, pool)
    assert torch.equal(states[:4], expect_pool[torch.tensor([3, 5, 1, 6])])
    assert torch.equal(states[4:], torch.zeros_like(states[4:]))
    with pytest.raises(ValueError, match=r"'ssm_state_indices'.*< slots = 8.*got 8"):  # an empty row's slot too
        kt.fused_recurrent_kda_fwd(**x, initial_state=pool.clone(), cu_seqlens=cu,
                                   ssm_state_indices=torch.tensor([3, 8, 5, 1, 6, -1]))


def test_decode_all_sequences_empty_and_mismatched_token_counts():
    """cu_seqlens with no tokens at all decodes nothing with [N] or [N, T] indices (o = 0, the pool
    untouched, zero states out of place); a packed k, v, g or beta with another token count than q
    is an error naming it, before the pool is written; peer-only keywords passed as None are
    accepted (a chain decode asks for nothing)."""
    x, _, _ = make(6, B=1, T=4, H=2, K=16, V=16)
    pool = torch.randn(6, 2, 16, 16)
    before = pool.clone()
    for idx, acc in ((torch.tensor([1, 2]), None), (torch.tensor([[1, 2], [3, 4]]), torch.tensor([1, 1]))):
        for inplace in (True, False):
            o, fs = kt.fused_recurrent_kda_fwd(**x, initial_state=pool, cu_seqlens=torch.tensor([0, 0, 0]),
                                               ssm_state_indices=idx, num_accepted_tokens=acc,
                                               inplace_final_state=inplace, output_final_state=True)
            assert torch.equal(o, torch.zeros_like(o)) and o.shape == (1, 4, 2, 16)
            assert torch.equal(pool, before)
            if not inplace:
                assert fs.shape == (4, 2, 16, 16) and torch.equal(fs, torch.zeros_like(fs))
    bad = dict(x, v=torch.randn(1, 6, 2, 16))
    with pytest.raises(ValueError, match=r"argument 'v': expected \[1, 4, \.\.\.\]"):
        kt.fused_recurrent_kda_fwd(**bad, initial_state=pool, cu_seqlens=torch.tensor([0, 2, 4]),
                                   ssm_state_indices=torch.tensor([1, 2]), out=torch.empty(1, 6, 2, 16))
    assert torch.equal(pool, before)
    o, _ = kt.fused_recurrent_kda_fwd(**x, initial_state=pool, cu_seqlens=torch.tensor([0, 2, 4]),
                                      ssm_state_indices=torch.tensor([1, 2]), retrieve_parent_token=None)
    assert o.shape == (1, 4, 2, 16)
