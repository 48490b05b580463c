"""KDA test cases of the serving stacks and kernel peers, ported to libkda's drop-ins
(``libkda.flash_kda`` for FlashKDA, ``libkda.torch`` for the FLA entry points that vLLM and
SGLang call), for the behaviours no other libkda test exercises. Sources, with the stored commit
each was read at:

- vllm-project/FlashKDA (vLLM's fork of MoonshotAI/FlashKDA): tests/test_beta_strides.py
  @edb99d6e3151a5babfb07e1646b88696feaaaa7a (a row-strided beta is read as the contiguous one,
  bit for bit) and tests/test_vsplit.py @1fb1d9ceffc9eaedd95573f2ad31b12a5775e5a2 (fixed length
  B = 2, T = 17; four full chunks; varlen with empty sequences at the start, middle and end and
  int32 or int64 cu_seqlens; every state in / out mode in bf16 and fp32; NaN-filled buffers).
  FlashKDA compares its kernel with its CUDA torch_ref bit for bit; here the reference is the
  float64 recurrence at FLA's 0.005 rms ratio, as in test_flash_kda_cases.py, and the empty
  sequences' final states are checked exactly (the initial state, or zeros). The fork's
  ``use_vsplit`` / ``workspace`` / ``segment_ids`` arguments and ``torch.ops.flash_kda`` are not
  MoonshotAI's API, which is what libkda.flash_kda stands in for (docs/PYTHON.md).
- sgl-project/sglang test/registered/attention/test_kda_kernels.py
  @05f70dc503324fcbc7cb999e78ab990f27a9597e (TestKDAFusedSigmoidGatingRecurrent,
  TestKDAChunkExponentDomain, TestKDAPackedDecode), test_kda_decode_flashinfer.py
  @045e94b2940a64061a505de0c50ea472aa8d6a10 (Kimi-K3's H = 12 safe-gate decode from gapped qkv
  views into random pool rows; target-verify per-token checkpoints against sequential decode)
  and test_kda_prefill_flashinfer.py @03e87db6f00d12b5039a712bd0b210cf4e61a447 (strided gate /
  beta views, a zero-length padded row, the state at a 64-aligned checkpoint). SGLang's own
  chunk_kda takes the state pool with ``initial_state_indices`` and updates it in place; FLA's
  and libkda's take per-sequence initial states, so the pool rows are gathered and the final
  states scattered back here (docs/PYTHON.md, Limitations: the pooled forward is not exposed in
  libkda.torch). SGLang's pools in these tests are bf16: the decode ports run bf16 pools (as
  SGLang does) and float32 ones.
- vllm-project/vllm tests/kernels/attention/test_flydsl_kda_decode.py
  @ff7b1ccb30ce433219bd73078959d6aae63c999a (Kimi-Linear's per-TP head counts 16 / 8 / 4, [bs, 1]
  int64 slot indices without num_accepted_tokens, the gate computed in kernel against the one from
  fused_kda_gate's older signature) and tests/kernels/mamba/cpu/test_cpu_kda_ops.py
  @1b12080ef628534debf5cd9d173b4235b382142a (vLLM's CPU KDA ops: chunk prefill with and without
  initial states, both gates, at 1e-5; the paged recurrent op over ragged sequences, which
  libkda's decode refuses by design; its NULL slot 0, where libkda's padding slot is negative).
- flashinfer-ai/flashinfer tests/kda/test_recurrent_kda_dense_padded_ssi.py
  @3f257633153f9f08457fee61aec38085486ce9ea (a -1 slot must not wrap to the last pool slot; the
  returned final state is the pool itself) and tests/kda/test_recurrent_kda.py
  @1981139e670cae92567f7c3bd6bff8247321c14f (test_vllm_padded_cuda_graph: vLLM's CUDA-graph
  padding with zero-length sequences, which libkda's decode refuses by design, and its
  equal-length form; test_non_compact_state_stride / test_non_contiguous_gate_stride;
  test_vllm_decode's bf16 V-first pools).
- ggml-org/llama.cpp tests/test-backend-ops.cpp @0054f92869492a7d2784ea9bc920916db8cd3301
  (test_gated_delta_net with kda = true: H = 32, K = V = 128, T = 1 and 64, log decays drawn in
  [-20, -1e-4], v in [-0.3, 5], states in [-1, 1], q / k L2-normalized first, optionally
  head-first storage; ggml's default NMSE bound 1e-7).

Every case compares with a float64 token-by-token recurrence (libkda.torch.naive_recurrent_kda
on float64 copies, the gates evaluated in float64). Shapes shrunk from the peers' (CPU, 2 cores):
SGLang's packed decode drops its B = 128 case (B <= 32), its verify tests run 4 heads instead of
16 and its H = 12 decode batches 1 and 8 (not 64); everything else runs at the peers' sizes."""

import math

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import numpy as np  # noqa: E402
from conftest import BF16, BOUND, assert_close  # noqa: E402

import libkda.torch as kt  # noqa: E402
from libkda import flash_kda  # noqa: E402

F64 = torch.float64
BF16_BOUND, F32_BOUND = BOUND[BF16], BOUND[np.dtype(np.float32)]  # SPEC.md section 4


