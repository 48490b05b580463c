"""FLA's own KDA test cases (fla-org/flash-linear-attention tests/ops/test_kda.py: test_chunk,
test_chunk_varlen, test_chunk_varlen_prefill, test_gate, test_chunk_return_intermediate_states,
test_flash_kda_chunk, test_flash_kda_chunk_varlen, test_chunk_use_beta_sigmoid_in_kernel,
test_chunk_state_v_first, test_naive_chunk, test_fused_recurrent,
test_fused_recurrent_use_beta_sigmoid_in_kernel, test_fused_recurrent_state_v_first,
test_fused_recurrent_gate_in_kernel, test_fused_recurrent_vllm_decode; tests/ops/test_kda_graph.py's
zero-length tail sequences, eager) run on libkda.torch with
FLA's metric and tolerances: rms(ref - ours) / rms(ref), skipped when the largest absolute error
is below 1e-6. The reference is stricter than FLA's: the token-by-token recurrence and the gate
evaluated in float64 on float64 copies of the inputs (so every tolerance is against the exact
answer, not against another low-precision kernel).

The case matrices are FLA's; by default each sequence is cut to at most 256 tokens and 4 heads so
the whole file runs in seconds on 2 cores. KDA_LARGE_TESTS=1 runs FLA's full sizes (T up to 8192)."""

import inspect
import os

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from libkda.torch import (chunk_kda, fused_kda_gate, fused_recurrent_kda, fused_recurrent_kda_fwd,  # noqa: E402
                          naive_chunk_kda, naive_kda_gate, naive_kda_lowerbound_gate, naive_recurrent_kda)

LARGE = os.environ.get("KDA_LARGE_TESTS") == "1"
F64 = torch.float64


def cap_t(T):
    return T if LARGE else min(T, 256)


def cap_h(H):
    return H if LARGE else min(H, 4)


def fla_assert_close(name, ref, tri, ratio, err_atol=1e-6):
    """FLA's assert_close (fla/utils.py): the rms error ratio, unless every error is tiny."""
    ref = ref.detach().to(F64)
    tri = tri.detach().to(F64)
    abs_err = (ref - tri).abs().max().item()
    err = (ref - tri).square().mean().sqrt().item()
    base = ref.square().mean().sqrt().item()
    rate = err / (base + 1e-8)
    assert abs_err <= err_atol or rate < ratio, (
        f"{name}: rms error ratio {rate:.3e} >= {ratio} (max abs error {abs_err:.3e}, rms of reference {base:.3e})")


def check_forward_and_grads(ref, tri, grad_tols):
    """FLA's test_chunk / test_chunk_varlen checks: o and ht at 0.005, then dq, dk, dv, dg, db,
    dh0 at grad_tols. ref, tri: (o, ht, [dq, dk, dv, dg, db, dh0, ...])."""
    fla_assert_close("o", ref[0], tri[0], 0.005)
    fla_assert_close("ht", ref[1], tri[1], 0.005)
    for name, r, t, tol in zip(("dq", "dk", "dv", "dg", "db", "dh0"), ref[2], tri[2], grad_tols):
        fla_assert_close(name, r, t, tol)


def leaves(*xs):
    return [None if x is None else x.detach().clone().requires_grad_(True) for x in xs]


def f64(*xs):
    """float64 leaves holding the same values: the reference's inputs."""
    return [None if x is None else x.detach().to(F64).requires_grad_(True) for x in xs]


def fla_naive_gate(g, A_log=None, dt_bias=None, lower_bound=None, dtype=F64):
    """FLA's naive_kda_gate / naive_kda_lowerbound_gate (fla/ops/kda/gate.py) written out, computed
    in dtype: ``-exp(A_log) * softplus(g + dt_bias)``, or ``lower_bound * sigmoid(exp(A_log) * (g +
    dt_bias))`` (no A_log: exp(A_log) = 1). libkda's own naive gates are its fused_kda_gate, so the
    tests of that gate need this independent one."""
    H, K = g.shape[-2:]
    x = g.to(dtype) + (0 if dt_bias is None else dt_bias.to(dtype).reshape(H, K))
    a = 1 if A_log is None else A_log.to(dtype).reshape(H, 1).exp()
    return -a * F.softplus(x) if lower_bound is None else lower_bound * torch.sigmoid(a * x)


# Tokens per activation-checkpointed piece of the float64 reference recurrence.
REFERENCE_PIECE = 256


def checkpointed_recurrence(q, k, v, g, beta, scale, h0):
    """naive_recurrent_kda in pieces of REFERENCE_PIECE tokens, each piece's final state the next
    one's initial state (0 + S: exact), each piece under activation checkpointing. The float64
    operations are the same, but autograd keeps the states at piece boundaries instead of every
    token's: FLA's D = 256, T = 4096 varlen case otherwise holds about 16 GB, more than this
    machine class's 24 GB leaves to the rest of KDA_LARGE_TESTS=1."""
    from torch.utils.checkpoint import checkpoint

    def piece(q_, k_, v_, g_, b_, s_):
        return naive_recurrent_kda(q_, k_, v_, g_, b_, scale=scale, initial_state=s_, output_final_state=True)

    T = q.shape[1]
    if T <= REFERENCE_PIECE:
        return piece(q, k, v, g, beta, h0)
    o, S = [], h0
    for a in range(0, T, REFERENCE_PIECE):
        b = min(T, a + REFERENCE_PIECE)
        o_a, S = checkpoint(piece, q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], S, use_reentrant=False)
        o.append(o_a)
    return torch.cat(o, 1), S


