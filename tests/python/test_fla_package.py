"""libkda.torch.chunk_kda against the FLA package's own torch references, imported from the
installed `fla-core` wheel (PyPI), not ported: `fla.ops.kda.naive.naive_recurrent_kda` (FLA's
token-by-token fp32 recurrence, the reference FLA's test_kda.py checks its kernels against),
`naive_chunk_kda` (FLA's chunked fp32 reference) and the gate references
`fla.ops.kda.gate.naive_kda_gate` / `naive_kda_lowerbound_gate`. Gradients come from autograd
through FLA's references.

Three-way checks per case, each with SPEC.md section 4's metric:
- FLA's reference against libkda's fp64 oracle (chunk_kda on float64 inputs) within the fp32
  bound: the two agree on the semantics (scale, grouped value heads, gate formulas, states);
- libkda against the fp64 oracle within SPEC.md's bound for its dtype;
- libkda against FLA's reference within the sum of the two sides' bounds.

scripts/install_deps.sh installs fla-core (pinned, without its triton extra: these references
are plain torch); a missing package is a collection error, not a skip."""

import warnings

import pytest
import torch
from conftest import torch_rel

import libkda.torch as kt

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fla warns that Triton has no GPU here and falls back to the CPU
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

F = torch.nn.functional
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16

# SPEC.md section 4
O_BOUND = {F32: 1e-5, BF16: 5e-3}
GRAD_BOUND = {F32: 1e-4, BF16: 8e-3}
# FLA's references compute in fp32 (they cast every input to float32), so they are held to the
# fp32 bounds against the fp64 oracle, except their output o, which they round to the input dtype.
PEER_O_BOUND, PEER_GRAD_BOUND = 1e-5, 1e-4


