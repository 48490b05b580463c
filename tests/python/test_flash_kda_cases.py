"""FlashKDA's public tests (MoonshotAI/FlashKDA tests/test_cpu.py, tests/test_fwd.py and
tests/test_fwd_full.py, cut to CPU sizes) on ``libkda.flash_kda``, the drop-in for the
``flash_kda`` package. test_cpu.py runs as written (float64 inputs: libkda's fp64 oracle, so
gradcheck is exact). test_fwd.py's test_fwd_vs_fla / test_fwd_varlen_vs_fla compare FlashKDA's
bf16 kernel with an fp64 recurrence by FLA's rms error ratio (0.005); the reference here is the
float64 token-by-token recurrence of libkda.torch, on float64 copies of the same inputs. FlashKDA's
test_fwd / test_fwd_varlen and test_fwd_full.py compare the kernel with its own CUDA torch_ref,
bitwise or within one bf16 ulp; that reference needs a GPU, so their configurations (state in /
out / neither in bf16 and fp32, arange initial states, tail lengths) are compared with the float64
recurrence instead, at the same 0.005. test_fwd_full.py's test_fwd_long / test_fwd_long_varlen
(up to 1M tokens) are not ported. tests/test_cp.py's test_cp_disabled, test_cp_final_state and
test_cp_with_initial_state check fwd_cp against fwd (bit for bit here) and the float64 recurrence."""

import math
import os

import pytest

torch = pytest.importorskip("torch")

from conftest import assert_close  # noqa: E402

from libkda import flash_kda  # noqa: E402
from libkda.torch import naive_recurrent_kda  # noqa: E402

LARGE = os.environ.get("KDA_LARGE_TESTS") == "1"


# ------------------------------------------------------------------------------------------
# tests/test_cpu.py
def _make_inputs(batch=2, sequence_length=4, query_heads=2, value_heads=2, key_dim=3, value_dim=4):
    torch.manual_seed(42)
    return (
        torch.randn(batch, sequence_length, query_heads, key_dim, dtype=torch.float64, requires_grad=True),
        torch.randn(batch, sequence_length, query_heads, key_dim, dtype=torch.float64, requires_grad=True),
        torch.randn(batch, sequence_length, value_heads, value_dim, dtype=torch.float64, requires_grad=True),
        torch.randn(batch, sequence_length, value_heads, key_dim, dtype=torch.float64, requires_grad=True),
        torch.randn(batch, sequence_length, value_heads, dtype=torch.float64, requires_grad=True),
        torch.randn(value_heads, dtype=torch.float64, requires_grad=True),
        torch.randn(value_heads, key_dim, dtype=torch.float64, requires_grad=True),
    )


def _run(inputs, initial_state=None, **kwargs):
    q, k, v, g, beta, A_log, dt_bias = inputs
    return flash_kda.torch_kda(q=q, k=k, v=v, g=g, beta=beta, scale=0.5, initial_state=initial_state,
                               output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, A_log=A_log, dt_bias=dt_bias,
                               **kwargs)


