"""FlashKDA's public tests (MoonshotAI/FlashKDA tests/test_cpu.py, and tests/test_fwd.py's
test_fwd_vs_fla / test_fwd_varlen_vs_fla cases cut to CPU sizes) on ``libkda.flash_kda``, the
drop-in for the ``flash_kda`` package. test_cpu.py runs as written (float64 inputs: libkda's
fp64 oracle, so gradcheck is exact). test_fwd.py compares FlashKDA's bf16 kernel with an fp64
recurrence by FLA's rms error ratio (0.005); the reference here is the float64 token-by-token
recurrence of libkda.torch, on float64 copies of the same inputs. Its other tests compare against
FlashKDA's own CUDA reference within one bf16 ulp and need a GPU: not ported."""

import math
import os

import pytest

torch = pytest.importorskip("torch")

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