def test_checkpointed_reference_is_the_plain_recurrence_bitwise():
    """The pieces change what autograd keeps, not one bit of the outputs or the gradients."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, HV, K, V = 2, 2 * REFERENCE_PIECE + 37, 1, 2, 8, 4
    x = [torch.randn(*shape, generator=gen, dtype=F64) for shape in
         ((B, T, H, K), (B, T, H, K), (B, T, HV, V), (B, T, HV, K), (B, T, HV), (B, HV, K, V))]
    x[3] = -torch.rand(B, T, HV, K, generator=gen, dtype=F64)  # log decay
    x[4] = torch.rand(B, T, HV, generator=gen, dtype=F64)  # beta
    results = []
    for run in (lambda *a: naive_recurrent_kda(*a[:5], scale=0.3, initial_state=a[5], output_final_state=True),
                lambda *a: checkpointed_recurrence(*a[:5], 0.3, a[5])):
        leaves_ = [t.clone().requires_grad_() for t in x]
        o, ht = run(*leaves_)
        (o.square().sum() + ht.sum()).backward()
        results.append([o.detach(), ht.detach()] + [t.grad for t in leaves_])
    for name, plain, pieced in zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"), *results):
        assert torch.equal(plain, pieced), f"{name}: max difference {(plain - pieced).abs().max().item():.3e}"


def recurrent_reference(q, k, v, g, beta, h0, cu_seqlens=None, scale=None):
    """naive_recurrent_kda (float64 inputs in, so a float64 recurrence) run sequence by sequence
    over cu_seqlens (B = 1, h0 [N, HV, K, V]) or on the whole batch; returns (o, final states)."""
    if cu_seqlens is None:
        return checkpointed_recurrence(q, k, v, g, beta, scale, h0)
    o, ht = [], []
    for i in range(len(cu_seqlens) - 1):
        a, b = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        o_i, ht_i = checkpointed_recurrence(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale,
                                            None if h0 is None else h0[i:i + 1])
        o.append(o_i)
        ht.append(ht_i)
    return torch.cat(o, 1), torch.cat(ht, 0)


def grads(*xs):
    out = [None if x is None else x.grad for x in xs]
    for x in xs:
        if x is not None:
            x.grad = None
    return out


# ------------------------------------------------------------------------------------------
# test_chunk: fixed length, GVA (HV > H), gate in kernel, safe gate, chunk sizes, both
# residual policies, fp16 / bf16.
# (B, T, H, HV, D, scale, gate_logit_normalizer, mask_p, qk_l2norm_in_kernel, gate_in_kernel,
#  dtype, safe_gate, disable_recompute, chunk_size)
CHUNK_CASES = [
    (1, 63, 1, 1, 64, 1, 1, 0, False, False, torch.float16, True, False, 64),
    (2, 500, 3, 3, 60, 1, 1, 0, False, False, torch.float16, True, True, 64),
    (2, 1000, 3, 3, 64, 0.1, 1, 0.5, False, False, torch.float16, False, True, 64),
    (3, 1024, 4, 4, 100, 1, 0.1, 0, False, False, torch.float16, False, False, 64),
    (4, 1024, 4, 4, 128, 0.1, 1, 0, False, False, torch.float16, True, True, 64),
    (4, 1024, 4, 4, 128, 0.1, 1, 0, True, False, torch.float16, True, False, 64),
    (2, 1500, 4, 4, 128, 0.1, 10, 0, False, True, torch.float16, False, True, 64),
    (4, 2048, 8, 8, 64, 0.1, 1, 0, False, True, torch.float16, True, True, 64),
    (2, 1024, 2, 4, 64, 0.1, 1, 0, False, False, torch.float16, False, False, 64),
    (2, 1024, 2, 8, 64, 0.1, 1, 0, False, True, torch.float16, False, False, 64),
    (2, 1024, 4, 8, 128, 0.1, 1, 0, True, True, torch.float16, False, False, 64),
    (2, 160, 2, 4, 64, 0.1, 1, 0, False, True, torch.float16, True, True, 32),
    (2, 1024, 2, 4, 64, 0.1, 1, 0, True, True, torch.bfloat16, True, False, 64),
    (2, 1024, 2, 4, 64, 0.1, 1, 0, False, True, torch.bfloat16, False, False, 64),
    (2, 160, 2, 4, 64, 0.1, 1, 0, False, True, torch.bfloat16, True, True, 32),
    (2, 1024, 2, 8, 128, 0.1, 1, 0, True, True, torch.bfloat16, False, False, 64),
]


@pytest.mark.parametrize("case", CHUNK_CASES, ids=lambda c: "B{}-T{}-H{}-HV{}-D{}-s{}-n{}-m{}-l2{}-gate{}-{}-safe{}-dr{}-c{}"
                         .format(*c).replace("torch.", ""))
def test_chunk(case):
    B, T, H, HV, D, scale, norm, mask_p, l2_in_kernel, gate_in_kernel, dtype, safe_gate, disable_recompute, cs = case
    T = cap_t(T)
    if not LARGE and HV > 4:  # keep the group ratio HV / H
        H, HV = max(1, H * 4 // HV), 4
    torch.manual_seed(42)
    q = torch.rand(B, T, H, D, dtype=dtype)
    k = torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, HV, D, dtype=dtype)
    g = torch.randn(B, T, HV, D, dtype=torch.float if not gate_in_kernel else dtype)
    A_log = dt_bias = None
    if gate_in_kernel:
        A_log = torch.randn(HV, dtype=torch.float)
        dt_bias = torch.randn(HV * D, dtype=torch.float)
    else:
        g = F.logsigmoid(g) / norm
        g = g * (torch.rand_like(g) > mask_p)
    lower_bound = -5.0 if safe_gate else None
    if safe_gate and not gate_in_kernel:
        g = g.clamp(-5, 0)
    beta = torch.randn(B, T, HV, dtype=dtype).sigmoid()
    h0 = torch.randn(B, HV, D, D, dtype=torch.float32)
    do = torch.randn_like(v)
    dht = torch.randn_like(h0)

    # float64 reference
    rq, rk, rv, rg, rb, rh0, rA, rbias = f64(q, k, v, g, beta, h0, A_log, dt_bias)
    if gate_in_kernel:
        gate_fn = naive_kda_lowerbound_gate if safe_gate else naive_kda_gate
        rgate = gate_fn(rg, rA, rbias, output_dtype=F64)
    else:
        rgate = rg
    ref, ref_ht = naive_recurrent_kda(F.normalize(rq, p=2, dim=-1), F.normalize(rk, p=2, dim=-1), rv, rgate, rb,
                                      scale=scale, initial_state=rh0, output_final_state=True)
    ((ref * do.to(F64)).sum() + (ref_ht * dht.to(F64)).sum()).backward()
    ref_g = grads(rq, rk, rv, rg, rb, rh0, rA, rbias)

    q, k, v, g, beta, h0 = leaves(q, k, v, g, beta, h0)
    if gate_in_kernel:
        A_log, dt_bias = leaves(A_log, dt_bias)
    tri, tri_ht = chunk_kda(
        q=q if l2_in_kernel else F.normalize(q, p=2, dim=-1), k=k if l2_in_kernel else F.normalize(k, p=2, dim=-1),
        v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=l2_in_kernel, use_gate_in_kernel=gate_in_kernel, safe_gate=safe_gate,
        lower_bound=lower_bound, disable_recompute=disable_recompute, chunk_size=cs)
    ((tri * do).sum() + (tri_ht * dht).sum()).backward()
    tri_g = grads(q, k, v, g, beta, h0, A_log, dt_bias)

    check_forward_and_grads((ref, ref_ht, ref_g), (tri, tri_ht, tri_g), (0.008, 0.008, 0.008, 0.02, 0.02, 0.008))
    if gate_in_kernel:
        # FLA only warns above 0.003; SPEC.md 4 bounds dA_log at 2e-2 for bf16/fp16 inputs (bf16
        # cases measure 3.8e-3 here, fp16 ones stay under 0.003).
        fla_assert_close("dA", ref_g[6], tri_g[6], 0.003 if dtype == torch.float16 else 0.02)
        fla_assert_close("dbias", ref_g[7], tri_g[7], 0.008)


# ------------------------------------------------------------------------------------------
# test_chunk_varlen: packed sequences (cu_seqlens), g = -1000 on masked channels, gate in kernel
# with FLA's [1, 1, H, 1] A_log, odd head dims (60, 100), chunk 32.
# (H, D, mask_p, cu_seqlens, dtype, gate_in_kernel, safe_gate, disable_recompute, chunk_size)
VARLEN_CASES = [
    (4, 60, 0.1, [0, 15], torch.float16, True, False, False, 64),
    (4, 64, 0.9, [0, 256, 500, 1000], torch.float16, True, False, False, 64),
    (4, 128, 0.5, [0, 256, 500, 1000], torch.float16, False, False, False, 64),
    (4, 100, 0, [0, 15, 100, 300, 1200, 2000], torch.float16, True, False, False, 64),
    (4, 256, 0, [0, 100, 300, 1200, 3000, 4096], torch.float16, False, True, True, 64),
    (4, 60, 0.1, [0, 31, 96, 160], torch.float16, True, False, True, 32),
]


def _scaled_cu_seqlens(cu):
    """Each sequence cut to cap_t tokens (boundaries stay non-aligned)."""
    lengths = [cap_t(b - a) for a, b in zip(cu[:-1], cu[1:])]
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _varlen_inputs(H, D, mask_p, cu, dtype, gate_in_kernel, safe_gate):
    """test_chunk_varlen's and test_chunk_varlen_prefill's inputs, drawn in FLA's order (seed 42):
    cu, q, k, v, g (masked to -1000 with probability mask_p), A_log / dt_bias, beta, h0."""
    torch.manual_seed(42)
    cu = torch.LongTensor(_scaled_cu_seqlens(cu))
    T, N = int(cu[-1]), len(cu) - 1
    q = torch.randn((1, T, H, D), dtype=dtype)
    k = F.normalize(torch.randn(1, T, H, D, dtype=torch.float32), p=2, dim=-1).to(dtype)
    v = torch.randn((1, T, H, D), dtype=dtype)
    g = torch.randn(1, T, H, D, dtype=torch.float if not gate_in_kernel else dtype)
    A_log = dt_bias = None
    if gate_in_kernel:
        A_log = torch.log(torch.randn(1, 1, H, 1, dtype=torch.float32).uniform_(1, 16))
        dt_bias = torch.randn(H * D, dtype=torch.float32)
    else:
        g = F.logsigmoid(g)
        g = g * (torch.rand_like(g) > mask_p)
    mask = torch.rand_like(g) > mask_p
    g = g * mask + (~mask) * (-1000)
    if safe_gate:
        g = g.clamp(-5, 0)
    beta = torch.rand(1, T, H, dtype=dtype).sigmoid()
    h0 = torch.randn((N, H, D, D), dtype=torch.float32)
    return cu, T, N, q, k, v, g, A_log, dt_bias, beta, h0


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: "H{}-D{}-m{}-cu{}-{}-gate{}-safe{}-dr{}-c{}"
                         .format(*c).replace("torch.", "").replace(" ", ""))
def test_chunk_varlen(case):
    H, D, mask_p, cu, dtype, gate_in_kernel, safe_gate, disable_recompute, cs = case
    cu, T, N, q, k, v, g, A_log, dt_bias, beta, h0 = _varlen_inputs(H, D, mask_p, cu, dtype, gate_in_kernel,
                                                                     safe_gate)
    do = torch.randn_like(v)
    dht = torch.rand_like(h0)

    rq, rk, rv, rg, rb, rh0, rA, rbias = f64(q, k, v, g, beta, h0, A_log, dt_bias)
    gate = naive_kda_gate(rg, rA, rbias, output_dtype=F64) if gate_in_kernel else rg
    ref, ref_ht = recurrent_reference(F.normalize(rq, p=2, dim=-1), rk, rv, gate, rb, rh0, cu)
    ((ref * do.to(F64)).sum() + (ref_ht * dht.to(F64)).sum()).backward()
    ref_g = grads(rq, rk, rv, rg, rb, rh0, rA, rbias)

    q, k, v, g, beta, h0 = leaves(q, k, v, g, beta, h0)
    if gate_in_kernel:
        A_log, dt_bias = leaves(A_log, dt_bias)
    tri, tri_ht = chunk_kda(q=F.normalize(q, p=2, dim=-1), k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
                            initial_state=h0, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu,
                            use_gate_in_kernel=gate_in_kernel, safe_gate=safe_gate,
                            disable_recompute=disable_recompute, chunk_size=cs)
    ((tri * do).sum() + (tri_ht * dht).sum()).backward()
    tri_g = grads(q, k, v, g, beta, h0, A_log, dt_bias)

    check_forward_and_grads((ref, ref_ht, ref_g), (tri, tri_ht, tri_g), (0.007, 0.008, 0.007, 0.015, 0.015, 0.007))
    if gate_in_kernel:
        assert tri_g[6].shape == A_log.shape, "dA_log not in the caller's shape"
        fla_assert_close("dA", ref_g[6], tri_g[6], 0.008)
        fla_assert_close("dbias", ref_g[7], tri_g[7], 0.005)


# ------------------------------------------------------------------------------------------
# test_chunk_varlen_prefill: test_chunk_varlen's cases forward only, under torch.inference_mode
# (FLA's prefill path), o and ht at 0.005. Its first case is one 8192-token sequence.
@pytest.mark.parametrize("H,D,mask_p,cu,dtype,gate_in_kernel,safe_gate,disable_recompute", [
    (4, 60, 0.1, [0, 8192], torch.float16, True, False, False),
    (4, 64, 0.9, [0, 256, 500, 1000], torch.float16, True, False, False),
    (4, 128, 0.5, [0, 256, 500, 1000], torch.float16, False, False, False),
    (4, 100, 0, [0, 15, 100, 300, 1200, 2000], torch.float16, True, False, False),
    (4, 256, 0, [0, 100, 300, 1200, 3000, 4096], torch.float16, False, True, True),
], ids=lambda x: str(x).replace("torch.", "").replace(" ", ""))
@torch.inference_mode()
def test_chunk_varlen_prefill(H, D, mask_p, cu, dtype, gate_in_kernel, safe_gate, disable_recompute):
    cu, T, N, q, k, v, g, A_log, dt_bias, beta, h0 = _varlen_inputs(H, D, mask_p, cu, dtype, gate_in_kernel,
                                                                     safe_gate)

    tri, tri_ht = chunk_kda(q=F.normalize(q.clone(), p=2, dim=-1), k=k.clone(), v=v.clone(), g=g.clone(),
                            beta=beta.clone(), A_log=A_log, dt_bias=dt_bias, initial_state=h0.clone(),
                            output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(),
                            use_gate_in_kernel=gate_in_kernel, safe_gate=safe_gate,
                            disable_recompute=disable_recompute)
    gate = fla_naive_gate(g, A_log, dt_bias) if gate_in_kernel else g.to(F64)
    ref, ref_ht = recurrent_reference(F.normalize(q.to(F64), p=2, dim=-1), k.to(F64), v.to(F64), gate,
                                      beta.to(F64), h0.to(F64), cu)
    fla_assert_close("o", ref, tri, 0.005)
    fla_assert_close("ht", ref_ht, tri_ht, 0.005)


# ------------------------------------------------------------------------------------------
# test_gate: fused_kda_gate and the naive gates, called with FLA's keywords, over FLA's
# HAS_A_LOG x HAS_BIAS x LOWER_BOUND matrix; forward, dg, dA_log (in A_log's [1, 1, H, 1]) and
# dbias at 1e-4 against FLA's naive gate computed as FLA computes it, in float32. (Not against
# float64: there FLA's own float32 naive gate is 2.0e-4 off in dA on the first case, whose dA sums
# 24 saturated-sigmoid terms to 5e-2; 1e-4 bounds a float32 evaluation, not the exact value.)
@pytest.mark.parametrize("B,T,H,D,has_a_log,has_bias,lower_bound", [
    (1, 2, 2, 12, True, False, -5.0),
    (1, 32, 2, 16, True, False, -5.0),
    (2, 64, 4, 32, True, False, -5.0),
    (4, 128, 8, 64, True, False, -5.0),
    (4, 128, 8, 128, True, False, None),
    (1, 2, 2, 12, True, True, None),
    (1, 32, 2, 16, True, True, None),
    (2, 64, 4, 32, True, True, None),
    (4, 128, 8, 64, True, True, None),
    (4, 128, 8, 128, True, True, None),
    (1, 2, 2, 12, False, False, -5.0),
    (2, 64, 4, 32, False, False, -5.0),
    (4, 128, 8, 64, False, True, -5.0),
    (4, 128, 8, 128, False, True, -5.0),
], ids=lambda x: str(x))
def test_gate(B, T, H, D, has_a_log, has_bias, lower_bound):
    torch.manual_seed(42)
    g = torch.randn(B, T, H, D, dtype=torch.float32) * 10
    A_log = torch.log(torch.randn(1, 1, H, 1, dtype=torch.float32).uniform_(1, 16)) if has_a_log else None
    dt_bias = torch.randn(H * D, dtype=torch.float32) if has_bias else None
    do = torch.randn_like(g)
    rg, rA, rbias = leaves(g, A_log, dt_bias)
    ref = fla_naive_gate(rg, rA, rbias, lower_bound, dtype=torch.float32)
    (ref * do).sum().backward()
    ref_dg, ref_dA, ref_dbias = grads(rg, rA, rbias)

    def naive(g, A_log, dt_bias):  # FLA's reference call, FLA's keywords
        if lower_bound is None:
            return naive_kda_gate(g=g, A_log=A_log, dt_bias=dt_bias)
        return naive_kda_lowerbound_gate(g=g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)

    def fused(g, A_log, dt_bias):
        return fused_kda_gate(g=g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)

    for name, gate_fn in (("naive", naive), ("fused", fused)):
        tg, tA, tbias = leaves(g, A_log, dt_bias)
        tri = gate_fn(tg, tA, tbias)
        (tri * do).sum().backward()
        fla_assert_close(f"{name} o", ref, tri, 1e-4)
        fla_assert_close(f"{name} dg", ref_dg, tg.grad, 1e-4)
        if has_a_log:
            assert tA.grad.shape == A_log.shape
            fla_assert_close(f"{name} dA", ref_dA, tA.grad, 1e-4)
        if has_bias:
            fla_assert_close(f"{name} dbias", ref_dbias, tbias.grad, 1e-4)


# ------------------------------------------------------------------------------------------
# test_chunk_return_intermediate_states, at FLA's sizes (B=2, T=1024, H=4, D=128, bf16): in
# inference mode h is the state entering every 64-token chunk, [B, NT, H, K, V] in the input
# dtype (varlen: [1, NC, H, K, V]). FLA's inputs (raw randn g, so growing decays) overflow; only
# shapes and dtypes are checked, as FLA does, plus h[:, 0] = the (zero) initial state.
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_chunk_return_intermediate_states(dtype):
    torch.manual_seed(42)
    B, T, H, D, chunk_size = 2, 1024, 4, 128, 64
    q, k, v, g = (torch.randn(B, T, H, D, dtype=dtype) for _ in range(4))
    beta = torch.rand(B, T, H, dtype=dtype)
    with torch.inference_mode():
        o, final_state, h = chunk_kda(q=q, k=k, v=v, g=g, beta=beta, initial_state=None, output_final_state=True,
                                      return_intermediate_states=True, disable_recompute=False)
        assert o.shape == (B, T, H, D)
        assert final_state.shape == (B, H, D, D)
        assert h.shape == (B, (T + chunk_size - 1) // chunk_size, H, D, D) and h.dtype == dtype
        assert not h[:, 0].any(), "the state entering the first chunk is not the zero initial state"

        N = 2
        cu_seqlens = torch.tensor([0, T // N, T], dtype=torch.long)
        q, k, v, g = (torch.randn(1, T, H, D, dtype=dtype) for _ in range(4))
        beta = torch.rand(1, T, H, dtype=dtype)
        o, final_state, h = chunk_kda(q=q, k=k, v=v, g=g, beta=beta, initial_state=None, output_final_state=True,
                                      cu_seqlens=cu_seqlens, return_intermediate_states=True,
                                      disable_recompute=False)
        assert o.shape == (1, T, H, D)
        assert final_state.shape == (N, H, D, D)
        assert h.shape[0] == 1 and h.shape[2:] == (H, D, D) and h.dtype == dtype


# ------------------------------------------------------------------------------------------
# test_flash_kda_chunk / test_flash_kda_chunk_varlen: chunk_kda called with the keywords that
# route FLA to its FlashKDA backend (l2norm, gate and beta sigmoid in kernel, safe gate at -5,
# V-first states), also bound positionally through inspect.signature(chunk_kda), at 0.006 against
# FLA's gold (the float64 recurrence; beta = sigmoid(raw) * 2 with allow_neg_eigval). FLA also
# asserts which backend ran; libkda has one. Sizes cut like the rest of this file.
_FLASH_KDA_REQUIRED_KWARGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                  use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                                  state_v_first=True)


def _flash_kda_run(positional=False, **kwargs):
    with torch.inference_mode():
        if positional:
            bound = inspect.signature(chunk_kda).bind(**kwargs, **_FLASH_KDA_REQUIRED_KWARGS)
            bound.apply_defaults()
            return chunk_kda(*bound.args, **bound.kwargs)
        return chunk_kda(**kwargs, **_FLASH_KDA_REQUIRED_KWARGS)


def _flash_kda_gold(q, k, v, g, beta_raw, A_log, dt_bias, scale, h0_vk, cu_seqlens=None, allow_neg_eigval=False):
    """FLA's _flash_kda_gold in float64: V-first states in and out."""
    gate = fla_naive_gate(g, A_log, dt_bias, -5.0)
    beta = torch.sigmoid(beta_raw.to(F64)) * (2 if allow_neg_eigval else 1)
    o, ht = recurrent_reference(F.normalize(q.to(F64), dim=-1), F.normalize(k.to(F64), dim=-1), v.to(F64), gate,
                                beta, h0_vk.to(F64).transpose(-1, -2), cu_seqlens, scale)
    return o, ht.transpose(-1, -2)