def test_torch_kda_cpu_forward_and_backward():
    inputs = _make_inputs()
    initial_state = torch.randn(2, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    output, final_state = _run(inputs, initial_state=initial_state)
    loss = output.square().mean() + final_state.square().mean()
    loss.backward()
    assert output.shape == (2, 4, 2, 4)
    assert final_state.shape == (2, 2, 3, 4)
    for tensor in (*inputs, initial_state):
        assert tensor.grad is not None
        assert torch.isfinite(tensor.grad).all()


@pytest.mark.parametrize("use_cpp_backend", [False, True])
def test_torch_kda_cpu_gradcheck(use_cpp_backend):
    inputs = _make_inputs(batch=1, sequence_length=2, query_heads=1, value_heads=1, key_dim=2, value_dim=2)
    initial_state = torch.randn(1, 1, 2, 2, dtype=torch.float64, requires_grad=True)

    def function(*arguments):
        return _run(arguments[:-1], initial_state=arguments[-1], use_cpp_backend=use_cpp_backend)

    assert torch.autograd.gradcheck(function, (*inputs, initial_state), fast_mode=True)


def test_module_exports_flash_kda_names():
    """FlashKDA's ``__all__``: every name is here; its CUDA extension is not (CPU tensors only)."""
    for name in ("fwd", "fwd_cp", "torch_kda", "has_cpu_extension", "has_cuda_extension"):
        assert name in flash_kda.__all__ and callable(getattr(flash_kda, name))
    assert flash_kda.has_cuda_extension() is False


def test_cpp_backend_matches_pytorch_forward_and_gradients():
    """FlashKDA compares its C++ and PyTorch backends; both are libkda's kernels here, so the two
    settings must agree exactly."""
    assert flash_kda.has_cpu_extension()
    inputs = _make_inputs(batch=1, sequence_length=3, query_heads=1, value_heads=2, key_dim=2, value_dim=3)
    initial_state = torch.randn(1, 2, 2, 3, dtype=torch.float64, requires_grad=True)

    def evaluate(use_cpp_backend):
        cloned_inputs = tuple(tensor.detach().clone().requires_grad_(True) for tensor in inputs)
        cloned_state = initial_state.detach().clone().requires_grad_(True)
        output, final_state = _run(cloned_inputs, initial_state=cloned_state, use_cpp_backend=use_cpp_backend)
        gradients = torch.autograd.grad(output.square().sum() + final_state.square().sum(),
                                        (*cloned_inputs, cloned_state))
        return output, final_state, gradients

    cpp_output, cpp_state, cpp_gradients = evaluate(True)
    torch_output, torch_state, torch_gradients = evaluate(False)
    torch.testing.assert_close(cpp_output, torch_output)
    torch.testing.assert_close(cpp_state, torch_state)
    for cpp_gradient, torch_gradient in zip(cpp_gradients, torch_gradients):
        torch.testing.assert_close(cpp_gradient, torch_gradient)


def test_torch_kda_l2norm_eps_other_than_the_kernels():
    """FlashKDA's torch_kda takes any l2norm_eps (x * rsqrt(sum(x^2) + eps)); libkda normalizes q
    and k itself then and runs the kernel without its 1e-6 l2norm: the same as normalizing outside,
    different from eps = 1e-6, and differentiable through the normalization."""
    q, k, v, g, beta, A_log, dt_bias = _make_inputs(batch=1, sequence_length=6, key_dim=4, value_dim=3)
    eps = 0.5
    norm = lambda x: x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)  # noqa: E731
    got, got_s = _run((q, k, v, g, beta, A_log, dt_bias), l2norm_eps=eps)
    want, want_s = flash_kda.torch_kda(q=norm(q), k=norm(k), v=v, g=g, beta=beta, scale=0.5, output_final_state=True,
                                       use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0,
                                       A_log=A_log, dt_bias=dt_bias)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_s, want_s, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got, _run((q, k, v, g, beta, A_log, dt_bias))[0], rtol=1e-3)
    assert torch.autograd.gradcheck(lambda q_, k_: _run((q_, k_, v, g, beta, A_log, dt_bias), l2norm_eps=eps)[0],
                                    (q, k), fast_mode=True)
    with pytest.raises(ValueError, match=r"'l2norm_eps'.*>= 0, got -1"):
        _run((q, k, v, g, beta, A_log, dt_bias), l2norm_eps=-1.0)


def test_torch_kda_cpu_supports_fla_gate_and_grouped_value_heads():
    inputs = _make_inputs(batch=1, query_heads=1, value_heads=2, key_dim=3, value_dim=2)
    q, k, v, g, beta, A_log, dt_bias = inputs
    output, final_state = flash_kda.torch_kda(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
                                              output_final_state=True, use_gate_in_kernel=True,
                                              use_beta_sigmoid_in_kernel=True)
    (output.sum() + final_state.sum()).backward()
    assert output.shape == (1, 4, 2, 2)
    assert final_state.shape == (1, 2, 3, 2)
    assert A_log.grad is not None
    assert dt_bias.grad is not None