# ------------------------------------------------------------------------------------------
# float64 reference
def _l2(x):
    """FLA's / the kernels' l2norm: x * rsqrt(sum x^2 + 1e-6)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def reference(q, k, v, g, beta, *, h0=None, cu=None, scale=None, l2norm=False, gate=None, A_log=None,
              dt_bias=None, lower_bound=-5.0, beta_sigmoid=False, v_first=False):
    """float64 token-by-token recurrence. q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (the
    log decay, or the raw gate with gate = "softplus" / "lower_bound"); states [N, HV, K, V]
    ([N, HV, V, K] with v_first), one per batch row or per cu_seqlens segment (empty segments keep
    their state). Returns (o float64, final states float64 in the states' layout)."""
    q, k, v, g, beta = (x.to(F64) for x in (q, k, v, g, beta))
    if l2norm:
        q, k = _l2(q), _l2(k)
    if gate == "softplus":
        g = kt.naive_kda_gate(g, A_log.to(F64), None if dt_bias is None else dt_bias.to(F64), output_dtype=F64)
    elif gate == "lower_bound":
        g = kt.naive_kda_lowerbound_gate(g, A_log.to(F64), None if dt_bias is None else dt_bias.to(F64),
                                         lower_bound, output_dtype=F64)
    if beta_sigmoid:
        beta = beta.sigmoid()
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    if cu is None:
        rows = [(b, 0, q.shape[1]) for b in range(q.shape[0])]
    else:
        bounds = [int(x) for x in cu]
        rows = [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]
    o = torch.zeros(v.shape, dtype=F64)
    finals = []
    for n, (b, s, e) in enumerate(rows):
        h = torch.zeros(1, HV, K, V, dtype=F64) if h0 is None else h0[n:n + 1].to(F64)
        if v_first and h0 is not None:
            h = h.transpose(-1, -2)
        sl = lambda x: x[b:b + 1, s:e]  # noqa: E731
        on, hn = kt.naive_recurrent_kda(sl(q), sl(k), sl(v), sl(g), sl(beta), scale=scale, initial_state=h,
                                        output_final_state=True)
        o[b:b + 1, s:e] = on
        finals.append(hn.transpose(-1, -2) if v_first else hn)
    return o, torch.cat(finals, 0)


def _ratio(ref, out):
    """FLA's error ratio (rms(ref - out) / rms(ref)), FlashKDA's and SGLang's metric."""
    ref, out = ref.double(), out.double()
    return ((ref - out).square().mean().sqrt() / (ref.square().mean().sqrt() + 1e-8)).item()


# ------------------------------------------------------------------------------------------
# vllm-project/FlashKDA tests/test_beta_strides.py: a row-strided beta (a column slice of a wider
# buffer, as vLLM's fused projections produce) gives bit for bit the contiguous beta's result.
@pytest.mark.parametrize("seq_lens", [None, [17, 20]], ids=["fixed", "varlen"])
def test_flash_kda_row_strided_beta_matches_contiguous(seq_lens):
    torch.manual_seed(0)
    batch = 2 if seq_lens is None else 1
    tokens = 35 if seq_lens is None else sum(seq_lens)
    sequences = batch if seq_lens is None else len(seq_lens)
    heads, dim = 4, 128
    shape = (batch, tokens, heads, dim)
    q, k, v, g = (torch.randn(shape, dtype=torch.bfloat16) for _ in range(4))
    beta_storage = torch.randn(batch, tokens, heads + 3, dtype=torch.bfloat16)
    beta_strided = beta_storage[..., :heads]
    assert beta_strided.stride(1) == heads + 3 and not beta_strided.is_contiguous()
    h0 = torch.randn(sequences, heads, dim, dim, dtype=torch.bfloat16)
    A_log, dt_bias = torch.rand(heads), torch.rand(heads, dim)
    cu = None if seq_lens is None else torch.tensor([0, seq_lens[0], sum(seq_lens)], dtype=torch.int32)

    def run(beta):
        out, fs = torch.empty_like(q), torch.empty_like(h0)
        flash_kda.fwd(q, k, v, g, beta, 1.0 / math.sqrt(dim), out, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
                      initial_state=h0, final_state=fs, **({} if cu is None else {"cu_seqlens": cu}))
        return out, fs

    expected, actual = run(beta_strided.contiguous()), run(beta_strided)
    assert torch.equal(actual[0], expected[0])
    assert torch.equal(actual[1], expected[1])
    ref_o, ref_ht = reference(q, k, v, g, beta_strided, h0=h0, cu=cu, scale=1.0 / math.sqrt(dim), l2norm=True,
                              gate="lower_bound", A_log=A_log, dt_bias=dt_bias, beta_sigmoid=True, v_first=True)
    assert _ratio(ref_o, actual[0]) < 0.005 and _ratio(ref_ht, actual[1]) < 0.005


# ------------------------------------------------------------------------------------------
# vllm-project/FlashKDA tests/test_vsplit.py: H = 1, D = 128; every state in / out mode in bf16 and
# fp32 over a fixed-length batch (B = 2, T = 17), four full chunks (T = 64), and varlen sequences
# (0, 1, 0, 17, 0) with empty ones at the start, middle and end, int32 and int64 cu_seqlens.
# Output and final-state buffers start as NaN: every element must be written, an empty
# sequence's final state included (its initial state, or zeros without one).
VS_D, VS_H = 128, 1
STATE_CASES = [("no_state", False, False, None), ("in_only_bf16", True, False, torch.bfloat16),
               ("in_only_fp32", True, False, torch.float32), ("out_only_bf16", False, True, torch.bfloat16),
               ("out_only_fp32", False, True, torch.float32), ("in_out_bf16", True, True, torch.bfloat16),
               ("in_out_fp32", True, True, torch.float32)]


def _vsplit_problem(batch, seq_len, seed):
    torch.manual_seed(seed)
    shape = (batch, seq_len, VS_H, VS_D)
    q = F.normalize(torch.randn(shape), p=2, dim=-1).to(torch.bfloat16)
    k = F.normalize(torch.randn(shape), p=2, dim=-1).to(torch.bfloat16)
    v, g = torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16)
    beta = torch.randn(shape[:-1], dtype=torch.bfloat16)
    return q, k, v, g, beta, torch.rand(VS_H), torch.rand(VS_H, VS_D)


def _vsplit_check(problem, n_seq, cu, case):
    name, has_in, has_out, dtype = case
    q, k, v, g, beta, A_log, dt_bias = problem
    torch.manual_seed(303)
    h0 = torch.randn(n_seq, VS_H, VS_D, VS_D).to(dtype) if has_in else None
    fs = torch.full((n_seq, VS_H, VS_D, VS_D), float("nan"), dtype=dtype) if has_out else None
    out = torch.full_like(q, float("nan"))
    flash_kda.fwd(q, k, v, g, beta, 1.0 / math.sqrt(VS_D), out, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
                  initial_state=None if h0 is None else h0.clone(), final_state=fs, cu_seqlens=cu)
    ref_o, ref_ht = reference(q, k, v, g, beta, h0=h0, cu=cu, scale=1.0 / math.sqrt(VS_D), l2norm=True,
                              gate="lower_bound", A_log=A_log, dt_bias=dt_bias, beta_sigmoid=True, v_first=True)
    assert not out.isnan().any(), f"{name}: output not written everywhere"
    assert_close(out.double().numpy(), ref_o.numpy(), 0.005, f"{name} o")
    if has_out:
        assert fs.dtype == dtype and not fs.isnan().any(), f"{name}: final state not written everywhere"
        assert_close(fs.double().numpy(), ref_ht.numpy(), 0.005, f"{name} final_state")
        if cu is not None:
            bounds = [int(x) for x in cu]
            for n in range(n_seq):
                if bounds[n + 1] == bounds[n]:  # an empty sequence: its state passes through exactly
                    want = h0[n] if has_in else torch.zeros_like(fs[n])
                    assert torch.equal(fs[n], want), f"{name}: empty sequence {n} final state"


@pytest.mark.parametrize("case", STATE_CASES, ids=[c[0] for c in STATE_CASES])
def test_flash_kda_vsplit_fixed(case):
    """test_vsplit_fixed_exact: B = 2, T = 17 (a chunk boundary crossed, a tail stored)."""
    _vsplit_check(_vsplit_problem(2, 17, 101), 2, None, case)


def test_flash_kda_vsplit_stage_reuse():
    """test_vsplit_stage_reuse_exact: T = 64 (four full 16-row chunks), fp32 state in and out."""
    _vsplit_check(_vsplit_problem(1, 64, 404), 1, None, ("stage_reuse_fp32", True, True, torch.float32))


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=["cu_int32", "cu_int64"])
@pytest.mark.parametrize("case", STATE_CASES, ids=[c[0] for c in STATE_CASES])
def test_flash_kda_vsplit_varlen_empty_sequences(case, cu_dtype):
    """test_vsplit_varlen_exact: lengths (0, 1, 0, 17, 0)."""
    lengths = (0, 1, 0, 17, 0)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    _vsplit_check(_vsplit_problem(1, offsets[-1], 202), len(lengths), torch.tensor(offsets, dtype=cu_dtype), case)