@pytest.mark.parametrize("B,T,H,D,allow_neg_eigval,has_A,has_bias,positional", [
    pytest.param(1, 1024, 4, 128, False, True, True, False, id="dense"),
    pytest.param(2, 2048, 8, 128, False, True, True, False, id="batched"),
    pytest.param(1, 4096, 16, 128, False, True, True, False, id="long"),
    pytest.param(1, 1024, 4, 128, True, True, True, False, id="negative-eigenvalues"),
    pytest.param(1, 1024, 4, 128, False, False, True, False, id="no-A"),
    pytest.param(1, 1024, 4, 128, False, True, False, False, id="no-bias"),
    pytest.param(1, 1024, 4, 128, False, True, True, True, id="positional"),
    pytest.param(1, 1024, 4, 128, True, True, True, True, id="positional-negative-eigenvalues"),
])
def test_flash_kda_chunk(B, T, H, D, allow_neg_eigval, has_A, has_bias, positional):
    T, H = cap_t(T), cap_h(H)
    torch.manual_seed(42)
    dtype = torch.bfloat16
    q, k, v = (torch.rand(B, T, H, D, dtype=dtype) for _ in range(3))
    g = torch.randn(B, T, H, D, dtype=dtype)
    beta = torch.randn(B, T, H, dtype=dtype)
    A_log = torch.log(torch.empty(H, dtype=torch.float32).uniform_(1, 16))
    dt_bias = torch.randn(H * D, dtype=torch.float32)
    A_log, dt_bias = (A_log if has_A else None), (dt_bias if has_bias else None)
    h0 = torch.randn(B, H, D, D, dtype=torch.float32)
    scale = D ** -0.5
    ref_o, ref_ht = _flash_kda_gold(q, k, v, g, beta, A_log, dt_bias, scale, h0, allow_neg_eigval=allow_neg_eigval)
    tri_o, tri_ht = _flash_kda_run(positional=positional, q=q, k=k, v=v, g=g, beta=beta, A_log=A_log,
                                   dt_bias=dt_bias, scale=scale, initial_state=h0.clone(), output_final_state=True,
                                   allow_neg_eigval=allow_neg_eigval)
    fla_assert_close("o", ref_o, tri_o, 0.006)
    fla_assert_close("ht", ref_ht, tri_ht, 0.006)