def leaves(B, T, H, HV, K, V, seed, h0=True, gate="log"):
    """FLA's test_kda.py inputs: unit-norm q and k rows, g = logsigmoid(randn) / 16 (or the raw
    gate), beta = sigmoid(rand), a random initial state. float64 leaves; cast per test."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=F64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=F64)
    if gate == "log":
        g = F.logsigmoid(torch.randn(B, T, HV, K, generator=gen, dtype=F64)) / 16
    else:
        g = torch.randn(B, T, HV, K, generator=gen, dtype=F64)
    beta = torch.rand(B, T, HV, generator=gen, dtype=F64).sigmoid()
    state = torch.randn(B, HV, K, V, generator=gen, dtype=F64) if h0 else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=state)


def cast(x, dtype):
    """A fresh leaf of x in dtype (the state stays float32, or float64 for the oracle)."""
    return x.detach().to(dtype).requires_grad_(True)


def check(name, out, oracle, peer, dtype, o_like):
    """The three-way check of one tensor; o_like picks the output bounds over the gradient ones."""
    own_bound = (O_BOUND if o_like else GRAD_BOUND)[dtype]
    peer_bound = PEER_O_BOUND if o_like else PEER_GRAD_BOUND
    if peer.dtype != F32:  # FLA's o in the input dtype
        peer_bound = O_BOUND[peer.dtype]
    r_peer = torch_rel(oracle, peer)
    r_own = torch_rel(oracle, out)
    r_between = torch_rel(peer, out)
    msg = (f"{name}: FLA vs fp64 oracle {r_peer:.2e} (bound {peer_bound:.0e}), libkda vs oracle {r_own:.2e} "
           f"(bound {own_bound:.0e}), libkda vs FLA {r_between:.2e} (bound {own_bound + peer_bound:.1e})")
    print(msg)
    assert torch.isfinite(out).all(), msg
    assert r_peer <= peer_bound and r_own <= own_bound and r_between <= own_bound + peer_bound, msg


# (B, T, H, HV, K, V, scale, initial state)
SHAPES = [
    (1, 1, 1, 1, 16, 16, None, False),
    (2, 63, 2, 2, 32, 32, None, True),
    (1, 130, 2, 4, 64, 32, 0.1, True),  # grouped value heads, K != V
    (2, 200, 3, 3, 32, 64, None, True),
    (1, 100, 1, 2, 128, 128, 1.0, False),
]
SHAPE_IDS = [f"B{s[0]}-T{s[1]}-H{s[2]}-HV{s[3]}-K{s[4]}-V{s[5]}-s{s[6]}-h0{int(s[7])}" for s in SHAPES]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_forward_matches_fla_naive_recurrent(shape, dtype):
    B, T, H, HV, K, V, scale, h0 = shape
    x = leaves(B, T, H, HV, K, V, seed=T * 31 + K, h0=h0)
    low = {n: t.to(dtype) for n, t in x.items() if n != "initial_state" and t is not None}
    state = x["initial_state"]
    o_ref, s_ref = kt.chunk_kda(**{n: t.to(F64) for n, t in low.items()}, scale=scale,
                                initial_state=state, output_final_state=True)
    o_peer, s_peer = naive_recurrent_kda(**low, scale=scale, initial_state=None if state is None else state.float(),
                                         output_final_state=True)
    o, s = kt.chunk_kda(**low, scale=scale, initial_state=None if state is None else state.float(),
                       output_final_state=True)
    assert o.dtype == dtype and s.dtype == F32
    check("o", o, o_ref, o_peer, dtype, True)
    check("final_state", s, s_ref, s_peer, dtype, True)


def grads_of(fn, inputs, cot):
    """Runs fn(**inputs) -> (o, final_state) and backpropagates the cotangents cot; returns the
    outputs and the gradients of every leaf that requires one."""
    o, s = fn(**inputs)
    torch.autograd.backward([o, s], [cot[0].to(o.dtype), cot[1].to(s.dtype)])
    leaves_with_grad = {n: t for n, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad}
    return o, s, {n: t.grad for n, t in leaves_with_grad.items()}


def cotangents(gen, B, T, HV, K, V, N=None):
    """float64 cotangents, drawn from gen, of o [B, T, HV, V] and of the final states [N, HV, K, V]
    (N = B unless given: the sequences of a varlen batch)."""
    N = B if N is None else N
    return torch.randn(B, T, HV, V, generator=gen, dtype=F64), torch.randn(N, HV, K, V, generator=gen, dtype=F64)


def check_with_gradients(peer, tensors, cot, final_state=True, common=None, ours=None, ours_fp32=None):
    """The three-way check of o, the final state (with final_state) and the gradient of every
    leaf: libkda's fp64 oracle and fp32 path (chunk_kda with `ours`; the fp32 path also with
    `ours_fp32`) against FLA's `peer` in fp32. `common` goes to all three calls."""
    common, ours, ours_fp32 = common or {}, ours or {}, ours_fp32 or {}

    def run(fn, dtype, **kw):
        inputs = {n: cast(t, dtype) for n, t in tensors.items() if t is not None}
        return grads_of(lambda **a: fn(**a, output_final_state=True, **common, **kw), inputs, cot)

    o_ref, s_ref, g_ref = run(kt.chunk_kda, F64, **ours)
    o_peer, s_peer, g_peer = run(peer, F32)
    o, s, g = run(kt.chunk_kda, F32, **ours, **ours_fp32)
    check("o", o, o_ref, o_peer, F32, True)
    if final_state:
        check("final_state", s, s_ref, s_peer, F32, True)
    for name in g_ref:
        check(f"d{name}", g[name], g_ref[name], g_peer[name], F32, False)


@pytest.mark.parametrize("disable_recompute", [False, True], ids=["remat", "saved"])
@pytest.mark.parametrize("shape", SHAPES[1:4], ids=SHAPE_IDS[1:4])
def test_gradients_match_fla_naive_recurrent(shape, disable_recompute):
    B, T, H, HV, K, V, scale, h0 = shape
    x = leaves(B, T, H, HV, K, V, seed=T * 17 + V, h0=h0)
    cot = cotangents(torch.Generator().manual_seed(T), B, T, HV, K, V)
    check_with_gradients(naive_recurrent_kda, x, cot, final_state=False, common=dict(scale=scale),
                         ours_fp32=dict(disable_recompute=disable_recompute))