def test_torch_kda_cpu_varlen_matches_individual_sequences():
    inputs = _make_inputs(batch=1, sequence_length=5, query_heads=1, value_heads=1, key_dim=2, value_dim=3)
    initial_state = torch.randn(2, 1, 3, 2, dtype=torch.float64)
    cu_seqlens = torch.tensor([0, 2, 5], dtype=torch.long)
    output, final_state = _run(inputs, initial_state=initial_state, state_v_first=True, cu_seqlens=cu_seqlens)
    expected_outputs, expected_states = [], []
    for sequence_index, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        sliced_inputs = tuple(tensor[:, start:end] if tensor.ndim >= 3 and tensor.shape[0] == 1 else tensor
                              for tensor in inputs)
        sequence_output, sequence_state = _run(sliced_inputs, initial_state=initial_state[sequence_index:sequence_index + 1],
                                               state_v_first=True)
        expected_outputs.append(sequence_output)
        expected_states.append(sequence_state)
    assert torch.allclose(output, torch.cat(expected_outputs, dim=1))
    assert torch.allclose(final_state, torch.cat(expected_states, dim=0))


def test_legacy_fwd_uses_cpu_backend():
    inputs = _make_inputs(batch=1, sequence_length=3, query_heads=1, value_heads=1, key_dim=2, value_dim=2)
    q, k, v, g, beta, A_log, dt_bias = inputs
    initial_state = torch.randn(1, 1, 2, 2, dtype=torch.float64)
    output = torch.empty_like(v)
    final_state = torch.empty_like(initial_state)
    flash_kda.fwd(q, k, v, g, beta, 0.5, output, A_log, dt_bias, -5.0, initial_state=initial_state,
                  final_state=final_state)
    expected_output, expected_state = _run(inputs, initial_state=initial_state, state_v_first=True)
    assert torch.allclose(output, expected_output)
    assert torch.allclose(final_state, expected_state)


# ------------------------------------------------------------------------------------------
# tests/test_fwd.py: flash_kda.fwd against an fp64 recurrence over FlashKDA's g / dt_bias sweep
# (constant gates from -8 to 8, uniform and normal ones, bias patterns), FLA's metric at 0.005.
def _fla_ratio(ref, out):
    ref, out = ref.double(), out.double()
    return ((ref - out).square().mean().sqrt() / (ref.square().mean().sqrt() + 1e-8)).item()


def _gate_cases(H, D, shape, dtype):
    g_specs = [
        ("g=-8", lambda s: torch.full(s, -8.0, dtype=dtype)),
        ("g=-4", lambda s: torch.full(s, -4.0, dtype=dtype)),
        ("g=0", lambda s: torch.full(s, 0.0, dtype=dtype)),
        ("g=8", lambda s: torch.full(s, 8.0, dtype=dtype)),
        ("g=U(-8,8)", lambda s: torch.zeros(s, dtype=dtype).uniform_(-8, 8)),
        ("g=N(0,8)", lambda s: torch.randn(s, dtype=dtype) * 8),
    ]
    bias_specs = [
        ("bias={-4,4}", torch.where(torch.rand(H, D) < 0.5, torch.tensor(-4.0), torch.tensor(4.0))),
        ("bias={-8,8}", torch.where(torch.rand(H, D) < 0.5, torch.tensor(-8.0), torch.tensor(8.0))),
        ("bias=U(-8,8)", torch.zeros(H, D).uniform_(-8, 8)),
        ("bias=N(0,8)", torch.randn(H, D) * 8),
    ]
    cases = [(f"{name}_bias=0", fn(shape), torch.zeros(H, D)) for name, fn in g_specs]
    cases += [(f"g=0_{name}", torch.zeros(shape, dtype=dtype), b.float()) for name, b in bias_specs]
    return cases