@pytest.mark.parametrize("H,D,cu,allow_neg_eigval,has_A,has_bias", [
    pytest.param(4, 128, [0, 256, 500, 1000], False, True, True, id="varlen"),
    pytest.param(8, 128, [0, 100, 300, 1200, 2000], False, True, True, id="multi-sequence"),
    pytest.param(16, 128, [0, 101, 303, 1205, 3007, 4096], False, True, True, id="unaligned"),
    pytest.param(4, 128, [0, 256, 500, 1000], True, True, True, id="negative-eigenvalues"),
    pytest.param(4, 128, [0, 256, 500, 1000], False, False, True, id="no-A"),
    pytest.param(4, 128, [0, 256, 500, 1000], False, True, False, id="no-bias"),
])
def test_flash_kda_chunk_varlen(H, D, cu, allow_neg_eigval, has_A, has_bias):
    H = cap_h(H)
    torch.manual_seed(42)
    dtype = torch.bfloat16
    cu = torch.LongTensor(_scaled_cu_seqlens(cu))
    T, N = int(cu[-1]), len(cu) - 1
    q, k, v, g = (torch.randn(1, T, H, D, dtype=dtype) for _ in range(4))
    beta = torch.randn(1, T, H, dtype=dtype)
    A_log = torch.log(torch.empty(H, dtype=torch.float32).uniform_(1, 16))
    dt_bias = torch.randn(H * D, dtype=torch.float32)
    A_log, dt_bias = (A_log if has_A else None), (dt_bias if has_bias else None)
    h0 = torch.randn(N, H, D, D, dtype=torch.float32)
    scale = D ** -0.5
    ref_o, ref_ht = _flash_kda_gold(q, k, v, g, beta, A_log, dt_bias, scale, h0, cu_seqlens=cu,
                                    allow_neg_eigval=allow_neg_eigval)
    tri_o, tri_ht = _flash_kda_run(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
                                   initial_state=h0.clone(), output_final_state=True, cu_seqlens=cu,
                                   allow_neg_eigval=allow_neg_eigval)
    fla_assert_close("o", ref_o, tri_o, 0.006)
    fla_assert_close("ht", ref_ht, tri_ht, 0.006)


# ------------------------------------------------------------------------------------------
# test_chunk_use_beta_sigmoid_in_kernel: raw beta logits with the sigmoid (x2 with
# allow_neg_eigval) in kernel against the same call with beta activated outside, every gradient
# (the raw-beta one after its cast to the input dtype) within 1e-4.
@pytest.mark.parametrize("B,T,H,D,allow_neg_eigval,dtype", [
    (1, 8192, 96, 128, False, torch.bfloat16),
    (1, 8192, 96, 128, True, torch.bfloat16),
    (2, 96, 2, 64, True, torch.float16),
])
def test_chunk_use_beta_sigmoid_in_kernel(B, T, H, D, allow_neg_eigval, dtype):
    T, H = (T, H) if LARGE else (min(T, 1024), min(H, 8))
    torch.manual_seed(42)
    q = torch.rand(B, T, H, D, dtype=dtype)
    k = torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, H, D, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, D, dtype=torch.float))
    beta_raw = torch.randn(B, T, H, dtype=dtype)
    beta_post = beta_raw.float().sigmoid()
    h0 = torch.randn(B, H, D, D, dtype=torch.float32)
    q, k, v, g, beta_post, beta_raw, h0 = leaves(q, k, v, g, beta_post, beta_raw, h0)
    do = torch.randn_like(v)
    dht = torch.randn_like(h0)
    common = dict(scale=None, initial_state=h0, output_final_state=True)

    ref, ref_ht = chunk_kda(q=F.normalize(q, p=2, dim=-1), k=F.normalize(k, p=2, dim=-1), v=v, g=g,
                            beta=beta_post * (2 if allow_neg_eigval else 1), **common)
    ((ref * do).sum() + (ref_ht * dht).sum()).backward()
    ref_dq, ref_dk, ref_dv, ref_dg, ref_db, ref_dh0 = grads(q, k, v, g, beta_post, h0)
    tri, tri_ht = chunk_kda(q=F.normalize(q, p=2, dim=-1), k=F.normalize(k, p=2, dim=-1), v=v, g=g, beta=beta_raw,
                            use_beta_sigmoid_in_kernel=True, allow_neg_eigval=allow_neg_eigval, **common)
    ((tri * do).sum() + (tri_ht * dht).sum()).backward()
    tri_dq, tri_dk, tri_dv, tri_dg, tri_db_raw, tri_dh0 = grads(q, k, v, g, beta_raw, h0)
    s = beta_post.detach()
    ref_db_raw = (ref_db * s * (1 - s)).to(tri_db_raw.dtype)
    for name, r, t in (("o", ref, tri), ("ht", ref_ht, tri_ht), ("dq", ref_dq, tri_dq), ("dk", ref_dk, tri_dk),
                       ("dv", ref_dv, tri_dv), ("dg", ref_dg, tri_dg), ("db_raw", ref_db_raw, tri_db_raw),
                       ("dh0", ref_dh0, tri_dh0)):
        fla_assert_close(name, r, t, 1e-4)


def layout_call(fn, keyword, v_first, **kw):
    """fn(**kw) with the state layout chosen by `keyword`: state_v_first, or FLA's deprecated
    transpose_state_layout (the name of an earlier test_kda.py's test_chunk_transpose_state /
    test_fused_recurrent_transpose_state, which pass it as True and False explicitly), which
    must warn."""
    if keyword == "state_v_first":
        return fn(**kw, state_v_first=v_first)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        return fn(**kw, transpose_state_layout=v_first)


LAYOUT_KEYWORDS = pytest.mark.parametrize("layout_keyword", ["state_v_first", "transpose_state_layout"])