# ------------------------------------------------------------------------------------------
# SGLang test_kda_kernels.py TestKDAFusedSigmoidGatingRecurrent: one-token decode of four
# sequences into pool slots 0, 2, 5, 8 of a 64-slot zero pool, the softplus gate computed in
# kernel from a raw gate with a bf16 dt_bias [H * K] and A_log [1, 1, H, 1], beta logits; against
# the same step with the gate and beta computed in torch and the states gathered (SGLang's
# run_kda), at SGLang's tolerances (o rtol 1e-3 / atol 1e-4; states torch.allclose's defaults).
def test_sglang_fused_sigmoid_gating_decode_matches_gathered_recurrence():
    torch.manual_seed(0)
    T, H, D, cache_len = 4, 8, 128, 64
    qsl = torch.tensor([0, 1, 2, 3, 4])
    cache_indices = torch.tensor([0, 2, 5, 8])
    A_log = torch.randn(1, 1, H, 1)
    a = torch.randn(1, T, H * D, dtype=torch.bfloat16)
    dt_bias = torch.randn(H * D, dtype=torch.bfloat16)
    q, k, v = (torch.randn(1, T, H, D, dtype=torch.bfloat16) for _ in range(3))
    beta = torch.randn(1, T, H, dtype=torch.bfloat16)
    ssm_states = torch.zeros(cache_len, H, D, D)

    pool = ssm_states.clone()
    o, fs = kt.fused_recurrent_kda_fwd(q, k, v, a.view(1, T, H, D), beta, A_log=A_log, dt_bias=dt_bias,
                                       initial_state=pool, cu_seqlens=qsl, ssm_state_indices=cache_indices,
                                       use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                       use_beta_sigmoid_in_kernel=True)
    assert fs is pool
    # SGLang's run_kda (its fused_recurrent_kda returns the final state; FLA's needs output_final_state)
    g = -torch.exp(A_log.float().view(1, 1, H, 1)) * F.softplus((a.float() + dt_bias.float()).view(1, -1, H, D))
    o_ref, last_ref = kt.fused_recurrent_kda(q, k, v, g, beta.float().sigmoid(),
                                             initial_state=ssm_states[cache_indices].clone(), output_final_state=True,
                                             use_qk_l2norm_in_kernel=True, cu_seqlens=qsl)
    assert torch.allclose(o, o_ref, rtol=1e-3, atol=1e-4), (o - o_ref).abs().max()
    assert torch.allclose(pool[cache_indices], last_ref), (pool[cache_indices] - last_ref).abs().max()
    untouched = torch.ones(cache_len, dtype=torch.bool)
    untouched[cache_indices] = False
    assert not pool[untouched].any()
    ref_o, ref_ht = reference(q, k, v, a.view(1, T, H, D), beta, h0=ssm_states[cache_indices], cu=qsl, l2norm=True,
                              gate="softplus", A_log=A_log, dt_bias=dt_bias, beta_sigmoid=True)
    assert_close(o.double().numpy(), ref_o.numpy(), BF16_BOUND, "o")
    assert_close(pool[cache_indices].double().numpy(), ref_ht.numpy(), F32_BOUND, "pool")


# ------------------------------------------------------------------------------------------
# SGLang TestKDAChunkExponentDomain: bf16 chunked prefill (H = 2, K = V = 64) from V-first pool
# states against the natural-exp recurrence, rms ratio < 1e-2 for o and the states: one 129-token
# sequence (precomputed gate), varlen [15, 16, 17, 63, 65] with int32 cu_seqlens and the softplus
# gate in kernel, and 129 two-token sequences (precomputed gate).
@pytest.mark.parametrize("lengths,use_varlen,fuse_gate", [
    ([129], False, False), ([15, 16, 17, 63, 65], True, True), ([2] * 129, True, False)],
    ids=["single129", "varlen_fused_gate", "129x2"])
def test_sglang_chunk_prefill_matches_natural_exp_recurrence(lengths, use_varlen, fuse_gate):
    torch.manual_seed(42)
    dtype, H, D = torch.bfloat16, 2, 64
    total = sum(lengths)
    shape = (1, total, H, D)
    q = F.normalize(torch.randn(shape), dim=-1).to(dtype)
    k = F.normalize(torch.randn(shape), dim=-1).to(dtype)
    v = torch.randn(shape, dtype=dtype) * 0.1
    raw_gate = (torch.randn(shape) * 0.5 - 2.0).to(dtype)
    A_log = torch.randn(H) * 0.1
    dt_bias = torch.randn(H * D) * 0.1
    activated = -torch.exp(A_log.view(1, 1, H, 1)) * F.softplus(raw_gate.float() + dt_bias.view(1, 1, H, D))
    kernel_gate = raw_gate if fuse_gate else activated.to(dtype)
    beta = torch.rand(1, total, H, dtype=dtype).sigmoid()
    pool = torch.randn(len(lengths), H, D, D) * 0.05  # V-first, SGLang's layout
    idx = torch.arange(len(lengths), dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32) if use_varlen else None

    before = pool.clone()
    o, fs = kt.chunk_kda(q, k, v, kernel_gate, beta, initial_state=pool[idx.long()], output_final_state=True,
                         state_v_first=True, cu_seqlens=cu, use_gate_in_kernel=fuse_gate,
                         **(dict(A_log=A_log, dt_bias=dt_bias) if fuse_gate else {}))
    pool[idx.long()] = fs  # SGLang's chunk_kda writes the pool rows in place
    ref_o, ref_ht = reference(q, k, v, raw_gate if fuse_gate else kernel_gate, beta, h0=before,
                              cu=cu if use_varlen else torch.tensor([0, total]),
                              gate="softplus" if fuse_gate else None, A_log=A_log, dt_bias=dt_bias, v_first=True)
    assert_close(o.double().numpy(), ref_o.numpy(), 1e-2, "output")
    assert_close(pool.double().numpy(), ref_ht.numpy(), 1e-2, "state")


# ------------------------------------------------------------------------------------------
# SGLang TestKDAPackedDecode: one-token decode for B requests from a fused qkv projection (q, k, v
# are gapped column views of one [B, 2 H K + HV V] buffer), the raw gate [B, HV * K] and beta
# logits [B, HV] viewed in place, A_log [1, 1, HV, 1] and dt_bias [HV * K] (its
# production-shape test), a V-first pool, int32 slots and cu_seqlens, o into an [B, 1, HV, V]
# ``out`` buffer; against the float64 recurrence at SGLang's atol 2e-2 / rtol 1e-2. test_pad_slot:
# every other request padded (slot -1): o exactly 0 there and those slots untouched.
def _packed_decode(B, H, HV, K, V, pad=False, seed=42, pool_dtype=torch.bfloat16):
    torch.manual_seed(seed)
    qkv_dim = 2 * H * K + HV * V
    mixed_qkv = torch.randn(B, qkv_dim, dtype=torch.bfloat16) * 0.1
    a = torch.randn(B, HV * K, dtype=torch.bfloat16) * 0.5 - 1.0
    b = torch.randn(B, HV, dtype=torch.bfloat16) * 0.5
    A_log = torch.randn(HV) * 0.2
    dt_bias = torch.randn(HV * K) * 0.1
    pool = (torch.randn(B + 4, HV, V, K) * 0.01).to(pool_dtype)
    cache_indices = torch.arange(B, dtype=torch.int32)
    if pad:
        cache_indices[::2] = -1
    q_flat, k_flat, v_flat = torch.split(mixed_qkv, [H * K, H * K, HV * V], dim=-1)
    q, k, v = q_flat.view(1, B, H, K), k_flat.view(1, B, H, K), v_flat.view(1, B, HV, V)
    if B > 1:
        assert not q.is_contiguous() and not v.is_contiguous()  # read in place, not copied
    g, beta = a.view(1, B, HV, K), b.unsqueeze(0)
    before = pool.clone()
    out = torch.empty(B, 1, HV, V, dtype=torch.bfloat16)
    o, fs = kt.fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=A_log.view(1, 1, HV, 1), dt_bias=dt_bias,
                                       scale=K ** -0.5, initial_state=pool, ssm_state_indices=cache_indices,
                                       cu_seqlens=torch.arange(B + 1, dtype=torch.int32),
                                       use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                       use_beta_sigmoid_in_kernel=True, state_v_first=True, out=out)
    assert o is out and fs is pool
    live = cache_indices >= 0
    rows = cache_indices[live].long()
    ref_o, ref_ht = reference(q[:, live], k[:, live], v[:, live], g[:, live], beta[:, live], h0=before[rows],
                              cu=torch.arange(int(live.sum()) + 1), scale=K ** -0.5, l2norm=True, gate="softplus",
                              A_log=A_log, dt_bias=dt_bias, beta_sigmoid=True, v_first=True)
    o = out.transpose(0, 1)
    torch.testing.assert_close(o[:, live].double(), ref_o, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(pool[rows].double(), ref_ht, atol=2e-2, rtol=1e-2)
    assert torch.equal(o[:, ~live], torch.zeros_like(o[:, ~live])), "a padded request's output must be 0"
    untouched = torch.ones(B + 4, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(pool[untouched], before[untouched]), "a slot no request writes changed"


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32], ids=["bf16_pool", "fp32_pool"])
@pytest.mark.parametrize("B,H,HV", [(1, 16, 16), (4, 16, 16), (32, 16, 16), (8, 8, 16)],
                         ids=["b1", "b4", "b32", "asymmetric_heads"])