def _fp64_reference(q, k, v, g, beta, h0_vk, A_log, dt_bias, scale, lower_bound, cu_seqlens=None):
    """FlashKDA's gold: every transform applied in float64, then the token-by-token recurrence
    (V-first states in and out)."""
    H = A_log.shape[0]
    gate = lower_bound * torch.sigmoid(torch.exp(A_log.double()).view(1, 1, H, 1) *
                                       (g.double() + dt_bias.double().view(1, 1, H, -1)))
    def l2norm(t):  # x / sqrt(sum x^2 + 1e-6), FlashKDA's and FLA's
        t = t.double()
        return t * torch.rsqrt(t.square().sum(-1, keepdim=True) + 1e-6)

    x = dict(q=l2norm(q), k=l2norm(k), v=v.double(), g=gate, beta=torch.sigmoid(beta.double()))
    bounds = [0, q.shape[1]] if cu_seqlens is None else [int(t) for t in cu_seqlens]
    outs, states = [], []
    for n in range(len(bounds) - 1):
        a, b = bounds[n], bounds[n + 1]
        h0 = h0_vk.double() if cu_seqlens is None else h0_vk[n:n + 1].double()
        o, s = naive_recurrent_kda(**{name: t[:, a:b] for name, t in x.items()}, scale=scale,
                                   initial_state=h0.transpose(-1, -2), output_final_state=True)
        outs.append(o)
        states.append(s.transpose(-1, -2))
    return torch.cat(outs, 1), torch.cat(states, 0)


