"""libkda: Kimi Delta Attention (KDA) CPU kernels for numpy arrays.

Inputs use FLA's batch-first layouts (q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K];
beta [B, T, HV]) with any strides: views are passed to the library without a copy, so a
head-first tensor transposed to batch-first costs nothing. Dtypes: float32, float16 and
ml_dtypes.bfloat16. The semantics are those of SPEC.md section 1; all shape and option checks
are done by the C++ library, whose ValueError messages name the offending argument.

chunk_kda / naive_recurrent_kda are the forward (chunked kernel / fp64 oracle);
chunk_kda_fwd_bwd / naive_recurrent_kda_bwd run the forward and then its backward.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from . import _libkda

__all__ = [
    "chunk_kda",
    "naive_recurrent_kda",
    "chunk_kda_fwd_bwd",
    "naive_recurrent_kda_bwd",
    "cpu_target",
    "memory_stats",
    "reset_peak_memory",
    "__version__",
]

__version__ = _libkda.version()

_FLOAT_CODES = {
    np.dtype(np.float32): "f32",
    np.dtype(np.float16): "f16",
    np.dtype(ml_dtypes.bfloat16): "bf16",
    np.dtype(np.float64): "f64",
}
_INT_CODES = {np.dtype(np.int32): "i32", np.dtype(np.int64): "i64"}
_FLOAT_NAMES = "float32, float16 or bfloat16"

# Output allocator; tests may replace it (e.g. to poison fresh outputs with NaN).
_alloc = np.empty


def cpu_target() -> str:
    """The CPU kernel target chosen at run time ("avx512" or "generic")."""
    return _libkda.cpu_target()


def memory_stats() -> tuple[int, int]:
    """(current_bytes, peak_bytes) of the library's accounting allocator."""
    return tuple(_libkda.memory_stats())


def reset_peak_memory() -> None:
    """Sets the peak to the current usage, so the next peak is measured from here."""
    _libkda.reset_peak_memory()


def _dtype_name(dt: np.dtype) -> str:
    return "bfloat16" if dt == np.dtype(ml_dtypes.bfloat16) else str(dt)


def _wrap(name, x, codes, expected, optional=True):
    """(array view, dtype code) for the binding, or None. Never copies unless the strides
    cannot be expressed in whole, non-negative elements."""
    if x is None:
        if optional:
            return None
        raise ValueError(f"kda: argument '{name}' is required but was not given")
    if not isinstance(x, np.ndarray):
        raise ValueError(
            f"kda: argument '{name}': expected a numpy.ndarray of dtype {expected}, "
            f"got {type(x).__module__}.{type(x).__qualname__}"
        )
    code = codes.get(x.dtype)
    if code is None:
        raise ValueError(f"kda: argument '{name}': expected dtype {expected}, got {_dtype_name(x.dtype)}")
    if any(s < 0 or s % x.itemsize for s in x.strides):
        x = np.ascontiguousarray(x)
    if code == "bf16":
        x = x.view(np.uint16)  # numpy has no DLPack code for bfloat16
    return (x, code)


def _dims(x, n):
    return isinstance(x, np.ndarray) and x.ndim == n


def _inputs(oracle, q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval,
            cu_seqlens, segment_ids, max_num_segments, state_v_first, chunk_size, path, num_threads):
    """The forward's inputs and options as binding keyword arguments."""
    fl = _FLOAT_NAMES + (" (or float64 for the oracle)" if oracle else "")
    return dict(
        q=_wrap("q", q, _FLOAT_CODES, fl, optional=False),
        k=_wrap("k", k, _FLOAT_CODES, fl, optional=False),
        v=_wrap("v", v, _FLOAT_CODES, fl, optional=False),
        g=_wrap("g", g, _FLOAT_CODES, fl, optional=False),
        beta=_wrap("beta", beta, _FLOAT_CODES, fl, optional=False),
        A_log=_wrap("A_log", A_log, _FLOAT_CODES, fl),
        dt_bias=_wrap("dt_bias", dt_bias, _FLOAT_CODES, fl),
        cu_seqlens=_wrap("cu_seqlens", cu_seqlens, _INT_CODES, "int32 or int64"),
        segment_ids=_wrap("segment_ids", segment_ids, _INT_CODES, "int32"),
        initial_state=_wrap("initial_state", initial_state, _FLOAT_CODES, fl),
        max_num_segments=0 if max_num_segments is None else int(max_num_segments),
        scale=None if scale is None else float(scale),
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        use_gate_in_kernel=bool(use_gate_in_kernel),
        lower_bound=None if lower_bound is None else float(lower_bound),
        use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid_in_kernel),
        allow_neg_eigval=bool(allow_neg_eigval),
        chunk_size=int(chunk_size),
        state_v_first=bool(state_v_first),
        path=str(path),
        num_threads=0 if num_threads is None else int(num_threads),
    )


