"""libkda.jax: libkda's KDA kernels as JAX ops, a drop-in for Tokamax's ``kimi_delta_attention``.

``kimi_delta_attention`` takes Tokamax's head-first contract (query / key ``[H, B, T, K]``, value
``[HV, B, T, V]``, gate ``[HV, B, T, K]``, beta ``[HV, B, T]``, states ``[B, N, HV, K, V]``,
``segment_ids [B, T]`` 1-indexed with 0 = padding) and runs libkda's CPU kernels through XLA FFI
custom calls (``jax.ffi.ffi_call``; the handlers are python/src/jax_ffi.cpp). The head-first
buffers are read in place through strides, never transposed. Differentiation is a
``jax.custom_vjp`` whose backward is libkda's C++ backward. Works under ``jit``, ``grad`` and
``vmap``: the custom calls use ``vmap_method="expand_dims"`` -- under ``vmap`` mapped operands
carry the mapped axes in front and unmapped ones size-1 axes there (broadcast in the handler,
never copied); the handler loops over the mapped index, one library call each (docs/PYTHON.md). float64 inputs (with ``jax_enable_x64``) run the fp64 oracle.

Only the CPU platform is registered (there is no CUDA backend yet).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _libkda

__all__ = ["kimi_delta_attention"]

if not hasattr(_libkda, "jax_ffi_targets"):
    raise ImportError(
        "libkda.jax: this libkda build has no XLA FFI handlers -- it was built without the XLA FFI "
        "headers (jaxlib's jax.ffi.include_dir()). Reinstall libkda with jax installed in the build "
        "environment (pip install jax; pip install --no-build-isolation .)."
    )

for _name, _capsule in _libkda.jax_ffi_targets().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

# Bits shared with python/src/jax_ffi.cpp.
_HAS_A_LOG, _HAS_DT_BIAS, _HAS_SEGMENT_IDS, _HAS_INITIAL_STATE = 1, 2, 4, 8
_HAS_CHUNK_STATES, _HAS_D_FINAL_STATE, _WANT_DH0, _WANT_DA_LOG, _WANT_DDT_BIAS = 16, 32, 64, 128, 256
_WANT_FINAL_STATE = 512
_L2NORM, _GATE, _BETA_SIGMOID, _NEG_EIGVAL = 1, 2, 4, 8


class _Config(NamedTuple):
    """The static (hashable) options of one call."""

    scale: float | None  # None: K^-0.5
    lower_bound: float | None  # None: no lower bound
    flags: int
    chunk_size: int
    num_states: int  # N of the state shape [B, N, HV, K, V]
    segmented: bool
    output_final_state: bool
    save_states: bool


def _present(a_log, dt_bias, initial_state, segment_ids):
    return ((_HAS_A_LOG if a_log is not None else 0) | (_HAS_DT_BIAS if dt_bias is not None else 0)
            | (_HAS_SEGMENT_IDS if segment_ids is not None else 0)
            | (_HAS_INITIAL_STATE if initial_state is not None else 0))


def _operands(q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids):
    return [x for x in (q, k, v, g, beta, a_log, dt_bias, segment_ids, initial_state) if x is not None]


def _attrs(cfg: _Config, present: int, oracle: bool):
    return dict(
        scale=np.float32(np.nan if cfg.scale is None else cfg.scale),
        lower_bound=np.float32(np.nan if cfg.lower_bound is None else cfg.lower_bound),
        flags=np.int64(cfg.flags),
        chunk_size=np.int64(cfg.chunk_size),
        max_num_segments=np.int64(cfg.num_states if cfg.segmented else 0),
        present=np.int64(present),
        oracle=np.int64(1 if oracle else 0),
    )


def _chunk_capacity(B, T, cfg: _Config):
    """Upper bound of NC (shapes only): per row ceil(T / C), plus N - 1 partial chunks with
    segments. The handler uses the first NC entries."""
    nt = -(-T // cfg.chunk_size)
    return B * (nt + (cfg.num_states - 1 if cfg.segmented else 0))


def _forward(q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids, cfg: _Config):
    H, B, T, K = q.shape
    HV, V = v.shape[0], v.shape[3]
    oracle = q.dtype == jnp.float64
    sdt = jnp.float64 if oracle else jnp.float32
    present = _present(a_log, dt_bias, initial_state, segment_ids)
    out_types = [jax.ShapeDtypeStruct((HV, B, T, V), q.dtype)]
    if cfg.output_final_state:
        present |= _WANT_FINAL_STATE
        out_types.append(jax.ShapeDtypeStruct((B, cfg.num_states, HV, K, V), sdt))
    if cfg.save_states:
        present |= _HAS_CHUNK_STATES
        out_types.append(jax.ShapeDtypeStruct((_chunk_capacity(B, T, cfg), HV, K, V), sdt))
    outs = jax.ffi.ffi_call("libkda_kda_forward", out_types, vmap_method="expand_dims")(
        *_operands(q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids), **_attrs(cfg, present, oracle))
    o = outs[0]
    final_state = outs[1] if cfg.output_final_state else None
    chunk_states = outs[-1] if cfg.save_states else None
    return o, final_state, chunk_states


def _backward(q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids, chunk_states, do, dht, cfg: _Config):
    H, B, T, K = q.shape
    oracle = q.dtype == jnp.float64
    f32 = jnp.float64 if oracle else jnp.float32
    present = _present(a_log, dt_bias, initial_state, segment_ids)
    operands = _operands(q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids)
    if chunk_states is not None:
        present |= _HAS_CHUNK_STATES
        operands.append(chunk_states)
    operands.append(do)
    if dht is not None:
        present |= _HAS_D_FINAL_STATE
        operands.append(dht)

    def like(x):
        return jax.ShapeDtypeStruct(x.shape, jnp.float64 if oracle else x.dtype)

    out_types = [like(q), like(k), like(v), like(g), like(beta)]
    gate = bool(cfg.flags & _GATE)
    if initial_state is not None:
        present |= _WANT_DH0
        out_types.append(jax.ShapeDtypeStruct(initial_state.shape, f32))
    if gate and a_log is not None:
        present |= _WANT_DA_LOG
        out_types.append(jax.ShapeDtypeStruct(a_log.shape, f32))
    if gate and dt_bias is not None:
        present |= _WANT_DDT_BIAS
        out_types.append(jax.ShapeDtypeStruct(dt_bias.shape, f32))
    outs = list(jax.ffi.ffi_call("libkda_kda_backward", out_types, vmap_method="expand_dims")(
        *operands, **_attrs(cfg, present, oracle)))
    dq, dk, dv, dg, dbeta = outs[:5]
    rest = outs[5:]
    dh0 = rest.pop(0) if initial_state is not None else None
    da = rest.pop(0) if (gate and a_log is not None) else None
    ddt = rest.pop(0) if (gate and dt_bias is not None) else None
    return dq, dk, dv, dg, dbeta, da, ddt, dh0


def _cast(x, like):
    if x is None:
        return None
    return x.astype(like.dtype) if x.dtype != like.dtype else x


def _zeros_like(x):
    return None if x is None else jnp.zeros_like(x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _kda(q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids, cfg):
    o, final_state, _ = _forward(q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids, cfg)
    return o, final_state


def _kda_fwd(q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids, cfg):
    o, final_state, chunk_states = _forward(q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids, cfg)
    residuals = (q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids, chunk_states)
    return (o, final_state), residuals


def _kda_bwd(cfg, residuals, cotangents):
    q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids, chunk_states = residuals
    do, dht = cotangents
    if not cfg.output_final_state:
        dht = None
    dq, dk, dv, dg, dbeta, da, ddt, dh0 = _backward(q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids,
                                                    chunk_states, do, dht, cfg)
    gate = bool(cfg.flags & _GATE)
    return (
        _cast(dq, q), _cast(dk, k), _cast(dv, v), _cast(dg, g), _cast(dbeta, beta),
        _cast(da, a_log) if gate else _zeros_like(a_log),
        _cast(ddt, dt_bias) if gate else _zeros_like(dt_bias),
        _cast(dh0, initial_state),
        None,  # segment_ids: integer, no cotangent
    )


_kda.defvjp(_kda_fwd, _kda_bwd)


def kimi_delta_attention(
    query,
    key,
    value,
    gate,
    beta,
    *,
    a_log=None,
    delta_time_bias=None,
    scale: float | None = None,
    initial_state=None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    use_gate_in_kernel: bool = False,
    segment_ids=None,
    lower_bound: float | None = None,
    context_parallel_metadata=None,
    max_num_segments: int | None = None,
    chunk_size: int = 64,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    rematerialize_for_backward: bool = False,
    implementation=None,
):
    """Tokamax's ``kimi_delta_attention`` (head-first) on libkda's CPU kernels.

    Args (Tokamax's names and layouts):
      query, key: ``[H, B, T, K]``. value: ``[HV, B, T, V]`` (HV % H == 0; Tokamax has HV = H).
      gate: ``[HV, B, T, K]``, the log decay, or the raw gate with ``use_gate_in_kernel``.
      beta: ``[HV, B, T]`` (logits with ``use_beta_sigmoid_in_kernel``, a libkda extension).
      a_log: ``[HV]``; delta_time_bias: ``[HV * K]`` -- the in-kernel gate
        ``-exp(a_log) * softplus(gate + delta_time_bias)``, or with ``lower_bound`` (< 0)
        ``lower_bound * sigmoid(exp(a_log) * (gate + delta_time_bias))`` (SPEC.md 1.3).
      scale: query scale, default ``K ** -0.5``.
      initial_state: ``[B, N, HV, K, V]`` (any float dtype); N = 1 without segment_ids.
      output_final_state: also return the final state, float32 ``[B, N, HV, K, V]``.
      use_qk_l2norm: L2-normalize query and key per token inside the kernel.
      segment_ids: ``[B, T]`` int, 1-indexed runs 1, 2, 3, ... with 0 = padding at the tail.
      max_num_segments: N with segment_ids (inferred from initial_state when omitted).
      chunk_size: 64, 32 or 16.
      rematerialize_for_backward: False (default) saves the state entering every chunk for the
        backward; True saves nothing and recomputes the states in the backward.
      context_parallel_metadata: must be None (no context parallelism). implementation: ignored.

    Returns ``(output [HV, B, T, V] in query's dtype, final_state or None)``.
    """
    if context_parallel_metadata is not None:
        raise NotImplementedError("libkda.jax.kimi_delta_attention: context parallelism is not supported")
    del implementation
    if query.ndim != 4 or value.ndim != 4:
        raise ValueError(
            f"kda: query must be [H, B, T, K] and value [HV, B, T, V]; got {query.shape} and {value.shape}")
    H, B, T, K = query.shape
    HV, V = value.shape[0], value.shape[3]
    expected = dict(key=(H, B, T, K), value=(HV, B, T, V), gate=(HV, B, T, K), beta=(HV, B, T))
    for name, arr in (("key", key), ("value", value), ("gate", gate), ("beta", beta)):
        if tuple(arr.shape) != expected[name] or (name == "value" and (HV < H or HV % H)):
            raise ValueError(
                f"kda: argument '{name}': expected shape {list(expected[name])} (head-first; query is "
                f"[H, B, T, K] = {list(query.shape)}, value [HV, B, T, V] with HV a multiple of H), "
                f"got {list(arr.shape)}")
    if initial_state is not None:
        if initial_state.ndim != 5:
            raise ValueError(f"kda: initial_state must be [B, N, HV, K, V], got {initial_state.shape}")
        state_count = initial_state.shape[1]
        if max_num_segments is None:
            max_num_segments = state_count
        elif max_num_segments != state_count:
            raise ValueError(
                "`max_num_segments` must match the `initial_state` segment dimension; got "
                f"max_num_segments={max_num_segments}, num_segments={state_count}.")
    if max_num_segments is not None and max_num_segments <= 0:
        raise ValueError(f"`max_num_segments` must be positive, got {max_num_segments}.")
    if segment_ids is None:
        if max_num_segments not in (None, 1):
            raise ValueError(
                f"without segment_ids there is one state per batch row (N = 1), got N = {max_num_segments}")
        num_states = 1
    else:
        if max_num_segments is None:
            raise ValueError("`max_num_segments` is required when `segment_ids` is provided without `initial_state`.")
        num_states = int(max_num_segments)
        segment_ids = jnp.asarray(segment_ids)
        if segment_ids.dtype != jnp.int32:
            segment_ids = segment_ids.astype(jnp.int32)
    if use_gate_in_kernel:
        if a_log is None and lower_bound is None:
            raise ValueError("`a_log` must be provided when `use_gate_in_kernel=True` (or set `lower_bound`).")
    else:
        a_log = delta_time_bias = lower_bound = None
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"`chunk_size` must be 64, 32 or 16, got {chunk_size}.")
    flags = ((_L2NORM if use_qk_l2norm else 0) | (_GATE if use_gate_in_kernel else 0)
             | (_BETA_SIGMOID if use_beta_sigmoid_in_kernel else 0) | (_NEG_EIGVAL if allow_neg_eigval else 0))
    oracle = jax.dtypes.canonicalize_dtype(query.dtype) == jnp.float64
    cfg = _Config(
        scale=None if scale is None else float(scale),
        lower_bound=None if lower_bound is None else float(lower_bound),
        flags=flags,
        chunk_size=int(chunk_size),
        num_states=num_states,
        segmented=segment_ids is not None,
        output_final_state=bool(output_final_state),
        save_states=not rematerialize_for_backward and not oracle,
    )
    return _kda(query, key, value, gate, beta, a_log, delta_time_bias, initial_state, segment_ids, cfg)
