"""libkda: Kimi Delta Attention (KDA) CPU kernels for numpy arrays.

Inputs use FLA's batch-first layouts (q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K];
beta [B, T, HV]) with any strides: views are passed to the library without a copy, so a
head-first tensor transposed to batch-first costs nothing. Dtypes: float32, float16 and
ml_dtypes.bfloat16. The semantics are those of SPEC.md section 1; all shape and option checks
are done by the C++ library, whose ValueError messages name the offending argument.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from . import _libkda

__all__ = [
    "chunk_kda",
    "naive_recurrent_kda",
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


def _run(entry, oracle, q, k, v, g, beta, *, scale, initial_state, output_final_state,
         use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound,
         use_beta_sigmoid_in_kernel, allow_neg_eigval, cu_seqlens, segment_ids, max_num_segments,
         state_v_first, chunk_size, path, num_threads):
    fl = _FLOAT_NAMES + (" (or float64 for the oracle)" if oracle else "")
    args = dict(
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
    )

    # Outputs. Shapes follow from q and v (SPEC.md 1.1, 1.2); when those are malformed a
    # placeholder is passed and the library reports the bad input first.
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

    o_arg = _wrap("o", o, _FLOAT_CODES, fl)
    fs_arg = _wrap("final_state", final_state, _FLOAT_CODES, fl)

    entry(
        **args,
        max_num_segments=0 if max_num_segments is None else int(max_num_segments),
        o=o_arg,
        final_state=fs_arg,
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
    return o, final_state


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