@pytest.mark.parametrize("varlen", [False, True])
def test_fwd_vs_fla(varlen):
    """test_fwd_vs_fla (B=1, T=8192, H=1, D=128) and test_fwd_varlen_vs_fla, T cut to 512 in CI
    (KDA_LARGE_TESTS=1: 8192)."""
    T, H, D, lower_bound = (8192 if LARGE else 512), 1, 128, -5.0
    scale = 1 / math.sqrt(D)
    torch.manual_seed(42)
    dtype = torch.bfloat16
    q = torch.rand(1, T, H, D, dtype=dtype)
    k = torch.rand(1, T, H, D, dtype=dtype)
    v = torch.rand(1, T, H, D, dtype=dtype)
    beta = torch.randn(1, T, H, dtype=dtype)
    cu = torch.tensor([0, T // 5, T // 5 + 1, T // 2 + 7, T], dtype=torch.long) if varlen else None
    n = 1 if cu is None else cu.shape[0] - 1
    h0 = torch.randn(n, H, D, D, dtype=torch.float32)  # V-first
    A_log = torch.zeros(H, dtype=torch.float32)
    for name, g, dt_bias in _gate_cases(H, D, (1, T, H, D), dtype):
        out = torch.zeros(1, T, H, D, dtype=torch.bfloat16)
        final_state = torch.zeros_like(h0)
        flash_kda.fwd(q, k, v, g, beta, scale, out, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                      initial_state=h0.clone(), final_state=final_state, cu_seqlens=cu)
        ref, ref_ht = _fp64_reference(q, k, v, g, beta, h0, A_log, dt_bias, scale, lower_bound, cu)
        assert _fla_ratio(ref, out) < 0.005, f"{name} o: {_fla_ratio(ref, out):.3e}"
        # FlashKDA only warns for the state; SPEC.md 4 bounds it at 5e-3 for bf16 inputs.
        assert _fla_ratio(ref_ht, final_state) < 0.005, f"{name} ht: {_fla_ratio(ref_ht, final_state):.3e}"


def test_fwd_buffers_are_checked_and_bf16_states_round_trip():
    """FlashKDA's buffers: out [B, T, H, V] and a final_state of the initial state's shape, in its
    dtype (bf16 states are FlashKDA's default); a wrong shape is an error naming the buffer and
    writes nothing."""
    torch.manual_seed(3)
    B, T, H, D = 2, 40, 2, 32
    q, k, v, g = (torch.randn(B, T, H, D, dtype=torch.bfloat16) for _ in range(4))
    beta = torch.randn(B, T, H, dtype=torch.bfloat16)
    A_log, dt_bias = torch.rand(H), torch.rand(H, D)
    h0 = torch.randn(B, H, D, D).to(torch.bfloat16)
    out = torch.zeros(B, T, H, D, dtype=torch.bfloat16)
    fs = torch.zeros_like(h0)
    flash_kda.fwd(q, k, v, g, beta, D ** -0.5, out, A_log, dt_bias, -5.0, initial_state=h0, final_state=fs)
    assert fs.dtype == torch.bfloat16 and bool(fs.abs().sum() > 0) and bool(out.abs().sum() > 0)
    ref, ref_ht = _fp64_reference(q, k, v, g, beta, h0, A_log, dt_bias, D ** -0.5, -5.0)
    assert _fla_ratio(ref, out) < 0.005 and _fla_ratio(ref_ht, fs) < 0.005
    bad = torch.full((B, T, H, D + 1), 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="argument 'out'"):
        flash_kda.fwd(q, k, v, g, beta, D ** -0.5, bad, A_log, dt_bias, -5.0)
    assert bool((bad == 7.0).all())
    with pytest.raises(ValueError, match="argument 'final_state'"):
        flash_kda.fwd(q, k, v, g, beta, D ** -0.5, out, A_log, dt_bias, -5.0, final_state=fs[:1])


# ------------------------------------------------------------------------------------------
# tests/test_fwd.py's test_fwd / test_fwd_varlen and tests/test_fwd_full.py: flash_kda.fwd over
# state in / out / both / neither, bf16 and fp32 states, FlashKDA's arange initial states, odd
# lengths; against the float64 recurrence at FLA's 0.005. The output and final-state buffers start
# as NaN here (FlashKDA does that in test_fwd_varlen_all_tail_lengths), so every element must be
# written. CI runs the configurations whose sequences are at most 512 tokens long, with at most 4
# heads; KDA_LARGE_TESTS=1 all of them.
D, LOWER_BOUND = 128, -5.0
STATE_IO = [(True, True), (True, False), (False, True), (False, False)]
STATE_IO_IDS = ["in+out", "in_only", "out_only", "no_state"]
STATE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _ci(values, keep):
    """FlashKDA's values; in CI those for which keep holds."""
    return list(values) if LARGE else [x for x in values if keep(x)]


def _make_fwd_inputs(B, T, H, seed=42):
    """test_fwd_full.py's _make_inputs (and test_fwd.py's, seed 0), B rows."""
    torch.manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, D), p=2, dim=-1).to(torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D), p=2, dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T, H, D, dtype=torch.bfloat16)
    g = torch.randn(B, T, H, D, dtype=torch.bfloat16)
    beta = torch.randn(B, T, H, dtype=torch.bfloat16)
    A_log = torch.rand(H, dtype=torch.float32)
    dt_bias = torch.rand(H, D, dtype=torch.float32)
    return q, k, v, g, beta, A_log, dt_bias, 1.0 / math.sqrt(D)


def _make_state(shape, dtype):
    """test_fwd_full.py's _make_state: arange, rounded to bf16, in dtype (large states)."""
    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape).to(torch.bfloat16).to(dtype)


