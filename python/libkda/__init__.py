"""libkda: Kimi Delta Attention (KDA) CPU kernels for numpy arrays.

Inputs use FLA's batch-first layouts (q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K];
beta [B, T, HV]) with any strides: views are passed to the library without a copy, so a
head-first tensor transposed to batch-first costs nothing. Dtypes: float32, float16 and
ml_dtypes.bfloat16. The semantics are those of SPEC.md section 1; all shape and option checks
are done by the C++ library, whose ValueError messages name the offending argument.

chunk_kda / naive_recurrent_kda are the forward (chunked kernel / fp64 oracle);
chunk_kda_fwd_bwd / naive_recurrent_kda_bwd run the forward and then its backward;
kda_inference is the forward without residuals, optionally reading its initial states from a
state pool; kda_decode advances sequences by a few tokens against a state pool, in place.

Framework ops (docs/PYTHON.md): libkda.torch (drop-in for fla.ops.kda), libkda.flash_kda
(FlashKDA's flash_kda.fwd / torch_kda, on torch) and libkda.jax (drop-in for Tokamax's
kimi_delta_attention) import torch / jax on demand; `import libkda` needs neither.
"""

from __future__ import annotations

import math
import ml_dtypes
import numpy as np

from . import _libkda

__all__ = [
    "chunk_kda",
    "naive_recurrent_kda",
    "chunk_kda_fwd_bwd",
    "naive_recurrent_kda_bwd",
    "kda_inference",
    "kda_decode",
    "cpu_target",
    "cpu_bf16_dot_products",
    "backends",
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
    """The CPU kernel target chosen at run time ("avx512", "avx2" or "generic"; KDA_CPU_TARGET forces one)."""
    return _libkda.cpu_target()


def cpu_bf16_dot_products() -> bool:
    """Whether bf16 inputs' state products run as bf16 dot products with fp32 accumulation where
    ``bf16_dot_products=True`` (the default) allows them: on the avx512 target of a CPU with
    AVX512_BF16 that issues them as fast as its fp32 FMAs (AMD Zen 4 / Zen 5). Intel's Xeons run
    them at half that rate, so there bf16 inputs are multiplied in fp32 (docs/ARCHITECTURE.md).
    KDA_BF16_DOT_PRODUCTS=auto|on|off overrides the rule."""
    return _libkda.cpu_bf16_dot_products()


def backends() -> list[str]:
    """The compute backends of this build: ["cpu", "cpu:<target>"] with the CPU kernel target
    chosen at run time (see cpu_target()). There is no CUDA backend yet. The framework
    integrations are the submodules libkda.torch (needs torch) and libkda.jax (needs jax); they
    are imported on demand, so `import libkda` needs neither."""
    return ["cpu", "cpu:" + _libkda.cpu_target()]


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


def _wrap_token_inputs(q, k, v, g, beta, A_log, dt_bias, fl):
    """The per-token tensors and gate parameters every entry takes, wrapped for the binding."""
    return dict(
        q=_wrap("q", q, _FLOAT_CODES, fl, optional=False),
        k=_wrap("k", k, _FLOAT_CODES, fl, optional=False),
        v=_wrap("v", v, _FLOAT_CODES, fl, optional=False),
        g=_wrap("g", g, _FLOAT_CODES, fl, optional=False),
        beta=_wrap("beta", beta, _FLOAT_CODES, fl, optional=False),
        A_log=_wrap("A_log", A_log, _FLOAT_CODES, fl),
        dt_bias=_wrap("dt_bias", dt_bias, _FLOAT_CODES, fl),
    )


def _dims(x, n):
    return isinstance(x, np.ndarray) and x.ndim == n


def _opt_float(name, x):
    """A float option, None when not given. NaN is refused: the kernels read NaN as "not given"
    (scale None = K^-0.5, lower_bound None = no lower bound), so a NaN must not pass for either."""
    if x is None:
        return None
    # A real number (Python, numpy or a 0-d tensor), not a string that float() would parse.
    if isinstance(x, (str, bytes)) or not hasattr(x, "__float__"):
        raise TypeError(f"kda: argument '{name}': expected a number or None, got {type(x).__name__} {x!r}")
    x = float(x)
    if math.isnan(x):
        raise ValueError(f"kda: argument '{name}': expected a number or None, got nan")
    return x


def _inputs(oracle, q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval,
            cu_seqlens, segment_ids, max_num_segments, state_v_first, chunk_size, path, num_threads,
            initial_state_indices=None, bf16_dot_products=True):
    """The forward's inputs and options as binding keyword arguments."""
    fl = _FLOAT_NAMES + (" (or float64 for the oracle)" if oracle else "")
    return dict(
        **_wrap_token_inputs(q, k, v, g, beta, A_log, dt_bias, fl),
        cu_seqlens=_wrap("cu_seqlens", cu_seqlens, _INT_CODES, "int32 or int64"),
        segment_ids=_wrap("segment_ids", segment_ids, _INT_CODES, "int32"),
        initial_state=_wrap("initial_state", initial_state, _FLOAT_CODES, fl),
        initial_state_indices=_wrap("initial_state_indices", initial_state_indices, _INT_CODES, "int32 or int64"),
        max_num_segments=0 if max_num_segments is None else int(max_num_segments),
        scale=_opt_float("scale", scale),
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        use_gate_in_kernel=bool(use_gate_in_kernel),
        lower_bound=_opt_float("lower_bound", lower_bound),
        use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid_in_kernel),
        allow_neg_eigval=bool(allow_neg_eigval),
        chunk_size=int(chunk_size),
        state_v_first=bool(state_v_first),
        path=str(path),
        num_threads=0 if num_threads is None else int(num_threads),
        bf16_dot_products=bool(bf16_dot_products),
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


def _chunk_states(args, o_arg, fs_arg, q, v, state_v_first, dtype):
    """A fresh chunk_states buffer [NC, HV, K, V] ([NC, HV, V, K] V-first); NC from the library,
    which validates the inputs first (so the shapes of q and v can be trusted)."""
    nc = _libkda.forward_chunk_count(**args, o=o_arg, final_state=fs_arg)
    HV, V, K = v.shape[2], v.shape[3], q.shape[3]
    inner = (HV, V, K) if state_v_first else (HV, K, V)
    return _alloc((nc,) + inner, dtype=dtype)


def _run(entry, oracle, q, k, v, g, beta, *, output_final_state, return_intermediate_states=False, **opts):
    """The forward: (o, final_state), or (o, final_state, h) with return_intermediate_states."""
    fl = _FLOAT_NAMES + (" (or float64 for the oracle)" if oracle else "")
    args = _inputs(oracle, q, k, v, g, beta, **opts)
    o, final_state = _forward_outputs(oracle, q, v, output_final_state, opts["cu_seqlens"],
                                      opts["segment_ids"], opts["max_num_segments"], opts["state_v_first"])
    o_arg = _wrap("o", o, _FLOAT_CODES, fl)
    fs_arg = _wrap("final_state", final_state, _FLOAT_CODES, fl)
    h = None
    if return_intermediate_states:
        h = _chunk_states(args, o_arg, fs_arg, q, v, opts["state_v_first"],
                          np.float64 if oracle else np.float32)
    entry(**args, o=o_arg, final_state=fs_arg, chunk_states=_wrap("chunk_states", h, _FLOAT_CODES, fl))
    return (o, final_state, h) if return_intermediate_states else (o, final_state)


_RESIDUALS = ("saved", "remat", "saved+v_new", "remat+v_new")


def _run_fwd_bwd(forward, backward, oracle, q, k, v, g, beta, do, dht, *, residuals, output_final_state,
                 **opts):
    """The forward (o, final_state) then the backward; see chunk_kda_fwd_bwd."""
    if not isinstance(residuals, str) or residuals not in _RESIDUALS:
        raise ValueError("kda: argument 'residuals': expected one of "
                         f"{', '.join(repr(r) for r in _RESIDUALS)}, got {residuals!r}")
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
    # With "+v_new" it also writes every token's delta (float32, o's shape), which the backward
    # reads instead of recomputing it.
    chunk_states = v_new = None
    if residuals.startswith("saved") and not oracle:
        chunk_states = _chunk_states(args, o_arg, fs_arg, q, v, opts["state_v_first"], np.float32)
    if residuals.endswith("+v_new") and not oracle:
        v_new = _alloc(o.shape, dtype=np.float32)
    cs_arg = _wrap("chunk_states", chunk_states, _FLOAT_CODES, "float32")
    vn_arg = _wrap("v_new", v_new, _FLOAT_CODES, "float32")
    forward(**args, o=o_arg, final_state=fs_arg, chunk_states=cs_arg, v_new=vn_arg)

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
    backward(**args, chunk_states=cs_arg, v_new=vn_arg,
             d_o=do_arg, d_final_state=dht_arg,
             **{name: _wrap(name, x, _FLOAT_CODES, fl) for name, x in grads.items()})
    return dict(o=o, final_state=final_state, **grads)


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
              lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
              cu_seqlens=None, segment_ids=None, max_num_segments=None, state_v_first=False,
              chunk_size=64, path="fused", num_threads=None, return_intermediate_states=False,
              bf16_dot_products=True):
    """The chunked KDA forward on the CPU. Returns (o, final_state), or (o, final_state, h)
    with return_intermediate_states=True.

    o has q's dtype and shape [B, T, HV, V]. final_state (float32) is returned only with
    output_final_state=True, else None; its shape is [B, HV, K, V] (fixed length),
    [N, HV, K, V] (cu_seqlens, N + 1 entries, from 0 to at most T: the tokens after
    cu_seqlens[-1] are padding, output and gradients 0) or [B, max_num_segments, HV, K, V]
    (segment_ids); state_v_first swaps the last two dims (also for initial_state).

    h (intermediate states, for prefix caching; SPEC.md section 3) is the state entering every
    chunk, float32 [NC, HV, K, V] ([NC, HV, V, K] with state_v_first). Chunks are numbered
    segment by segment -- fixed length: batch row by batch row; cu_seqlens: segment by segment;
    segment_ids: row-major over [B, max_num_segments] -- and, inside a segment, from its first
    token: the chunk grid restarts at every segment, so segment s of length L has
    ceil(L / chunk_size) chunks (none when empty) and its first one's entry is the segment's
    initial state (or zeros). Entry c of a segment is the state after its first c * chunk_size
    tokens. NC is the total over all segments (include/kda/ops.hpp, ForwardParams.chunk_states).

    scale None means K^-0.5; lower_bound None means no lower bound; path is "fused" or
    "staged"; chunk_size is 64, 32 or 16; num_threads None uses all cores.
    bf16_dot_products: with bf16 inputs on a CPU with AVX512_BF16, the fused path's state
    products run as bf16 dot products with fp32 accumulation (the default, as FLA's bf16 kernels
    do on tensor cores); False keeps them in fp32. No effect for fp32/fp16 inputs.
    Raises ValueError naming the offending argument.
    """
    return _run(_libkda.forward, False, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, return_intermediate_states=return_intermediate_states,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval, cu_seqlens=cu_seqlens, segment_ids=segment_ids,
                max_num_segments=max_num_segments, state_v_first=state_v_first, chunk_size=chunk_size,
                path=path, num_threads=num_threads, bf16_dot_products=bf16_dot_products)


