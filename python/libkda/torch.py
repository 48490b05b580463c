"""libkda.torch: PyTorch ops of libkda that drop in for ``fla.ops.kda``.

``chunk_kda`` and ``fused_recurrent_kda`` take the argument names, layouts, defaults and return
values of flash-linear-attention's ``fla.ops.kda`` (q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``;
g ``[B, T, HV, K]``; beta ``[B, T, HV]``; states ``[N, HV, K, V]``, or ``[N, HV, V, K]`` with
``state_v_first``), so switching is a change of import::

    from libkda.torch import chunk_kda, fused_recurrent_kda   # was: from fla.ops.kda import ...

The kernels are libkda's CPU kernels (SPEC.md). CPU tensors are read and written in place through
their data pointers and strides (no copies, no contiguity requirement); CUDA tensors raise a
clear error (there is no CUDA backend yet). float64 inputs run the fp64 oracle (the exact
recurrence of SPEC.md section 1 and its adjoint), so ``torch.autograd.gradcheck`` works.

Ops (``torch.library``, namespace ``libkda``; each has a fake kernel for ``torch.compile``):
  libkda::chunk_kda_fwd, libkda::chunk_kda_bwd  -- the chunked forward / backward
  libkda::decode                                -- decode against a state pool, in place
Autograd is a ``torch.autograd.Function`` over the two chunk ops (``disable_recompute=True``
keeps the state entering every chunk and every token's delta v_new for the backward, ``False``
rematerializes them). The plain
torch reference helpers of FLA's gate.py / naive.py (``fused_kda_gate``, ``naive_kda_gate``,
``naive_kda_lowerbound_gate``, ``naive_recurrent_kda``, ``naive_chunk_kda``) are here too, for
tests. See docs/PYTHON.md for the mapping to FLA and the limitations.
"""

from __future__ import annotations

import numbers
import warnings

import torch

from . import _libkda, _opt_float

__all__ = ["chunk_kda", "fused_recurrent_kda", "fused_recurrent_kda_fwd", "kda_decode", "fused_kda_gate",
           "naive_kda_gate", "naive_kda_lowerbound_gate", "naive_recurrent_kda", "naive_chunk_kda"]

_raw_forward = _libkda.raw_forward
_raw_backward = _libkda.raw_backward
_raw_decode = _libkda.raw_decode
_L2NORM, _GATE, _BETA_SIGMOID, _NEG_EIGVAL, _V_FIRST, _FP32_PRODUCTS = _libkda.RAW_FLAGS
_NAN = float("nan")

# kda::DType numbering (python/src/raw.cpp).
_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float64: 3,
    torch.int32: 4,
    torch.int64: 5,
}


def _desc(t):
    """The raw descriptor (ptr, dtype, shape, strides) of a CPU tensor, or None. No copy. An
    unsupported dtype gets code -1, which the library rejects naming the argument."""
    if t is None:
        return None
    return (t.data_ptr(), _CODES.get(t.dtype, -1), t.shape, t.stride())


def _f(x, name):
    """A float option for the raw ops, NaN when not given (scale: K^-0.5; lower_bound: none), so
    a caller's NaN is refused rather than read as "not given"."""
    return _NAN if x is None else _opt_float(name, x)


def _state_shape(B, N_or_none, HV, K, V, flags):
    inner = (HV, V, K) if flags & _V_FIRST else (HV, K, V)
    return (N_or_none,) + inner


def _chunk_capacity(B, T, cu_seqlens, chunk_size):
    """An upper bound of NC, the number of chunk states, from shapes only (no data): fixed length
    B * ceil(T / C); packed ceil(T / C) + N - 1 (N segments add at most N - 1 partial chunks).
    The library trims the buffer to the exact NC (python/src/raw.cpp)."""
    nt = (T + chunk_size - 1) // chunk_size
    if cu_seqlens is None:
        return B * nt
    n = cu_seqlens.shape[0] - 1
    return nt + (n - 1 if n > 1 else 0)