def _check_fwd(B, T, H, state_dtype, has_in, has_out, seq_lens=None, seed=42):
    """flash_kda.fwd into NaN buffers, against _fp64_reference; o and the final state at 0.005."""
    cu = None if seq_lens is None else torch.tensor([0] + torch.tensor(seq_lens).cumsum(0).tolist())
    if cu is not None:
        B, T = 1, int(cu[-1])
    N = B if cu is None else len(seq_lens)
    q, k, v, g, beta, A_log, dt_bias, scale = _make_fwd_inputs(B, T, H, seed)
    h0 = _make_state((N, H, D, D), state_dtype) if has_in else None
    final_state = torch.full((N, H, D, D), float("nan"), dtype=state_dtype) if has_out else None
    out = torch.full_like(q, float("nan"))
    flash_kda.fwd(q, k, v, g, beta, scale, out, A_log=A_log, dt_bias=dt_bias, lower_bound=LOWER_BOUND,
                  initial_state=None if h0 is None else h0.clone(), final_state=final_state, cu_seqlens=cu)
    ref, ref_ht = _fp64_reference(q, k, v, g, beta, torch.zeros(N, H, D, D) if h0 is None else h0, A_log, dt_bias,
                                  scale, LOWER_BOUND, cu)
    assert_close(out.double(), ref, 0.005, "o")
    if has_out:
        assert final_state.dtype == state_dtype
        assert_close(final_state.double(), ref_ht, 0.005, "final_state")