def naive_recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                        lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                        cu_seqlens=None, segment_ids=None, max_num_segments=None, state_v_first=False,
                        chunk_size=64, path="fused", num_threads=None, return_intermediate_states=False):
    """The exact token-by-token recurrence in fp64 (the test oracle). Same arguments and
    results as chunk_kda (path is ignored; float64 inputs are accepted too); o, final_state and
    h are float64. chunk_size only sets the grid of h (any size >= 1 is accepted here)."""
    return _run(_libkda.reference_forward, True, q, k, v, g, beta, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                return_intermediate_states=return_intermediate_states,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                cu_seqlens=cu_seqlens, segment_ids=segment_ids, max_num_segments=max_num_segments,
                state_v_first=state_v_first, chunk_size=chunk_size, path=path, num_threads=num_threads)


def chunk_kda_fwd_bwd(q, k, v, g, beta, do, dht=None, *, scale=None, initial_state=None,
                      output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                      A_log=None, dt_bias=None, lower_bound=None, use_beta_sigmoid_in_kernel=False,
                      allow_neg_eigval=False, cu_seqlens=None, segment_ids=None, max_num_segments=None,
                      state_v_first=False, chunk_size=64, path="fused", num_threads=None, residuals="saved",
                      bf16_dot_products=True):
    """The chunked KDA forward and its backward on the CPU (SPEC.md section 2).

    do is the cotangent of o (o's shape [B, T, HV, V]; float32, bfloat16 or float16); dht,
    optional, that of the final state (the final-state shape, see chunk_kda; any float dtype,
    float64 too). The other arguments are chunk_kda's (bf16_dot_products applies to the
    backward's state products too).
    residuals: "saved" (the forward keeps the state entering every chunk, float32
    [NC, HV, K, V] or [NC, HV, V, K] with state_v_first, and the backward reuses it) or "remat"
    (nothing is kept; the backward recomputes the states); "saved+v_new" / "remat+v_new" also
    keep every token's delta v_new = beta (v - S~^T k) (float32, o's shape), which spares the
    backward one state-sized product per token (docs/PERF.md). All four give the same gradients,
    bit for bit.

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
                        chunk_size=chunk_size, path=path, num_threads=num_threads,
                        bf16_dot_products=bf16_dot_products)


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


def kda_inference(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                  lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                  cu_seqlens=None, segment_ids=None, max_num_segments=None, state_v_first=False,
                  chunk_size=64, path="fused", num_threads=None, initial_state_indices=None,
                  bf16_dot_products=True):
    """The inference forward (SPEC.md section 3): chunk_kda without residuals -- nothing is kept
    for a backward, so peak memory is the inputs, the outputs and per-thread scratch. Returns
    (o, final_state) exactly as chunk_kda does (bitwise the same values for the same inputs).

    initial_state_indices, optional [N] int32/int64 (fixed length: N = B; cu_seqlens: N
    segments; not with segment_ids): initial_state is then a state pool [slots, HV, K, V]
    ([slots, HV, V, K] with state_v_first; any float dtype) and sequence n starts from slot
    initial_state_indices[n] (negative: the zero state). The pool is read in place, never
    gathered or copied, and is not written. final_state, with output_final_state=True, is per
    sequence: float32 [N, HV, K, V] (V-first: [N, HV, V, K]); write it back into the pool with
    pool[indices] = final_state where wanted. bf16_dot_products: as in chunk_kda. Raises
    ValueError naming the offending argument.
    """
    return _run(_libkda.forward, False, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                initial_state_indices=initial_state_indices, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                cu_seqlens=cu_seqlens, segment_ids=segment_ids, max_num_segments=max_num_segments,
                state_v_first=state_v_first, chunk_size=chunk_size, path=path, num_threads=num_threads,
                bf16_dot_products=bf16_dot_products)


def _state_pool_arg(x):
    """The decode state pool as a binding argument: it is updated in place, so it must reach the
    library as the caller's own memory. Anything that would need a copy is an error."""
    name = "state_pool"
    pool_dtypes = "float32, bfloat16 or float16"
    if not isinstance(x, np.ndarray):
        raise ValueError(
            f"kda: argument '{name}': expected a writable numpy.ndarray of dtype {pool_dtypes}, "
            f"got {type(x).__module__}.{type(x).__qualname__}"
        )
    if x.dtype not in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)):
        raise ValueError(f"kda: argument '{name}': expected dtype {pool_dtypes}, got {_dtype_name(x.dtype)}")
    if not x.flags.writeable:
        raise ValueError(f"kda: argument '{name}': the array is read-only; the pool is updated in place")
    if any(s < 0 or s % x.itemsize for s in x.strides):
        raise ValueError(
            f"kda: argument '{name}': strides {x.strides} (bytes) are not non-negative multiples of the "
            f"element size; the pool is updated in place and cannot be passed through a copy"
        )
    code = _FLOAT_CODES[x.dtype]
    return (x.view(np.uint16) if code == "bf16" else x, code)  # a view: still the caller's memory