def test_sglang_packed_decode(B, H, HV, pool_dtype):
    _packed_decode(B, H, HV, 128, 128, pool_dtype=pool_dtype)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32], ids=["bf16_pool", "fp32_pool"])
def test_sglang_packed_decode_pad_slot(pool_dtype):
    _packed_decode(8, 16, 16, 128, 128, pad=True, pool_dtype=pool_dtype)


# ------------------------------------------------------------------------------------------
# SGLang test_kda_decode_flashinfer.py test_kda_decode_cake_matches_triton_kimi_k3_h12: Kimi-K3's
# TP8-local H = 12 safe-gate (lower_bound = -5) decode, q / k / v gapped views of one fused
# conv output, random non-identity pool rows; SGLang's atol = rtol = 1e-2 for o and the states.
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32], ids=["bf16_pool", "fp32_pool"])
@pytest.mark.parametrize("batch", [1, 8])
def test_sglang_kimi_k3_h12_safe_gate_decode(batch, pool_dtype):
    torch.manual_seed(12000 + batch)
    H = HV = 12
    K = V = 128
    pool_size = batch + 16
    segment = H * K
    mixed_qkv = torch.randn(batch, 3 * segment, dtype=torch.bfloat16)
    qf, kf, vf = mixed_qkv.split([segment, segment, segment], dim=-1)
    q, k, v = (x.unflatten(-1, (H, K)).unsqueeze(0) for x in (qf, kf, vf))
    a = torch.randn(batch, HV * K, dtype=torch.bfloat16) * 0.5 - 1.0
    b = torch.randn(batch, HV, dtype=torch.bfloat16) * 0.5
    A_log = torch.randn(H) * 0.2
    dt_bias = torch.randn(H * K) * 0.1
    pool = (torch.randn(pool_size, HV, V, K) * 0.01).to(pool_dtype)
    slots = torch.randperm(pool_size)[:batch].to(torch.int32)
    before = pool.clone()
    o, _ = kt.fused_recurrent_kda_fwd(q, k, v, a.view(1, batch, HV, K), b.unsqueeze(0), A_log=A_log, dt_bias=dt_bias,
                                      initial_state=pool, ssm_state_indices=slots,
                                      cu_seqlens=torch.arange(batch + 1, dtype=torch.int32),
                                      use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                      use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, state_v_first=True)
    ref_o, ref_ht = reference(q, k, v, a.view(1, batch, HV, K), b.unsqueeze(0), h0=before[slots.long()],
                              cu=torch.arange(batch + 1), l2norm=True, gate="lower_bound", A_log=A_log,
                              dt_bias=dt_bias, beta_sigmoid=True, v_first=True)
    torch.testing.assert_close(o.double(), ref_o, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(pool[slots.long()].double(), ref_ht, atol=1e-2, rtol=1e-2)
    others = torch.ones(pool_size, dtype=torch.bool)
    others[slots.long()] = False
    assert torch.equal(pool[others], before[others])


# ------------------------------------------------------------------------------------------
# SGLang test_kda_decode_flashinfer.py test_kda_target_verify_flashinfer_matches_triton /
# _checkpoint_states: a topk = 1 verify of T = 1 + num_spec draft tokens per request keeps the
# committed pool untouched and returns the state after every token; those checkpoints equal
# single-token decodes run one step at a time (SGLang: max 1e-1 / mean 1e-2 for the states, max
# 1e-2 / mean 1e-3 for o). libkda's verify is FLA's inplace_final_state=False with slot indices.
@pytest.mark.parametrize("batch,num_spec", [(1, 7), (8, 7), (32, 3)])
def test_sglang_target_verify_checkpoints_equal_sequential_decode(batch, num_spec):
    torch.manual_seed(1000 + batch + num_spec)
    H = HV = 4  # SGLang: 16
    K = V = 128
    T = 1 + num_spec
    seq = batch * T
    q, k = (torch.randn(1, seq, H, K, dtype=torch.bfloat16) * 0.5 for _ in range(2))
    v = torch.randn(1, seq, HV, V, dtype=torch.bfloat16) * 0.5
    a = torch.randn(seq, HV * K, dtype=torch.bfloat16) * 0.5 - 1.0
    b = torch.randn(seq, HV, dtype=torch.bfloat16) * 0.5
    A_log, dt_bias = torch.randn(HV) * 0.2, torch.randn(HV * K) * 0.1
    pool = torch.randn(batch + 16, HV, V, K) * 0.01
    cache_indices = torch.arange(batch, dtype=torch.int32)
    opts = dict(A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, state_v_first=True)
    before = pool.clone()
    o, checkpoints = kt.fused_recurrent_kda_fwd(q, k, v, a.view(1, seq, HV, K), b.view(1, seq, HV),
                                                initial_state=pool, inplace_final_state=False,
                                                output_final_state=True, ssm_state_indices=cache_indices,
                                                cu_seqlens=torch.arange(0, seq + 1, T, dtype=torch.int32), **opts)
    assert torch.equal(pool, before), "verify must leave the committed pool untouched"
    assert checkpoints.shape == (seq, HV, V, K)
    got = checkpoints.view(batch, T, HV, V, K)

    st = pool.clone()
    ref_states = torch.zeros(batch, T, HV, V, K)
    ref_out = torch.zeros(1, seq, HV, V)
    for t in range(T):
        pos = torch.arange(batch) * T + t
        ot, _ = kt.fused_recurrent_kda_fwd(q[:, pos], k[:, pos], v[:, pos], a[pos].view(1, batch, HV, K),
                                           b[pos].view(1, batch, HV), initial_state=st,
                                           ssm_state_indices=cache_indices,
                                           cu_seqlens=torch.arange(batch + 1, dtype=torch.int32), **opts)
        ref_out[:, pos] = ot.float()
        ref_states[:, t] = st[cache_indices.long()]
    s_err = (got - ref_states).abs()
    assert s_err.max() < 1e-1 and s_err.mean() < 1e-2, (s_err.max(), s_err.mean())
    o_err = (o.float() - ref_out).abs()
    assert o_err.max() < 1e-2 and o_err.mean() < 1e-3, (o_err.max(), o_err.mean())


# ------------------------------------------------------------------------------------------
# SGLang test_kda_prefill_flashinfer.py test_kda_prefill_checkpoints: H = 12, K = V = 128,
# lengths [130, 128] (+ a zero-length padded row), raw gates with the safe gate (A_log = 0,
# dt_bias = 0, lower_bound = -5) and raw beta; "strided_gates": g and beta are column slices of
# wider buffers; states bf16 or fp32 from V-first pool slots [1, 2, 0]. The state after the
# 64-aligned 128th token of the 130-token sequence (SGLang's tracked checkpoint) equals the final
# state of the 128-token prefix exactly (SGLang: atol = 0 against its own prefix run) and is within
# SGLang's 5e-2 norm ratio of the float64 recurrence; o and the pool within SGLang's atol = rtol =
# 3e-2 (its backend test); the padded row's slot is untouched. SGLang's buffers carry 14 tokens
# of padding past cu_seqlens[-1] in g and beta; libkda takes g and beta of q's token count, so
# they are sliced to it here.
@pytest.mark.parametrize("layout,state_dtype", [("dense", torch.bfloat16), ("dense", torch.float32),
                                                ("strided_gates", torch.float32), ("padded_row", torch.bfloat16)],
                         ids=["bf16", "fp32", "strided_gates", "padded_row"])
def test_sglang_prefill_checkpoint_strided_gates_and_padded_row(layout, state_dtype):
    torch.manual_seed(7)
    lengths = [130, 128] + ([0] if layout == "padded_row" else [])
    heads, dim = 12, 128
    total = sum(lengths)
    q, k, v = (torch.randn(1, total, heads, dim, dtype=torch.bfloat16) * 0.01 for _ in range(3))
    gate_dim = dim * 2 if layout == "strided_gates" else dim
    beta_dim = heads * 12 if layout == "strided_gates" else heads
    g = (torch.randn(1, total + 14, heads, gate_dim, dtype=torch.bfloat16) * 0.1)[..., :dim][:, :total]
    beta = torch.randn(1, total + 14, beta_dim, dtype=torch.bfloat16)[..., :heads][:, :total]
    if layout == "strided_gates":
        assert not g.is_contiguous() and not beta.is_contiguous()
    pool = (torch.randn(4, heads, dim, dim) * 0.01).to(state_dtype)
    slots = torch.tensor([1, 2, 0][:len(lengths)])
    gates = dict(A_log=torch.zeros(heads), dt_bias=torch.zeros(heads, dim), lower_bound=-5.0,
                 use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True,
                 state_v_first=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    before = pool.clone()
    with torch.inference_mode():
        o, fs, h = kt.chunk_kda(q, k, v, g, beta, initial_state=pool[slots], output_final_state=True,
                                cu_seqlens=cu, return_intermediate_states=True, **gates)
        _, prefix_state = kt.chunk_kda(q[:, :128], k[:, :128], v[:, :128], g[:, :128], beta[:, :128],
                                       initial_state=pool[slots[:1]], output_final_state=True,
                                       cu_seqlens=torch.tensor([0, 128], dtype=torch.int32), **gates)
    pool[slots] = fs.to(state_dtype)
    # h: the state entering every chunk, sequence by sequence ([1, NC, HV, V, K], in k's dtype):
    # the 130-token sequence's chunks start at 0, 64 and 128.
    checkpoint = h[0, 2]
    assert torch.equal(checkpoint, prefix_state[0].to(checkpoint.dtype))
    ref_o, ref_ht = reference(q, k, v, g, beta, h0=before[slots], cu=cu, l2norm=True, gate="lower_bound",
                              A_log=gates["A_log"], dt_bias=gates["dt_bias"], beta_sigmoid=True, v_first=True)
    _, ref_prefix = reference(q[:, :128], k[:, :128], v[:, :128], g[:, :128], beta[:, :128], h0=before[slots[:1]],
                              cu=torch.tensor([0, 128]), l2norm=True, gate="lower_bound", A_log=gates["A_log"],
                              dt_bias=gates["dt_bias"], beta_sigmoid=True, v_first=True)
    norm = torch.linalg.vector_norm
    assert norm(checkpoint.double() - ref_prefix[0]) / norm(ref_prefix[0]) < 5e-2
    torch.testing.assert_close(o.double(), ref_o, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(pool[slots].double(), ref_ht.to(state_dtype).double(), atol=3e-2, rtol=3e-2)
    if layout == "padded_row":
        assert torch.equal(pool[0], before[0]), "the zero-length row's slot changed"
    assert torch.equal(pool[3], before[3])


# ------------------------------------------------------------------------------------------
# vLLM test_flydsl_kda_decode.py: one decode step (T = 1) on Kimi-Linear-48B-A3B's per-TP head
# counts (32 heads at TP 2 / 4 / 8: 16, 8, 4), K = V = 128, bs 1 and 4. The reference path is
# vLLM's: fused_kda_gate(g1 [bs, T, H * D], A_log [1, 1, H, 1], head_dim, g_bias=dt_bias), beta
# sigmoided in torch, packed tokens with cu_seqlens and [bs, 1] int64 slot indices (no
# num_accepted_tokens); the other path computes gate and beta in kernel from the raw projections
# (FlyDSL's role). vLLM's bound: max |diff| <= 1.5e-2, here also against the float64 recurrence.
@pytest.mark.parametrize("num_heads", [16, 8, 4], ids=["tp2-nh16", "tp4-nh8", "tp8-nh4"])
@pytest.mark.parametrize("bs", [1, 4])
def test_vllm_kimi_linear_decode_gate_in_kernel_matches_fused_kda_gate(num_heads, bs):
    torch.manual_seed(0)
    H, D, T = num_heads, 128, 1
    q, k, v = (torch.randn(bs, T, H, D, dtype=torch.bfloat16) * 0.1 for _ in range(3))
    g1_raw = torch.randn(bs, T, H * D, dtype=torch.bfloat16) * 0.1
    beta_raw = torch.randn(bs, T, H) * 0.5
    A_log = (torch.randn(H) * -1.0 - 2.0).view(1, 1, H, 1)
    dt_bias = torch.randn(H * D) * 0.01
    state_init = torch.zeros(bs, H, D, D)
    cu = torch.arange(0, bs * T + 1, T, dtype=torch.int32)
    ssm_state_indices = torch.arange(bs, dtype=torch.long).unsqueeze(-1)
    packed = lambda x: x.reshape(1, bs * T, *x.shape[2:])  # noqa: E731

    g_fla = kt.fused_kda_gate(g1_raw, A_log, D, g_bias=dt_bias)
    state_fla = state_init.clone()
    out_fla, _ = kt.fused_recurrent_kda(q=packed(q), k=packed(k), v=packed(v), g=g_fla.reshape(1, bs * T, H, D),
                                        beta=beta_raw.sigmoid().reshape(1, bs * T, H), initial_state=state_fla,
                                        inplace_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                        ssm_state_indices=ssm_state_indices)
    state_fused = state_init.clone()
    out_fused, _ = kt.fused_recurrent_kda(q=packed(q), k=packed(k), v=packed(v), g=packed(g1_raw.unflatten(-1, (H, D))),
                                          beta=packed(beta_raw), A_log=A_log, dt_bias=dt_bias,
                                          initial_state=state_fused, inplace_final_state=True,
                                          use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                          use_beta_sigmoid_in_kernel=True, cu_seqlens=cu,
                                          ssm_state_indices=ssm_state_indices)
    diff = (out_fla.float() - out_fused.float()).abs()
    assert diff.max() <= 1.5e-2, diff.max()
    ref_o, ref_ht = reference(packed(q), packed(k), packed(v), packed(g1_raw.unflatten(-1, (H, D))), packed(beta_raw),
                              h0=state_init, cu=cu, l2norm=True, gate="softplus", A_log=A_log, dt_bias=dt_bias,
                              beta_sigmoid=True)
    for name, out, state in (("fused_kda_gate", out_fla, state_fla), ("gate in kernel", out_fused, state_fused)):
        assert (out.double() - ref_o).abs().max() <= 1.5e-2, name
        assert_close(out.double().numpy(), ref_o.numpy(), BF16_BOUND, f"o ({name})")
        assert_close(state.double().numpy(), ref_ht.numpy(), F32_BOUND, f"state ({name})")


# ------------------------------------------------------------------------------------------
# vLLM tests/kernels/mamba/cpu/test_cpu_kda_ops.py (GLM-5.3-Flash's CPU KDA ops): H = 2,
# K = V = 64, varlen [17, 13, 10] with int32 cu_seqlens, float32; max |diff| <= 1e-5 against the
# reference (vLLM's own float32 transcription; the float64 recurrence here).
CPU_H, CPU_K, CPU_V, CPU_LB = 2, 64, 64, -5.0
CPU_SEQ_LENS = [17, 13, 10]
CPU_SLOTS = [1, 3, 5]
CPU_CU = torch.tensor([0, 17, 30, 40], dtype=torch.int32)


def _cpu_inputs():
    torch.manual_seed(12345)
    T = sum(CPU_SEQ_LENS)
    return (torch.randn(1, T, CPU_H, CPU_K), torch.randn(1, T, CPU_H, CPU_K), torch.randn(1, T, CPU_H, CPU_V),
            torch.randn(1, T, CPU_H, CPU_K) * 0.5, torch.randn(1, T, CPU_H) * 0.5, torch.randn(CPU_H) * 0.3 - 1.0,
            torch.randn(CPU_H, CPU_K) * 0.1)


def _max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("with_initial_state", [True, False], ids=["init", "no_init"])
@pytest.mark.parametrize("safe", [True, False], ids=["safe_gate", "softplus_gate"])
def test_vllm_cpu_chunk_kda_matches_reference(safe, with_initial_state):
    """test_chunk_kda_matches_reference / test_chunk_kda_no_initial_state: chunked prefill with the
    gate in kernel (both gates), beta pre-sigmoided, V-first initial states [3, H, V, K] * 0.3."""
    q, k, v, g, beta, a_log, g_bias = _cpu_inputs()
    init = torch.randn(len(CPU_SLOTS), CPU_H, CPU_V, CPU_K) * 0.3 if with_initial_state else None
    o, fs = kt.chunk_kda(q, k, v, g, beta.sigmoid(), A_log=a_log, dt_bias=g_bias,
                         initial_state=None if init is None else init.clone(), output_final_state=True,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, cu_seqlens=CPU_CU, safe_gate=safe,
                         lower_bound=CPU_LB if safe else None, state_v_first=True)
    ref_o, ref_ht = reference(q, k, v, g, beta, h0=init, cu=CPU_CU, l2norm=True,
                              gate="lower_bound" if safe else "softplus", A_log=a_log, dt_bias=g_bias,
                              lower_bound=CPU_LB, beta_sigmoid=True, v_first=True)
    assert _max_diff(o, ref_o) <= 1e-5, _max_diff(o, ref_o)
    assert _max_diff(fs, ref_ht) <= 1e-5, _max_diff(fs, ref_ht)


def test_vllm_cpu_paged_recurrent_over_ragged_sequences():
    """test_recurrent_kda_paged_cache: vLLM's CPU recurrent op runs ragged multi-token sequences
    (17, 13 and 10 tokens) through slot indices [1, 3, 5] of an 8-slot V-first pool. libkda runs
    a decode call per length (docs/PYTHON.md, Decode): o and the written slots against the float64
    recurrence at 1e-5, the other slots bitwise untouched; out of place (other kernels: each
    token's state kept), o and the last tokens' states at 1e-5 too and the pool untouched; and
    chunk_kda on the gathered states (the route for long ragged prefill) agrees at 1e-5."""
    q, k, v, g, beta, a_log, g_bias = _cpu_inputs()
    torch.manual_seed(1)
    init = torch.randn(8, CPU_H, CPU_V, CPU_K) * 0.3
    cache = init.clone()
    slots = torch.tensor(CPU_SLOTS, dtype=torch.int32)
    opts = dict(A_log=a_log, dt_bias=g_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, lower_bound=CPU_LB, state_v_first=True)
    o, fs = kt.fused_recurrent_kda(q, k, v, g, beta, initial_state=cache, cu_seqlens=CPU_CU, ssm_state_indices=slots,
                                   **opts)
    assert fs is cache
    ref_o, ref_ht = reference(q, k, v, g, beta, h0=init[slots.long()], cu=CPU_CU, l2norm=True, gate="lower_bound",
                              A_log=a_log, dt_bias=g_bias, lower_bound=CPU_LB, beta_sigmoid=True, v_first=True)
    assert _max_diff(o, ref_o) <= 1e-5, _max_diff(o, ref_o)
    assert _max_diff(cache[slots.long()], ref_ht) <= 1e-5
    untouched = [s for s in range(8) if s not in CPU_SLOTS]
    assert torch.equal(cache[untouched], init[untouched])

    pool = init.clone()
    o_oop, states = kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, inplace_final_state=False,
                                               output_final_state=True, cu_seqlens=CPU_CU, ssm_state_indices=slots,
                                               **opts)
    assert torch.equal(pool, init) and _max_diff(o_oop, ref_o) <= 1e-5
    last = (CPU_CU[1:] - 1).long()  # each sequence's last token: its final state
    assert _max_diff(states[last], ref_ht) <= 1e-5

    oc, hc = kt.chunk_kda(q, k, v, g, beta, initial_state=init[slots.long()], output_final_state=True,
                          cu_seqlens=CPU_CU, **opts)
    assert _max_diff(oc, ref_o) <= 1e-5 and _max_diff(hc, ref_ht) <= 1e-5


def test_vllm_cpu_slot_zero_is_a_real_slot_and_negative_is_padding():
    """test_recurrent_kda_null_slot_skipped: in that vLLM CPU op slot 0 is the NULL block, and its
    sequences are skipped. libkda follows FLA / vLLM's PAD_SLOT_ID / SGLang: a negative slot is
    padding (o = 0, nothing written) and slot 0 is an ordinary slot (docs/PYTHON.md, Decode:
    "Negative slots are skipped; a negative read slot makes the row padding")."""
    q, k, v, g, beta, a_log, g_bias = (x[:, :3] if x.dim() > 2 else x for x in _cpu_inputs())
    torch.manual_seed(2)
    init = torch.randn(4, CPU_H, CPU_V, CPU_K)
    cache = init.clone()
    slots = torch.tensor([0, 2, -1], dtype=torch.int32)
    opts = dict(A_log=a_log, dt_bias=g_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, lower_bound=CPU_LB, state_v_first=True)
    cu = torch.arange(4, dtype=torch.int32)
    o, _ = kt.fused_recurrent_kda(q, k, v, g, beta, initial_state=cache, cu_seqlens=cu, ssm_state_indices=slots,
                                  **opts)
    ref_o, ref_ht = reference(q[:, :2], k[:, :2], v[:, :2], g[:, :2], beta[:, :2], h0=init[[0, 2]],
                              cu=torch.arange(3), l2norm=True, gate="lower_bound", A_log=a_log, dt_bias=g_bias,
                              lower_bound=CPU_LB, beta_sigmoid=True, v_first=True)
    assert _max_diff(o[:, :2], ref_o) <= 1e-5
    assert _max_diff(cache[[0, 2]], ref_ht) <= 1e-5
    assert torch.equal(o[:, 2], torch.zeros_like(o[:, 2])), "the padding row's o must be 0"
    assert torch.equal(cache[[1, 3]], init[[1, 3]])


# ------------------------------------------------------------------------------------------
# FlashInfer tests/kda/test_recurrent_kda_dense_padded_ssi.py: dense [B, 1, H, D] decode
# (no cu_seqlens), H = 32, D = 64, precomputed gate; a -1 slot must not wrap around to the last
# pool slot (which holds a 7.0 sentinel), the active slots change, the others stay bitwise the
# same, and the returned final state is the pool itself. FlashInfer's pool is bf16; also float32.
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32], ids=["bf16_pool", "fp32_pool"])
@pytest.mark.parametrize("B,ssi,active", [(2, [-1, 3], [3]), (4, [-1, 1, -1, 3], [1, 3])],
                         ids=["grouped-B2", "onewarp-B4"])
