"""libkda.flash_kda: FlashKDA's Python API (MoonshotAI/FlashKDA, package ``flash_kda``) on
libkda's CPU kernels, so code and tests written against it run unchanged::

    from libkda import flash_kda   # was: import flash_kda

- ``fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None,
  final_state=None, cu_seqlens=None)``: FlashKDA's inference forward. Every transform is in
  kernel as in FlashKDA: q and k l2-normalized, the gate ``lower_bound * sigmoid(exp(A_log) *
  (g + dt_bias))`` from the raw ``g``, ``beta = sigmoid(beta)`` from logits; states V-first
  ``[N, H, V, K]`` (bf16 or fp32). ``out`` (``[B, T, H, V]``) and ``final_state`` are written in
  place. FlashKDA needs K = V = 128, bf16 and CUDA; here any K, V, float dtype and CPU tensors
  work (and grouped value heads, v ``[B, T, HV, V]``).
- ``fwd_cp``: the same call (FlashKDA's intra-card context parallelism only changes the schedule).
- ``torch_kda(...)``: FlashKDA's differentiable CPU path, with FLA's ``chunk_kda`` arguments
  plus ``l2norm_eps`` (1e-6, the only value libkda's kernels use) and ``use_cpp_backend``
  (accepted and ignored: libkda's C++ kernels always run). Returns ``(o in v's dtype,
  final_state or None)``; the final state is float32 (float64 for float64 inputs, the oracle).
- ``has_cpu_extension()``: True (the compiled CPU kernels are libkda's).

The kernels are ``libkda.torch.chunk_kda``'s; see docs/PYTHON.md.
"""

from __future__ import annotations

import torch

from .torch import _overlapping, chunk_kda

__all__ = ["fwd", "fwd_cp", "torch_kda", "has_cpu_extension", "has_cuda_extension"]


def has_cpu_extension() -> bool:
    """FlashKDA's check for its compiled CPU kernels: libkda's always are."""
    return True


def has_cuda_extension() -> bool:
    """FlashKDA's check for its CUDA kernels: libkda's CUDA backend is not reachable from here (CPU
    tensors only, docs/PYTHON.md), so False, and FlashKDA's CUDA-only tests skip."""
    return False


def _check_buffer(name, buf, shape):
    """An output buffer, checked before anything is computed: the shape, a floating dtype, and
    distinct elements (a broadcast view cannot be written), so an error writes nothing."""
    if buf is None:
        raise ValueError(f"flash_kda.fwd: argument '{name}': expected a tensor of shape {list(shape)}, got None")
    if tuple(buf.shape) != tuple(shape):
        raise ValueError(f"flash_kda.fwd: argument '{name}': expected shape {list(shape)}, got {list(buf.shape)}")
    if not buf.is_floating_point():
        raise ValueError(f"flash_kda.fwd: argument '{name}': expected a floating dtype, got {buf.dtype}")
    if _overlapping(buf):
        raise ValueError(f"flash_kda.fwd: argument '{name}': a broadcast or overlapping view (strides "
                         f"{list(buf.stride())}) cannot be written; outputs need distinct elements")


def fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None,
        cu_seqlens=None):
    """FlashKDA's forward: writes o into ``out`` and, when given, the final states (V-first) into
    ``final_state``, in that buffer's dtype. Returns None, as FlashKDA does."""
    for name, x in (("q", q), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"flash_kda.fwd: argument '{name}': expected shape [B, T, H, D], got {list(x.shape)}")
    _check_buffer("out", out, v.shape)
    if final_state is not None:
        n = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        _check_buffer("final_state", final_state, (n, v.shape[2], v.shape[3], q.shape[3]))
    with torch.no_grad():
        o, fs = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                          output_final_state=final_state is not None, use_qk_l2norm_in_kernel=True,
                          use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound,
                          A_log=A_log, dt_bias=dt_bias, state_v_first=True, cu_seqlens=cu_seqlens)
        out.copy_(o)
        if final_state is not None:
            final_state.copy_(fs)


def fwd_cp(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None,
           cu_seqlens=None, auto_cp=True):
    """FlashKDA's ``fwd_cp``: the same result as ``fwd`` (``auto_cp`` only picks a schedule)."""
    del auto_cp
    fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state, cu_seqlens)


def torch_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, safe_gate=False,
              lower_bound=None, A_log=None, dt_bias=None, l2norm_eps=1e-6, disable_recompute=False,
              return_intermediate_states=False, cp_context=None, chunk_size=64, use_cpp_backend=None, **kwargs):
    """FlashKDA's ``torch_kda`` (flash_kda/torch_backend.py): FLA's ``chunk_kda`` conventions,
    differentiable, on libkda's kernels. Its errors: unknown keywords TypeError,
    ``return_intermediate_states`` / ``cp_context`` ValueError. ``l2norm_eps`` other than the
    kernels' 1e-6 (SPEC.md 1.3): q and k are normalized here, as FlashKDA does
    (``x * rsqrt(sum(x^2) + eps)`` in float32, float64 for float64 inputs, differentiable), and the
    kernel runs without its own l2norm (on float32 q / k, so with fp32 state products)."""
    del use_cpp_backend, safe_gate
    if kwargs:
        raise TypeError(f"unexpected keyword arguments: {', '.join(sorted(kwargs))}")
    if return_intermediate_states:
        raise ValueError("return_intermediate_states is not supported by the PyTorch backend")
    if cp_context is not None:
        raise ValueError("context parallelism is not supported by the PyTorch backend")
    if use_qk_l2norm_in_kernel and float(l2norm_eps) != 1e-6:
        eps = float(l2norm_eps)
        if not eps >= 0.0:
            raise ValueError(f"torch_kda: argument 'l2norm_eps': expected a number >= 0, got {l2norm_eps}")
        ct = torch.float64 if q.dtype == torch.float64 else torch.float32
        q, k = (x.to(ct) * torch.rsqrt(x.to(ct).square().sum(dim=-1, keepdim=True) + eps) for x in (q, k))
        use_qk_l2norm_in_kernel = False
    if use_gate_in_kernel and A_log is None:
        raise ValueError("A_log is required when use_gate_in_kernel=True")
    if cu_seqlens is None and cu_seqlens_cpu is not None:
        cu_seqlens = cu_seqlens_cpu
    o, fs = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                      use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                      allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
                      cu_seqlens=cu_seqlens, disable_recompute=disable_recompute,
                      chunk_size=chunk_size if chunk_size in (32, 64) else 64,  # FlashKDA ignores it
                      **(dict(A_log=A_log, dt_bias=dt_bias) if use_gate_in_kernel else {}))
    return (o if o.dtype == v.dtype else o.to(v.dtype)), fs
