"""More of FLA's KDA tests (fla-org/flash-linear-attention) run on libkda.torch: the cases and call
patterns that tests/python/test_fla_cases.py, test_fla_dropin.py and test_fla_package.py do not
port. Sources (stored versions read through the code index):

- tests/ops/test_kda_graph.py @04bb98c98626a8d77d39b20c2711541fea538b7f (and its other stored
  version, which checks the same calls with FLA's rms ``assert_close`` instead of
  ``torch.testing.assert_close``): test_chunk_kda_graph_callable_option_matrix_matches_eager,
  test_chunk_kda_graph_callable_multi_replay_matches_eager (int32 and int64 cu_seqlens),
  test_chunk_kda_graph_callable_skips_sentinels_between_tasks (leading and middle empty
  sequences), test_chunk_kda_graph_callable_intermediate_states_match_eager, and the two full
  layouts ("4seq", "4seq_alt") of test_chunk_kda_graph_replay_matches_eager /
  test_chunk_kda_graph_multi_replay_varlen (@d28a6185038be74a94693d3f0d4aee0797c93cb0 has the
  same two tests) that test_fla_cases.py leaves out. FLA runs the callable tests on Ascend NPU
  graphs only; the capture is not the point here, the calls and their results are: the
  graph-mode call (use_graph=True, max_num_seqs) on the whole buffer against the eager call on
  the real tokens, at FLA's tolerances, plus both against the float64 recurrence at test_chunk's
  bounds (as test_fla_cases.py does) and the padding tokens' outputs and gradients exactly 0
  (docs/PYTHON.md: padding has zero output and gradients).
- tests/ops/test_kda_graph_npu.py @3041cf6174195eeb0302303e9b6d256829826859:
  test_chunk_kda_npugraph_multi_replay_matches_eager is the multi-replay case above (same inputs,
  its first three layouts).
- tests/ops/test_graph_backend_compat.py and test_graph_backend_dispatch.py
  @c03597d3668591211d4930764f74719a9f498bee: FLA's newer chunk_kda keywords ``graph_mode``
  ("eager" / "auto" / "force_graph"), ``chunk_indices``, ``chunk_offsets``, ``graph_t_max``: FLA
  asserts that the routed call gives the eager result with rtol = atol = 0 and that
  ``graph_mode="eager"`` with ``use_graph=True`` is a ValueError ("conflicts").
- tests/ops/test_kda_compression.py @f7a5ebfe94eb6e3cc4264b93d3f6299a95319222: test_delta_checkpoint
  (its other tests are in test_fla_cases.py; test_lowrank_* test torch.linalg.svd only).
- tests/ops/test_kda.py: an earlier stored version's test_chunk_transpose_state,
  test_fused_recurrent_transpose_state (``transpose_state_layout=True`` and ``=False`` passed
  explicitly) and test_fused_recurrent_vllm_decode call with ``use_exp2=False`` are parameters of
  test_fla_cases.py's test_chunk_state_v_first, test_fused_recurrent_state_v_first and
  test_fused_recurrent_vllm_decode; the newest stored version's ``_flash_kda_gold``, which is
  ``fused_recurrent_kda`` itself called in float64 with the gate in kernel, V-first states and
  cu_seqlens. (@d1097c609b23b5f478f490da0fbd00060b0e9dc3 is an older, shorter version whose five
  tests are all in test_fla_cases.py.)

Metric and tolerances are FLA's (fla_assert_close: rms(ref - ours) / rms(ref), skipped when the
largest absolute error is below 1e-6). Sizes: as FLA's, except the option matrix's
"fp16-long-sequence-large-head" (T = 2048 cut to 512, layouts [0, 1023, 2048], [0, 65, 1024],
[0, 1, 2048] to [0, 255, 512], [0, 65, 256], [0, 1, 512]) and the graph layouts "4seq" /
"4seq_alt" (T = 1024 scaled to 256, boundaries / 4), and the _flash_kda_gold cases (T <= 256, H <= 4, varlen
sequences <= 128 tokens); KDA_LARGE_TESTS=1 runs FLA's sizes.

Three of these found differences that libkda then fixed (twenty-second session):
test_chunk_kda_graph_callable_intermediate_states_match_eager (h's static shape with
use_graph=True), test_graph_mode_eager_with_use_graph_is_an_error (FLA main's option check) and
test_float64_scale_is_not_rounded_to_float32 (the float64 path's scale)."""