def test_flashinfer_padded_slot_does_not_wrap(B, ssi, active, pool_dtype):
    torch.manual_seed(0)
    H, D, n_slots = 32, 64, 5
    state_pool = torch.zeros(n_slots, H, D, D, dtype=pool_dtype)
    state_pool[-1] = 7.0
    for slot in active:
        state_pool[slot] = torch.randn(H, D, D) * 0.01
    before = state_pool.clone()
    q, k, v = (torch.rand(B, 1, H, D, dtype=torch.bfloat16) for _ in range(3))
    g = F.logsigmoid(torch.randn(B, 1, H, D)).to(torch.bfloat16)
    beta = torch.rand(B, 1, H, dtype=torch.bfloat16).sigmoid()
    out, final_state = kt.fused_recurrent_kda(q, k, v, g, beta, scale=D ** -0.5, initial_state=state_pool,
                                              output_final_state=True, use_qk_l2norm_in_kernel=True,
                                              ssm_state_indices=torch.tensor(ssi, dtype=torch.int32))
    assert final_state is state_pool and tuple(final_state.shape) == (n_slots, H, D, D)
    for slot in set(range(n_slots)) - set(active):
        assert torch.equal(state_pool[slot], before[slot]), f"inactive slot {slot} was modified"
    rows = [i for i, s in enumerate(ssi) if s >= 0]
    ref_o, ref_ht = reference(q[rows], k[rows], v[rows], g[rows], beta[rows], h0=before[active], scale=D ** -0.5,
                              l2norm=True)
    assert_close(out[rows].double().numpy(), ref_o.numpy(), BF16_BOUND, "o")
    assert_close(state_pool[active].double().numpy(), ref_ht.numpy(),
                 F32_BOUND if pool_dtype == torch.float32 else BF16_BOUND, "active slots")
    pad = [i for i, s in enumerate(ssi) if s < 0]
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))