@pytest.mark.parametrize("varlen", [False, True], ids=["test_fwd", "test_fwd_varlen"])
def test_fwd(varlen):
    """test_fwd.py's test_fwd (B=1, T=8192, H=96) and test_fwd_varlen (seq_lens 1300, 547, 2048, 963,
    271, 3063; H=96): seed 0, bf16 arange states in and out. CI: T = 512, lengths / 8, H = 4."""
    H = 96 if LARGE else 4
    if varlen:
        seq_lens = [1300, 547, 2048, 963, 271, 3063]
        _check_fwd(1, None, H, torch.bfloat16, True, True, seq_lens if LARGE else [n // 8 for n in seq_lens], seed=0)
    else:
        _check_fwd(1, 8192 if LARGE else 512, H, torch.bfloat16, True, True, seed=0)


def _state_params(B, T, H):
    """(state_dtype, has_in, has_out) for every state dtype and STATE_IO. (With bf16 state products
    in the block that reads the initial state, (B, T, H) = (1, 64, 4), (1, 1024, 1), (1, 4096, 4)
    and (2, 1024, 4) put o 5.8e-3 to 8.7e-3 from the float64 recurrence: the arange state makes the
    first token's output one short cancelling sum; that block keeps fp32 products now.)"""
    return [pytest.param(sd, has_in, has_out, id=f"{sd}-{io}") for sd in STATE_DTYPES
            for (has_in, has_out), io in zip(STATE_IO, STATE_IO_IDS)]


@pytest.mark.parametrize("T,H,state_dtype,has_in,has_out", [
    pytest.param(T, H, *p.values, id=f"H{H}-T{T}-{p.id}")
    for H in _ci([1, 4, 32, 96], lambda h: h <= 4)
    for T in _ci([16, 64, 256, 1024, 4096, 8192, 17, 37, 97], lambda t: t <= 512)
    for p in _state_params(1, T, H)])
def test_fwd_fixed(T, H, state_dtype, has_in, has_out):
    """test_fwd_full.py's test_fwd_fixed."""
    _check_fwd(1, T, H, STATE_DTYPES[state_dtype], has_in, has_out)


@pytest.mark.parametrize("has_in,has_out", STATE_IO, ids=STATE_IO_IDS)
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("seq_lens", _ci([[16], [16, 16], [4, 8, 12], [64, 128, 256], [1300, 547, 2048, 963, 271, 3063],
                                          [1024] * 8, [20, 50, 100], [17, 33, 65]], lambda sl: max(sl) <= 512),
                         ids=lambda sl: "seqs" + "_".join(map(str, sl)))
@pytest.mark.parametrize("H", _ci([1, 4, 96], lambda h: h <= 4), ids=lambda h: f"H{h}")
def test_fwd_varlen(seq_lens, H, state_dtype, has_in, has_out):
    """test_fwd_full.py's test_fwd_varlen."""
    _check_fwd(1, None, H, STATE_DTYPES[state_dtype], has_in, has_out, seq_lens)


def test_fwd_varlen_all_tail_lengths():
    """test_fwd_full.py: 15 sequences of 1 to 15 tokens (every partial 16-row tile at adjacent
    boundaries), H=4, no states, the output buffer starting as NaN."""
    _check_fwd(1, None, 4, torch.float32, False, False, list(range(1, 16)))


@pytest.mark.parametrize("B,T,H,state_dtype,has_in,has_out", [
    pytest.param(B, T, H, *p.values, id=f"H{H}-B{B}_T{T}-{p.id}")
    for H in _ci([1, 4, 96], lambda h: h <= 4)
    for B, T in _ci([(2, 64), (2, 1024), (4, 256), (8, 128)], lambda bt: bt[1] <= 512)
    for p in _state_params(B, T, H)])
def test_fwd_batched(B, T, H, state_dtype, has_in, has_out):
    """test_fwd_full.py's test_fwd_batched: B > 1 equal-length rows without cu_seqlens."""
    _check_fwd(B, T, H, STATE_DTYPES[state_dtype], has_in, has_out)


# ------------------------------------------------------------------------------------------
# tests/test_cp.py (MoonshotAI/FlashKDA @ab67c75ae3005d6599cd409cfbc5d0b485ea32d0): fwd_cp, FlashKDA's
# intra-card context parallelism, against fwd. Its cases run B=1, T=8192, H=16, D=128 on CUDA;
# here CI runs T=512, H=4 (KDA_LARGE_TESTS=1: FlashKDA's sizes). FlashKDA accepts fwd_cp either
# bit-identical to fwd or, when CP engages, within its bounds (final state max |diff| < 1.0,
# output max |diff| < 0.1); libkda's fwd_cp is the same call as fwd (auto_cp only picks a
# schedule), so those bounds are checked as written and, beyond them, both calls against the
# float64 recurrence at FLA's 0.005. The output and final-state buffers start as NaN (FlashKDA's
# are torch.empty), so every element must be written. test_cp_correctness_single_seq /
# test_cp_correctness_long_seq (T up to 65536) are the same comparison without states: not ported.
CP_T, CP_H = (8192, 16) if LARGE else (512, 4)


def _make_cp_inputs(B, T, H, D):
    """test_cp.py's make_inputs, on the CPU."""
    q = torch.randn(B, T, H, D, dtype=torch.bfloat16)
    k = torch.randn(B, T, H, D, dtype=torch.bfloat16)
    v = torch.randn(B, T, H, D, dtype=torch.bfloat16)
    g = torch.randn(B, T, H, D, dtype=torch.bfloat16)
    beta = torch.randn(B, T, H, dtype=torch.bfloat16)
    A_log = torch.randn(H, dtype=torch.float32).abs().neg()  # negative
    dt_bias = torch.randn(H, D, dtype=torch.float32)
    scale = D ** -0.5
    lower_bound = -5.0
    return q, k, v, g, beta, scale, A_log, dt_bias, lower_bound


def _nan_like(x, dtype=None):
    return torch.full_like(x, float("nan"), dtype=dtype)


def test_cp_disabled():
    """test_cp.py's test_cp_disabled: fwd_cp(auto_cp=False) gives fwd's output exactly."""
    torch.manual_seed(42)
    B, T, H, D = 1, CP_T, CP_H, 128
    q, k, v, g, beta, scale, A_log, dt_bias, lower_bound = _make_cp_inputs(B, T, H, D)

    out_ref = _nan_like(q)
    flash_kda.fwd(q, k, v, g, beta, scale, out_ref, A_log, dt_bias, lower_bound)

    out_cp = _nan_like(q)
    flash_kda.fwd_cp(q, k, v, g, beta, scale, out_cp, A_log, dt_bias, lower_bound, auto_cp=False)

    assert torch.allclose(out_ref, out_cp, atol=0, rtol=0), "auto_cp=False should be identical to fwd()"
    assert torch.equal(out_ref.view(torch.int16), out_cp.view(torch.int16))  # bit for bit, signed zeros too
    ref, _ = _fp64_reference(q, k, v, g, beta, torch.zeros(B, H, D, D), A_log, dt_bias, scale, lower_bound)
    assert_close(out_cp.double(), ref, 0.005, "o")


def test_cp_final_state():
    """test_cp.py's test_cp_final_state: the final state of fwd_cp(auto_cp=True) equals fwd's
    (FlashKDA: identical, or max |diff| < 1.0 when CP engages)."""
    torch.manual_seed(42)
    B, T, H, D = 1, CP_T, CP_H, 128
    q, k, v, g, beta, scale, A_log, dt_bias, lower_bound = _make_cp_inputs(B, T, H, D)
    A_log = -torch.ones(H, dtype=torch.float32) * 0.1

    out_ref = _nan_like(q)
    fs_ref = torch.full((B, H, D, D), float("nan"), dtype=torch.float32)
    flash_kda.fwd(q, k, v, g, beta, scale, out_ref, A_log, dt_bias, lower_bound, final_state=fs_ref)

    out_cp = _nan_like(q)
    fs_cp = torch.full((B, H, D, D), float("nan"), dtype=torch.float32)
    flash_kda.fwd_cp(q, k, v, g, beta, scale, out_cp, A_log, dt_bias, lower_bound, final_state=fs_cp, auto_cp=True)

    max_diff = (fs_ref - fs_cp).abs().max().item()
    print(f"[final_state] max_diff={max_diff:.6f}")
    assert torch.allclose(fs_ref, fs_cp, atol=0, rtol=0) or max_diff < 1.0, f"final_state max_diff={max_diff}"
    assert torch.equal(fs_ref, fs_cp) and torch.equal(out_ref.view(torch.int16), out_cp.view(torch.int16))
    ref, ref_ht = _fp64_reference(q, k, v, g, beta, torch.zeros(B, H, D, D), A_log, dt_bias, scale, lower_bound)
    assert_close(out_cp.double(), ref, 0.005, "o")
    assert_close(fs_cp.double(), ref_ht, 0.005, "final_state")


def test_cp_with_initial_state():
    """test_cp.py's test_cp_with_initial_state: h0 (0.01 * randn, V-first) reaches fwd_cp's first
    sub-segment: its output equals fwd's (FlashKDA: identical, or max |diff| < 0.1 when CP engages)."""
    torch.manual_seed(42)
    B, T, H, D = 1, CP_T, CP_H, 128
    q, k, v, g, beta, scale, A_log, dt_bias, lower_bound = _make_cp_inputs(B, T, H, D)
    A_log = -torch.ones(H, dtype=torch.float32) * 0.1
    h0 = torch.randn(B, H, D, D, dtype=torch.float32) * 0.01

    out_ref = _nan_like(q)
    flash_kda.fwd(q, k, v, g, beta, scale, out_ref, A_log, dt_bias, lower_bound, initial_state=h0)

    out_cp = _nan_like(q)
    flash_kda.fwd_cp(q, k, v, g, beta, scale, out_cp, A_log, dt_bias, lower_bound, initial_state=h0, auto_cp=True)

    diff = (out_ref.float() - out_cp.float()).abs()
    print(f"[with_h0] max_diff={diff.max().item():.6f}, mean_diff={diff.mean().item():.6f}")
    assert torch.allclose(out_ref, out_cp, atol=0, rtol=0) or diff.max().item() < 0.1, diff.max().item()
    assert torch.equal(out_ref.view(torch.int16), out_cp.view(torch.int16))
    ref, _ = _fp64_reference(q, k, v, g, beta, h0, A_log, dt_bias, scale, lower_bound)
    assert_close(out_cp.double(), ref, 0.005, "o")
    # The initial state matters: without it the output differs (h0 really reached the kernel).
    out_no_h0 = _nan_like(q)
    flash_kda.fwd_cp(q, k, v, g, beta, scale, out_no_h0, A_log, dt_bias, lower_bound, auto_cp=True)
    assert not torch.equal(out_no_h0, out_cp)