def _exact_chunks(B, T, cu_seqlens, chunk_size):
    if cu_seqlens is None:
        return B * ((T + chunk_size - 1) // chunk_size)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return int(((lengths + chunk_size - 1) // chunk_size).sum())


# ---------------------------------------------------------------------------------------------
# The ops
# ---------------------------------------------------------------------------------------------

_lib = torch.library.Library("libkda", "DEF")
_lib.define(
    "chunk_kda_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
    "Tensor? initial_state, Tensor? cu_seqlens, float? scale, float? lower_bound, int flags, int chunk_size, "
    "bool output_final_state, bool save_states, bool save_v_new=False) -> (Tensor, Tensor, Tensor, Tensor)"
)
_lib.define(
    "chunk_kda_bwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
    "Tensor? initial_state, Tensor? cu_seqlens, Tensor? chunk_states, Tensor? v_new, Tensor do, Tensor? dht, "
    "float? scale, "
    "float? lower_bound, int flags, int chunk_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_lib.define(
    "decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
    "Tensor(a!) state_pool, Tensor slot_indices, Tensor? num_accepted_tokens, float? scale, float? lower_bound, "
    "int flags) -> Tensor"
)


def _fwd_shapes(q, v, cu_seqlens, flags, chunk_size, output_final_state, save_states, save_v_new):
    """(o shape, final_state shape, chunk_states shape, v_new shape, state dtype) of chunk_kda_fwd.
    Shared by the CPU and the fake kernel so that they agree exactly. save_states keeps the chunk
    states, save_v_new every token's delta v_new (o's shape, float32): the autograd keeps both
    with FLA's disable_recompute=True, as FLA does."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if chunk_size not in (16, 32, 64):  # the kernels' own check comes after these shapes are sized
        raise ValueError(f"kda: argument 'chunk_size': expected 64, 32 or 16, got {chunk_size}")
    oracle = q.dtype == torch.float64
    state_dtype = torch.float64 if oracle else torch.float32
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    fs = _state_shape(B, N, HV, K, V, flags) if output_final_state else (0,)
    cs = _state_shape(B, _chunk_capacity(B, T, cu_seqlens, chunk_size), HV, K, V, flags) if save_states else (0,)
    vn = (B, T, HV, V) if save_v_new else (0,)
    return (B, T, HV, V), fs, cs, vn, state_dtype


def _check_dims(q, v):
    if q.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"kda: q must be [B, T, H, K] and v [B, T, HV, V]; got q {list(q.shape)}, v {list(v.shape)}"
        )


def _chunk_kda_fwd_cpu(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound, flags,
                       chunk_size, output_final_state, save_states, save_v_new=False):
    _check_dims(q, v)
    o_shape, fs_shape, cs_shape, vn_shape, sdt = _fwd_shapes(q, v, cu_seqlens, flags, chunk_size,
                                                             output_final_state, save_states, save_v_new)
    o = torch.empty(o_shape, dtype=q.dtype)
    fs = torch.empty(fs_shape, dtype=sdt)
    cs = torch.empty(cs_shape, dtype=sdt)
    vn = torch.empty(vn_shape, dtype=sdt)
    nc = _raw_forward(
        1 if q.dtype == torch.float64 else 0,
        (_desc(q), _desc(k), _desc(v), _desc(g), _desc(beta), _desc(A_log),
         _desc(dt_bias), _desc(cu_seqlens), None, _desc(initial_state),
         None, _desc(o), _desc(fs) if output_final_state else None,
         _desc(cs) if save_states else None, _desc(vn) if save_v_new else None),
        0, _f(scale, "scale"), _f(lower_bound, "lower_bound"), flags, chunk_size, 0, 0)
    if save_states and nc < cs.shape[0]:
        cs[nc:].zero_()  # the capacity's unused tail: deterministic contents
    return o, fs, cs, vn


def _chunk_kda_fwd_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound, flags,
                        chunk_size, output_final_state, save_states, save_v_new=False):
    _check_dims(q, v)
    o_shape, fs_shape, cs_shape, vn_shape, sdt = _fwd_shapes(q, v, cu_seqlens, flags, chunk_size,
                                                             output_final_state, save_states, save_v_new)
    return (q.new_empty(o_shape), q.new_empty(fs_shape, dtype=sdt), q.new_empty(cs_shape, dtype=sdt),
            q.new_empty(vn_shape, dtype=sdt))


def _bwd_dtypes(q, k, v, g, beta, initial_state, A_log, dt_bias, flags):
    """Gradient buffers' (shape, dtype): inputs' dtypes (fp32 for dh0, dA_log, ddt_bias); all fp64
    on the oracle path. Absent gradients are empty (0,) tensors."""
    oracle = q.dtype == torch.float64
    f32 = torch.float64 if oracle else torch.float32

    def like(x):
        return (tuple(x.shape), torch.float64 if oracle else x.dtype)

    gate = bool(flags & _GATE)
    return [
        like(q), like(k), like(v), like(g), like(beta),
        (tuple(initial_state.shape), f32) if initial_state is not None else ((0,), f32),
        (tuple(A_log.shape), f32) if (gate and A_log is not None) else ((0,), f32),
        (tuple(dt_bias.shape), f32) if (gate and dt_bias is not None) else ((0,), f32),
    ]


def _chunk_kda_bwd_cpu(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_states, v_new, do, dht,
                       scale, lower_bound, flags, chunk_size):
    _check_dims(q, v)
    grads = [torch.empty(shape, dtype=dt) for shape, dt in _bwd_dtypes(q, k, v, g, beta, initial_state, A_log,
                                                                         dt_bias, flags)]
    dq, dk, dv, dg, dbeta, dh0, dA, ddt = grads
    gate = bool(flags & _GATE)
    oracle = q.dtype == torch.float64
    if chunk_states is not None and chunk_states.numel() == 0:
        chunk_states = None
    if v_new is not None and v_new.numel() == 0:
        v_new = None
    _raw_backward(
        1 if oracle else 0,
        (_desc(q), _desc(k), _desc(v), _desc(g), _desc(beta), _desc(A_log),
         _desc(dt_bias), _desc(cu_seqlens), None, _desc(initial_state),
         None, None, None, _desc(chunk_states), _desc(v_new),
         _desc(do), _desc(dht),
         _desc(dq), _desc(dk), _desc(dv), _desc(dg), _desc(dbeta),
         _desc(dh0) if initial_state is not None else None,
         _desc(dA) if (gate and A_log is not None) else None,
         _desc(ddt) if (gate and dt_bias is not None) else None),
        0, _f(scale, "scale"), _f(lower_bound, "lower_bound"), flags, chunk_size, 0, 0)
    return dq, dk, dv, dg, dbeta, dh0, dA, ddt


def _chunk_kda_bwd_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_states, v_new, do, dht,
                        scale, lower_bound, flags, chunk_size):
    _check_dims(q, v)
    return tuple(q.new_empty(shape, dtype=dt)
                 for shape, dt in _bwd_dtypes(q, k, v, g, beta, initial_state, A_log, dt_bias, flags))


def _decode_cpu(q, k, v, g, beta, A_log, dt_bias, state_pool, slot_indices, num_accepted_tokens, scale, lower_bound,
                flags):
    _check_dims(q, v)
    o = torch.empty((q.shape[0], q.shape[1], v.shape[2], v.shape[3]), dtype=q.dtype)
    _raw_decode(
        (_desc(q), _desc(k), _desc(v), _desc(g), _desc(beta), _desc(A_log),
         _desc(dt_bias), _desc(state_pool), _desc(slot_indices),
         _desc(num_accepted_tokens), _desc(o)),
        _f(scale, "scale"), _f(lower_bound, "lower_bound"), flags, 0)
    return o


def _decode_fake(q, k, v, g, beta, A_log, dt_bias, state_pool, slot_indices, num_accepted_tokens, scale, lower_bound,
                 flags):
    _check_dims(q, v)
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2], v.shape[3]))


def _no_cuda(name):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"libkda::{name}: CUDA tensors are not supported -- libkda has a CPU backend only (no CUDA "
            f"backend yet). Move the inputs to the CPU (tensor.cpu()) or use fla.ops.kda on the GPU."
        )
    return kernel


for _name, _cpu, _fake in (("chunk_kda_fwd", _chunk_kda_fwd_cpu, _chunk_kda_fwd_fake),
                           ("chunk_kda_bwd", _chunk_kda_bwd_cpu, _chunk_kda_bwd_fake),
                           ("decode", _decode_cpu, _decode_fake)):
    _lib.impl(_name, _cpu, "CPU")
    _lib.impl(_name, _no_cuda(_name), "CUDA")
    torch.library.register_fake(f"libkda::{_name}", _fake, lib=_lib)

_fwd_op = torch.ops.libkda.chunk_kda_fwd.default
_bwd_op = torch.ops.libkda.chunk_kda_bwd.default
_decode_op = torch.ops.libkda.decode.default

# Eager fast path. Going through the dispatcher to a Python kernel costs several microseconds per
# call (boxing 13+ arguments and unboxing them again), as much as a decode-sized library call. When nothing could observe the
# difference -- plain CPU tensors, no torch.compile / dispatch or function modes / functorch
# transforms / profiler -- the public functions call the CPU kernels above directly (the very
# code the dispatcher would run). Otherwise they call the registered ops.
import torch.utils._python_dispatch as _pd  # noqa: E402

_is_compiling = torch.compiler.is_compiling
_C = torch._C
_Tensor = torch.Tensor


def _eager_ok(*tensors):
    if _is_compiling():
        return False
    if (_pd._is_in_torch_dispatch_mode or _C._is_torch_function_mode_enabled()
            or _C._are_functorch_transforms_active() or torch.autograd.profiler._is_profiler_enabled):
        return False
    for t in tensors:
        if t is not None and (type(t) is not _Tensor or not t.is_cpu):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------

def _chunk_grads(saved, opts, do, dht, need):
    """The 15 input gradients of chunk_kda_fwd from the C++ backward (SPEC.md section 2).
    saved: (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_states or None,
    v_new or None);
    opts: (scale, lower_bound, flags, chunk_size, output_final_state); need: needs_input_grad."""
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cs, vn = saved
    scale, lower_bound, flags, chunk_size, output_final_state = opts
    if do is None:
        do = torch.zeros((q.shape[0], q.shape[1], v.shape[2], v.shape[3]), dtype=q.dtype, device=q.device)
    if not output_final_state:
        dht = None
    bwd = _chunk_kda_bwd_cpu if _eager_ok(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cs, vn,
                                          do, dht) else _bwd_op
    dq, dk, dv, dg, dbeta, dh0, dA, ddt = bwd(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cs, vn,
                                              do, dht, scale, lower_bound, flags, chunk_size)
    gate = bool(flags & _GATE)
    return _no_double_backward((
        dq.to(q.dtype) if need[0] else None,
        dk.to(k.dtype) if need[1] else None,
        dv.to(v.dtype) if need[2] else None,
        dg.to(g.dtype) if need[3] else None,
        dbeta.to(beta.dtype) if need[4] else None,
        dA.to(A_log.dtype) if (need[5] and gate) else None,
        ddt.to(dt_bias.dtype) if (need[6] and gate) else None,
        dh0.to(initial_state.dtype) if need[7] else None,
        None, None, None, None, None, None, None,
    ))


def _raise_when_differentiated(tensors, message):
    """Each tensor behind a node that raises `message` when a backward reaches it (None and
    non-tensors as they are): for results that do not depend differentiably on inputs that
    require grad, so that a backward through them fails loudly instead of treating them as
    constants."""
    err = torch._C._functions.DelayedError(message.encode(), 1)
    return tuple(err(t.detach().requires_grad_(True)) if isinstance(t, torch.Tensor) else t for t in tensors)


def _no_double_backward(grads):
    """The gradients as they are, or, under create_graph=True (grad mode on inside the backward),
    each behind a node that raises when differentiated: the C++ backward has no derivative of its
    own, and gradients that silently did not depend on the inputs would make a gradient penalty
    wrong without a word (torch's once_differentiable does this only when the incoming gradients
    require grad; here the saved inputs do)."""
    if not torch.is_grad_enabled():
        return grads
    return _raise_when_differentiated(grads, "libkda.torch: the backward of chunk_kda is not differentiable (no "
                                             "double backward; create_graph=True gradients cannot be differentiated "
                                             "again)")


class ChunkKDAFunction(torch.autograd.Function):
    """Autograd of the chunked forward through the C++ backward (SPEC.md section 2). With
    save_states the forward keeps the state entering every chunk and every token's delta v_new
    (saved-state residual); without, the backward rematerializes them (SPEC.md section 3). Arguments are those of
    libkda::chunk_kda_fwd; returns (o, final_state or None)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound, flags,
                chunk_size, output_final_state, save_states):
        fwd = _chunk_kda_fwd_cpu if _eager_ok(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens) else _fwd_op
        o, fs, cs, vn = fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound, flags,
                            chunk_size, output_final_state, save_states, save_states)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                              cs if save_states else None, vn if save_states else None)
        ctx.opts = (scale, lower_bound, flags, chunk_size, output_final_state)
        if output_final_state:
            return o, fs
        return o, None

    @staticmethod
    def backward(ctx, do, dht):
        return _chunk_grads(ctx.saved_tensors, ctx.opts, do, dht, ctx.needs_input_grad)