# ------------------------------------------------------------------------------------------
# FlashInfer test_recurrent_kda.py test_vllm_padded_cuda_graph: vLLM pads a decode batch for its
# CUDA graphs with zero-length sequences (cu_seqlens [0, 1, 2, 3, 4, 4, 4, 4]) whose slot is
# PAD_SLOT_ID = -1, over a buffer of 7 tokens; slot 0 holds a 7.0 sentinel that must survive.
# libkda decodes the zero-length sequences as nothing and gives the 3 tokens after cu_seqlens[-1]
# o = 0 (docs/PYTHON.md, Decode): o and the pool are bitwise those of the same batch padded with
# one-token rows of slot -1, the sentinel slot is untouched and the active rows match the
# recurrence (FlashInfer's tolerances: o atol = rtol = 5e-3, states atol 0.1 / rtol 0.05).
@pytest.mark.parametrize("H,D,gate_in_kernel,l2norm", [(8, 64, False, True), (16, 128, False, True),
                                                       (8, 64, False, False), (8, 64, True, True),
                                                       (16, 128, True, True)],
                         ids=["H8-D64-precomputed", "H16-D128-precomputed", "H8-D64-precomputed-no-qk-l2",
                              "H8-D64-in-kernel", "H16-D128-in-kernel"])
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32], ids=["bf16_pool", "fp32_pool"])
def test_flashinfer_vllm_cuda_graph_padding(H, D, gate_in_kernel, l2norm, pool_dtype):
    torch.manual_seed(42)
    B_active, B_padded = 4, 3
    B_total = B_active + B_padded
    pool = torch.zeros(32, H, D, D, dtype=pool_dtype)  # bf16 in FlashInfer
    pool[0] = 7.0
    active = torch.randperm(31)[:B_active] + 1
    pool[active] = (torch.randn(B_active, H, D, D) * 0.01).to(pool_dtype)
    before = pool.clone()
    q, k, v = (torch.rand(1, B_total, H, D, dtype=torch.bfloat16) for _ in range(3))
    if gate_in_kernel:
        g = torch.randn(1, B_total, H, D, dtype=torch.bfloat16)
        gate = dict(A_log=torch.log(torch.empty(H).uniform_(1, 16)), dt_bias=torch.randn(H * D),
                    use_gate_in_kernel=True)
    else:
        g = F.logsigmoid(torch.randn(1, B_total, H, D)).to(torch.bfloat16)
        gate = {}
    beta = torch.rand(1, B_total, H, dtype=torch.bfloat16).sigmoid()
    slots = torch.cat([active.int(), torch.full((B_padded,), -1, dtype=torch.int32)])
    opts = dict(scale=D ** -0.5, initial_state=pool, use_qk_l2norm_in_kernel=l2norm, ssm_state_indices=slots, **gate)
    vllm_cu = torch.cat([torch.arange(B_active + 1, dtype=torch.int32),
                         torch.full((B_padded,), B_active, dtype=torch.int32)])
    o_vllm, _ = kt.fused_recurrent_kda_fwd(q, k, v, g, beta, cu_seqlens=vllm_cu, **opts)
    pool_vllm = pool.clone()
    pool.copy_(before)
    o, _ = kt.fused_recurrent_kda_fwd(q, k, v, g, beta, cu_seqlens=torch.arange(B_total + 1, dtype=torch.int32),
                                      **opts)
    assert torch.equal(o_vllm, o) and torch.equal(pool_vllm, pool), "zero-length padding != slot -1 rows"
    assert torch.all(pool[0] == 7.0), "the sentinel slot 0 was written"
    assert torch.equal(o[:, B_active:], torch.zeros_like(o[:, B_active:]))
    ref_o, ref_ht = reference(q[:, :B_active], k[:, :B_active], v[:, :B_active], g[:, :B_active],
                              beta[:, :B_active], h0=before[active], cu=torch.arange(B_active + 1), scale=D ** -0.5,
                              l2norm=l2norm, gate="softplus" if gate_in_kernel else None,
                              A_log=gate.get("A_log"), dt_bias=gate.get("dt_bias"))
    torch.testing.assert_close(o[:, :B_active].double(), ref_o, atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(pool[active].double(), ref_ht, atol=0.1, rtol=0.05)
    others = torch.ones(32, dtype=torch.bool)
    others[active] = False
    assert torch.equal(pool[others], before[others])


# ------------------------------------------------------------------------------------------
# FlashInfer test_recurrent_kda.py test_non_compact_state_stride / test_non_contiguous_gate_stride:
# a pool whose rows are padded (stride[0] = HV D D + 32, vLLM's block-based cache) and a gate
# split from a fused projection (token stride HV K + 256), in the batched and the slot-indexed
# path, against compact copies. libkda reads any strides in place, so the results are bitwise
# the compact ones (FlashInfer: within atol 5e-3 / 0.1), and the row padding stays untouched.
@pytest.mark.parametrize("H,D", [(8, 64), (16, 128)], ids=["H8-D64", "H16-D128"])
def test_flashinfer_non_compact_pool_and_gate_strides(H, D):
    torch.manual_seed(42)
    B, pad, extra = 4, 32, 256
    q, k, v = (torch.rand(1, B, H, D, dtype=torch.bfloat16) for _ in range(3))
    beta = torch.rand(1, B, H, dtype=torch.bfloat16).sigmoid()
    g_compact = F.logsigmoid(torch.randn(1, B, H, D)).to(torch.bfloat16)
    backing_g = torch.zeros(extra + B * (H * D + extra), dtype=torch.bfloat16)
    g_strided = backing_g[extra:].as_strided((1, B, H, D), (B * (H * D + extra), H * D + extra, D, 1))
    g_strided.copy_(g_compact)
    state0 = torch.randn(B, H, D, D) * 0.01
    backing_s = torch.full((B * (H * D * D + pad),), 5.0)
    pool_strided = backing_s.as_strided((B, H, D, D), (H * D * D + pad, D * D, D, 1))
    pool_strided.copy_(state0)
    pool_compact = state0.clone()
    opts = dict(scale=D ** -0.5, use_qk_l2norm_in_kernel=True, cu_seqlens=torch.arange(B + 1, dtype=torch.int32),
                ssm_state_indices=torch.arange(B, dtype=torch.int32))
    o_s, _ = kt.fused_recurrent_kda_fwd(q, k, v, g_strided, beta, initial_state=pool_strided, **opts)
    o_c, _ = kt.fused_recurrent_kda_fwd(q, k, v, g_compact, beta, initial_state=pool_compact, **opts)
    assert torch.equal(o_s, o_c) and torch.equal(pool_strided, pool_compact)
    gaps = backing_s.view(B, -1)[:, H * D * D:]
    assert bool((gaps == 5.0).all()), "the pool's row padding was written"
    # the batched path (no cu_seqlens / slots): [B, 1, H, D] tokens, one initial state per row
    to_rows = lambda x: x.transpose(0, 1)  # noqa: E731  [1, B, ...] -> [B, 1, ...], a view
    o_s, ht_s = kt.fused_recurrent_kda(to_rows(q), to_rows(k), to_rows(v), to_rows(g_strided), to_rows(beta),
                                       scale=D ** -0.5, initial_state=state0, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)
    o_c, ht_c = kt.fused_recurrent_kda(to_rows(q), to_rows(k), to_rows(v), to_rows(g_compact).contiguous(),
                                       to_rows(beta), scale=D ** -0.5, initial_state=state0,
                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.equal(o_s, o_c) and torch.equal(ht_s, ht_c)


# ------------------------------------------------------------------------------------------
# FlashInfer test_recurrent_kda.py test_vllm_decode and SGLang's KDA tests keep the decode pool in
# bf16 (V-first), as FLA's kernel allows any pool dtype: each state is read converted, the token
# runs in fp32 and the state is stored rounded (docs/PYTHON.md, Decode). o against the float64
# recurrence from the pool's own values, within SPEC.md's bf16 bound; each written state within
# half an ulp of the pool dtype of the reference (plus the fp32 computation's 1e-5 of the largest
# element: rounding the fp32 state, not the fp64 one); the other slots and `out`'s dtype kept.
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_vllm_decode_narrow_pool(pool_dtype):
    torch.manual_seed(42)
    B, H, D = 7, 4, 128
    pool = torch.randn(B * 3, H, D, D).to(pool_dtype)
    before = pool.clone()
    slots = torch.randperm(B * 3)[:B].int()
    q, k, v = (torch.rand(1, B, H, D, dtype=torch.bfloat16) for _ in range(3))
    g = torch.randn(1, B, H, D, dtype=torch.bfloat16)
    beta = torch.randn(1, B, H, dtype=torch.bfloat16).sigmoid()
    A_log, dt_bias = torch.log(torch.empty(H).uniform_(1, 16)), torch.randn(H * D)
    out = torch.full((1, B, H, D), 3.0, dtype=torch.bfloat16)
    o, fs = kt.fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool, scale=0.5,
                                       use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0,
                                       cu_seqlens=torch.arange(B + 1), ssm_state_indices=slots, state_v_first=True,
                                       out=out)
    assert o is out and fs is pool and pool.dtype == pool_dtype
    ref_o, ref_ht = reference(q, k, v, g, beta, h0=before[slots.long()], cu=torch.arange(B + 1), scale=0.5,
                              l2norm=True, gate="lower_bound", A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
                              v_first=True)
    assert _ratio(ref_o, o) <= BF16_BOUND, f"o: ratio {_ratio(ref_o, o):.3g}"
    got = pool[slots.long()].double()
    bits = 8 if pool_dtype == torch.bfloat16 else 11  # significand bits
    half_ulp = torch.ldexp(torch.full_like(ref_ht, 0.5), torch.frexp(ref_ht).exponent - bits)
    excess = (got - ref_ht).abs() - (half_ulp + 1e-5 * ref_ht.abs().max())
    assert bool((excess <= 0).all()), f"written slots: {int((excess > 0).sum())} elements off by more than half an ulp"
    others = torch.ones(B * 3, dtype=torch.bool)
    others[slots.long()] = False
    assert torch.equal(pool[others], before[others])


# A float64 pool (no kernel of FLA's serving stack keeps one) is refused before anything is
# computed or written: a ValueError naming the argument and the dtypes taken.
def test_float64_pool_is_refused_before_anything_is_written():
    torch.manual_seed(42)
    B, H, D = 3, 2, 32
    pool = torch.randn(B, H, D, D, dtype=torch.float64)
    before = pool.clone()
    q, k, v = (torch.rand(1, B, H, D, dtype=torch.bfloat16) for _ in range(3))
    g = F.logsigmoid(torch.randn(1, B, H, D)).to(torch.bfloat16)
    beta = torch.rand(1, B, H, dtype=torch.bfloat16)
    out = torch.full((1, B, H, D), 3.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"state_pool.*float32, bfloat16 or float16.*float64"):
        kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, cu_seqlens=torch.arange(B + 1),
                                   ssm_state_indices=torch.arange(B).int(), out=out)
    assert torch.equal(pool, before) and bool((out == 3.0).all())