@pytest.mark.parametrize("gate", ["softplus", "softplus-no-bias", "lower-bound", "lower-bound-no-A_log"])
def test_gate_in_kernel_matches_fla_gate_references(gate):
    """use_gate_in_kernel against FLA's naive gate followed by its naive recurrence, with the
    gradients of the raw gate, A_log and dt_bias through FLA's gate reference."""
    B, T, H, HV, K, V = 2, 90, 2, 4, 32, 32
    x = leaves(B, T, H, HV, K, V, seed=5, gate="raw")
    gen = torch.Generator().manual_seed(6)
    params = {"A_log": torch.rand(HV, generator=gen, dtype=F64) * 2 - 1,
              "dt_bias": torch.randn(HV * K, generator=gen, dtype=F64) * 0.5}
    if gate == "softplus-no-bias":
        del params["dt_bias"]
    if gate == "lower-bound-no-A_log":
        del params["A_log"]
    lower_bound = -5.0 if gate.startswith("lower-bound") else None
    cot = cotangents(gen, B, T, HV, K, V)

    def peer(g, A_log=None, dt_bias=None, **rest):
        if lower_bound is None:
            decay = naive_kda_gate(g, A_log, dt_bias)
        else:
            decay = naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound=lower_bound)
        return naive_recurrent_kda(g=decay, **rest)

    check_with_gradients(peer, {**x, **params}, cot,
                         ours=dict(use_gate_in_kernel=True, lower_bound=lower_bound, safe_gate=lower_bound is not None))


@pytest.mark.parametrize("allow_neg_eigval", [False, True])
def test_l2norm_and_beta_sigmoid_in_kernel_match_fla_applied_outside(allow_neg_eigval):
    """In-kernel l2norm and beta sigmoid against FLA's reference fed F.normalize(q), F.normalize(k)
    and (2 *) sigmoid(beta), as FLA's tests build it; gradients through those transforms."""
    B, T, H, HV, K, V = 1, 77, 2, 2, 64, 32
    x = leaves(B, T, H, HV, K, V, seed=8)
    gen = torch.Generator().manual_seed(9)
    x["q"] = torch.randn(B, T, H, K, generator=gen, dtype=F64) * 3  # not unit norm: the l2norm matters
    x["k"] = torch.randn(B, T, H, K, generator=gen, dtype=F64) * 3
    x["beta"] = torch.randn(B, T, HV, generator=gen, dtype=F64)  # logits
    cot = cotangents(gen, B, T, HV, K, V)
    c = 2.0 if allow_neg_eigval else 1.0

    def peer(q, k, beta, **rest):
        return naive_recurrent_kda(q=F.normalize(q, dim=-1), k=F.normalize(k, dim=-1), beta=c * beta.sigmoid(), **rest)

    check_with_gradients(peer, x, cot, final_state=False,
                         ours=dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                   allow_neg_eigval=allow_neg_eigval))


def test_varlen_matches_fla_naive_per_sequence():
    """cu_seqlens with boundaries off the chunk grid against FLA's reference run on each
    sequence with its own initial state (how FLA's test_chunk_varlen builds its reference)."""
    cu = [0, 15, 100, 101, 230]
    N, T, H, HV, K, V = len(cu) - 1, cu[-1], 2, 2, 32, 48
    x = leaves(1, T, H, HV, K, V, seed=11, h0=False)
    gen = torch.Generator().manual_seed(12)
    x["initial_state"] = torch.randn(N, HV, K, V, generator=gen, dtype=F64)
    cot = cotangents(gen, 1, T, HV, K, V, N=N)

    def peer(q, k, v, g, beta, initial_state, output_final_state):
        outs, states = [], []
        for i in range(N):
            a, b = cu[i], cu[i + 1]
            o_i, s_i = naive_recurrent_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                           initial_state=initial_state[i:i + 1], output_final_state=True)
            outs.append(o_i)
            states.append(s_i)
        return torch.cat(outs, 1), torch.cat(states, 0)

    check_with_gradients(peer, x, cot, ours=dict(cu_seqlens=torch.tensor(cu, dtype=torch.long)))