# The same autograd on the op itself, for callers of torch.ops.libkda.chunk_kda_fwd (its third and
# fourth outputs, the chunk states and v_new, are residuals and get no gradient).
def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound, flags, chunk_size,
     output_final_state, save_states, *rest) = inputs
    save_v_new = bool(rest[0]) if rest else False
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                          output[2] if save_states else None, output[3] if save_v_new else None)
    ctx.opts = (scale, lower_bound, flags, chunk_size, output_final_state)


def _fwd_backward(ctx, do, dfs, dcs, dvn):
    return _chunk_grads(ctx.saved_tensors, ctx.opts, do, dfs, ctx.needs_input_grad) + (None,)  # save_v_new


torch.library.register_autograd("libkda::chunk_kda_fwd", _fwd_backward, setup_context=_fwd_setup_context, lib=_lib)


# ---------------------------------------------------------------------------------------------
# FLA-compatible entry points
# ---------------------------------------------------------------------------------------------

def _flags(use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first):
    return ((_L2NORM if use_qk_l2norm_in_kernel else 0) | (_GATE if use_gate_in_kernel else 0)
            | (_BETA_SIGMOID if use_beta_sigmoid_in_kernel else 0) | (_NEG_EIGVAL if allow_neg_eigval else 0)
            | (_V_FIRST if state_v_first else 0))


_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_tensors(ints=(), **tensors):
    """Each tensor argument before it reaches the raw ops: on the CPU (one elsewhere -- CUDA, or a
    meta tensor beside CPU ones -- would reach the kernels' shape-only path and come back as
    uninitialized output), and of a supported dtype (the raw ops know only a code for
    "unsupported"): the names in `ints` int32 / int64, the others float32, bfloat16, float16 or
    float64."""
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"kda: argument '{name}': expected a torch.Tensor or None, got {type(t).__name__}")
        if not t.is_cpu:  # (t.device builds a device object: a third of a microsecond per tensor)
            raise NotImplementedError(
                f"libkda.torch: argument '{name}' is on device '{t.device}', which is not supported -- libkda has "
                f"a CPU backend only (no CUDA backend yet). Move the inputs to the CPU or use fla.ops.kda on the GPU."
            )
        if name in ints and t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"kda: argument '{name}': expected dtype int32 or int64, got {t.dtype}")
        if name == "state_pool":  # decode pools: float32, or narrow (no float64 pools)
            _check_pool_dtype(t)
        elif name not in ints and t.dtype not in _FLOATS:
            raise ValueError(f"kda: argument '{name}': expected dtype float32, bfloat16, float16 or float64, got "
                             f"{t.dtype}")


# Keywords of other stacks' KDA entries that change what a call computes and that libkda's FLA
# signatures do not implement. FLA's functions take **kwargs and ignore what they do not know, and
# so do these, but passing one of these must not silently give another computation: SGLang's
# chunk_kda updates a state pool at initial_state_indices in place (here: kda_inference reads a
# pool by index, and the decode entries write one); vLLM's retrieve_parent_token selects each draft
# token's parent in a token tree (EAGLE), where these run a chain.
_PEER_ONLY_KEYWORDS = {
    "initial_state_indices": "SGLang's pooled chunk_kda (libkda: libkda.kda_inference reads initial states "
                             "from a pool by index; fused_recurrent_kda_fwd with ssm_state_indices updates one)",
    "retrieve_parent_token": "vLLM's tree speculative decoding (libkda decodes draft tokens as a chain)",
}


def _reject_peer_only_keywords(kwargs, function):
    for name, value in kwargs.items():
        if name in _PEER_ONLY_KEYWORDS and value is not None:  # None (a chain decode) asks for nothing
            raise TypeError(f"libkda.torch.{function}: keyword '{name}' is not supported: "
                            f"{_PEER_ONLY_KEYWORDS[name]}")


def _state_v_first_kwarg(state_v_first, kwargs, function):
    _reject_peer_only_keywords(kwargs, function)
    if "transpose_state_layout" in kwargs:  # FLA's deprecated name
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                      stacklevel=3)
        state_v_first = kwargs.pop("transpose_state_layout")
    return state_v_first