# ------------------------------------------------------------------------------------------
# test_chunk_state_v_first: the V-first state layout ([V, K]) against K-first, within 1e-4.
@pytest.mark.parametrize("B,T,H,D,scale,norm,dtype", [
    (1, 63, 1, 64, 1, 1, torch.float16),
    (2, 500, 3, 60, 1, 1, torch.float16),
    (3, 1024, 4, 128, 0.1, 1, torch.float16),
    (4, 2048, 8, 64, 0.1, 1, torch.float16),
])
@LAYOUT_KEYWORDS
def test_chunk_state_v_first(B, T, H, D, scale, norm, dtype, layout_keyword):
    T, H = cap_t(T), cap_h(H)
    torch.manual_seed(42)
    q = torch.rand(B, T, H, D, dtype=dtype)
    k = torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, H, D, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, D, dtype=torch.float)) / norm
    beta = torch.randn(B, T, H, dtype=dtype).sigmoid()
    h0_kv = torch.randn(B, H, D, D, dtype=torch.float32)
    h0_vk = h0_kv.transpose(-1, -2).contiguous()
    q, k, v, g, beta, h0_kv, h0_vk = leaves(q, k, v, g, beta, h0_kv, h0_vk)
    do = torch.randn_like(v)
    dht_vk = torch.randn(B, H, D, D, dtype=torch.float32)
    dht_kv = dht_vk.transpose(-1, -2).contiguous()
    x = lambda: dict(q=F.normalize(q, p=2, dim=-1), k=F.normalize(k, p=2, dim=-1), v=v, g=g, beta=beta,  # noqa: E731
                     scale=scale, output_final_state=True)
    tri, tri_ht = layout_call(chunk_kda, layout_keyword, True, **x(), initial_state=h0_vk)
    ((tri * do).sum() + (tri_ht * dht_vk).sum()).backward()
    tri_g = grads(q, k, v, g, beta, h0_vk)
    ref, ref_ht = layout_call(chunk_kda, layout_keyword, False, **x(), initial_state=h0_kv)
    ((ref * do).sum() + (ref_ht * dht_kv).sum()).backward()
    ref_g = grads(q, k, v, g, beta, h0_kv)
    fla_assert_close("o", ref, tri, 1e-4)
    fla_assert_close("ht", ref_ht, tri_ht.transpose(-1, -2), 1e-4)
    for name, r, t in zip(("dq", "dk", "dv", "dg", "db"), ref_g[:5], tri_g[:5]):
        fla_assert_close(name, r, t, 1e-4)
    fla_assert_close("dh0", ref_g[5], tri_g[5].transpose(-1, -2), 1e-4)