# ------------------------------------------------------------------------------------------
# llama.cpp test-backend-ops.cpp test_gated_delta_net(kda = true): H = 32, K = V = 128, one
# sequence, T = 1 (generation) and T = 64 (prompt processing); q, k ~ U(-1, 1) L2-normalized
# (eps 1e-6) before the op, log decay g ~ U(-20, -1e-4) per channel, beta ~ U(0, 1),
# v ~ U(-0.3, 5), state ~ U(-1, 1); "permuted": q / k / v stored head-first and seen through a
# permutation. ggml's default bound: NMSE (mse / mean square of the reference) <= 1e-7.
@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
@pytest.mark.parametrize("T", [1, 64], ids=["tg", "pp64"])
def test_ggml_gated_delta_net_kda(T, permuted):
    torch.manual_seed(T)
    H, D = 32, 128

    def uniform(shape, lo, hi, head_first=False):
        if head_first:  # created with the token and head dims swapped, then permuted back
            return (torch.rand(shape[0], shape[2], shape[1], shape[3]) * (hi - lo) + lo).transpose(1, 2)
        return torch.rand(shape) * (hi - lo) + lo

    q = F.normalize(uniform((1, T, H, D), -1, 1, permuted), dim=-1, eps=1e-6)
    k = F.normalize(uniform((1, T, H, D), -1, 1, permuted), dim=-1, eps=1e-6)
    v = uniform((1, T, H, D), -0.3, 5.0, permuted)
    if permuted:
        q, k = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k))
        assert T == 1 or (not q.is_contiguous() and not v.is_contiguous())  # T = 1: the view is dense
    g = uniform((1, T, H, D), -20.0, -1e-4)
    beta = uniform((1, T, H), 0.0, 1.0)
    state = uniform((1, H, D, D), -1.0, 1.0)
    o, ht = kt.fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    ref_o, ref_ht = reference(q, k, v, g, beta, h0=state)
    nmse = lambda out, ref: ((out.double() - ref).square().sum() / ref.square().sum()).item()  # noqa: E731
    assert nmse(o, ref_o) <= 1e-7, nmse(o, ref_o)
    assert nmse(ht, ref_ht) <= 1e-7, nmse(ht, ref_ht)