def _gate_params(q, v, A_log, dt_bias):
    """A_log of any shape with HV elements (FLA passes ``[1, 1, HV, 1]``) as ``[HV]`` and dt_bias
    of any shape with HV * K elements as ``[HV * K]``, by reshaping (a view where the strides
    allow; autograd through the reshape hands gradients back in the caller's shape)."""
    if q.dim() != 4 or v.dim() != 4:
        return A_log, dt_bias  # _check_dims reports the layout
    HV, K = v.shape[2], q.shape[3]
    for name, t, n, what in (("A_log", A_log, HV, "HV"), ("dt_bias", dt_bias, HV * K, "HV * K")):
        if t is not None and t.numel() != n:
            raise ValueError(f"kda: argument '{name}': expected {what} = {n} elements (e.g. shape [{n}]), "
                             f"got shape {list(t.shape)} ({t.numel()} elements)")
    A_log = A_log if A_log is None or A_log.dim() == 1 else A_log.reshape(HV)
    dt_bias = dt_bias if dt_bias is None or dt_bias.dim() == 1 else dt_bias.reshape(HV * K)
    return A_log, dt_bias


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs,
):
    """``fla.ops.kda.chunk_kda`` on libkda's CPU kernels: same arguments, defaults and results.

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` (HV % H == 0); g ``[B, T, HV, K]`` (log decay, or
    the raw gate with ``use_gate_in_kernel``: ``A_log`` (HV elements, any shape: ``[HV]`` or FLA's
    ``[1, 1, HV, 1]``) and optional ``dt_bias`` (HV * K elements, e.g. ``[HV * K]`` or ``[HV, K]``)
    are passed as keywords, as in FLA; their gradients come back in the shapes passed); beta
    ``[B, T, HV]`` (logits with ``use_beta_sigmoid_in_kernel``). Varlen: ``cu_seqlens [N + 1]`` with
    B = 1. States ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), float32. Any dtype of
    float32 / bfloat16 / float16 (float64: the fp64 oracle). Extra keywords: ``chunk_size`` (64 or
    32, as in FLA: anything else raises ValueError; the numpy ``libkda.chunk_kda`` also takes 16),
    ``A_log``, ``dt_bias``.

    ``disable_recompute=True`` keeps the state entering every chunk and every token's delta
    ``v_new`` (float32, o's shape) for the backward, as FLA keeps its ``h`` and ``v_new`` (saved-state);
    ``False`` (the default) rematerializes them in the backward. ``return_intermediate_states=True``
    returns ``(o, final_state, h)`` without autograd, h being the state entering every chunk,
    ``[B, NT, HV, K, V]`` (varlen: ``[1, NC, HV, K, V]``) in the input dtype (k's), as in FLA.

    ``safe_gate``, ``cu_seqlens_cpu``, ``use_graph`` and ``max_num_seqs`` are accepted for
    compatibility and do not change the result (``safe_gate`` validates ``lower_bound`` as FLA
    does; with ``use_graph``, varlen ``h`` has FLA's static capacity of ceil(T / chunk_size) + N - 1
    chunk states, zeros after the last chunk, and ``graph_mode="eager"`` is an error);
    ``cp_context`` is not supported. Other stacks' keywords that would change the computation
    (SGLang's ``initial_state_indices``, vLLM's ``retrieve_parent_token``) raise TypeError; other
    unknown keywords are ignored, as FLA ignores them.

    Returns ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state float32 or None.
    """
    state_v_first = _state_v_first_kwarg(state_v_first, kwargs, "chunk_kda")
    if kwargs.get("graph_mode") == "eager" and use_graph:  # FLA main's check
        raise ValueError("libkda.torch.chunk_kda: graph_mode='eager' conflicts with use_graph=True "
                         "(argument 'graph_mode')")
    if cp_context is not None:
        raise NotImplementedError("libkda.torch.chunk_kda: context parallelism (cp_context) is not supported")
    gate_params = dict(A_log=kwargs.get("A_log"), dt_bias=kwargs.get("dt_bias"))
    _check_tensors(("cu_seqlens",), q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
                   cu_seqlens=cu_seqlens, **gate_params)
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(
                f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`."
                f"Please flatten variable-length inputs before processing."
            )
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
            raise ValueError(f"kda: argument 'cu_seqlens': expected shape [N + 1], got {list(cu_seqlens.shape)}")
        if use_graph and max_num_seqs is not None and cu_seqlens.shape[0] - 1 != max_num_seqs:
            # FLA's assert (AssertionError, kept under python -O); the buffer of a captured graph holds
            # max_num_seqs sequences, padded with empty ones
            raise AssertionError(
                f"cu_seqlens must be padded with zero-length tail sequences to exactly max_num_seqs + 1 entries, "
                f"got {cu_seqlens.shape[0] - 1} sequences with max_num_seqs={max_num_seqs} "
                f"(argument 'cu_seqlens' of libkda.torch.chunk_kda with use_graph=True)")
        if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
            raise ValueError(
                f"The number of initial states is expected to be equal to the number of input sequences, "
                f"i.e., {len(cu_seqlens) - 1} rather than {initial_state.shape[0]}."
            )
    A_log = dt_bias = None
    if use_gate_in_kernel:
        A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
        if A_log is None and lower_bound is None:
            raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set.")
        A_log, dt_bias = _gate_params(q, v, A_log, dt_bias)
    chunk_size = kwargs.pop("chunk_size", 64)
    if chunk_size not in (32, 64):  # FLA's rule; the numpy libkda.chunk_kda also takes 16
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError("`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`.")
        if not (-5 <= lower_bound < 0):
            raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}.")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if not use_gate_in_kernel:
        lower_bound = None  # FLA: the lower bound only shapes the in-kernel gate
    flags = _flags(use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                   state_v_first)
    if not kwargs.pop("bf16_dot_products", True):  # libkda's option (not FLA's): fp32 state products
        flags |= _FP32_PRODUCTS
    scale = _opt_float("scale", scale)

    if return_intermediate_states:
        # FLA's contract (its asserts, as AssertionError also under python -O).
        if not torch.is_inference_mode_enabled():
            raise AssertionError("return_intermediate_states is only allowed in inference mode")
        if disable_recompute:
            raise AssertionError("return_intermediate_states must be used with disable_recompute=False")
        o, fs, cs, _ = _fwd_op(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
                               flags, chunk_size, output_final_state, True)
        B, T = q.shape[0], q.shape[1]
        nc = _exact_chunks(B, T, cu_seqlens, chunk_size)
        h = cs[:nc]
        if use_graph and cu_seqlens is not None:
            # FLA sizes h by the static chunk capacity of a captured step, ceil(T / chunk_size) +
            # N - 1 (its nt_max), whatever cu_seqlens holds; the slots after the last chunk are 0.
            cap = _chunk_capacity(B, T, cu_seqlens, chunk_size)
            h = torch.cat([h, h.new_zeros((cap - nc,) + tuple(h.shape[1:]))]) if cap > nc else h
        h = h.unflatten(0, (B, nc // B if B else 0)) if cu_seqlens is None else h.unsqueeze(0)
        return o, (fs if output_final_state else None), h.to(k.dtype)  # FLA: h in the input dtype

    if _eager_ok(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens) and not (
            torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                            for t in (q, k, v, g, beta, A_log, dt_bias, initial_state))):
        # Nothing to differentiate: the forward alone, without residuals (the inference path).
        o, fs, _, _ = _chunk_kda_fwd_cpu(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale,
                                         lower_bound, flags, chunk_size, bool(output_final_state), False)
        return o, (fs if output_final_state else None)
    return ChunkKDAFunction.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
                                  flags, chunk_size, bool(output_final_state), bool(disable_recompute))


def _recurrent_beta(beta, q, v, use_beta_sigmoid_in_kernel, name):
    """FLA's fused_recurrent beta: None means beta = 1 (its older default); a per-value-channel
    beta [B, T, HV, V] (the kernel's IS_BETA_HEADWISE) has no counterpart in libkda's kernels."""
    if beta is None:
        if use_beta_sigmoid_in_kernel:
            raise ValueError(f"{name}: beta=None means beta = 1, which has no logit; pass beta with "
                             "use_beta_sigmoid_in_kernel=True")
        return torch.ones(v.shape[:-1], dtype=q.dtype, device=q.device)
    if beta.dim() == v.dim():
        raise ValueError(f"{name}: argument 'beta': a per-value-channel beta {list(beta.shape)} (FLA's "
                         f"IS_BETA_HEADWISE) is not supported; expected shape {list(v.shape[:-1])} [B, T, HV]")
    return beta


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
):
    """``fla.ops.kda.fused_recurrent_kda``: same arguments, defaults and results
    (``(o, final_state)``). Runs libkda's chunked kernel, which computes the same recurrence
    (and, unlike FLA's, is differentiable).

    With ``ssm_state_indices`` (vLLM's continuous batching; optional ``num_accepted_tokens`` for
    speculative decoding; ``inplace_final_state=True``), this is the decode entry: ``initial_state``
    is then a state pool ``[slots, HV, K, V]`` updated in place, see ``fused_recurrent_kda_fwd``.

    ``store_dtype`` (a torch dtype, e.g. float16 or float8_e4m3fn; keyword) returns the final state
    in that dtype: computed in fp32 as always, then cast (the FLA fork's state compression).
    """
    state_v_first = _state_v_first_kwarg(state_v_first, kwargs, "fused_recurrent_kda")
    beta = _recurrent_beta(beta, q, v, use_beta_sigmoid_in_kernel, "fused_recurrent_kda")
    if kwargs.get("ssm_state_indices") is not None:
        return fused_recurrent_kda_fwd(
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state, scale=scale,
            output_final_state=output_final_state, inplace_final_state=kwargs.get("inplace_final_state", True),
            state_v_first=state_v_first, cu_seqlens=cu_seqlens, ssm_state_indices=kwargs["ssm_state_indices"],
            num_accepted_tokens=kwargs.get("num_accepted_tokens"), use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, out=kwargs.get("out"))
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if cu_seqlens is not None and initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
        raise ValueError(
            f"The number of initial states is expected to be equal to the number of input sequences, "
            f"i.e., {len(cu_seqlens) - 1} rather than {initial_state.shape[0]}."
        )
    extra = {}
    if use_gate_in_kernel:
        extra = dict(A_log=A_log, dt_bias=dt_bias)
    o, fs = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                      use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                      allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
                      cu_seqlens=cu_seqlens, **extra)
    store_dtype = kwargs.get("store_dtype")
    if fs is not None and store_dtype is not None and store_dtype != fs.dtype:
        fs = fs.to(store_dtype)  # computed in fp32, stored narrower (differentiable cast)
    return o, fs


def _check_out(out, v, name="out"):
    """``out`` (FLA's decode output buffer), checked before anything is computed or written: a
    floating tensor with o's element count (o has v's shape); it receives a copy of o."""
    if out is None:
        return
    if not out.is_floating_point():
        raise ValueError(f"kda: argument '{name}': expected a floating tensor for o, got {out.dtype}")
    if out.numel() != v.numel():
        raise ValueError(f"kda: argument '{name}': expected {v.numel()} elements (o's shape {list(v.shape)}), "
                         f"got shape {list(out.shape)}")
    if _overlapping(out):
        raise ValueError(f"kda: argument '{name}': its elements overlap in memory (shape {list(out.shape)}, strides "
                         f"{list(out.stride())}); outputs need distinct elements")


def _overlapping(t):
    """Whether a tensor's elements can share memory: the C++ check_writable rule (each dim's stride,
    by size, steps past everything the smaller-stride dims span), for buffers copied into here."""
    span = 1
    for stride, size in sorted((abs(st), n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride < span:
            return True
        span += stride * (size - 1)
    return False


def fused_recurrent_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    output_final_state: bool = False,
    inplace_final_state: bool = True,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    out: torch.Tensor | None = None,
    **kwargs,
):
    """``fla.ops.kda.fused_recurrent_kda_fwd`` (the decode entry vLLM / SGLang call), on
    kda::decode. Returns ``(o, final_state)``.

    With ``ssm_state_indices`` and ``inplace_final_state=True`` (the default): ``initial_state`` is
    a state pool ``[slots, HV, K, V]`` (``[slots, HV, V, K]`` with ``state_v_first``), read and
    updated in place; ``final_state`` is that pool. float32, or bfloat16 / float16 as FLA's kernel
    takes them: each state read converted, a row's tokens computed in fp32, each written state
    rounded to nearest. ``ssm_state_indices`` ``[N]``: sequence
    n reads and writes slot ``ssm_state_indices[n]``; ``[N, T]`` with ``num_accepted_tokens [N]``:
    it reads slot ``ssm_state_indices[n, num_accepted_tokens[n] - 1]`` and writes the state after
    token t to ``ssm_state_indices[n, t]`` (negative: skipped; a negative read slot makes row n
    padding: o = 0, pool untouched). Tokens: q ``[N, T, H, K]``, or ``[1, total, H, K]`` with
    ``cu_seqlens`` (sequences of no tokens anywhere decode nothing, and tokens after
    ``cu_seqlens[-1]`` get o = 0, as vLLM pads a batch for its CUDA graphs; sequences of different
    lengths run a decode call per length, ``[N, T]`` indices then with T the longest sequence's
    tokens, every index of the batch checked before the first call writes). ``[N, T']`` indices
    with T' above the tokens per sequence (vLLM's ``[N, num_spec + 1]`` capacity) use their first
    columns, as FLA's kernel reads them; every column is range-checked.

    Without ``ssm_state_indices`` this is ``fused_recurrent_kda``; with ``inplace_final_state=True``
    and an ``initial_state`` ``[N, HV, K, V]``, as in FLA, sequence n's final state is written back
    into ``initial_state[n]`` (forward only, no autograd) and ``final_state`` is ``initial_state``;
    ``inplace_final_state=True`` without ``initial_state`` is FLA's AssertionError. With
    ``inplace_final_state=False`` and ``ssm_state_indices`` the pool is left untouched and, with
    ``output_final_state=True``, the float32 state after every token comes back (else None).
    ``out``, when given, receives o (a copy).
    """
    state_v_first = _state_v_first_kwarg(state_v_first, kwargs, "fused_recurrent_kda_fwd")
    beta = _recurrent_beta(beta, q, v, use_beta_sigmoid_in_kernel, "fused_recurrent_kda_fwd")
    _check_out(out, v)
    if inplace_final_state and initial_state is None:
        # FLA's `assert initial_state is not None` (an AssertionError also under python -O).
        raise AssertionError("fused_recurrent_kda_fwd: inplace_final_state=True (the default) writes the final "
                             "state into initial_state, which is None; pass initial_state or "
                             "inplace_final_state=False")
    if ssm_state_indices is None:
        inplace = bool(inplace_final_state)
        run = lambda: fused_recurrent_kda(  # noqa: E731
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state or inplace, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
            cu_seqlens=cu_seqlens)
        if inplace:
            # FLA: sequence n's final state is written back into initial_state[n]; the result is
            # initial_state itself. Forward only, like FLA's (no autograd through the write).
            with torch.no_grad():
                o, fs = run()
                initial_state.copy_(fs)
            fs = initial_state
        else:
            o, fs = run()
        if out is not None:
            out.copy_(o.reshape(out.shape))
            o = out
        return o, fs
    if initial_state is None:
        raise ValueError("fused_recurrent_kda_fwd: ssm_state_indices needs initial_state (the state pool)")
    gate = dict(A_log=A_log, dt_bias=dt_bias, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first)
    if not inplace_final_state:
        o, fs = _decode_out_of_place(q, k, v, g, beta, initial_state, ssm_state_indices, num_accepted_tokens,
                                     cu_seqlens, gate)
        fs = fs if output_final_state else None  # FLA: the per-token states only when asked for
        if out is not None:
            out.copy_(o.reshape(out.shape))
            return out, fs
        return _decode_not_differentiable((o, fs), q, k, v, g, beta, A_log, dt_bias, initial_state)
    o = kda_decode(q, k, v, g, beta, initial_state, ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                   A_log=A_log, dt_bias=dt_bias, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                   use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                   allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
                   cu_seqlens=cu_seqlens)
    if out is not None:
        out.copy_(o.reshape(out.shape))
        return out, initial_state
    return _decode_not_differentiable((o,), q, k, v, g, beta, A_log, dt_bias, initial_state) + (initial_state,)


def _decode_not_differentiable(results, *inputs):
    """The decode against a pool is forward only (as FLA's decode kernel): when grad mode is on and
    an input requires grad, its results raise when a backward reaches them, instead of silently
    giving no gradient. (A result written into `out` is returned as that tensor, unwrapped.)"""
    if not torch.is_grad_enabled() or not any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
        return tuple(results)
    return _raise_when_differentiated(results, "libkda.torch: the decode with ssm_state_indices (a state pool) is "
                                               "not differentiable; use chunk_kda or fused_recurrent_kda without "
                                               "ssm_state_indices for gradients")


def _check_slot_range(indices, slots):
    """Slot indices below `slots` (negative ones are padding), as kda::decode requires."""
    if indices.numel() and int(indices.max()) >= slots:
        raise ValueError(f"kda: argument 'ssm_state_indices': expected indices < slots = {slots} (negative = "
                         f"padding), got {int(indices.max())}")


def _index_shape_ok(indices, n, t):
    """Slot indices [N], or [N, T'] with T' >= T (the first T columns used, as FLA's kernel reads
    each row through its stride; vLLM keeps [N, num_spec + 1])."""
    return tuple(indices.shape) == (n,) or (indices.dim() == 2 and indices.shape[0] == n and indices.shape[1] >= t)


def _check_decode_indices(indices, num_accepted_tokens, n, t, slots):
    """kda::decode's index contract, for the out-of-place path that does not call it: int indices
    [N] or [N, T] below `slots` (negative: padding), num_accepted_tokens [N] in [1, T] and only
    with [N, T] indices."""
    name = "ssm_state_indices"
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kda: argument '{name}': expected dtype int32 or int64, got {indices.dtype}")
    if not _index_shape_ok(indices, n, t):
        raise ValueError(f"kda: argument '{name}': expected shape [N] = [{n}] or [N, T'] = [{n}, >= {t}] (T = {t} "
                         f"tokens; the first T columns are used), got {list(indices.shape)}")
    _check_slot_range(indices, slots)
    if num_accepted_tokens is None:
        return
    if indices.dim() != 2:
        raise ValueError(f"kda: argument 'num_accepted_tokens': needs {name} of shape [N, T], got "
                         f"{list(indices.shape)}")
    if num_accepted_tokens.dtype not in (torch.int32, torch.int64) or tuple(num_accepted_tokens.shape) != (n,):
        raise ValueError(f"kda: argument 'num_accepted_tokens': expected an int32 or int64 tensor of shape [N] = "
                         f"[{n}], got {num_accepted_tokens.dtype} of shape {list(num_accepted_tokens.shape)}")
    if n and (int(num_accepted_tokens.min()) < 1 or int(num_accepted_tokens.max()) > t):
        lo, hi = int(num_accepted_tokens.min()), int(num_accepted_tokens.max())
        raise ValueError(f"kda: argument 'num_accepted_tokens': expected values in [1, T = {t}], got values in "
                         f"[{lo}, {hi}]")


def _packed_lengths(q, cu_seqlens, **others):
    """(N, lengths [N] int64, used = cu_seqlens[-1]) of decode's packed layout [1, tokens, ...],
    after checking cu_seqlens (1-D int32 / int64, starting at 0, non-decreasing, ending at most at
    the buffer's tokens) and that k, v, g and beta have q's tokens. vLLM pads a decode batch for its
    CUDA graphs with sequences of no tokens (cu_seqlens [0, 1, 2, 3, 3, 3] over a buffer of 5
    tokens, slot -1): as in FLA's kernel they decode nothing, and the tokens after cu_seqlens[-1]
    belong to no sequence (o = 0 here)."""
    if q.shape[0] != 1:
        raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`.")
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
        raise ValueError(f"kda: argument 'cu_seqlens': expected a 1-D int32 or int64 tensor, got "
                         f"{cu_seqlens.dtype} of shape {list(cu_seqlens.shape)}")
    total = q.shape[1]
    for name, x in others.items():  # each is sliced by cu_seqlens alone: same token count as q
        if x.dim() < 2 or tuple(x.shape[:2]) != (1, total):
            raise ValueError(f"kda: argument '{name}': expected [1, {total}, ...] (q's tokens, packed with "
                             f"cu_seqlens), got {list(x.shape)}")
    cu = cu_seqlens.to(torch.int64).cpu()
    n = cu.shape[0] - 1
    lengths = cu.diff() if n > 0 else cu.new_zeros(0)
    if n <= 0 or int(cu[0]) != 0 or bool((lengths < 0).any()) or int(cu[-1]) > total:
        shown = cu.tolist()
        raise ValueError(f"kda: argument 'cu_seqlens': expected [0, ...] non-decreasing, at least two entries, "
                         f"ending at most at the buffer's {total} tokens, got "
                         f"{shown if len(shown) <= 8 else shown[:8] + ['...']}")
    return n, lengths, int(cu[-1])


def _check_ragged_indices(indices, num_accepted_tokens, lengths, slots, writes):
    """The whole batch's slot indices when sequences of different lengths run as separate groups
    (_decode_groups), checked before any group writes: int32 / int64, [N] or [N, T] with T the
    longest sequence's tokens or more (row n uses its first lengths[n] entries, as FLA's kernel does),
    below `slots`; num_accepted_tokens [N], only with [N, T], within [1, lengths[n]] for every row
    with tokens; and, when the call `writes` the pool (in place), each slot written by one row
    (kda::decode's rule, which a group alone would only apply to its own rows; out of place the
    pool is only read, and rows may share a slot)."""
    name = "ssm_state_indices"
    n, tmax = lengths.numel(), int(lengths.max())
    if indices.dtype not in (torch.int32, torch.int64) or not _index_shape_ok(indices, n, tmax):
        raise ValueError(f"kda: argument '{name}': expected an int32 or int64 tensor of shape [N] = [{n}] or "
                         f"[N, T'] = [{n}, >= {tmax}] (T' at least the longest sequence of cu_seqlens), got "
                         f"{indices.dtype} of shape {list(indices.shape)}")
    _check_slot_range(indices, slots)
    idx = indices.to(torch.int64).cpu()
    per_token = idx.dim() == 2
    acc = None
    if num_accepted_tokens is not None:
        if not per_token:
            raise ValueError(f"kda: argument 'num_accepted_tokens': needs {name} of shape [N, T], got "
                             f"{list(indices.shape)}")
        if num_accepted_tokens.dtype not in (torch.int32, torch.int64) or tuple(num_accepted_tokens.shape) != (n,):
            raise ValueError(f"kda: argument 'num_accepted_tokens': expected an int32 or int64 tensor of shape [N] = "
                             f"[{n}], got {num_accepted_tokens.dtype} of shape {list(num_accepted_tokens.shape)}")
        acc = num_accepted_tokens.to(torch.int64).cpu()
        bad = torch.nonzero((lengths > 0) & ((acc < 1) | (acc > lengths))).flatten()
        if bad.numel():
            row = int(bad[0])
            raise ValueError(f"kda: argument 'num_accepted_tokens': expected values in [1, T] with T the row's "
                             f"tokens, got {int(acc[row])} at row {row} of {int(lengths[row])} tokens")
    owner = {}
    for row in (torch.nonzero(lengths).flatten().tolist() if writes else []):
        read = int(idx[row, int(acc[row]) - 1 if acc is not None else 0] if per_token else idx[row])
        if read < 0:  # padding row: nothing read, nothing written
            continue
        writes = idx[row, :int(lengths[row])].tolist() if per_token else [read]
        for slot in set(w for w in writes if w >= 0):
            if owner.setdefault(slot, row) != row:
                raise ValueError(f"kda: argument '{name}': slot {slot} is written by rows {owner[slot]} and {row}; "
                                 f"each slot may belong to one sequence")


def _decode_groups(q, k, v, g, beta, cu_seqlens, slots, indices, num_accepted_tokens, writes):
    """Decode's packed layout ([1, tokens, ...] with cu_seqlens) as groups of sequences of one
    length: ([(q, k, v, g, beta as [rows, T, ...], the rows' slot indices, accepted counts, token
    positions)], the buffer's token count). One length (vLLM's decode and speculative batches):
    one group of views, positions None (its tokens are the first cu_seqlens[-1], in order).
    Several lengths (vLLM's CPU recurrent op over ragged sequences): a group per length, its rows'
    tokens gathered, positions their rows in the buffer; the whole batch's indices are checked
    first (_check_ragged_indices). Sequences of no tokens decode nothing (their indices are still
    checked); with none at all the list is empty."""
    total = q.shape[1]
    n, lengths, used = _packed_lengths(q, cu_seqlens, k=k, v=v, g=g, beta=beta)
    rows = torch.nonzero(lengths).flatten()
    distinct = sorted(set(lengths[rows].tolist()))
    if len(distinct) <= 1:
        keep = None if rows.numel() == n else rows
        indices, num_accepted_tokens = _rows_with_tokens(keep, n, slots, indices, num_accepted_tokens)
        if not distinct:
            return [], total
        tokens = tuple(x[0, :used].unflatten(0, (rows.numel(), distinct[0])) for x in (q, k, v, g, beta))
        return [(tokens, indices, num_accepted_tokens, None)], total
    _check_ragged_indices(indices, num_accepted_tokens, lengths, slots, writes)
    starts = cu_seqlens[:-1].to(torch.int64).cpu()
    groups = []
    for t in distinct:
        sel = rows[lengths[rows] == t]
        pos = (starts[sel][:, None] + torch.arange(t)).flatten()
        tokens = tuple(x[0, pos.to(x.device)].unflatten(0, (sel.numel(), t)) for x in (q, k, v, g, beta))
        at = sel.to(indices.device)
        idx = indices[at] if indices.dim() == 1 else indices[at, :t]
        acc = None if num_accepted_tokens is None else num_accepted_tokens[sel.to(num_accepted_tokens.device)]
        groups.append((tokens, idx, acc, pos))
    return groups, total


def _scatter_tokens(parts, total, like):
    """[1, total, ...] from (values [rows, T, ...], positions) pairs, zero at the positions none
    covers (the tokens of no sequence)."""
    out = like.new_zeros((1, total) + tuple(like.shape[2:]))
    for values, pos in parts:
        out[0, pos.to(out.device)] = values.flatten(0, 1).to(out.dtype)
    return out


def _pad_tokens(x, total):
    """[1, used, ...] -> [1, total, ...] with zeros for the tokens after cu_seqlens[-1]."""
    if x.shape[1] == total:
        return x
    return torch.cat([x, x.new_zeros((1, total - x.shape[1]) + tuple(x.shape[2:]))], 1)


def _rows_with_tokens(keep, n, slots, indices, num_accepted_tokens):
    """The slot indices (and accepted counts) of the rows `keep` selects, after checking the whole
    index tensor's dtype, shape ([N] or [N, T]) and range, so that a bad index of a row with no
    tokens is still an error."""
    if keep is None:
        return indices, num_accepted_tokens
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() not in (1, 2) or indices.shape[0] != n:
        raise ValueError(f"kda: argument 'ssm_state_indices': expected an int32 or int64 tensor of shape [N] or "
                         f"[N, T] with N = {n} (the sequences of cu_seqlens), got {indices.dtype} of shape "
                         f"{list(indices.shape)}")
    _check_slot_range(indices, slots)
    if num_accepted_tokens is not None and (num_accepted_tokens.dim() != 1 or num_accepted_tokens.shape[0] != n):
        raise ValueError(f"kda: argument 'num_accepted_tokens': expected shape [N] = [{n}], got "
                         f"{list(num_accepted_tokens.shape)}")
    keep = keep.to(indices.device)
    return indices[keep], (None if num_accepted_tokens is None else num_accepted_tokens[keep.to(
        num_accepted_tokens.device)])


_POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_pool_dtype(pool):
    if pool.dtype not in _POOL_DTYPES:
        raise ValueError(f"kda: argument 'state_pool': expected dtype float32, bfloat16 or float16, got "
                         f"{str(pool.dtype).removeprefix('torch.')}")


def _check_pool(pool, q, v, g, state_v_first):
    """The state pool's rank, shape ([slots, HV, K, V], or [slots, HV, V, K] with state_v_first) and
    dtype, checked here for the calls that do not reach kda::decode's own check (no sequence has
    tokens; out of place, where the pool is only read by copies), so that a bad pool is an error
    whatever the batch holds and whichever entry reads it."""
    _check_pool_dtype(pool)
    if q.dim() < 1 or v.dim() < 2 or g.dim() < 2 or tuple(g.shape[-2:]) != (v.shape[-2], q.shape[-1]):
        return  # tokens that disagree among themselves: the decode names them, not the pool
    hv, kd, vd = v.shape[-2], q.shape[-1], v.shape[-1]
    inner = (hv, vd, kd) if state_v_first else (hv, kd, vd)
    if pool.dim() != 4 or tuple(pool.shape[1:]) != inner:
        layout = "V, K" if state_v_first else "K, V"
        raise ValueError(f"kda: argument 'state_pool': expected shape [slots, HV, {layout}] = "
                         f"[slots, {', '.join(map(str, inner))}], got {list(pool.shape)}")


def _decode_out_of_place(q, k, v, g, beta, pool, indices, num_accepted_tokens, cu_seqlens, gate):
    """FLA's ``inplace_final_state=False`` with ``ssm_state_indices``: sequence n starts from the
    slot it would read (``indices[n]``, ``indices[n, 0]`` or ``indices[n, num_accepted_tokens[n] - 1]``;
    negative: padding, o = 0 and a zero state), the pool is left untouched, and the state after
    every token is returned, ``[total tokens, HV, K, V]`` (row ``bos + t``), as FLA's kernel writes
    it. One kda::decode call with a slot per token: the returned buffer is its pool, sequence n's
    read state is copied into the row of token ``a_n - 1`` (a_n = its accepted tokens, else 1) and
    token t's state goes to row ``n T + t``, so the decode reads each state once and writes every
    token's state once, as the in-place speculative decode does. Packed sequences of different
    lengths run a group per length (_decode_groups), each row's states at its own tokens' rows."""
    _check_pool(pool, q, v, g, gate["state_v_first"])
    packed = cu_seqlens is not None
    if packed:
        groups, total = _decode_groups(q, k, v, g, beta, cu_seqlens, pool.shape[0], indices, num_accepted_tokens,
                                       writes=False)
        if not groups:  # no sequence has tokens: nothing to read; every token's o and state is 0
            o = torch.zeros((1, total) + tuple(v.shape[2:]), dtype=q.dtype, device=q.device)
            return o, torch.zeros((total,) + tuple(pool.shape[1:]), dtype=torch.float32, device=pool.device)
        if groups[0][3] is not None:  # several lengths: each group unpacked, then scattered back
            parts = [(*_decode_out_of_place(*tokens, pool, idx, acc, None, gate), pos)
                     for tokens, idx, acc, pos in groups]
            o = _scatter_tokens([(o_g, pos) for o_g, _, pos in parts], total, q.new_empty((1, 0) + tuple(v.shape[2:])))
            final = _scatter_tokens([(f_g.unsqueeze(1), pos) for _, f_g, pos in parts], total,
                                    pool.new_empty((1, 0) + tuple(pool.shape[1:]), dtype=torch.float32))[0]
            return o, final
        (q, k, v, g, beta), indices, num_accepted_tokens, _ = groups[0]
    n, t = q.shape[0], q.shape[1]
    _check_decode_indices(indices, num_accepted_tokens, n, t, pool.shape[0])
    if t == 0:  # no tokens: nothing to read or return, as the in-place decode of T = 0 is a no-op
        o = torch.empty((n, 0) + tuple(v.shape[2:]), dtype=q.dtype, device=q.device)
        final = torch.zeros((total if packed else 0,) + tuple(pool.shape[1:]), dtype=torch.float32,
                            device=pool.device)  # the tokens after cu_seqlens[-1], if any: zero states
        return (_pad_tokens(o.flatten(0, 1).unsqueeze(0), total) if packed else o), final
    if indices.dim() == 2 and num_accepted_tokens is not None:
        accepted = num_accepted_tokens.to(torch.int64)
        read = indices.gather(1, (accepted - 1).clamp(min=0)[:, None])[:, 0].to(torch.int64)
    else:
        accepted = torch.ones(n, dtype=torch.int64)
        read = (indices if indices.dim() == 1 else indices[:, 0]).to(torch.int64)
    # Every row of `final` is written once: by the decode (valid rows' tokens), or zeroed here
    # (padding rows); the read states go in first, each into the row the decode reads.
    final = torch.empty((n, t) + tuple(pool.shape[1:]), dtype=torch.float32, device=pool.device)
    slots = torch.arange(n * t, dtype=torch.int64).reshape(n, t)  # token t of row n: row n T + t
    for row, (r, a) in enumerate(zip(read.tolist(), accepted.tolist())):
        if r < 0:  # padding row: o = 0, its rows of `final` zeroed
            final[row].zero_()
            slots[row] = -1
        else:
            final[row, a - 1].copy_(pool[r])
    final = final.flatten(0, 1)
    o = kda_decode(q, k, v, g, beta, final, slots, num_accepted_tokens=accepted, **gate)
    if packed:  # the tokens after cu_seqlens[-1]: o = 0 and a zero state
        o = _pad_tokens(o.flatten(0, 1).unsqueeze(0), total)
        final = _pad_tokens(final.unsqueeze(0), total)[0]
    return o, final


def kda_decode(q, k, v, g, beta, state_pool, ssm_state_indices, num_accepted_tokens=None, *, A_log=None,
               dt_bias=None, scale=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
               use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, state_v_first=False,
               cu_seqlens=None):
    """Decode against a state pool (libkda::decode, kda::decode): updates ``state_pool`` in place
    and returns o in q's layout (``[N, T, HV, V]``, or ``[1, total, HV, V]`` with ``cu_seqlens``).
    See ``fused_recurrent_kda_fwd`` for the index contract. Not differentiable."""
    _check_tensors(("ssm_state_indices", "num_accepted_tokens", "cu_seqlens"), q=q, k=k, v=v, g=g, beta=beta,
                   state_pool=state_pool, ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                   A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    packed = cu_seqlens is not None
    if packed:
        groups, total = _decode_groups(q, k, v, g, beta, cu_seqlens, state_pool.shape[0], ssm_state_indices,
                                       num_accepted_tokens, writes=True)
        if not groups:  # no sequence has tokens: the pool untouched, o = 0
            _check_pool(state_pool, q, v, g, state_v_first)
            return torch.zeros((1, total) + tuple(v.shape[2:]), dtype=q.dtype, device=q.device)
        if groups[0][3] is not None:  # several lengths: a call per group (their write slots are disjoint)
            opts = dict(A_log=A_log, dt_bias=dt_bias, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                        allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first)
            parts = [(kda_decode(*tokens, state_pool, idx, acc, **opts), pos) for tokens, idx, acc, pos in groups]
            return _scatter_tokens(parts, total, q.new_empty((1, 0) + tuple(v.shape[2:])))
        (q, k, v, g, beta), ssm_state_indices, num_accepted_tokens, _ = groups[0]
    if not use_gate_in_kernel:
        A_log = dt_bias = lower_bound = None
    A_log, dt_bias = _gate_params(q, v, A_log, dt_bias)
    flags = _flags(use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                   state_v_first)
    decode = (_decode_cpu if _eager_ok(q, k, v, g, beta, A_log, dt_bias, state_pool, ssm_state_indices,
                                       num_accepted_tokens) else _decode_op)
    o = decode(q, k, v, g, beta, A_log, dt_bias, state_pool, ssm_state_indices, num_accepted_tokens,
               _opt_float("scale", scale), lower_bound, flags)
    return _pad_tokens(o.flatten(0, 1).unsqueeze(0), total) if packed else o


# ---------------------------------------------------------------------------------------------
# Reference helpers with the signatures of FLA's fla/ops/kda/gate.py and fla/ops/kda/naive.py
# (what FLA's tests import). Plain torch, differentiable by autograd, slow: for tests, not for
# training. Computed in float32 (float64 stays float64); A_log has H elements (``[H]`` or
# ``[1, 1, H, 1]``), dt_bias H * K.
# ---------------------------------------------------------------------------------------------

def _gate_input(g, A_log, dt_bias):
    H, K = g.shape[-2:]
    ct = torch.promote_types(g.dtype, torch.float32)
    x = g.to(ct)
    if dt_bias is not None:
        x = x + dt_bias.to(ct).reshape(H, K)
    a = None if A_log is None else A_log.to(ct).reshape(H, 1).exp()
    return x, a


def fused_kda_gate(g, A_log=None, dt_bias=None, lower_bound=None, output_dtype=torch.float32, *older, g_bias=None,
                   b=None, beta=1.0, threshold=20.0, head_k_dim=None):
    """``fla.ops.kda.gate.fused_kda_gate``: the in-kernel gate of SPEC.md 1.3 on g ``[..., H, K]``:
    ``-exp(A_log) * softplus(g + dt_bias)``, or with ``lower_bound``
    ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``; ``A_log=None`` means a unit scale
    (A_log = 0). Returns ``[..., H, K]`` in ``output_dtype`` (float32).

    Also the older form that Kimi Linear's Hugging Face modeling code and vLLM call,
    ``fused_kda_gate(g [..., H * K], A_log, head_k_dim, g_bias=None, beta=1.0, threshold=20.0)``
    (an int third argument): ``-exp(A_log) * softplus(g + g_bias)`` with torch's softplus
    ``beta`` / ``threshold``, returned as float32 ``[..., H, K]``; and its variant with
    ``b=None`` [..., H] between ``g_bias`` and ``beta``, which returns ``(g_out, sigmoid(b))``
    (both float32) when ``b`` is given."""
    older_form = isinstance(dt_bias, numbers.Integral) and not isinstance(dt_bias, bool)
    if older_form or head_k_dim is not None:
        K = int(dt_bias) if older_form else int(head_k_dim)
        if isinstance(lower_bound, torch.Tensor):  # the older form's 4th positional: g_bias
            g_bias = lower_bound
        if output_dtype is None or isinstance(output_dtype, torch.Tensor):  # the 5th: b (that variant) ...
            b, rest = output_dtype, older
        elif not isinstance(output_dtype, torch.dtype):  # ... or beta
            rest = (output_dtype,) + older
        else:
            rest = older
        if len(rest) > 2:
            raise TypeError(f"fused_kda_gate: {len(rest) - 2} positional arguments too many after beta, threshold")
        beta, threshold = (tuple(rest) + (beta, threshold)[len(rest):])[:2]
        if g.shape[-1] % K:
            raise ValueError(f"fused_kda_gate: g's last dimension {g.shape[-1]} is not a multiple of head_k_dim {K}")
        x, a = _gate_input(g.unflatten(-1, (g.shape[-1] // K, K)), A_log, g_bias)
        y = torch.nn.functional.softplus(x, beta=float(beta), threshold=float(threshold))
        g_out = -(y if a is None else a * y).to(torch.float32)
        return g_out if b is None else (g_out, torch.sigmoid(b.float()))  # float32, as FLA's kernel writes it
    if older or b is not None:
        raise TypeError("fused_kda_gate: `b` and positional arguments after output_dtype belong to the older form "
                        "fused_kda_gate(g, A, head_k_dim, g_bias, b, beta, threshold) (an int head_k_dim third)")
    x, a = _gate_input(g, A_log, dt_bias)
    if lower_bound is None:
        y = torch.nn.functional.softplus(x)
        y = -(y if a is None else a * y)
    else:
        y = lower_bound * torch.sigmoid(x if a is None else a * x)
    return y.to(output_dtype)


def naive_kda_gate(g, A_log=None, dt_bias=None, output_dtype=torch.float32):
    """``fla.ops.kda.gate.naive_kda_gate``: ``-exp(A_log) * softplus(g + dt_bias)``."""
    return fused_kda_gate(g, A_log, dt_bias, None, output_dtype)


def naive_kda_lowerbound_gate(g, A_log=None, dt_bias=None, lower_bound=-5.0, output_dtype=torch.float32):
    """``fla.ops.kda.gate.naive_kda_lowerbound_gate``: ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``."""
    return fused_kda_gate(g, A_log, dt_bias, lower_bound, output_dtype)


def _naive_prep(q, k, v, g, beta, scale):
    H, HV = q.shape[2], v.shape[2]
    ct = torch.promote_types(v.dtype, torch.float32)
    q, k, v, g, beta = (x.to(ct) for x in (q, k, v, g, beta))
    q = q.repeat_interleave(HV // H, dim=2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    return q, k.repeat_interleave(HV // H, dim=2), v, g, beta


def naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """``fla.ops.kda.naive.naive_recurrent_kda``: SPEC.md section 1 token by token. q, k
    ``[B, T, H, K]``; v ``[B, T, HV, V]``; g (log decay) ``[B, T, HV, K]``; beta ``[B, T, HV]``;
    initial_state ``[B, HV, K, V]``. Returns ``(o in v's dtype, final state or None)``."""
    dtype = v.dtype
    q, k, v, g, beta = _naive_prep(q, k, v, g, beta, scale)
    B, T, HV, K = g.shape
    S = q.new_zeros(B, HV, K, v.shape[-1])
    if initial_state is not None:
        S = S + initial_state.to(S.dtype)
    o = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        r = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], r)
        o.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(o, 1) if T else v.new_zeros(v.shape)
    return o.to(dtype), (S if output_final_state else None)


def naive_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64):
    """``fla.ops.kda.naive.naive_chunk_kda``: the chunked algorithm of SPEC.md section 2 in plain
    torch (T need not be a multiple of chunk_size: the tail is padded with g = k = beta = 0, which
    leaves the state unchanged). Same arguments and results as ``naive_recurrent_kda``."""
    dtype, T, C = v.dtype, v.shape[1], chunk_size
    q, k, v, g, beta = _naive_prep(q, k, v, g, beta, scale)
    pad = (-T) % C
    if pad:
        q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, 0, 0, pad))
    B, Tp, HV, K = g.shape
    # [B, HV, NT, C, ...]
    q, k, v, g = (x.unflatten(1, (Tp // C, C)).permute(0, 3, 1, 2, 4) for x in (q, k, v, g))
    beta = beta.unflatten(1, (Tp // C, C)).permute(0, 3, 1, 2)
    G = g.cumsum(-2)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i only (masked before exp: every factor <= 1)
    D = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
    L = (beta[..., None] * torch.einsum("...id,...jd,...ijd->...ij", k, k, D)).tril(-1)
    Aqk = torch.einsum("...id,...jd,...ijd->...ij", q, k, D)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    M = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    U = M @ (beta[..., None] * v)
    W = M @ (beta[..., None] * k * G.exp())
    S = q.new_zeros(B, HV, K, v.shape[-1])
    if initial_state is not None:
        S = S + initial_state.to(S.dtype)
    o = []
    for n in range(Tp // C):
        Gn, Gl = G[:, :, n], G[:, :, n, -1:]
        Vn = U[:, :, n] - W[:, :, n] @ S
        o.append((q[:, :, n] * Gn.exp()) @ S + Aqk[:, :, n] @ Vn)
        S = Gl.transpose(-1, -2).exp() * S + (k[:, :, n] * (Gl - Gn).exp()).transpose(-1, -2) @ Vn
    o = torch.stack(o, 2).flatten(2, 3).transpose(1, 2)[:, :T] if o else v.new_zeros(B, T, HV, v.shape[-1])
    return o.to(dtype), (S if output_final_state else None)