# ------------------------------------------------------------------------------------------
# test_fused_recurrent_gate_in_kernel: the gate in kernel (softplus or lower bound, with and
# without A_log / dt_bias, GVA) against the gate applied outside, within 0.002.
@pytest.mark.parametrize("B,T,H,HV,D,scale,has_a_log,has_dt_bias,safe_gate,dtype", [
    (1, 64, 1, 1, 64, 1, True, False, False, torch.float),
    (2, 256, 2, 2, 64, 1, True, True, False, torch.float),
    (2, 512, 2, 4, 64, 0.1, True, True, True, torch.float16),
    (3, 1000, 2, 8, 128, 1, True, False, False, torch.float16),
    (4, 1024, 4, 4, 128, 0.1, True, True, True, torch.float16),
    (1, 64, 1, 1, 64, 1, False, False, True, torch.float),
    (2, 256, 2, 4, 64, 1, False, True, True, torch.float),
])
def test_fused_recurrent_gate_in_kernel(B, T, H, HV, D, scale, has_a_log, has_dt_bias, safe_gate, dtype):
    T = cap_t(T)
    torch.manual_seed(42)
    q = torch.rand(B, T, H, D, dtype=dtype)
    k = torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, HV, D, dtype=dtype)
    beta = torch.rand(B, T, HV, dtype=dtype).sigmoid()
    g_raw = torch.randn(B, T, HV, D, dtype=torch.float32)
    A_log = torch.log(torch.empty(HV, dtype=torch.float32).uniform_(1, 16)) if has_a_log else None
    dt_bias = torch.randn(HV * D, dtype=torch.float32) if has_dt_bias else None
    h0 = torch.randn(B, HV, D, D, dtype=torch.float32)
    lower_bound = -5.0 if safe_gate else None
    gate_fn = naive_kda_lowerbound_gate if safe_gate else naive_kda_gate
    common = dict(q=q, k=k, v=v, beta=beta, scale=scale, initial_state=h0, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
    ref, ref_ht = fused_recurrent_kda(g=gate_fn(g_raw, A_log, dt_bias), **common)
    tri, tri_ht = fused_recurrent_kda(g=g_raw, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                                      lower_bound=lower_bound, **common)
    fla_assert_close("o", ref, tri, 0.002)
    fla_assert_close("ht", ref_ht, tri_ht, 0.002)
    # and both against the float64 recurrence
    rq, rk, rv, rb, rh0, rg = f64(q, k, v, beta, h0, g_raw)
    rA, rbias = f64(A_log, dt_bias)
    gate = gate_fn(rg, rA, rbias, output_dtype=F64)
    o64, ht64 = naive_recurrent_kda(F.normalize(rq, dim=-1), F.normalize(rk, dim=-1), rv, gate, rb, scale=scale,
                                    initial_state=rh0, output_final_state=True)
    fla_assert_close("o vs fp64", o64, tri, 0.005)
    fla_assert_close("ht vs fp64", ht64, tri_ht, 0.005)


# ------------------------------------------------------------------------------------------
# test_fused_recurrent_vllm_decode (GPU-only in FLA; the CPU decode here): continuous batching,
# one token per sequence in vLLM's packed layout, a state pool whose untouched slots hold 1e30
# and must stay bitwise unchanged. An earlier test_kda.py's version of it passed use_exp2=False (a
# keyword of FLA's kernel then, which vLLM's call sites carried): accepted, and it changes nothing.
@pytest.mark.parametrize("extra", [{}, {"use_exp2": False}], ids=["", "use_exp2"])
@pytest.mark.parametrize("B,H,D,scale,norm,l2_in_kernel,gate_in_kernel,safe_gate,dtype", [
    (16, 16, 128, 0.1, 1.0, True, False, False, torch.bfloat16),
    (32, 8, 64, 1.0, 1.0, False, False, False, torch.float16),
    (7, 32, 128, 0.5, 0.5, True, False, False, torch.bfloat16),
    (16, 16, 128, 0.1, 1.0, True, True, False, torch.bfloat16),
    (32, 8, 64, 1.0, 1.0, False, True, False, torch.float16),
    (7, 32, 128, 0.5, 0.5, True, True, True, torch.bfloat16),
])
def test_fused_recurrent_vllm_decode(B, H, D, scale, norm, l2_in_kernel, gate_in_kernel, safe_gate, dtype, extra):
    torch.manual_seed(42)
    slots = B * 3
    pool = torch.randn(slots, H, D, D, dtype=torch.float32)
    idx = torch.randperm(slots)[:B].int()
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[idx.long()] = False
    pool[untouched] = 1e30
    q = torch.rand(1, B, H, D, dtype=dtype)
    k = torch.rand(1, B, H, D, dtype=dtype)
    v = torch.rand(1, B, H, D, dtype=dtype)
    g = torch.randn(1, B, H, D, dtype=torch.float if not gate_in_kernel else dtype)
    A_log = dt_bias = lower_bound = None
    if gate_in_kernel:
        A_log = torch.log(torch.randn(1, 1, H, 1, dtype=torch.float32).uniform_(1, 16)).squeeze()
        dt_bias = torch.randn(H * D, dtype=torch.float32)
        lower_bound = -5.0 if safe_gate else None
    else:
        g = F.logsigmoid(g) / norm
    beta = torch.randn(1, B, H, dtype=dtype).sigmoid()
    cu = torch.arange(0, B + 1, dtype=torch.int32)
    ref_pool = pool.to(F64)
    ref_o = []
    gate_fn = naive_kda_lowerbound_gate if safe_gate else naive_kda_gate
    for i in range(B):
        s = int(idx[i])
        qi, ki, vi, gi, bi = (x[:, i:i + 1].to(F64) for x in (q, k, v, g, beta))
        if gate_in_kernel:
            gi = gate_fn(gi, A_log.to(F64), dt_bias.to(F64), output_dtype=F64)
        o_i, ht_i = naive_recurrent_kda(F.normalize(qi, dim=-1), F.normalize(ki, dim=-1), vi, gi, bi, scale=scale,
                                        initial_state=ref_pool[s:s + 1], output_final_state=True)
        ref_o.append(o_i)
        ref_pool[s] = ht_i[0]
    ref_o = torch.cat(ref_o, 1)
    tri_pool = pool.clone()
    tri_o, _ = fused_recurrent_kda_fwd(
        q=q if l2_in_kernel else F.normalize(q.float(), dim=-1).to(dtype),
        k=k if l2_in_kernel else F.normalize(k.float(), dim=-1).to(dtype),
        v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=tri_pool, scale=scale,
        output_final_state=False, inplace_final_state=True, cu_seqlens=cu, ssm_state_indices=idx,
        num_accepted_tokens=None, use_qk_l2norm_in_kernel=l2_in_kernel, use_gate_in_kernel=gate_in_kernel,
        lower_bound=lower_bound, **extra)
    fla_assert_close("o", ref_o, tri_o, 0.005)
    fla_assert_close("ht", ref_pool[idx.long()], tri_pool[idx.long()], 0.005)
    assert torch.equal(tri_pool[untouched], pool[untouched]), "an untouched pool slot was written"


def fp32_inputs(B, T, H, HV, D, norm):
    """FLA's fp32 inputs of test_naive_chunk / test_fused_recurrent (seed 42): q, k, v uniform,
    g = logsigmoid(N(0, 1)) / norm, beta = sigmoid(N(0, 1)), h0 ~ N(0, 1) [B, HV, D, D]."""
    torch.manual_seed(42)
    q = torch.rand(B, T, H, D)
    k = torch.rand(B, T, H, D)
    v = torch.rand(B, T, HV, D)
    g = F.logsigmoid(torch.randn(B, T, HV, D)) / norm
    beta = torch.randn(B, T, HV).sigmoid()
    return q, k, v, g, beta, torch.randn(B, HV, D, D)


# ------------------------------------------------------------------------------------------
# test_naive_chunk: the chunked torch reference against the token-by-token one (GVA included).
@pytest.mark.parametrize("B,T,H,HV,D,scale,norm", [
    (1, 64, 1, 1, 64, 1, 1), (2, 512, 3, 3, 60, 1, 1), (4, 1024, 4, 4, 128, 0.1, 1), (4, 1024, 4, 4, 128, 1, 10),
    (1, 64, 1, 2, 64, 1, 1), (2, 512, 2, 4, 60, 1, 1),
])
def test_naive_chunk(B, T, H, HV, D, scale, norm):
    q, k, v, g, beta, h0 = fp32_inputs(B, cap_t(T), H, HV, D, norm)
    x = dict(q=F.normalize(q, p=2, dim=-1), k=F.normalize(k, p=2, dim=-1), v=v, g=g, beta=beta, scale=scale,
             initial_state=h0, output_final_state=True)
    ref, ref_ht = naive_recurrent_kda(**x)
    tri, tri_ht = naive_chunk_kda(**x)
    fla_assert_close("o", ref, tri, 0.005)
    fla_assert_close("ht", ref_ht, tri_ht, 0.005)


# ------------------------------------------------------------------------------------------
# test_fused_recurrent: fp32, odd head dims, GVA, l2norm in kernel; where D is not a power of two
# g is a view into a buffer that continues with 1e30, so any read past D shows up.
@pytest.mark.parametrize("B,T,H,HV,D,scale,norm,l2_in_kernel", [
    (1, 64, 1, 1, 64, 1, 1, False), (2, 512, 3, 3, 60, 1, 1, False), (3, 1000, 4, 4, 100, 0.1, 1, True),
    (4, 1024, 4, 4, 128, 0.1, 1, False), (2, 512, 2, 4, 60, 1, 1, False), (2, 1024, 2, 8, 128, 0.1, 1, True),
])
def test_fused_recurrent(B, T, H, HV, D, scale, norm, l2_in_kernel):
    q, k, v, g, beta, h0 = fp32_inputs(B, cap_t(T), H, HV, D, norm)
    g_tri = g.clone()
    if D & (D - 1):
        pow2 = 1 << (D - 1).bit_length()
        buf = torch.full((g.numel() + pow2,), 1e30)
        g_tri = buf[:g.numel()].view_as(g).copy_(g)
    rq, rk, rv, rg, rb, rh0 = f64(q, k, v, g, beta, h0)
    ref, ref_ht = naive_recurrent_kda(F.normalize(rq, p=2, dim=-1), F.normalize(rk, p=2, dim=-1), rv, rg, rb,
                                      scale=scale, initial_state=rh0, output_final_state=True)
    tri, tri_ht = fused_recurrent_kda(
        q=q if l2_in_kernel else F.normalize(q, p=2, dim=-1), k=k if l2_in_kernel else F.normalize(k, p=2, dim=-1),
        v=v, g=g_tri, beta=beta, scale=scale, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=l2_in_kernel)
    fla_assert_close("o", ref, tri, 0.005)
    fla_assert_close("ht", ref_ht, tri_ht, 0.005)


# ------------------------------------------------------------------------------------------
# test_fused_recurrent_use_beta_sigmoid_in_kernel: raw logits with the sigmoid in kernel against
# the activated beta, 0.005.
@pytest.mark.parametrize("B,T,H,D,allow_neg_eigval", [(2, 256, 4, 64, False), (2, 256, 4, 64, True),
                                                      (1, 512, 3, 60, True)])
def test_fused_recurrent_use_beta_sigmoid_in_kernel(B, T, H, D, allow_neg_eigval):
    T = cap_t(T)
    torch.manual_seed(42)
    q = torch.rand(B, T, H, D)
    k = torch.rand(B, T, H, D)
    v = torch.rand(B, T, H, D)
    g = F.logsigmoid(torch.randn(B, T, H, D))
    beta_post = torch.randn(B, T, H).sigmoid()
    beta_raw = torch.logit(beta_post.float().clamp_(1e-4, 1 - 1e-4))
    h0 = torch.randn(B, H, D, D)
    x = dict(q=F.normalize(q, p=2, dim=-1), k=F.normalize(k, p=2, dim=-1), v=v, g=g, scale=None, initial_state=h0,
             output_final_state=True)
    ref, ref_ht = fused_recurrent_kda(**x, beta=beta_post * (2 if allow_neg_eigval else 1))
    tri, tri_ht = fused_recurrent_kda(**x, beta=beta_raw, use_beta_sigmoid_in_kernel=True,
                                      allow_neg_eigval=allow_neg_eigval)
    fla_assert_close("o", ref, tri, 0.005)
    fla_assert_close("ht", ref_ht, tri_ht, 0.005)


# ------------------------------------------------------------------------------------------
# test_fused_recurrent_state_v_first: V-first against K-first within 1e-4, and FLA's deprecated
# transpose_state_layout keyword (a DeprecationWarning; ValueError together with state_v_first).
@pytest.mark.parametrize("B,T,H,D,scale,norm", [(1, 64, 1, 64, 1, 1), (2, 512, 3, 60, 1, 1),
                                                (3, 1000, 4, 100, 0.1, 1), (4, 1024, 4, 128, 0.1, 1)])
@LAYOUT_KEYWORDS
def test_fused_recurrent_state_v_first(B, T, H, D, scale, norm, layout_keyword):
    q, k, v, g, beta, h0_kv = fp32_inputs(B, cap_t(T), H, H, D, norm)
    h0_vk = h0_kv.transpose(-1, -2).contiguous()
    x = dict(q=F.normalize(q, p=2, dim=-1), k=F.normalize(k, p=2, dim=-1), v=v, g=g, beta=beta, scale=scale,
             output_final_state=True, use_qk_l2norm_in_kernel=False)
    ref, ref_ht = layout_call(fused_recurrent_kda, layout_keyword, False, **x, initial_state=h0_kv)
    tri, tri_ht = layout_call(fused_recurrent_kda, layout_keyword, True, **x, initial_state=h0_vk)
    fla_assert_close("o", ref, tri, 1e-4)
    fla_assert_close("ht", ref_ht, tri_ht.transpose(-1, -2), 1e-4)
    with pytest.warns(DeprecationWarning):
        fused_recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, transpose_state_layout=True)
    with pytest.raises(ValueError):
        fused_recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, state_v_first=True, transpose_state_layout=True)


# ------------------------------------------------------------------------------------------
# FLA's tests/ops/test_kda_compression.py: fused_recurrent_kda(store_dtype=...) returns the final
# state stored narrower (fp16, fp8) while the recurrence itself stays fp32. Two of its asserts
# cannot hold for any implementation and are not ported as written: test_fp16_state_precision
# checks the dtype after calling .float() on the state (checked before that here), and
# test_fp8_state_precision wants max error < 0.05 and mean relative error < 1% from an e4m3 state,
# below fp8's own rounding (a bare cast of N(0, 0.5) values: max 0.09, mean relative 2.6%). What
# an fp8 store_dtype can promise -- the fp32 state cast once -- is asserted bitwise in
# test_fla_dropin.py::test_fused_recurrent_store_dtype_casts_the_final_state.
HAS_FP8 = hasattr(torch, "float8_e4m3fn")


def compression_inputs(B=2, T=256, H=4, HV=4, K=128, V=128, dtype=torch.bfloat16):
    torch.manual_seed(42)
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = torch.randn(B, T, H, K, dtype=dtype)
    v = torch.randn(B, T, HV, V, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, HV, K, dtype=torch.float))
    beta = torch.randn(B, T, HV, dtype=dtype).sigmoid()
    h0 = torch.randn(B, HV, K, V, dtype=torch.float32)
    return F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1), v, g, beta, h0


@pytest.mark.parametrize("T", [256, 1024, 4096])
@pytest.mark.parametrize("H", [4, 8])
def test_fp16_state_precision(T, H):
    T = T if LARGE else min(T, 1024)
    q, k, v, g, beta, h0 = compression_inputs(2, T, H, H)
    _, ref_ht = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                    store_dtype=torch.float32)
    _, fp16_ht = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                     store_dtype=torch.float16)
    assert fp16_ht.dtype == torch.float16
    fp16_ht = fp16_ht.float()
    max_err = (ref_ht - fp16_ht).abs().max().item()
    rel_err = ((ref_ht - fp16_ht).abs() / (ref_ht.abs() + 1e-8)).mean().item()
    assert max_err < 0.01, f"FP16 max_err={max_err:.6f} > 0.01"
    assert rel_err < 0.001, f"FP16 rel_err={rel_err:.6f} > 0.001"