from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from libkda.torch import (chunk_kda, fused_recurrent_kda,  # noqa: E402
                          naive_recurrent_kda)
from test_fla_cases import (F64, GRAPH_CONFIGS, HAS_FP8, LARGE, cap_h, cap_t, check_graph_step_vs_fp64,  # noqa: E402
                            compression_inputs, f64, fla_assert_close, fla_naive_gate, graph_inputs, graph_step,
                            grads, leaves, recurrent_reference)


# ------------------------------------------------------------------------------------------
# test_kda_graph.py's graphed-callable tests (_GraphCase, _make_case_inputs, _call_case,
# _assert_training_case), eagerly.
@dataclass(frozen=True)
class GraphCase:
    T: int = 128
    H: int = 2
    HV: int = 2
    K: int = 64
    V: int = 64
    N: int = 2
    dtype: torch.dtype = torch.float16
    chunk_size: int = 64
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    use_a_log: bool = True
    use_dt_bias: bool = True
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    safe_gate: bool = False
    disable_recompute: bool = False
    return_intermediate_states: bool = False
    state_v_first: bool = False
    use_initial_state: bool = True
    output_final_state: bool = True
    cu_dtype: torch.dtype = torch.int64
    normalize_q: bool = True
    initial_state_scale: float = 0.01


def state_shape(case):
    return (case.N, case.HV, case.V, case.K) if case.state_v_first else (case.N, case.HV, case.K, case.V)