@pytest.mark.parametrize("HV", [2, 4], ids=["HV=H", "HV=2H"])
@pytest.mark.parametrize("chunk_size", [32, 64])
def test_forward_matches_fla_naive_chunk(chunk_size, HV):
    """FLA's chunked reference (the chunk form libkda's kernels compute) at its own chunk size,
    with and without grouped value heads."""
    B, T, H, K, V = 2, 192, 2, 64, 48
    x = leaves(B, T, H, HV, K, V, seed=13 + HV)
    low = {n: t.float() for n, t in x.items()}
    o_ref, s_ref = kt.chunk_kda(**x, output_final_state=True)
    o_peer, s_peer = naive_chunk_kda(**low, output_final_state=True, chunk_size=chunk_size)
    o, s = kt.chunk_kda(**low, output_final_state=True, chunk_size=chunk_size)
    check("o", o, o_ref, o_peer, F32, True)
    check("final_state", s, s_ref, s_peer, F32, True)


def test_state_v_first_matches_fla_naive_with_transposed_states():
    B, T, H, HV, K, V = 2, 70, 1, 2, 32, 64
    x = leaves(B, T, H, HV, K, V, seed=14)
    low = {n: t.float() for n, t in x.items()}
    o_peer, s_peer = naive_recurrent_kda(**low, output_final_state=True)
    vf = dict(low, initial_state=low["initial_state"].transpose(-1, -2).contiguous())
    o, s = kt.chunk_kda(**vf, output_final_state=True, state_v_first=True)
    assert s.shape == (B, HV, V, K)
    assert torch_rel(o_peer, o) <= 2e-5 and torch_rel(s_peer, s.transpose(-1, -2)) <= 2e-5, (
        f"o {torch_rel(o_peer, o):.2e}, final_state {torch_rel(s_peer, s.transpose(-1, -2)):.2e} (bound 2e-5)")


@pytest.mark.parametrize("state_v_first", [False, True], ids=["k-first", "v-first"])
@pytest.mark.parametrize("T", [1, 3])
def test_pool_decode_matches_fla_naive_recurrent(T, state_v_first):
    """vLLM's decode entry (fused_recurrent_kda with ssm_state_indices, pool updated in place)
    against FLA's reference run on each sequence from its slot's state: outputs, the written
    slots, and the slots no sequence names left bitwise as they were."""
    N, H, HV, K, V, slots = 5, 2, 4, 64, 32, 9
    x = leaves(N, T, H, HV, K, V, seed=20 + T, gate="raw")
    gen = torch.Generator().manual_seed(21)
    A_log = torch.rand(HV, generator=gen) * 2 - 1
    dt_bias = torch.randn(HV * K, generator=gen) * 0.5
    pool = torch.randn(slots, HV, K, V, generator=gen)
    index = torch.tensor([7, 0, 3, -1, 5], dtype=torch.int32)  # row 3 is padding
    low = {n: x[n].to(BF16) for n in ("q", "k", "v", "g", "beta")}
    qn, kn = F.normalize(low["q"].float(), dim=-1), F.normalize(low["k"].float(), dim=-1)
    decay = naive_kda_lowerbound_gate(low["g"], A_log, dt_bias, lower_bound=-5.0)
    live = index >= 0
    o_peer, s_peer = naive_recurrent_kda(qn[live], kn[live], low["v"][live], decay[live], low["beta"][live],
                                         initial_state=pool[index[live].long()], output_final_state=True)
    ours = pool.transpose(-1, -2).contiguous() if state_v_first else pool.clone()
    o, fs = kt.fused_recurrent_kda(**low, A_log=A_log, dt_bias=dt_bias, initial_state=ours,
                                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0,
                                   state_v_first=state_v_first, ssm_state_indices=index, inplace_final_state=True)
    assert fs.data_ptr() == ours.data_ptr()
    after = ours.transpose(-1, -2) if state_v_first else ours
    r_o = torch_rel(o_peer, o[live])
    r_s = torch_rel(s_peer, after[index[live].long()])
    assert r_o <= 1e-2 and r_s <= 5e-3, f"o {r_o:.2e} (bound 1e-2), written states {r_s:.2e} (bound 5e-3)"
    assert torch.equal(o[~live], torch.zeros_like(o[~live])), "padding row's output is not 0"
    untouched = [s for s in range(slots) if s not in index.tolist()]
    assert torch.equal(after[untouched], pool[untouched]), "a slot no sequence names changed"