@pytest.mark.parametrize("store_dtype", [torch.float16] + ([torch.float8_e4m3fn] if HAS_FP8 else []))
def test_output_equivalence(store_dtype):
    """test_output_equivalence_fp16 / _fp8: o does not depend on how the final state is stored."""
    q, k, v, g, beta, h0 = compression_inputs(2, 512 if store_dtype == torch.float16 else 256)
    o_fp32, _ = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                    store_dtype=torch.float32)
    o_low, _ = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   store_dtype=store_dtype)
    assert (o_fp32 - o_low).abs().max().item() < (0.005 if store_dtype == torch.float16 else 0.01)


_FP8_SLOPE = pytest.mark.xfail(
    LARGE, strict=True,
    reason="FLA's slope check compares two maxima of fp8 rounding noise 1024 tokens apart: at T = 16384 they are "
           "0.0155 and 0.0302 (slope 1.4e-5 > 1e-5) while the error stays far below its 0.1 bound")


@pytest.mark.parametrize("T", [4096, 16384])
@pytest.mark.parametrize("store_dtype", [torch.float16] + ([torch.float8_e4m3fn] if HAS_FP8 else []))
def test_long_context_accumulation(T, store_dtype, request):
    """The state carried across 64-token calls, stored narrower after every call: the error stays
    below 0.1 and does not accelerate. T is 1024 in CI; with KDA_LARGE_TESTS=1 FLA's 4096 and
    16384, where the fp8 case at 16384 fails FLA's slope check (an expected failure, see
    _FP8_SLOPE)."""
    if LARGE and T == 16384 and store_dtype != torch.float16:
        request.applymarker(_FP8_SLOPE)
    T = T if LARGE else 1024
    q, k, v, g, beta, _ = compression_inputs(1, T)
    state_fp32 = torch.zeros(1, 4, 128, 128)
    state_low = torch.zeros(1, 4, 128, 128)
    metrics = []
    for i in range(0, T, 64):
        sl = slice(i, min(i + 64, T))
        _, state_fp32 = fused_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                            initial_state=state_fp32, output_final_state=True,
                                            store_dtype=torch.float32)
        _, state_low_raw = fused_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                               initial_state=state_low, output_final_state=True,
                                               store_dtype=store_dtype)
        assert state_low_raw.dtype == store_dtype
        state_low = state_low_raw.float()
        if (i // 64) % 8 == 0:
            metrics.append((i + 64, (state_fp32 - state_low).abs().max().item()))
    assert max(m[1] for m in metrics) < 0.1
    if len(metrics) >= 4:
        m0, m2 = metrics[-4], metrics[-2]
        assert (m2[1] - m0[1]) / (m2[0] - m0[0]) < 1e-5


# ------------------------------------------------------------------------------------------
# FLA's tests/ops/test_kda_graph.py captures chunk_kda(use_graph=True, max_num_seqs=4) forward +
# backward in a CUDA graph and replays it on cu_seqlens whose tail sequences are empty
# ("2seq_zerotail" [0, 512, 1024, 1024, 1024], "1seq_zerotail" [0, 1024, 1024, 1024, 1024]), over
# its six (gate in kernel, safe gate, GVA) configurations, bf16. The capture is GPU-only; the call
# and its results are not: here eager, each sequence cut to 256 tokens like the rest of this file.
GRAPH_H, GRAPH_D, GRAPH_MAX_NUM_SEQS = 4, 64, 4
GRAPH_CONFIGS = [  # (gate, safe_gate, hv)
    pytest.param(False, False, GRAPH_H, id="default"),
    pytest.param(False, True, GRAPH_H, id="safe_gate"),
    pytest.param(True, False, GRAPH_H, id="gate_in_kernel"),
    pytest.param(True, True, GRAPH_H, id="gate+safe_gate"),
    pytest.param(False, False, 2 * GRAPH_H, id="gva_default"),
    pytest.param(True, True, 2 * GRAPH_H, id="gva_gate+safe"),
]
GRAPH_ZERO_TAIL_LAYOUTS = [
    pytest.param([0, 512, 1024, 1024, 1024], id="2seq_zerotail"),
    pytest.param([0, 1024, 1024, 1024, 1024], id="1seq_zerotail"),
]


def graph_inputs(seed, gate, safe_gate, hv, T):
    """test_kda_graph.py's _rand_inputs (T tokens, h0 / dht for GRAPH_MAX_NUM_SEQS sequences)."""
    gen = torch.Generator().manual_seed(seed)
    H, D, dt = GRAPH_H, GRAPH_D, torch.bfloat16
    q = torch.randn(1, T, H, D, dtype=dt, generator=gen)
    k = F.normalize(torch.randn(1, T, H, D, dtype=torch.float32, generator=gen), p=2, dim=-1).to(dt)
    v = torch.randn(1, T, hv, D, dtype=dt, generator=gen)
    if gate:
        g = torch.randn(1, T, hv, D, dtype=dt, generator=gen)
        A_log = torch.log(torch.empty(1, 1, hv, 1).uniform_(1, 16, generator=gen))
        dt_bias = torch.randn(hv * D, dtype=torch.float32, generator=gen)
    else:
        g = F.logsigmoid(torch.randn(1, T, hv, D, dtype=torch.float32, generator=gen))
        if safe_gate:
            g = g.clamp(-5, 0)
        A_log = dt_bias = None
    beta = torch.rand(1, T, hv, dtype=dt, generator=gen).sigmoid()
    h0 = torch.randn(GRAPH_MAX_NUM_SEQS, hv, D, D, dtype=torch.float32, generator=gen)
    do = torch.randn(1, T, hv, D, dtype=dt, generator=gen)
    dht = torch.randn(GRAPH_MAX_NUM_SEQS, hv, D, D, dtype=torch.float32, generator=gen)
    return (q, k, v, g, beta, h0, A_log, dt_bias), do, dht


def graph_step(x, cu, gate, safe_gate, do, dht):
    """The captured step of test_kda_graph.py, eagerly: chunk_kda(use_graph=True, max_num_seqs=4)
    forward and backward. Returns (o, ht, grads of q, k, v, g, beta, h0, A_log, dt_bias)."""
    q, k, v, g, beta, h0, A_log, dt_bias = x = leaves(*x)
    o, ht = chunk_kda(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                      use_gate_in_kernel=gate, safe_gate=safe_gate, lower_bound=(-5 if safe_gate else None),
                      use_graph=True, max_num_seqs=GRAPH_MAX_NUM_SEQS,
                      **(dict(A_log=A_log, dt_bias=dt_bias) if gate else {}))
    ((o * do).sum() + (ht * dht).sum()).backward()
    return o, ht, grads(*x)


@pytest.mark.parametrize("cu", GRAPH_ZERO_TAIL_LAYOUTS)
@pytest.mark.parametrize("gate,safe_gate,hv", GRAPH_CONFIGS)
def test_chunk_kda_graph_zero_length_tail_matches_fp64(gate, safe_gate, hv, cu):
    """o, ht and every gradient with empty tail sequences, against the float64 recurrence at
    test_chunk's bf16 bounds (FLA compares the graph with the eager path at 2e-3)."""
    cu = torch.LongTensor(_scaled_cu_seqlens(cu))
    x, do, dht = graph_inputs(0, gate, safe_gate, hv, int(cu[-1]))
    tri, tri_ht, tri_g = graph_step(x, cu, gate, safe_gate, do, dht)
    check_graph_step_vs_fp64(x, cu, gate, safe_gate, do, dht, (tri, tri_ht, tri_g))


def check_graph_step_vs_fp64(x, cu, gate, safe_gate, do, dht, step):
    """graph_step's (o, ht, grads) against the float64 recurrence at test_chunk's bf16 bounds."""
    tri, tri_ht, tri_g = step
    rq, rk, rv, rg, rb, rh0, rA, rbias = r = f64(*x)
    gate_f64 = fla_naive_gate(rg, rA, rbias, -5.0 if safe_gate else None) if gate else rg
    ref, ref_ht = recurrent_reference(rq, rk, rv, gate_f64, rb, rh0, cu)
    ((ref * do.to(F64)).sum() + (ref_ht * dht.to(F64)).sum()).backward()
    ref_g = grads(*r)
    check_forward_and_grads((ref, ref_ht, ref_g), (tri, tri_ht, tri_g), (0.008, 0.008, 0.008, 0.02, 0.02, 0.008))
    if gate:
        fla_assert_close("dA", ref_g[6], tri_g[6], 0.02)  # test_chunk's bf16 bound (see there)
        fla_assert_close("dbias", ref_g[7], tri_g[7], 0.008)


@pytest.mark.parametrize("cu", GRAPH_ZERO_TAIL_LAYOUTS)
@pytest.mark.parametrize("gate,safe_gate,hv", GRAPH_CONFIGS)
def test_chunk_kda_graph_empty_sequence_passes_its_state_through(gate, safe_gate, hv, cu):
    """An empty sequence's final state is its initial state and its dh0 is its dht, exactly."""
    cu = torch.LongTensor(_scaled_cu_seqlens(cu))
    x, do, dht = graph_inputs(0, gate, safe_gate, hv, int(cu[-1]))
    _, ht, tri_g = graph_step(x, cu, gate, safe_gate, do, dht)
    h0, dh0 = x[5], tri_g[5]
    empty = [i for i in range(GRAPH_MAX_NUM_SEQS) if cu[i] == cu[i + 1]]
    assert empty, "the layout has no empty sequence"
    for i in empty:
        assert torch.equal(ht[i], h0[i]), f"sequence {i} (empty): final state != initial state"
        assert torch.equal(dh0[i], dht[i]), f"sequence {i} (empty): dh0 != dht"


# test_kda_graph.py's test_chunk_kda_graph_partial_tokens: a buffer of T tokens holding
# cu_seqlens[-1] < T real ones; the tokens after cu_seqlens[-1] are padding. Its layouts ("half"
# [0, 512, 512, 512, 512], "quarter_2seq" [0, 128, 384, 384, 384] in a buffer of 1024) are scaled
# by cap_t like the rest of this file, buffer included.
GRAPH_PARTIAL_LAYOUTS = [
    pytest.param([0, 512, 512, 512, 512], id="half"),
    pytest.param([0, 128, 384, 384, 384], id="quarter_2seq"),
]
GRAPH_PARTIAL_CONFIGS = [  # (safe_gate, hv); the gate is in the kernel
    pytest.param(False, GRAPH_H, id="gate_in_kernel"),
    pytest.param(True, GRAPH_H, id="gate+safe_gate"),
    pytest.param(True, 2 * GRAPH_H, id="gva_gate+safe"),
]


@pytest.mark.parametrize("cu", GRAPH_PARTIAL_LAYOUTS)
@pytest.mark.parametrize("safe_gate,hv", GRAPH_PARTIAL_CONFIGS)
def test_chunk_kda_graph_partial_tokens(safe_gate, hv, cu):
    """FLA runs the real tokens alone eagerly and compares at 2e-3: o and the token gradients on
    the real tokens, ht, dh0, dA and dbias. Here they are bitwise equal (batch invariance), and
    the padding tokens' o and gradients are exactly 0 though their inputs are fresh noise."""
    scale = cap_t(1024) / 1024
    cu = torch.LongTensor([round(c * scale) for c in cu])
    T, n = round(1024 * scale), int(cu[-1])
    x, do, dht = graph_inputs(7, True, safe_gate, hv, T)
    tri, tri_ht, tri_g = graph_step(x, cu, True, safe_gate, do, dht)
    cut = [t[:, :n] if i < 5 else t for i, t in enumerate(x)]  # q, k, v, g, beta; h0, A_log, dt_bias whole
    ref, ref_ht, ref_g = graph_step(cut, cu, True, safe_gate, do[:, :n], dht)
    names = ["dq", "dk", "dv", "dg", "db", "dh0", "dA", "dbias"]
    assert torch.equal(tri[:, :n], ref), "o on the real tokens"
    assert torch.count_nonzero(tri[:, n:]) == 0, "o on the padding tokens"
    assert torch.equal(tri_ht, ref_ht), "ht"
    for i, (name, t, r) in enumerate(zip(names, tri_g, ref_g)):
        if i < 5:
            assert torch.equal(t[:, :n], r), f"{name} on the real tokens"
            assert torch.count_nonzero(t[:, n:]) == 0, f"{name} on the padding tokens"
        else:
            assert torch.equal(t, r), name


# ------------------------------------------------------------------------------------------
# chunk_kda(transpose_state_layout=True, ...) called directly, as FlashKDA's run_fla_gold_reference
# (MoonshotAI/FlashKDA tests/test_fwd.py @25efb9ee) calls FLA's chunk_kda for its test_fwd_vs_fla /
# test_fwd_varlen_vs_fla: bf16 q, k, v, the raw g, beta already through sigmoid (bf16), an fp32
# V-first h0, use_gate_in_kernel=True with A_log [H], dt_bias [H, D] and lower_bound=-5,
# use_qk_l2norm_in_kernel=True. FLA's deprecated keyword must give exactly what state_v_first=True
# gives, with FLA's DeprecationWarning, attributed to the caller (FLA's stacklevel=2). FlashKDA's
# sizes (T = 8192; seq_lens 1300, 547, 2048, 963, 271, 3063) are cut to T = 256 and lengths / 32
# (KDA_LARGE_TESTS=1: FlashKDA's).
@pytest.mark.parametrize("varlen", [False, True], ids=["test_fwd_vs_fla", "test_fwd_varlen_vs_fla"])
@torch.inference_mode()
def test_chunk_transpose_state_layout_as_flash_kda_gold_reference(varlen):
    H, D, lower_bound = 1, 128, -5.0
    scale = 1 / D ** 0.5
    seq_lens = [n if LARGE else n // 32 for n in (1300, 547, 2048, 963, 271, 3063)]  # CI: 254 tokens
    T = sum(seq_lens) if varlen else cap_t(8192)
    cu_seqlens = torch.tensor([0] + torch.tensor(seq_lens).cumsum(0).tolist(), dtype=torch.long) if varlen else None
    N = len(seq_lens) if varlen else 1
    torch.manual_seed(42)
    dtype = torch.bfloat16
    q = torch.rand(1, T, H, D, dtype=dtype)
    k = torch.rand(1, T, H, D, dtype=dtype)
    v = torch.rand(1, T, H, D, dtype=dtype)
    beta = torch.randn(1, T, H, dtype=dtype)
    h0 = torch.randn(N, H, D, D, dtype=torch.float32)
    A_log = torch.full((H,), 0.0, dtype=torch.float32)
    g = torch.randn(1, T, H, D, dtype=dtype) * 8  # make_test_cases' "g=N(0,8)" with its "bias=N(0,8)"
    dt_bias = torch.randn(H, D, dtype=torch.float32) * 8
    beta_activated = torch.sigmoid(beta.clone().float()).to(torch.bfloat16)
    x = dict(q=q.clone().to(torch.bfloat16), k=k.clone().to(torch.bfloat16), v=v.clone(), g=g.clone(),
             beta=beta_activated, scale=scale, initial_state=h0.clone(), output_final_state=True,
             use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, A_log=A_log.clone(), dt_bias=dt_bias.clone(),
             lower_bound=lower_bound, **(dict(cu_seqlens=cu_seqlens) if varlen else {}))

    with pytest.warns(DeprecationWarning, match="`transpose_state_layout` is deprecated") as record:
        chunk_o, chunk_ht = chunk_kda(**x, transpose_state_layout=True)
    assert [w.filename for w in record if w.category is DeprecationWarning] == [__file__]
    ref_o, ref_ht = chunk_kda(**x, state_v_first=True)
    assert chunk_o.dtype == ref_o.dtype == torch.bfloat16 and chunk_ht.shape == (N, H, D, D)
    assert torch.equal(chunk_o.view(torch.int16), ref_o.view(torch.int16)), "o"
    assert torch.equal(chunk_ht.view(torch.int32), ref_ht.view(torch.int32)), "ht"
    # V-first really: the K-first call on the transposed h0 gives the transposed final state.
    kf_o, kf_ht = chunk_kda(**dict(x, initial_state=h0.transpose(-1, -2).contiguous()))
    fla_assert_close("o (K-first)", kf_o, chunk_o, 1e-4)
    fla_assert_close("ht (K-first)", kf_ht.transpose(-1, -2), chunk_ht, 1e-4)
    with pytest.raises(ValueError, match="transpose_state_layout"):
        chunk_kda(**x, state_v_first=True, transpose_state_layout=True)


def test_chunk_kda_graph_rejects_mismatched_sequence_capacity():
    """FLA's chunk_kda asserts, with use_graph=True, that cu_seqlens holds exactly max_num_seqs + 1
    entries (test_kda_graph.py's test_chunk_kda_graph_callable_rejects_mismatched_sequence_capacity
    expects that AssertionError); without use_graph, max_num_seqs is ignored, as in FLA."""
    x, _, _ = graph_inputs(0, False, False, GRAPH_H, 64)
    q, k, v, g, beta = x[:5]
    cu = torch.LongTensor([0, 20, 64])
    with pytest.raises(AssertionError, match=r"max_num_seqs \+ 1 entries, got 2 sequences with max_num_seqs=4"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=cu, use_graph=True, max_num_seqs=GRAPH_MAX_NUM_SEQS)
    o, _ = chunk_kda(q, k, v, g, beta, cu_seqlens=cu, max_num_seqs=GRAPH_MAX_NUM_SEQS)  # no graph: accepted
    ref, _ = chunk_kda(q, k, v, g, beta, cu_seqlens=cu, use_graph=True, max_num_seqs=2)
    assert torch.equal(o, ref)