def _forward_outputs(oracle, q, v, output_final_state, cu_seqlens, segment_ids, max_num_segments,
                     state_v_first):
    """Fresh o and (optionally) final_state. Shapes follow from q and v (SPEC.md 1.1, 1.2); when
    those are malformed a placeholder is passed and the library reports the bad input first."""
    shapes_ok = _dims(q, 4) and _dims(v, 4)
    o_dtype = np.dtype(np.float64) if oracle else q.dtype
    if shapes_ok:
        B, T, _, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        o = _alloc((B, T, HV, V), dtype=o_dtype)
    else:
        o = _alloc((0,), dtype=o_dtype)

    final_state = None
    if output_final_state:
        state_dtype = np.float64 if oracle else np.float32
        shape = None
        if shapes_ok:
            inner = (HV, V, K) if state_v_first else (HV, K, V)
            if cu_seqlens is not None:
                if _dims(cu_seqlens, 1) and cu_seqlens.shape[0] >= 1:
                    shape = (cu_seqlens.shape[0] - 1,) + inner
            elif segment_ids is not None:
                if max_num_segments is not None and max_num_segments >= 1:
                    shape = (B, int(max_num_segments)) + inner
            else:
                shape = (B,) + inner
        final_state = _alloc(shape if shape is not None else (0,), dtype=state_dtype)
    return o, final_state


def _run(entry, oracle, q, k, v, g, beta, *, output_final_state, **opts):
    """The forward: (o, final_state)."""
    fl = _FLOAT_NAMES + (" (or float64 for the oracle)" if oracle else "")
    args = _inputs(oracle, q, k, v, g, beta, **opts)
    o, final_state = _forward_outputs(oracle, q, v, output_final_state, opts["cu_seqlens"],
                                      opts["segment_ids"], opts["max_num_segments"], opts["state_v_first"])
    entry(**args, o=_wrap("o", o, _FLOAT_CODES, fl), final_state=_wrap("final_state", final_state, _FLOAT_CODES, fl))
    return o, final_state


_RESIDUALS = ("saved", "remat")


def _run_fwd_bwd(forward, backward, oracle, q, k, v, g, beta, do, dht, *, residuals, output_final_state,
                 **opts):
    """The forward (o, final_state) then the backward; see chunk_kda_fwd_bwd."""
    if not isinstance(residuals, str) or residuals not in _RESIDUALS:
        raise ValueError(f"kda: argument 'residuals': expected 'saved' or 'remat', got {residuals!r}")
    fl = _FLOAT_NAMES + (" (or float64 for the oracle)" if oracle else "")
    args = _inputs(oracle, q, k, v, g, beta, **opts)
    do_arg = _wrap("do", do, _FLOAT_CODES, fl, optional=False)
    dht_arg = _wrap("dht", dht, _FLOAT_CODES, _FLOAT_NAMES + " or float64")
    o, final_state = _forward_outputs(oracle, q, v, output_final_state or dht is not None,
                                      opts["cu_seqlens"], opts["segment_ids"], opts["max_num_segments"],
                                      opts["state_v_first"])
    o_arg = _wrap("o", o, _FLOAT_CODES, fl)
    fs_arg = _wrap("final_state", final_state, _FLOAT_CODES, fl)

    # Saved-state policy (SPEC.md section 3): the forward writes the state entering every chunk
    # and the backward reads it. The token-by-token oracle has no chunks: it ignores the policy.
    chunk_states = None
    if residuals == "saved" and not oracle:
        nc = _libkda.forward_chunk_count(**args, o=o_arg, final_state=fs_arg)
        HV, V, K = v.shape[2], v.shape[3], q.shape[3]
        inner = (HV, V, K) if opts["state_v_first"] else (HV, K, V)
        chunk_states = _alloc((nc,) + inner, dtype=np.float32)
    cs_arg = _wrap("chunk_states", chunk_states, _FLOAT_CODES, "float32")
    forward(**args, o=o_arg, final_state=fs_arg, chunk_states=cs_arg)

    # The forward validated the inputs, so their shapes can be trusted from here on.
    def grad(x, dtype=None):  # a fresh gradient buffer shaped like input x, or None
        if x is None:
            return None
        return _alloc(x.shape, dtype=np.float64 if oracle else (x.dtype if dtype is None else dtype))

    use_gate = bool(opts["use_gate_in_kernel"])
    grads = dict(
        dq=grad(q), dk=grad(k), dv=grad(v), dg=grad(g), dbeta=grad(beta),
        dh0=grad(opts["initial_state"], np.float32),
        dA_log=grad(opts["A_log"] if use_gate else None, np.float32),
        ddt_bias=grad(opts["dt_bias"] if use_gate else None, np.float32),
    )
    backward(**args, chunk_states=cs_arg,
             d_o=do_arg, d_final_state=dht_arg,
             **{name: _wrap(name, x, _FLOAT_CODES, fl) for name, x in grads.items()})
    return dict(o=o, final_state=final_state, **grads)


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
              lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
              cu_seqlens=None, segment_ids=None, max_num_segments=None, state_v_first=False,
              chunk_size=64, path="fused", num_threads=None):
    """The chunked KDA forward on the CPU. Returns (o, final_state).

    o has q's dtype and shape [B, T, HV, V]. final_state (float32) is returned only with
    output_final_state=True, else None; its shape is [B, HV, K, V] (fixed length),
    [N, HV, K, V] (cu_seqlens, N + 1 entries) or [B, max_num_segments, HV, K, V]
    (segment_ids); state_v_first swaps the last two dims (also for initial_state).

    scale None means K^-0.5; lower_bound None means no lower bound; path is "fused" or
    "staged"; chunk_size is 64, 32 or 16; num_threads None uses all cores.
    Raises ValueError naming the offending argument.
    """
    return _run(_libkda.forward, False, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval, cu_seqlens=cu_seqlens, segment_ids=segment_ids,
                max_num_segments=max_num_segments, state_v_first=state_v_first, chunk_size=chunk_size,
                path=path, num_threads=num_threads)