def make_case_inputs(case, seed):
    """_make_case_inputs: q, k, v, g, beta, h0, A_log, dt_bias drawn in FLA's order."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, case.T, case.H, case.K, dtype=case.dtype, generator=gen)
    k = torch.randn(1, case.T, case.H, case.K, dtype=torch.float32, generator=gen)
    if not case.use_qk_l2norm_in_kernel:
        if case.normalize_q:
            q = F.normalize(q.float(), dim=-1).to(case.dtype)
        k = F.normalize(k, dim=-1)
    k = k.to(case.dtype)
    v = torch.randn(1, case.T, case.HV, case.V, dtype=case.dtype, generator=gen)
    if case.use_gate_in_kernel:
        g = torch.randn(1, case.T, case.HV, case.K, dtype=case.dtype, generator=gen)
    else:
        g = F.logsigmoid(torch.randn(1, case.T, case.HV, case.K, dtype=torch.float32, generator=gen))
    if case.use_beta_sigmoid_in_kernel:
        beta = torch.randn(1, case.T, case.HV, dtype=case.dtype, generator=gen)
    else:
        beta = torch.rand(1, case.T, case.HV, dtype=case.dtype, generator=gen)
    h0 = torch.randn(*state_shape(case), dtype=torch.float32, generator=gen) * case.initial_state_scale
    A_log = torch.randn(case.HV, dtype=torch.float32, generator=gen)
    dt_bias = torch.randn(case.HV * case.K, dtype=torch.float32, generator=gen)
    return q, k, v, g, beta, h0, A_log, dt_bias


def call_case(case, inputs, cu_seqlens, use_graph):
    """_call_case: chunk_kda with every option of the case."""
    q, k, v, g, beta, h0, A_log, dt_bias = inputs
    gate = case.use_gate_in_kernel
    return chunk_kda(
        q=q, k=k, v=v, g=g, beta=beta, initial_state=h0 if case.use_initial_state else None,
        output_final_state=case.output_final_state, use_qk_l2norm_in_kernel=case.use_qk_l2norm_in_kernel,
        use_gate_in_kernel=gate, use_beta_sigmoid_in_kernel=case.use_beta_sigmoid_in_kernel,
        allow_neg_eigval=case.allow_neg_eigval, safe_gate=case.safe_gate,
        lower_bound=-5.0 if case.safe_gate else None, disable_recompute=case.disable_recompute,
        return_intermediate_states=case.return_intermediate_states, state_v_first=case.state_v_first,
        cu_seqlens=cu_seqlens, use_graph=use_graph, max_num_seqs=case.N,
        A_log=A_log if gate and case.use_a_log else None, dt_bias=dt_bias if gate and case.use_dt_bias else None,
        chunk_size=case.chunk_size)


def active_input_names(case):
    names = ["q", "k", "v", "g", "beta"]
    if case.use_initial_state:
        names.append("h0")
    if case.use_gate_in_kernel:
        names += (["A_log"] if case.use_a_log else []) + (["dt_bias"] if case.use_dt_bias else [])
    return names


def case_reference(case, inputs, cu_seqlens):
    """The float64 recurrence of a case, sequence by sequence over cu_seqlens: inputs are float64
    tensors (the real tokens only); the in-kernel transforms are applied here in float64."""
    q, k, v, g, beta, h0, A_log, dt_bias = inputs
    if case.use_qk_l2norm_in_kernel:
        q, k = F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1)
    if case.use_gate_in_kernel:
        g = fla_naive_gate(g, A_log if case.use_a_log else None, dt_bias if case.use_dt_bias else None,
                           -5.0 if case.safe_gate else None)
    if case.use_beta_sigmoid_in_kernel:
        beta = beta.sigmoid() * (2 if case.allow_neg_eigval else 1)
    h0 = None if not case.use_initial_state else (h0.transpose(-1, -2) if case.state_v_first else h0)
    o, ht = recurrent_reference(q, k, v, g, beta, h0, cu_seqlens)
    return o, (ht.transpose(-1, -2) if case.state_v_first else ht)


GRAD_NAMES = ("q", "k", "v", "g", "beta", "h0", "A_log", "dt_bias")
# test_chunk's bounds against the reference, by input (dA: test_fla_cases.py's, bf16 at SPEC.md's 2e-2)
FP64_BOUNDS = dict(q=0.008, k=0.008, v=0.008, g=0.02, beta=0.02, h0=0.008, dt_bias=0.008)


def run_training_case(case, offsets, tolerance=3e-3):
    """_assert_training_case without the capture: each replay's graph-mode call (whole buffer,
    use_graph=True) against the eager call on the real tokens (use_graph=False), FLA's checks at
    its tolerance (o, ht, every active gradient; None for inactive inputs; finite), then the
    padding tokens' o and gradients exactly 0 and the eager results against the float64
    recurrence at test_chunk's bounds."""
    layouts = (offsets,) if isinstance(offsets[0], int) else offsets
    active = active_input_names(case)
    for replay, current in enumerate(layouts, start=1):
        tag = str(current)
        inputs = make_case_inputs(case, seed=replay)
        gen = torch.Generator().manual_seed(replay + 100)
        do = torch.randn(1, case.T, case.HV, case.V, dtype=case.dtype, generator=gen)
        dht = torch.randn(*state_shape(case), dtype=torch.float32, generator=gen)
        cu = torch.tensor(current, dtype=case.cu_dtype)
        n = current[-1]

        x = leaves(*inputs)
        o, ht = call_case(case, x, cu, use_graph=True)
        ((o * do).sum() + (0 if ht is None else (ht * dht).sum())).backward()

        cropped = [t[:, :n] if i < 5 else t for i, t in enumerate(inputs)]
        r = leaves(*cropped)
        ro, rht = call_case(case, r, cu, use_graph=False)
        ((ro * do[:, :n]).sum() + (0 if rht is None else (rht * dht).sum())).backward()

        torch.testing.assert_close(o[:, :n], ro, rtol=tolerance, atol=tolerance, msg=lambda m: f"{tag}::o: {m}")
        fla_assert_close(f"{tag}::o", ro, o[:, :n], tolerance)
        if case.output_final_state:
            torch.testing.assert_close(ht, rht, rtol=tolerance, atol=tolerance, msg=lambda m: f"{tag}::ht: {m}")
            fla_assert_close(f"{tag}::ht", rht, ht, tolerance)
        else:
            assert ht is None and rht is None
        for i, (name, t, ref) in enumerate(zip(GRAD_NAMES, x, r)):
            if name not in active:
                assert t.grad is None and ref.grad is None, f"{tag}::{name}: gradient of an unused input"
                continue
            got = t.grad[:, :n] if i < 5 else t.grad
            assert torch.isfinite(got).all(), f"{tag}::{name} graph gradient is not finite"
            assert torch.isfinite(ref.grad).all(), f"{tag}::{name} eager gradient is not finite"
            torch.testing.assert_close(got, ref.grad, rtol=tolerance, atol=tolerance,
                                       msg=lambda m, name=name: f"{tag}::{name}: {m}")
            fla_assert_close(f"{tag}::d{name}", ref.grad, got, tolerance)
        if n < case.T:
            for name, t in zip(("o", "dq", "dk", "dv", "dg", "db"), (o, *(x[i].grad for i in range(5)))):
                assert torch.count_nonzero(t[:, n:]) == 0, f"{tag}::{name} padding"

        # the eager results against the float64 recurrence
        r64 = f64(*cropped)
        o64, ht64 = case_reference(case, r64, cu)
        ((o64 * do[:, :n].to(F64)).sum() + (0 if not case.output_final_state else (ht64 * dht.to(F64)).sum())
         ).backward()
        fla_assert_close(f"{tag}::o vs fp64", o64, ro, 0.005)
        if case.output_final_state:
            fla_assert_close(f"{tag}::ht vs fp64", ht64, rht, 0.005)
        for name, t64, t in zip(GRAD_NAMES, r64, r):
            if name in active:
                bound = FP64_BOUNDS.get(name, 0.003 if case.dtype == torch.float16 else 0.02)
                fla_assert_close(f"{tag}::d{name} vs fp64", t64.grad, t.grad, bound)