def kda_decode(q, k, v, g, beta, state_pool, slot_indices, *, num_accepted_tokens=None, scale=None,
               use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
               lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
               state_v_first=False, num_threads=None):
    """Decode against a state pool (SPEC.md section 3; include/kda/ops.hpp, DecodeParams): T
    tokens per sequence (1, or a few draft tokens), token by token, in fp32. Returns o
    [N, T, HV, V] in q's dtype.

    q, k [N, T, H, K]; v [N, T, HV, V]; g [N, T, HV, K]; beta [N, T, HV] (any strides; input
    transforms as in chunk_kda). state_pool: a writable float32 (or bfloat16 / float16) numpy
    array [slots, HV, K, V] ([slots, HV, V, K] with state_v_first), updated IN PLACE (never
    copied; a read-only or otherwise uncopyable-in-place array raises ValueError). A bfloat16 or
    float16 pool is read converted and written rounded to nearest (the state stays fp32 through a
    row's tokens). slot_indices, int32/int64:
      [N]    -- sequence n reads slot slot_indices[n] and writes its state after the last token
                back to it;
      [N, T] -- sequence n reads slot slot_indices[n, a - 1], a = num_accepted_tokens[n] (1 when
                not given), and writes the state after token t to slot_indices[n, t] (skipped
                when negative), so rejected draft tokens can be rolled back.
    A negative read slot makes row n padding: its o rows are 0 and the pool is not touched.
    [N, T'] with T' > T uses the first T columns (every column range-checked).
    num_accepted_tokens [N] int32/int64, values in [1, T], only with [N, T] indices.
    Errors (ValueError with the library's message, nothing written to the pool): a slot index
    >= slots, two rows writing the same slot, num_accepted_tokens out of range, bad shapes.
    """
    fl = _FLOAT_NAMES
    ints = "int32 or int64"
    args = dict(
        **_wrap_token_inputs(q, k, v, g, beta, A_log, dt_bias, fl),
        slot_indices=_wrap("slot_indices", slot_indices, _INT_CODES, ints, optional=False),
        num_accepted_tokens=_wrap("num_accepted_tokens", num_accepted_tokens, _INT_CODES, ints),
        scale=_opt_float("scale", scale),
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        use_gate_in_kernel=bool(use_gate_in_kernel),
        lower_bound=_opt_float("lower_bound", lower_bound),
        use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid_in_kernel),
        allow_neg_eigval=bool(allow_neg_eigval),
        state_v_first=bool(state_v_first),
        num_threads=0 if num_threads is None else int(num_threads),
    )
    pool = _state_pool_arg(state_pool)
    if _dims(q, 4) and _dims(v, 4):
        o = _alloc((q.shape[0], q.shape[1], v.shape[2], v.shape[3]), dtype=q.dtype)
    else:  # malformed: the library reports the bad input
        o = _alloc((0,), dtype=q.dtype)
    _libkda.decode(**args, state_pool=pool, o=_wrap("o", o, _FLOAT_CODES, fl))
    return o