def naive_recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                        lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                        cu_seqlens=None, segment_ids=None, max_num_segments=None, state_v_first=False,
                        chunk_size=64, path="fused", num_threads=None):
    """The exact token-by-token recurrence in fp64 (the test oracle). Same arguments as
    chunk_kda (chunk_size and path are ignored; float64 inputs are accepted too); o and
    final_state are float64."""
    return _run(_libkda.reference_forward, True, q, k, v, g, beta, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                cu_seqlens=cu_seqlens, segment_ids=segment_ids, max_num_segments=max_num_segments,
                state_v_first=state_v_first, chunk_size=chunk_size, path=path, num_threads=num_threads)


def chunk_kda_fwd_bwd(q, k, v, g, beta, do, dht=None, *, scale=None, initial_state=None,
                      output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                      A_log=None, dt_bias=None, lower_bound=None, use_beta_sigmoid_in_kernel=False,
                      allow_neg_eigval=False, cu_seqlens=None, segment_ids=None, max_num_segments=None,
                      state_v_first=False, chunk_size=64, path="fused", num_threads=None, residuals="saved"):
    """The chunked KDA forward and its backward on the CPU (SPEC.md section 2).

    do is the cotangent of o (o's shape [B, T, HV, V]; float32, bfloat16 or float16); dht,
    optional, that of the final state (the final-state shape, see chunk_kda; any float dtype,
    float64 too). The other arguments are chunk_kda's.
    residuals: "saved" (the forward keeps the state entering every chunk, float32
    [NC, HV, K, V] or [NC, HV, V, K] with state_v_first, and the backward reuses it) or "remat"
    (nothing is kept; the backward recomputes the states). Both give the same gradients.

    Returns a dict: o, final_state (None unless output_final_state or dht is given), and the
    gradients dq, dk, dv, dg, dbeta in the dtype of q, k, v, g, beta (dg and dbeta with respect
    to the arguments as given: the raw gate / beta logits when transformed in the kernel; dq and
    dk summed over value-head groups); dh0 (float32, initial_state's shape; None without
    initial_state); dA_log (float32 [HV]; None without A_log) and ddt_bias (float32, dt_bias's
    shape; None without dt_bias). Raises ValueError naming the offending argument (the
    library calls do 'd_o' and dht 'd_final_state').
    """
    return _run_fwd_bwd(_libkda.forward, _libkda.backward, False, q, k, v, g, beta, do, dht,
                        residuals=residuals, scale=scale, initial_state=initial_state,
                        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                        lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                        allow_neg_eigval=allow_neg_eigval, cu_seqlens=cu_seqlens, segment_ids=segment_ids,
                        max_num_segments=max_num_segments, state_v_first=state_v_first,
                        chunk_size=chunk_size, path=path, num_threads=num_threads)


def naive_recurrent_kda_bwd(q, k, v, g, beta, do, dht=None, *, scale=None, initial_state=None,
                            output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                            A_log=None, dt_bias=None, lower_bound=None, use_beta_sigmoid_in_kernel=False,
                            allow_neg_eigval=False, cu_seqlens=None, segment_ids=None, max_num_segments=None,
                            state_v_first=False, chunk_size=64, path="fused", num_threads=None,
                            residuals="saved"):
    """The exact adjoint of the token-by-token recurrence in fp64 (the backward oracle).
    Same arguments and result as chunk_kda_fwd_bwd, with every entry float64 (float64 inputs
    are accepted too); the forward part is naive_recurrent_kda's. residuals is validated but
    has no effect (the oracle keeps fp64 checkpoints of its own); chunk_size and path are
    ignored."""
    return _run_fwd_bwd(_libkda.reference_forward, _libkda.reference_backward, True, q, k, v, g, beta, do,
                        dht, residuals=residuals, scale=scale, initial_state=initial_state,
                        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                        lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                        allow_neg_eigval=allow_neg_eigval, cu_seqlens=cu_seqlens, segment_ids=segment_ids,
                        max_num_segments=max_num_segments, state_v_first=state_v_first,
                        chunk_size=chunk_size, path=path, num_threads=num_threads)
