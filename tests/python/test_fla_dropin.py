"""Drop-in check (issue 6): FLA's documented call patterns for fla.ops.kda -- the chunk_kda and
fused_recurrent_kda docstring examples (fixed length, GVA, varlen cu_seqlens), the
KimiDeltaAttention layer's calls (gate in kernel; pre-activated gate in fused_recurrent mode) and
vLLM's V-first state-pool decode -- run unchanged against libkda.torch, with the import switched,
device='cpu' and sizes scaled down. Every result is checked against the fp64 oracle."""

import numpy as np
import pytest
from conftest import assert_close

import libkda

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
F = torch.nn.functional

from libkda.torch import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_fwd  # noqa: E402  (was: fla.ops.kda)
from libkda.torch import fused_kda_gate, naive_kda_gate  # noqa: E402  (was: fla.ops.kda.gate)
from libkda.torch import naive_chunk_kda, naive_recurrent_kda  # noqa: E402  (was: fla.ops.kda.naive)

device = "cpu"


def rearrange_b_t_to_1_bt(x):
    """einops.rearrange(x, 'b t ... -> 1 (b t) ...')"""
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


def np64(t):
    return None if t is None else t.detach().to(torch.float64).numpy()


def check(o, ht, q, k, v, g, beta, h0, bound, **kw):
    ro, rht = libkda.naive_recurrent_kda(np64(q), np64(k), np64(v), np64(g), np64(beta), initial_state=np64(h0),
                                         output_final_state=True, **{n: (np64(x) if torch.is_tensor(x) and
                                                                         x.is_floating_point() else
                                                                         (x.numpy() if torch.is_tensor(x) else x))
                                                                     for n, x in kw.items()})
    assert_close(np64(o), ro, bound, "o")
    assert_close(np64(ht), rht, 1e-5 if bound <= 1e-5 else bound, "final_state")