LONG_T = 2048 if LARGE else 512
OPTION_MATRIX = [
    pytest.param(GraphCase(T=96, H=1, HV=2, K=64, V=32, N=3, dtype=torch.bfloat16, chunk_size=32,
                           use_qk_l2norm_in_kernel=True, use_initial_state=False),
                 [0, 17, 96, 96], id="bf16-bt32-gva-k-ne-v-l2-no-h0"),
    pytest.param(GraphCase(V=32, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, disable_recompute=True),
                 [0, 65, 128], id="fp16-fused-gate-beta-no-recompute"),
    pytest.param(GraphCase(T=96, dtype=torch.bfloat16, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                           use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, safe_gate=True, state_v_first=True),
                 ([0, 1, 96], [0, 65, 96], [0, 64, 64], [0, 1, 96]), id="bf16-production-safe-gate-partial"),
    pytest.param(GraphCase(T=64, H=1, HV=1, V=32, use_gate_in_kernel=True, use_a_log=False, use_dt_bias=False,
                           use_beta_sigmoid_in_kernel=True, safe_gate=True),
                 [0, 32, 64], id="fp16-safe-gate-without-a-or-bias"),
    pytest.param(GraphCase(T=96, V=32, N=3, chunk_size=32, output_final_state=False, cu_dtype=torch.int32),
                 [0, 31, 64, 96], id="fp16-bt32-without-final-state"),
    pytest.param(GraphCase(T=LONG_T, H=1, HV=1, K=128, V=128),
                 ([0, LONG_T // 2 - 1, LONG_T], [0, 65, LONG_T // 2], [0, 1, LONG_T]),
                 id="fp16-long-sequence-large-head"),
    pytest.param(GraphCase(T=128, K=100, V=100), ([0, 1, 128], [0, 64, 64], [0, 1, 128]),
                 id="fp16-unaligned-head-partial"),
    pytest.param(GraphCase(T=4, N=8), [0, 0, 1, 1, 2, 2, 3, 3, 4], id="fp16-more-sequence-slots-than-tokens"),
]


@pytest.mark.parametrize("case,offsets", OPTION_MATRIX)
def test_chunk_kda_graph_callable_option_matrix_matches_eager(case, offsets):
    run_training_case(case, offsets)


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_chunk_kda_graph_callable_multi_replay_matches_eager(cu_dtype):
    """Also test_kda_graph_npu.py's test_chunk_kda_npugraph_multi_replay_matches_eager: the same
    inputs (fp16, T = 128, H = 2, D = 64, N = 2, q not normalized, h0 ~ N(0, 1)) on its layouts
    [0, 1, T], [0, 65, T], [0, 64, 64], both cu_seqlens dtypes."""
    run_training_case(GraphCase(cu_dtype=cu_dtype, normalize_q=False, initial_state_scale=1.0),
                      ([0, 1, 128], [0, 65, 128], [0, 64, 64], [0, 1, 128]), tolerance=2e-3)


def test_chunk_kda_graph_callable_skips_sentinels_between_tasks():
    """Empty sequences first and in the middle, not only at the tail (FLA also shrinks the NPU's
    core count to 1 so that one core walks past the empty tasks; that part is the NPU's)."""
    run_training_case(GraphCase(T=128, N=4), ([0, 0, 64, 128, 128], [0, 64, 64, 64, 64], [0, 0, 64, 128, 128]))


def chunk_states_reference(case, inputs, cu_seqlens):
    """The float64 state entering every chunk of every sequence, in the order of chunk_kda's h
    (K-first here; inputs float64, real tokens only)."""
    q, k, v, g, beta, h0, A_log, dt_bias = inputs
    C, out = case.chunk_size, []
    for i in range(len(cu_seqlens) - 1):
        a, b = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        S = h0[i:i + 1] if case.use_initial_state else torch.zeros(1, case.HV, case.K, case.V, dtype=F64)
        for c in range(a, b, C):
            out.append(S)
            e = min(b, c + C)
            _, S = naive_recurrent_kda(F.normalize(q[:, c:e], dim=-1) if case.use_qk_l2norm_in_kernel else q[:, c:e],
                                       F.normalize(k[:, c:e], dim=-1) if case.use_qk_l2norm_in_kernel else k[:, c:e],
                                       v[:, c:e], g[:, c:e], beta[:, c:e], initial_state=S, output_final_state=True)
    return torch.cat(out, 0).unsqueeze(0)


@torch.inference_mode()
def test_chunk_kda_graph_callable_intermediate_states_match_eager():
    """return_intermediate_states with use_graph=True: o, ht and the filled prefix of h against
    the eager call at 3e-3 (and against the float64 recurrence), and FLA's shape: with use_graph
    h holds the static capacity ceil(T / chunk_size) + N - 1 of chunk states (FLA's nt_max,
    fla/ops/kda/chunk.py), whatever cu_seqlens holds, so that the output of a captured step has
    a fixed shape (fla-core 0.6.0 sizes h by prepare_chunk_indices_static's nt_max rows: 4 for
    [0, 64, 64, 64], which has one chunk); the slots after the last chunk are zeros in libkda."""
    case = GraphCase(T=96, N=3, dtype=torch.bfloat16, return_intermediate_states=True)
    for seed, offsets in enumerate(([0, 1, 2, 96], [0, 64, 64, 64], [0, 1, 2, 96]), start=1):
        inputs = make_case_inputs(case, seed)
        cu = torch.tensor(offsets, dtype=case.cu_dtype)
        n = offsets[-1]
        o, ht, h = call_case(case, inputs, cu, use_graph=True)
        cropped = [t[:, :n] if i < 5 else t for i, t in enumerate(inputs)]
        ro, rht, rh = call_case(case, cropped, cu, use_graph=False)
        fla_assert_close(f"{offsets}::o", ro, o[:, :n], 3e-3)
        fla_assert_close(f"{offsets}::ht", rht, ht, 3e-3)
        fla_assert_close(f"{offsets}::h", rh, h[:, :rh.shape[1]], 3e-3)
        r64 = [t.to(F64) for t in cropped]
        o64, ht64 = case_reference(case, r64, cu)
        fla_assert_close(f"{offsets}::o vs fp64", o64, ro, 0.005)
        fla_assert_close(f"{offsets}::ht vs fp64", ht64, rht, 0.005)
        fla_assert_close(f"{offsets}::h vs fp64", chunk_states_reference(case, r64, cu), rh, 0.005)
        expected = (case.T + case.chunk_size - 1) // case.chunk_size + case.N - 1
        assert h.shape[1] == expected, (
            f"{offsets}: use_graph=True returned h with {h.shape[1]} chunk states, FLA's static capacity is {expected}")


# test_chunk_kda_graph_replay_matches_eager / _multi_replay_varlen: the layouts with four real
# sequences, which test_fla_cases.py's zero-tail port leaves out; there FLA compares the graph
# with the eager path (use_graph=False) at 2e-3. Boundaries / 4 in CI (T = 256).
GRAPH_FULL_LAYOUTS = [
    pytest.param([0, 300, 600, 900, 1024], id="4seq"),
    pytest.param([0, 100, 400, 700, 1024], id="4seq_alt"),
]


@pytest.mark.parametrize("cu", GRAPH_FULL_LAYOUTS)
@pytest.mark.parametrize("gate,safe_gate,hv", GRAPH_CONFIGS)
def test_chunk_kda_graph_full_layouts_match_eager_and_fp64(gate, safe_gate, hv, cu):
    cu = torch.LongTensor(cu if LARGE else [c // 4 for c in cu])
    x, do, dht = graph_inputs(0, gate, safe_gate, hv, int(cu[-1]))
    tri, tri_ht, tri_g = graph_step(x, cu, gate, safe_gate, do, dht)

    q, k, v, g, beta, h0, A_log, dt_bias = e = leaves(*x)
    ref, ref_ht = chunk_kda(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                            use_gate_in_kernel=gate, safe_gate=safe_gate, lower_bound=(-5 if safe_gate else None),
                            **(dict(A_log=A_log, dt_bias=dt_bias) if gate else {}))
    ((ref * do).sum() + (ref_ht * dht).sum()).backward()
    eager_g = grads(*e)
    for name, r, t in zip(("o", "ht", "dq", "dk", "dv", "dg", "db", "dh0", "dA", "dbias"),
                          (ref, ref_ht, *eager_g), (tri, tri_ht, *tri_g)):
        if r is not None:
            fla_assert_close(f"graph::{name}", r, t, 2e-3)

    check_graph_step_vs_fp64(x, cu, gate, safe_gate, do, dht, (tri, tri_ht, tri_g))


# ------------------------------------------------------------------------------------------
# test_graph_backend_dispatch.py / test_graph_backend_compat.py: FLA's newer graph keywords.
# FLA routes graph_mode="auto" to its graph path, to an external backend (FlashKDA) or to its
# eager kernels, and asserts the routed call gives what graph_mode="eager" and graph_mode=None
# give, with rtol = atol = 0. libkda has one path; every routing must give the plain call's
# result bitwise. The inputs are FLA's dispatch case (bf16, T = 128, H = 1, K = V = 128, the
# FlashKDA keywords, A_log = zeros(1)), random instead of FLA's zeros.
def dispatch_inputs(requires_grad=False):
    gen = torch.Generator().manual_seed(5)
    T, H, D = 128, 1, 128
    q, k, v, g = (torch.randn(1, T, H, D, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    beta = torch.randn(1, T, H, dtype=torch.bfloat16, generator=gen)
    v.requires_grad_(requires_grad)
    return dict(q=q, k=k, v=v, g=g, beta=beta, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, state_v_first=True, safe_gate=True, lower_bound=-5,
                A_log=torch.zeros(1))


@pytest.mark.parametrize("case", ["dense", "packed_low", "packed_high", "over_capacity", "force_graph"])
@torch.no_grad()
def test_graph_mode_keywords_give_the_eager_result(case):
    kwargs = dispatch_inputs()
    graph_kwargs = dict(graph_mode="auto")
    if case in ("packed_low", "packed_high", "force_graph"):
        kwargs["cu_seqlens"] = torch.tensor([0, 1, 1 if case == "packed_low" else 128])
        graph_kwargs["chunk_indices"] = torch.tensor(
            [[0, 0], [-1, 0], [-1, 0]] if case == "packed_low" else [[0, 0], [1, 0], [1, 1]])
        graph_kwargs["chunk_offsets"] = torch.tensor([0, 1, 1 if case == "packed_low" else 3])
    if case == "over_capacity":
        graph_kwargs["graph_t_max"] = 64
    if case == "force_graph":
        graph_kwargs["graph_mode"] = "force_graph"
    output, _ = chunk_kda(**kwargs, **graph_kwargs)
    plain, _ = chunk_kda(**kwargs)
    for mode in ("eager", None):
        reference, _ = chunk_kda(**kwargs, graph_mode=mode)
        torch.testing.assert_close(output, reference, rtol=0, atol=0)
        torch.testing.assert_close(plain, reference, rtol=0, atol=0)


def test_graph_mode_auto_keeps_autograd():
    """test_auto_backend_retains_autograd: graph_mode="auto" with graph_t_max, gradient of v."""
    kwargs = dispatch_inputs(requires_grad=True)
    chunk_kda(**kwargs, graph_mode="auto", graph_t_max=64)[0].float().sum().backward()
    routed, kwargs["v"].grad = kwargs["v"].grad, None
    chunk_kda(**kwargs)[0].float().sum().backward()
    assert routed is not None and torch.equal(routed, kwargs["v"].grad)


def test_graph_mode_eager_with_use_graph_is_an_error():
    """test_kda_eager_route_discards_graph_metadata's last check: graph_mode="eager" and
    use_graph=True conflict (FLA: ValueError matching "conflicts"). Its other checks patch FLA's
    internals (ChunkKDAFunction.apply, the device probes) to see which metadata reaches the
    kernels; test_graph_mode_keywords_give_the_eager_result covers what a caller can see.
    graph_mode is FLA main's (c03597d3); fla-core 0.6.0 has no such keyword and lets it pass
    through **kwargs unchecked."""
    x = dispatch_inputs()
    q, beta = x["q"], x["beta"]
    with pytest.raises(ValueError, match="conflicts"):
        chunk_kda(q, q, q, q, beta, graph_mode="eager", use_graph=True)


# ------------------------------------------------------------------------------------------
# test_kda_compression.py's test_delta_checkpoint, at FLA's size (B = 2, T = 2048, H = 4,
# K = V = 128): the state carried over 64-token fused_recurrent_kda calls (store_dtype float32),
# an fp16 checkpoint every 512 tokens and, in between, the difference to it stored as fp8 e4m3.
def test_delta_checkpoint():
    """FLA's assert compares, at every step t between checkpoints, the recomposed state at t with
    the reference state at the last checkpoint c (ref_states[ckpt_id - 1]) within 0.02. The
    exact states themselves differ that much: |S(t) - S(c)| is 0.56-0.99 here (the state's
    largest element is 0.57-0.73; the gates forget most of it within 64 tokens), so no
    implementation can pass it; and the fp8 delta alone costs up to 2^-4 of its largest element
    (0.016-0.032 here). Asserted instead: FLA's bound where it is meaningful (at the checkpoints,
    where the recomposed state is the fp16 checkpoint), the recomposed state at every step within
    fp16 + e4m3 rounding of the reference state at that same step, and the chained calls'
    states against the float64 recurrence."""
    B, T, H, HV, K, V = 2, 2048, 4, 4, 128, 128
    q, k, v, g, beta, _ = compression_inputs(B, T, H, HV, K, V)
    checkpoint_interval, compute_interval = 512, 64
    state = torch.zeros(B, HV, K, V)
    exact = torch.zeros(B, HV, K, V, dtype=F64)
    full_state_fp16 = None
    for i in range(0, T, compute_interval):
        sl = slice(i, min(i + compute_interval, T))
        _, state = fused_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=state,
                                       output_final_state=True, store_dtype=torch.float32)
        assert state.dtype == torch.float32
        _, exact = naive_recurrent_kda(*(t[:, sl].to(F64) for t in (q, k, v, g, beta)), initial_state=exact,
                                       output_final_state=True)
        t = i + compute_interval
        fla_assert_close(f"state at {t}", exact, state, 0.005)
        if t % checkpoint_interval == 0:
            full_state_fp16 = state.half()
            err = (state - full_state_fp16.float()).abs().max().item()
            assert err < 0.02, f"checkpoint at {t}: err={err:.6f}"  # FLA's bound
        elif full_state_fp16 is not None:
            d = state - full_state_fp16.float()
            delta = d.to(torch.float8_e4m3fn) if HAS_FP8 else d.half()
            recomposed = full_state_fp16.float() + delta.float()
            err = (state - recomposed).abs().max().item()
            bound = d.abs().max().item() * (2.0 ** -4 if HAS_FP8 else 2.0 ** -11) + 1e-6
            assert err <= bound, f"delta at {t}: err={err:.6f} > {bound:.6f}"


# ------------------------------------------------------------------------------------------
# test_kda.py's newest _flash_kda_gold is fused_recurrent_kda itself, called with float64
# inputs, the gate in kernel (lower bound -5, A_log / dt_bias optional), l2norm in kernel, beta
# activated outside (x2 with allow_neg_eigval), V-first states and cu_seqlens. libkda runs float64
# on its fp64 oracle: the call must work, return float64, and give the float64 recurrence written
# here (l2norm as SPEC.md 1.3 and FLA's l2norm_fwd define it, x * rsqrt(sum(x^2) + 1e-6)).
def l2norm_eps(x):
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def flash_kda_gold_f64(q, k, v, g, beta_raw, A_log, dt_bias, scale, h0_vk, cu_seqlens, allow_neg_eigval):
    gate = fla_naive_gate(g, A_log, dt_bias, -5.0)
    beta = torch.sigmoid(beta_raw.to(F64)) * (2 if allow_neg_eigval else 1)
    o, ht = recurrent_reference(l2norm_eps(q.to(F64)), l2norm_eps(k.to(F64)), v.to(F64), gate, beta,
                                h0_vk.to(F64).transpose(-1, -2), cu_seqlens, scale)
    return o, ht.transpose(-1, -2)


def fla_flash_kda_gold(q, k, v, g, beta_raw, A_log, dt_bias, scale, h0_vk, cu_seqlens, allow_neg_eigval):
    """test_kda.py's _flash_kda_gold, as written there."""
    return fused_recurrent_kda(
        q=q.to(F64), k=k.to(F64), v=v.to(F64), g=g.to(F64),
        beta=torch.sigmoid(beta_raw.to(F64)) * (2 if allow_neg_eigval else 1),
        A_log=None if A_log is None else A_log.to(F64), dt_bias=None if dt_bias is None else dt_bias.to(F64),
        scale=scale, initial_state=h0_vk.to(F64), output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, lower_bound=-5.0, state_v_first=True,
        **({} if cu_seqlens is None else dict(cu_seqlens=cu_seqlens)))


@pytest.mark.parametrize("B,T,H,cu,allow_neg_eigval,has_A,has_bias", [
    pytest.param(1, 1024, 4, None, False, True, True, id="dense"),
    pytest.param(2, 2048, 8, None, False, True, True, id="batched"),
    pytest.param(1, 1024, 4, None, True, True, True, id="negative-eigenvalues"),
    pytest.param(1, 1024, 4, None, False, False, True, id="no-A"),
    pytest.param(1, 1024, 4, None, False, True, False, id="no-bias"),
    pytest.param(1, None, 4, [0, 256, 500, 1000], False, True, True, id="varlen"),
    pytest.param(1, None, 16, [0, 101, 303, 1205, 3007, 4096], False, True, True, id="unaligned"),
    pytest.param(1, None, 4, [0, 256, 500, 1000], True, True, True, id="varlen-negative-eigenvalues"),
])
def test_flash_kda_gold_is_fused_recurrent_kda_in_float64(B, T, H, cu, allow_neg_eigval, has_A, has_bias):
    """The final states agree to float64 rounding (1e-12). o is held to 1e-6 only: libkda's
    float64 path takes ``scale`` as a float32 (kda::Options::scale), which moves o by up to
    ~3e-8 relative for FLA's scale K^-0.5 (test_float64_scale_is_not_rounded_to_float32); FLA
    uses this gold at 0.006."""
    D, H = 128, cap_h(H)
    if cu is not None:
        if not LARGE:  # sequences cut to at most 128 tokens
            lengths = [min(b - a, 128) for a, b in zip(cu[:-1], cu[1:])]
            cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
        cu = torch.tensor(cu)
        T = int(cu[-1])
    else:
        T = cap_t(T)
    N = B if cu is None else len(cu) - 1
    torch.manual_seed(42)
    q, k, v, g = (torch.randn(1 if cu is not None else B, T, H, D, dtype=torch.bfloat16) for _ in range(4))
    beta = torch.randn(*q.shape[:3], dtype=torch.bfloat16)
    A_log = torch.log(torch.empty(H, dtype=torch.float32).uniform_(1, 16)) if has_A else None
    dt_bias = torch.randn(H * D, dtype=torch.float32) if has_bias else None
    h0 = torch.randn(N, H, D, D, dtype=torch.float32)
    x = (q, k, v, g, beta, A_log, dt_bias, D ** -0.5, h0, cu, allow_neg_eigval)
    o, ht = fla_flash_kda_gold(*x)
    assert o.dtype == ht.dtype == F64 and o.shape == v.shape and ht.shape == (N, H, D, D)
    ref_o, ref_ht = flash_kda_gold_f64(*x)
    fla_assert_close("ht", ref_ht, ht, 1e-12, err_atol=0)
    fla_assert_close("o", ref_o, o, 1e-6, err_atol=0)


def test_float64_scale_is_not_rounded_to_float32():
    """The float64 path (the fp64 oracle, docs/PYTHON.md "the exact recurrence") with FLA's
    gold scale K^-0.5: o must be the float64 recurrence's to float64 rounding, for an exactly
    representable scale (0.5) and for K^-0.5, which kda::Options once held as a float (rounded to
    0.0883883461... from 0.0883883476..., 2e-8 relative)."""
    torch.manual_seed(42)
    H, D, T = 2, 128, 64
    q, k, v, g = (torch.randn(1, T, H, D, dtype=F64) for _ in range(4))
    q, k, g = F.normalize(q, dim=-1), F.normalize(k, dim=-1), F.logsigmoid(g)
    beta = torch.rand(1, T, H, dtype=F64)
    for scale in (0.5, D ** -0.5):
        o, _ = fused_recurrent_kda(q, k, v, g, beta, scale=scale)
        ref, _ = recurrent_reference(q, k, v, g, beta, None, scale=scale)
        fla_assert_close(f"o (scale {scale!r})", ref, o, 1e-12, err_atol=0)