def test_chunk_kda_docstring_examples():
    torch.manual_seed(0)
    # inputs with equal lengths (no GVA, HV == H)
    B, T, H, K, V = 2, 100, 2, 32, 32
    q = torch.randn(B, T, H, K, dtype=torch.bfloat16, device=device)
    k = torch.randn(B, T, H, K, dtype=torch.bfloat16, device=device)
    v = torch.randn(B, T, H, V, dtype=torch.bfloat16, device=device)
    beta = torch.rand(B, T, H, dtype=torch.bfloat16, device=device)
    g = torch.rand(B, T, H, K, dtype=torch.bfloat16, device=device)
    h0 = torch.randn(B, H, K, V, dtype=torch.float32, device=device)
    A_log = torch.randn(H, dtype=torch.float32, device=device)
    dt_bias = torch.randn(H * K, dtype=torch.float32, device=device)
    o, ht = chunk_kda(
        q, k, v, g, beta,
        A_log=A_log,
        dt_bias=dt_bias,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        initial_state=h0,
        output_final_state=True
    )
    assert o.shape == (B, T, H, V) and o.dtype == torch.bfloat16 and ht.shape == (B, H, K, V)
    gate = dict(A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
    check(o, ht, q, k, v, g, beta, h0, 5e-3, **gate)

    # GVA mode (HV > H)
    HV = 4  # 2x more value heads than qk heads
    v = torch.randn(B, T, HV, V, dtype=torch.bfloat16, device=device)
    g = torch.rand(B, T, HV, K, dtype=torch.bfloat16, device=device)
    beta = torch.rand(B, T, HV, dtype=torch.bfloat16, device=device)
    h0 = torch.randn(B, HV, K, V, dtype=torch.float32, device=device)
    A_log = torch.randn(HV, dtype=torch.float32, device=device)
    dt_bias = torch.randn(HV * K, dtype=torch.float32, device=device)
    o, ht = chunk_kda(
        q, k, v, g, beta,
        A_log=A_log,
        dt_bias=dt_bias,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        initial_state=h0,
        output_final_state=True
    )
    assert o.shape == (B, T, HV, V)
    gate = dict(A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
    check(o, ht, q, k, v, g, beta, h0, 5e-3, **gate)

    # for variable-length inputs, the batch size `B` is expected to be 1 and `cu_seqlens` is required
    q, k, v, beta, g = map(rearrange_b_t_to_1_bt, (q, k, v, beta, g))
    # for a batch with 2 sequences, `cu_seqlens` with 3 start/end positions are expected
    cu_seqlens = q.new_tensor([0, 100, 200], dtype=torch.long)
    o_var, ht_var = chunk_kda(
        q, k, v, g, beta,
        A_log=A_log,
        dt_bias=dt_bias,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu_seqlens
    )
    # packed == the fixed-length batch, bitwise (SPEC.md 4, exact equalities)
    assert torch.equal(o_var, rearrange_b_t_to_1_bt(o)) and torch.equal(ht_var, ht)


def test_fused_recurrent_kda_docstring_examples():
    torch.manual_seed(1)
    # inputs with equal lengths
    B, T, H, HV, K, V = 2, 50, 2, 4, 32, 16
    q = torch.randn(B, T, H, K, device=device)
    k = F.normalize(torch.randn(B, T, H, K, device=device), p=2, dim=-1)
    v = torch.randn(B, T, HV, V, device=device)
    g = F.logsigmoid(torch.rand(B, T, HV, K, device=device))
    beta = torch.rand(B, T, HV, device=device).sigmoid()
    h0 = torch.randn(B, HV, K, V, device=device)
    o, ht = fused_recurrent_kda(
        q, k, v, g, beta,
        initial_state=h0,
        output_final_state=True
    )
    check(o, ht, q, k, v, g, beta, h0, 1e-5)
    # for variable-length inputs, the batch size `B` is expected to be 1 and `cu_seqlens` is required
    q, k, v, g, beta = map(rearrange_b_t_to_1_bt, (q, k, v, g, beta))
    # for a batch with 2 sequences, `cu_seqlens` with 3 start/end positions are expected
    cu_seqlens = q.new_tensor([0, 50, 100], dtype=torch.long)
    o_var, ht_var = fused_recurrent_kda(
        q, k, v, g, beta,
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu_seqlens
    )
    assert torch.equal(o_var, rearrange_b_t_to_1_bt(o)) and torch.equal(ht_var, ht)


def test_kimi_delta_attention_layer_calls():
    """fla.layers.kda.KimiDeltaAttention: chunk mode (training / prefill, gate in kernel, varlen)
    then fused_recurrent mode (decode, gate activated outside) continuing from the cache."""
    torch.manual_seed(2)
    T, H, K = 90, 2, 32
    q = F.silu(torch.randn(1, T, H, K))
    k = F.silu(torch.randn(1, T, H, K))
    v = F.silu(torch.randn(1, T, H, K))
    g = torch.randn(1, T, H, K)
    beta = torch.randn(1, T, H).sigmoid()
    A_log = torch.log(torch.empty(H, dtype=torch.float32).uniform_(1, 16)).requires_grad_()
    dt_bias = torch.zeros(H * K, dtype=torch.float32).requires_grad_()
    cu_seqlens = torch.tensor([0, 40, 90])
    recurrent_state = None
    use_cache = True
    o, recurrent_state = chunk_kda(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        A_log=A_log,
        dt_bias=dt_bias,
        initial_state=recurrent_state,
        output_final_state=use_cache,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        cu_seqlens=cu_seqlens,
    )
    gate = dict(A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
    check(o, recurrent_state, q, k, v, g, beta, None, 1e-5, cu_seqlens=cu_seqlens, **gate)
    o.sum().backward()  # training: gradients reach the gate parameters
    assert A_log.grad is not None and torch.isfinite(A_log.grad).all() and dt_bias.grad.abs().sum() > 0

    # decode step: fused_kda_gate outside (g = -exp(A_log) * softplus(g + dt_bias)), then fused_recurrent_kda
    q1, k1, v1 = (F.silu(torch.randn(1, 2, H, K)) for _ in range(3))
    g1 = torch.randn(1, 2, H, K)
    beta1 = torch.randn(1, 2, H).sigmoid()
    g1_act = -A_log.detach().exp()[:, None] * F.softplus(g1 + dt_bias.detach().view(H, K))
    o1, state1 = fused_recurrent_kda(
        q=q1,
        k=k1,
        v=v1,
        g=g1_act,
        beta=beta1,
        initial_state=recurrent_state.detach(),
        output_final_state=use_cache,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=torch.tensor([0, 1, 2]),
    )
    check(o1, state1, q1, k1, v1, g1_act, beta1, recurrent_state, 1e-5, cu_seqlens=torch.tensor([0, 1, 2]),
          use_qk_l2norm_in_kernel=True)


def test_vllm_v_first_prefill_then_pool_decode():
    """A V-first state written by prefill (chunk_kda, state_v_first=True) is read by decode
    (fused_recurrent_kda_fwd with ssm_state_indices, in place) in the same layout; prefill + decode
    equals one prefill over all the tokens."""
    torch.manual_seed(3)
    H, K, V, L = 2, 32, 16, 70
    x = dict(q=torch.randn(1, L + 1, H, K), k=F.normalize(torch.randn(1, L + 1, H, K), dim=-1),
             v=torch.randn(1, L + 1, H, V), g=F.logsigmoid(torch.randn(1, L + 1, H, K)),
             beta=torch.rand(1, L + 1, H))
    pre = {n: t[:, :L] for n, t in x.items()}
    dec = {n: t[0, L:][:, None] for n, t in x.items()}  # [N=1, T=1, ...]
    _, state = chunk_kda(**pre, output_final_state=True, state_v_first=True)
    assert state.shape == (1, H, V, K)
    pool = torch.zeros(4, H, V, K)
    pool[2] = state[0]
    o, pool_out = fused_recurrent_kda_fwd(**dec, initial_state=pool, inplace_final_state=True,
                                          ssm_state_indices=torch.tensor([2], dtype=torch.int32),
                                          state_v_first=True)
    assert pool_out is pool
    o_full, state_full = chunk_kda(**x, output_final_state=True, state_v_first=True)
    assert_close(o[0, 0].numpy(), o_full[0, L].numpy(), 1e-5, "decode o")
    assert_close(pool[2].numpy(), state_full[0].numpy(), 1e-5, "pool state")
    # The K-first state is the transpose of the V-first one.
    _, state_k = chunk_kda(**pre, output_final_state=True)
    assert torch.equal(state_k, state.transpose(-1, -2))


def test_fla_test_kda_gate_and_naive_patterns():
    """FLA tests/ops/test_kda.py: test_gate (A_log of shape [1, 1, H, 1], fused vs naive gate,
    forward and backward), test_naive_chunk (naive_chunk_kda vs naive_recurrent_kda) and
    test_chunk's use of naive_kda_gate as the reference of the in-kernel gate; scaled down."""
    torch.manual_seed(42)
    B, T, H, D = 2, 64, 2, 16
    g = (torch.randn(B, T, H, D, dtype=torch.float32) * 10).requires_grad_(True)
    A_log = torch.log(torch.randn(1, 1, H, 1, dtype=torch.float32).uniform_(1, 16)).requires_grad_(True)
    dt_bias = torch.randn(H * D, dtype=torch.float32).requires_grad_(True)
    do = torch.randn_like(g)
    ref = naive_kda_gate(g.clone(), A_log.clone(), dt_bias.clone())
    (ref * do).sum().backward()
    ref_grads = [t.grad for t in (g, A_log, dt_bias)]
    g.grad = A_log.grad = dt_bias.grad = None
    tri = fused_kda_gate(g.clone(), A_log.clone(), dt_bias.clone())
    (tri * do).sum().backward()
    assert torch.equal(ref, tri) and A_log.grad.shape == (1, 1, H, 1)
    for r, t in zip(ref_grads, (g.grad, A_log.grad, dt_bias.grad)):
        assert_close(t.numpy(), r.numpy(), 1e-6, "gate grad")

    # test_naive_chunk
    q, k, v = (torch.rand(B, T, H, D) for _ in range(3))
    gl = F.logsigmoid(torch.randn(B, T, H, D))
    beta = torch.randn(B, T, H).sigmoid()
    h0 = torch.randn(B, H, D, D)
    qn, kn = F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1)
    ref, ref_ht = naive_recurrent_kda(qn, kn, v, gl, beta, scale=0.1, initial_state=h0, output_final_state=True)
    tri, tri_ht = naive_chunk_kda(qn, kn, v, gl, beta, scale=0.1, initial_state=h0, output_final_state=True)
    assert_close(tri.numpy(), ref.numpy(), 1e-5, "naive chunk o")
    assert_close(tri_ht.numpy(), ref_ht.numpy(), 1e-5, "naive chunk ht")

    # test_chunk with the gate in kernel, A_log passed as FLA's layers hold it ([1, 1, H, 1])
    gr = torch.randn(B, T, H, D)
    o, ht = chunk_kda(qn, kn, v, gr, beta, A_log=A_log.detach(), dt_bias=dt_bias.detach(), scale=0.1,
                      initial_state=h0, output_final_state=True, use_gate_in_kernel=True)
    ro, rht = naive_recurrent_kda(qn, kn, v, naive_kda_gate(gr, A_log.detach(), dt_bias.detach()), beta, scale=0.1,
                                  initial_state=h0, output_final_state=True)
    assert_close(o.numpy(), ro.numpy(), 1e-5, "o")
    assert_close(ht.numpy(), rht.numpy(), 1e-5, "ht")
    check(o, ht, qn, kn, v, gr, beta, h0, 1e-5, scale=0.1, use_gate_in_kernel=True, A_log=A_log.detach().reshape(H),
          dt_bias=dt_bias.detach())


@pytest.mark.parametrize("V", [8, 16])
@pytest.mark.parametrize("two_d", [False, True])
def test_vllm_out_of_place_decode_returns_every_token_state_and_leaves_the_pool(two_d, V):
    """FLA/vLLM's ``inplace_final_state=False`` with ``ssm_state_indices``: each sequence starts from
    the slot it reads, the pool is untouched, and with ``output_final_state=True`` the state after
    every token comes back as float32 ``[N * T, HV, K, V]`` (row ``n * T + t``; None without it);
    equal to running the same tokens in place, one at a time: bitwise for one token, to rounding
    for two (a call of several tokens takes them as a group, whose sums are ordered differently
    from token-by-token steps; V = 16 takes that kernel on every CPU target)."""
    torch.manual_seed(4)
    N, T, H, K, slots = 3, 2 if two_d else 1, 2, 16, 9
    x = dict(q=torch.randn(N, T, H, K), k=F.normalize(torch.randn(N, T, H, K), dim=-1), v=torch.randn(N, T, H, V),
             g=F.logsigmoid(torch.randn(N, T, H, K)), beta=torch.rand(N, T, H))
    pool = torch.randn(slots, H, K, V)
    if two_d:
        idx = torch.tensor([[4, 5], [1, 2], [7, 8]], dtype=torch.int32)
        nat = torch.tensor([2, 1, 1], dtype=torch.int32)  # row 0 reads slot 5, rows 1, 2 slots 1, 7
    else:
        idx, nat = torch.tensor([4, -1, 7], dtype=torch.int32), None  # row 1: padding
    before = pool.clone()
    o0, none = fused_recurrent_kda_fwd(**x, initial_state=pool, inplace_final_state=False,
                                       ssm_state_indices=idx, num_accepted_tokens=nat)
    assert none is None and torch.equal(pool, before), "the pool was written"
    o, states = fused_recurrent_kda_fwd(**x, initial_state=pool, inplace_final_state=False,
                                        ssm_state_indices=idx, num_accepted_tokens=nat, output_final_state=True)
    assert torch.equal(pool, before), "the pool was written"
    assert torch.equal(o, o0)
    assert states.shape == (N * T, H, K, V) and states.dtype == torch.float32
    # The same tokens in place, one token at a time, on a pool whose read slots hold the start states.
    read = [5, 1, 7] if two_d else [4, -1, 7]
    for n in range(N):
        ref_pool = before.clone()
        for t in range(T):
            step = {name: val[n:n + 1, t:t + 1] for name, val in x.items()}
            slot = read[n] if read[n] >= 0 else -1
            o_ref, _ = fused_recurrent_kda_fwd(**step, initial_state=ref_pool, inplace_final_state=True,
                                               ssm_state_indices=torch.tensor([slot], dtype=torch.int32))
            want = ref_pool[slot] if slot >= 0 else torch.zeros(H, K, V)
            if T == 1:
                assert torch.equal(o[n, t], o_ref[0, 0]), f"o of row {n} token {t}"
                assert torch.equal(states[n * T + t], want), f"state after row {n} token {t}"
            else:
                assert_close(o[n, t].numpy(), o_ref[0, 0].numpy(), 1e-5, f"o of row {n} token {t}")
                assert_close(states[n * T + t].numpy(), want.numpy(), 1e-5, f"state after row {n} token {t}")


def test_fused_recurrent_fwd_inplace_without_initial_state_is_flas_assertion():
    x = dict(q=torch.randn(1, 3, 1, 16), k=torch.randn(1, 3, 1, 16), v=torch.randn(1, 3, 1, 8),
             g=F.logsigmoid(torch.randn(1, 3, 1, 16)), beta=torch.rand(1, 3, 1))
    with pytest.raises(AssertionError, match="initial_state"):
        fused_recurrent_kda_fwd(**x)
    o, fs = fused_recurrent_kda_fwd(**x, inplace_final_state=False, output_final_state=True)
    assert fs.shape == (1, 1, 16, 8) and o.shape == (1, 3, 1, 8)


@pytest.mark.parametrize("store_dtype", [torch.float16, torch.bfloat16, torch.float32]
                         + ([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else []))
def test_fused_recurrent_store_dtype_casts_the_final_state(store_dtype):
    """The FLA fork's state compression (tests/ops/test_kda_compression.py): computed in fp32, the
    final state comes back in store_dtype; o is unchanged."""
    torch.manual_seed(5)
    B, T, H, K, V = 2, 40, 2, 32, 16
    x = dict(q=F.normalize(torch.randn(B, T, H, K), dim=-1), k=F.normalize(torch.randn(B, T, H, K), dim=-1),
             v=torch.randn(B, T, H, V), g=F.logsigmoid(torch.randn(B, T, H, K)), beta=torch.rand(B, T, H))
    h0 = torch.randn(B, H, K, V)
    o32, ref = fused_recurrent_kda(**x, initial_state=h0, output_final_state=True, store_dtype=torch.float32)
    o, fs = fused_recurrent_kda(**x, initial_state=h0, output_final_state=True, store_dtype=store_dtype)
    assert fs.dtype == store_dtype and torch.equal(o, o32)
    assert torch.equal(fs, ref.to(store_dtype)), "not the fp32 state cast once"


def test_chunk_kda_initial_state_count_must_match_cu_seqlens():
    """FLA's message, which its tests match."""
    x = dict(q=torch.randn(1, 12, 2, 16), k=torch.randn(1, 12, 2, 16), v=torch.randn(1, 12, 2, 8),
             g=F.logsigmoid(torch.randn(1, 12, 2, 16)), beta=torch.rand(1, 12, 2))
    with pytest.raises(ValueError, match="The number of initial states is expected to be equal to the number of "
                                         "input sequences, i.e., 3 rather than 2"):
        chunk_kda(**x, initial_state=torch.zeros(2, 2, 16, 8), cu_seqlens=torch.tensor([0, 4, 9, 12]))


def test_fused_recurrent_beta_none_is_one():
    """Older FLA's fused_recurrent_kda(..., beta=None) means beta = 1 (its default); a
    per-value-channel beta [B, T, HV, V] (the newest kernel's IS_BETA_HEADWISE) is refused by name."""
    torch.manual_seed(3)
    B, T, H, HV, K, V = 1, 20, 1, 2, 16, 8
    q, k = F.normalize(torch.randn(B, T, H, K), dim=-1), F.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, HV, V)
    g = F.logsigmoid(torch.randn(B, T, HV, K))
    o1, ht1 = fused_recurrent_kda(q, k, v, g, output_final_state=True)
    o2, ht2 = fused_recurrent_kda(q, k, v, g, torch.ones(B, T, HV), output_final_state=True)
    assert torch.equal(o1, o2) and torch.equal(ht1, ht2)
    o3, _ = fused_recurrent_kda_fwd(q, k, v, g, inplace_final_state=False)
    assert torch.equal(o3, o1)
    with pytest.raises(ValueError, match="beta=None means beta = 1"):
        fused_recurrent_kda(q, k, v, g, use_beta_sigmoid_in_kernel=True)
    for fn in (fused_recurrent_kda, lambda *a: fused_recurrent_kda_fwd(*a, inplace_final_state=False)):
        with pytest.raises(ValueError, match=r"per-value-channel beta \[1, 20, 2, 8\].*\[1, 20, 2\]"):
            fn(q, k, v, g, torch.rand(B, T, HV, V))
