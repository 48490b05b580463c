"""libkda.jax: libkda's KDA kernels as JAX ops, a drop-in for Tokamax's ``kimi_delta_attention``.

``kimi_delta_attention`` takes Tokamax's head-first contract (query / key ``[H, B, T, K]``, value
``[HV, B, T, V]``, gate ``[HV, B, T, K]``, beta ``[HV, B, T]``, states ``[B, N, HV, K, V]``,
``segment_ids [B, T]`` 1-indexed with 0 = padding) and runs libkda's CPU kernels through XLA FFI
custom calls (``jax.ffi.ffi_call``; the handlers are python/src/jax_ffi.cpp). Tokamax's batch-first
``tokamax/_src/ops/kda/api.py`` contract (q ``[B, T, H, K]``, state ``[B, H, K, V]``) is
``libkda.jax.kda.kimi_delta_attention`` (also ``kimi_delta_attention_batch_first``). The head-first
buffers are read in place through strides, never transposed. Differentiation is a
``jax.custom_vjp`` whose backward is libkda's C++ backward. Works under ``jit``, ``grad`` and
``vmap``: the custom calls use ``vmap_method="expand_dims"`` -- under ``vmap`` mapped operands
carry the mapped axes in front and unmapped ones size-1 axes there (broadcast in the handler,
never copied); the handler loops over the mapped index, one library call each (docs/PYTHON.md). float64 inputs (with ``jax_enable_x64``) run the fp64 oracle.

Only the CPU platform is registered (there is no CUDA backend yet).
"""

from __future__ import annotations

import functools
import sys
import types
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _libkda, _opt_float

__all__ = ["kimi_delta_attention", "kimi_delta_attention_batch_first", "kda", "ShapeError",
           "UnknownImplementationError", "IMPLEMENTATIONS"]

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
_WANT_FINAL_STATE, _HAS_V_NEW = 512, 1024
_L2NORM, _GATE, _BETA_SIGMOID, _NEG_EIGVAL, _FP32_PRODUCTS = 1, 2, 4, 8, 32


class _Config(NamedTuple):
    """The static (hashable) options of one call."""

    scale: float | None  # None: K^-0.5
    lower_bound: float | None  # None: no lower bound
    flags: int
    chunk_size: int
    num_states: int  # N of the state shape [B, N, HV, K, V]
    segmented: bool
    output_final_state: bool
    save_states: bool  # the saved-state residual: the chunk states and the token deltas v_new


def _present(a_log, dt_bias, initial_state, segment_ids):
    return ((_HAS_A_LOG if a_log is not None else 0) | (_HAS_DT_BIAS if dt_bias is not None else 0)
            | (_HAS_SEGMENT_IDS if segment_ids is not None else 0)
            | (_HAS_INITIAL_STATE if initial_state is not None else 0))


def _operands(q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids):
    return [x for x in (q, k, v, g, beta, a_log, dt_bias, segment_ids, initial_state) if x is not None]


def _attrs(cfg: _Config, present: int, oracle: bool):
    return dict(
        # float64 attributes: the fp64 oracle (float64 inputs) uses them unrounded, the kernels round
        scale=np.float64(np.nan if cfg.scale is None else cfg.scale),
        lower_bound=np.float64(np.nan if cfg.lower_bound is None else cfg.lower_bound),
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


# Inside shard_map, JAX types every value with the manual mesh axes it varies over. An ffi_call's
# results come back typed invariant, and it rejects operands of mixed types; jax.grad then rejects
# cotangents whose type differs from their primal's. So operands and results are made varying over
# every axis any operand varies over (each device computed its own results), and a cotangent that
# varies where its primal does not (a_log, dt_bias or a state replicated over the data axis) is
# summed over those axes: the gradient of a replicated input is the sum of the shards' gradients.
# JAX 0.10 calls the type manual_axis_type and the cast pcast; 0.6-0.9 vma and pvary; older JAX
# has neither, and these are no-ops.
def _varying_axes(x):
    aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", None) or ())


def _make_varying(x, axes):
    missing = tuple(sorted(axes - _varying_axes(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)


def _varying_call(target, out_types, operands, attrs):
    """ffi_call with operands and results varying over the union of the operands' axes."""
    axes = frozenset().union(*(_varying_axes(x) for x in operands))
    operands = [_make_varying(x, axes) for x in operands]
    outs = jax.ffi.ffi_call(target, out_types, vmap_method="expand_dims")(*operands, **attrs)
    return [_make_varying(o, axes) for o in outs]


def _like_primal(ct, primal):
    """A cotangent summed over the manual axes it varies over and its primal does not."""
    if ct is None or primal is None:
        return ct
    extra = tuple(sorted(_varying_axes(ct) - _varying_axes(primal)))
    return jax.lax.psum(ct, extra) if extra else ct


def _forward(q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids, cfg: _Config):
    H, B, T, K = q.shape
    HV, V = v.shape[0], v.shape[3]
    oracle = q.dtype == jnp.float64
    sdt = jnp.float64 if oracle else jnp.float32
    present = _present(a_log, dt_bias, initial_state, segment_ids)
    operands = _operands(q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids)
    out_types = [jax.ShapeDtypeStruct((HV, B, T, V), q.dtype)]
    if cfg.output_final_state:
        present |= _WANT_FINAL_STATE
        out_types.append(jax.ShapeDtypeStruct((B, cfg.num_states, HV, K, V), sdt))
    if cfg.save_states:
        present |= _HAS_CHUNK_STATES | _HAS_V_NEW
        out_types.append(jax.ShapeDtypeStruct((_chunk_capacity(B, T, cfg), HV, K, V), sdt))
        out_types.append(jax.ShapeDtypeStruct((HV, B, T, V), sdt))  # v_new, laid out like the output
    outs = _varying_call("libkda_kda_forward", out_types, operands, _attrs(cfg, present, oracle))
    o = outs[0]
    final_state = outs[1] if cfg.output_final_state else None
    residual = (outs[-2], outs[-1]) if cfg.save_states else None  # (chunk_states, v_new)
    return o, final_state, residual


def _backward(q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids, residual, do, dht, cfg: _Config):
    H, B, T, K = q.shape
    oracle = q.dtype == jnp.float64
    f32 = jnp.float64 if oracle else jnp.float32
    present = _present(a_log, dt_bias, initial_state, segment_ids)
    operands = _operands(q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids)
    if residual is not None:  # (chunk_states, v_new)
        present |= _HAS_CHUNK_STATES | _HAS_V_NEW
        operands.extend(residual)
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
    outs = _varying_call("libkda_kda_backward", out_types, operands, _attrs(cfg, present, oracle))
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
    # Not differentiated: the forward alone, with no chunk states written (the inference path).
    o, final_state, _ = _forward(q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids,
                                 cfg._replace(save_states=False))
    return o, final_state


def _kda_fwd(q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids, cfg):
    o, final_state, saved = _forward(q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids, cfg)
    residuals = (q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids, saved)
    return (o, final_state), residuals


def _kda_bwd(cfg, residuals, cotangents):
    q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids, saved = residuals
    do, dht = cotangents
    if not cfg.output_final_state:
        dht = None
    dq, dk, dv, dg, dbeta, da, ddt, dh0 = _backward(q, k, v, g, beta, a_log, dt_bias, initial_state, segment_ids,
                                                    saved, do, dht, cfg)
    gate = bool(cfg.flags & _GATE)
    cts = (
        _cast(dq, q), _cast(dk, k), _cast(dv, v), _cast(dg, g), _cast(dbeta, beta),
        _cast(da, a_log) if gate else _zeros_like(a_log),
        _cast(ddt, dt_bias) if gate else _zeros_like(dt_bias),
        _cast(dh0, initial_state),
    )
    primals = (q, k, v, g, beta, a_log, dt_bias, initial_state)
    return tuple(_like_primal(ct, x) for ct, x in zip(cts, primals)) + (None,)  # segment_ids: no cotangent


_kda.defvjp(_kda_fwd, _kda_bwd)


# Tokamax's implementation names (tokamax/_src/ops/experimental/kda/api.py: "xla", "xla_chunked",
# "mosaic", registered as "mosaic_tpu"; older versions "pallas_tpu"). Every one runs libkda's kernels.
_IMPLEMENTATIONS = ("xla", "xla_chunked", "mosaic", "mosaic_tpu", "pallas_tpu")
# The batch-first API's (tokamax/_src/ops/kda/api.py: Literal["xla", "xla_chunked"]).
_BATCH_FIRST_IMPLEMENTATIONS = ("xla", "xla_chunked")

# The libkda options beyond Tokamax's signature (through **options), with their defaults.
_EXTENSIONS = dict(chunk_size=64, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                   rematerialize_for_backward=False, bf16_dot_products=False, per_channel_gate=True)
# The older experimental API's keywords (A_log, dt_bias, ...) -> the current names.
_ALIASES = dict(A_log="a_log", dt_bias="delta_time_bias", use_qk_l2norm_in_kernel="use_qk_l2norm",
                N_max="max_num_segments", cp_context="context_parallel_metadata")
_LEGACY = ("safe_gate", "disable_recompute")
# The oldest keyword names of the four leading arrays (kimi_delta_attention(q=, k=, v=, g=, beta=)).
_ARRAY_ALIASES = dict(q="query", k="key", v="value", g="gate")


class UnknownImplementationError(ValueError, NotImplementedError):
    """An implementation name libkda does not run. Tokamax's versions raise ValueError("Unknown
    implementation ...") or, the older batch-first API, NotImplementedError("Only XLA implementation
    is supported."); this is both, so either ``except``/``assertRaises`` catches it."""


try:  # Tokamax's newer ``bind`` is jaxtyped: a shape mismatch is a jaxtyping.TypeCheckError.
    from jaxtyping import TypeCheckError as _TypeCheckError

    _SHAPE_ERROR_BASES = (_TypeCheckError, ValueError)
except ImportError:  # jaxtyping is optional
    _SHAPE_ERROR_BASES = (ValueError,)


class ShapeError(*_SHAPE_ERROR_BASES):
    """An argument of the wrong shape. A ValueError (Tokamax's older ``bind`` raises ValueError
    with the same wording) and, when jaxtyping is installed, a ``jaxtyping.TypeCheckError`` (its
    newer, jaxtyped ``bind``), so tests of either version catch it."""


def _implementations(implementation, accepted, only_xla=False):
    """The entries of ``implementation`` up to and including the first one libkda runs, walked as
    Tokamax walks them: a callable is tried (the caller falls through to the next entry when it
    raises NotImplementedError); the first accepted name ends the walk (libkda runs every one, so
    later names are never reached, as in Tokamax); an unknown name before that raises
    ``UnknownImplementationError``. Returns the callables to try first."""
    if implementation is None:
        return []
    impls = (implementation,) if isinstance(implementation, str) or callable(implementation) else tuple(implementation)
    if not impls:
        raise ValueError("`implementation` must not be an empty sequence.")
    callables = []
    for impl in impls:
        if callable(impl):
            callables.append(impl)
            continue
        if impl not in accepted:
            suffix = " (Only XLA implementation is supported.)" if only_xla else ""
            raise UnknownImplementationError(f"Unknown implementation: {impl}{suffix}")
        return callables
    return callables + [None]  # None: every callable failed and no name follows


def _try_callables(callables, args, kwargs):
    """Runs the caller's implementation callables in order; returns (True, result) from the first
    that does not raise NotImplementedError, or (False, None) to run libkda's. When every entry is
    a callable and all decline, raises as Tokamax does: a single entry's own NotImplementedError,
    else ``ExceptionGroup("all implementations failed", errors)``."""
    errors = []
    for impl in callables:
        if impl is None:  # every entry was a callable and each declined: Tokamax's ending
            if len(errors) == 1:
                raise errors[0]  # a single entry's own error, re-raised
            if sys.version_info >= (3, 11):
                raise ExceptionGroup("all implementations failed", errors)  # noqa: F821 (3.11 builtin)
            raise NotImplementedError(f"all implementations failed: {errors}")
        try:
            return True, impl(*args, **kwargs)
        except NotImplementedError as e:
            errors.append(e)
    return False, None


def _check_context_parallel(metadata):
    """Runs with no metadata or metadata whose mesh axis (``axis_name``, default "context") has
    one device; real context parallelism raises NotImplementedError."""
    if metadata is None:
        return
    axis = getattr(metadata, "axis_name", "context")
    mesh = getattr(metadata, "mesh", None)
    size = None
    if mesh is not None:
        size = dict(mesh.shape).get(axis)
        if size is None:
            raise ValueError(f"context_parallel_metadata: its mesh has no axis {axis!r} (axes {tuple(mesh.shape)})")
    enabled = getattr(metadata, "is_cp_enabled", None)
    if enabled is None:
        if size is None:
            raise TypeError("context_parallel_metadata: expected Tokamax's ContextParallelMetadata (a `mesh` with "
                            f"a {axis!r} axis), got {type(metadata).__name__}")
        enabled = size > 1
    if enabled:
        raise NotImplementedError(
            f"libkda.jax.kimi_delta_attention: context parallelism is not supported (the mesh axis {axis!r} has "
            f"{size if size is not None else 'more than one'} devices); pass None or a mesh whose {axis!r} axis has "
            f"size 1, or run the whole sequence on one device")


def _options(options, given):
    """Splits **options into libkda's extensions and the older API's aliases (validated).
    given: the current-API keywords the caller set (name -> value, non-default ones only)."""
    ext = dict(_EXTENSIONS)
    renamed = {}
    legacy = {}
    for key, value in options.items():
        if key in _EXTENSIONS:
            ext[key] = value
        elif key in _ALIASES:
            new = _ALIASES[key]
            if new in given:
                raise TypeError(f"kimi_delta_attention() got both `{new}` and its older alias `{key}`")
            renamed[new] = value
        elif key in _LEGACY:
            legacy[key] = value
        else:
            raise TypeError(f"kimi_delta_attention() got an unexpected keyword argument {key!r}")
    if "disable_recompute" in legacy:
        remat = not legacy["disable_recompute"]
        if "rematerialize_for_backward" in options and bool(options["rematerialize_for_backward"]) != remat:
            raise ValueError("`disable_recompute` and `rematerialize_for_backward` disagree "
                             "(rematerialize_for_backward = not disable_recompute)")
        ext["rematerialize_for_backward"] = remat
    return ext, renamed, legacy.get("safe_gate")


def _bind(query, key, value, gate, beta, *, a_log=None, delta_time_bias=None, scale=None, initial_state=None,
          output_final_state=False, use_qk_l2norm=False, use_gate_in_kernel=False, segment_ids=None,
          lower_bound=None, context_parallel_metadata=None, max_num_segments=None, **options):
    """Tokamax's ``bind``: validates every argument (its checks and wording, with libkda's
    extensions) before anything runs, and returns the call's normalized arguments. Wrong shapes
    raise ``ShapeError``, other bad values ValueError, unknown keywords TypeError."""
    current = dict(a_log=a_log, delta_time_bias=delta_time_bias, use_qk_l2norm=use_qk_l2norm,
                   max_num_segments=max_num_segments, context_parallel_metadata=context_parallel_metadata)
    defaults = dict(a_log=None, delta_time_bias=None, use_qk_l2norm=False, max_num_segments=None,
                    context_parallel_metadata=None)
    ext, renamed, safe_gate = _options(options, {n: x for n, x in current.items() if x is not defaults[n]})
    current.update(renamed)
    # The older API's names in its messages when the call uses that API.
    older = bool(renamed) or safe_gate is not None or "disable_recompute" in options
    a_log_name, bias_name = ("A_log", "dt_bias") if older else ("a_log", "delta_time_bias")
    a_log, delta_time_bias = current["a_log"], current["delta_time_bias"]
    max_num_segments = current["max_num_segments"]
    _check_context_parallel(current["context_parallel_metadata"])
    # Tokamax's wording ("`k` shape ... must match `q` shape ..."), which its tests match, with
    # the argument's name here and the layout.
    if query.ndim != 4:
        raise ShapeError(f"`q` must be rank 4 (argument 'query', head-first [H, B, T, K]), got shape "
                         f"{tuple(query.shape)}.")
    if value.ndim != 4:
        raise ShapeError(f"`v` must be rank 4 (argument 'value', head-first [HV, B, T, V]), got shape "
                         f"{tuple(value.shape)}.")
    H, B, T, K = query.shape
    HV, V = value.shape[0], value.shape[3]
    if H < 1:  # before the HV % H check below, which would divide by zero
        raise ShapeError(f"`q` must have at least one head (argument 'query', head-first [H, B, T, K]): expected "
                         f"H >= 1, got H = {H} (shape {tuple(query.shape)}).")
    # The kernels' contract (and the numpy and torch entries): a state has K >= 1 rows and V >= 1
    # columns; B = 0 or T = 0 are valid empty calls. Checked here, before tracing, rather than in
    # the custom call at run time (where K = 0 surfaced as a JaxRuntimeError and V = 0 slipped
    # through the empty-output shortcut).
    if K < 1:
        raise ShapeError(f"`q` must have a key dimension of at least 1 (argument 'query', head-first [H, B, T, K]): "
                         f"expected K >= 1, got K = {K} (shape {tuple(query.shape)}).")
    if V < 1:
        raise ShapeError(f"`v` must have a value dimension of at least 1 (argument 'value', head-first "
                         f"[HV, B, T, V]): expected V >= 1, got V = {V} (shape {tuple(value.shape)}).")
    for name, x in (("query", query), ("key", key), ("value", value), ("gate", gate), ("beta", beta)):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise ValueError(f"kda: argument '{name}': expected a floating dtype (float32, bfloat16, float16 or "
                             f"float64), got {jnp.result_type(x)}")
    if tuple(key.shape) != (H, B, T, K):
        raise ShapeError(f"`k` shape {tuple(key.shape)} must match `q` shape {tuple(query.shape)} "
                         "(argument 'key', head-first [H, B, T, K]).")
    if value.shape[1:3] != (B, T) or HV < H or HV % H:
        raise ShapeError(f"`v` shape {tuple(value.shape)} must be [HV, B, T, V] = [HV, {B}, {T}, V] with HV a "
                         f"multiple of H = {H} (argument 'value', head-first).")
    if not ext["per_channel_gate"]:
        # One gate per head and token (a Tokamax TPU fork's scalar gate): broadcast over the K
        # channels here, so the gradient is the sum over them (jax.grad through the broadcast).
        if tuple(gate.shape) != (HV, B, T, 1):
            raise ShapeError(f"`g` shape {tuple(gate.shape)} must be {(HV, B, T, 1)} with per_channel_gate=False "
                             "(argument 'gate', head-first [HV, B, T, 1]).")
        gate = jnp.broadcast_to(gate, (HV, B, T, K))
    if tuple(gate.shape) != (HV, B, T, K):
        raise ShapeError(f"`g` shape {tuple(gate.shape)} must be {(HV, B, T, K)} (argument 'gate', head-first "
                         "[HV, B, T, K]; [HV, B, T, 1] with per_channel_gate=False).")
    if tuple(beta.shape) != (HV, B, T):
        raise ShapeError(f"`beta` shape {tuple(beta.shape)} must be {(HV, B, T)} (argument 'beta', head-first "
                         "[HV, B, T]).")
    if initial_state is not None:
        if initial_state.ndim != 5 or initial_state.shape[0] != B:
            raise ShapeError(f"`initial_state` must have shape [B, N, H, K, V] = [{B}, N, {HV}, {K}, {V}]; got "
                             f"{tuple(initial_state.shape)}.")
        if tuple(initial_state.shape[2:]) != (HV, K, V):
            raise ShapeError(f"`initial_state` trailing dimensions must be {(HV, K, V)}; got "
                             f"{tuple(initial_state.shape[2:])}.")
        state_count = initial_state.shape[1]
        if state_count <= 0:
            raise ValueError("`initial_state` must contain at least one recurrent state.")
        if max_num_segments is None:
            max_num_segments = state_count
        elif max_num_segments != state_count:
            raise ValueError(
                "`max_num_segments` (`N_max`) must match the `initial_state` segment dimension; got "
                f"max_num_segments={max_num_segments}, num_segments={state_count}.")
    if max_num_segments is not None and max_num_segments <= 0:
        raise ValueError(f"`max_num_segments` must be positive, got {max_num_segments}.")
    if segment_ids is None:
        if max_num_segments not in (None, 1):
            raise ValueError(
                f"without segment_ids there is one state per batch row (N = 1), got N = {max_num_segments}")
        num_states = 1
    else:
        if tuple(jnp.shape(segment_ids)) == (T,):  # one map for every batch row (SPEC.md 1.2)
            segment_ids = jnp.broadcast_to(jnp.asarray(segment_ids)[None, :], (B, T))
        if tuple(jnp.shape(segment_ids)) != (B, T):
            raise ShapeError(f"`segment_ids` shape {tuple(jnp.shape(segment_ids))} must be {(B, T)} or {(T,)}.")
        if max_num_segments is None:
            raise ValueError("`max_num_segments` is required when `segment_ids` is provided without "
                             "`initial_state` (in Tokamax's older API: `N_max` is required).")
        num_states = int(max_num_segments)
        segment_ids = jnp.asarray(segment_ids)
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):  # a float id would truncate silently
            raise ValueError(f"kda: argument 'segment_ids': expected an integer dtype, got {segment_ids.dtype}")
        if segment_ids.dtype != jnp.int32:  # int64 under x64: ids are < 2^31 (they count segments)
            segment_ids = segment_ids.astype(jnp.int32)
    if use_gate_in_kernel:
        if a_log is None:
            raise ValueError(f"`{a_log_name}` must be provided when `use_gate_in_kernel=True`.")
        if tuple(jnp.shape(a_log)) != (HV,):
            raise ShapeError(f"`{a_log_name}` shape {tuple(jnp.shape(a_log))} must be {(HV,)}.")
        if not ext["per_channel_gate"]:
            # One decay per head and token: the bias is per head too ([HV]), broadcast over K.
            if delta_time_bias is not None and tuple(jnp.shape(delta_time_bias)) != (HV,):
                raise ShapeError(f"`{bias_name}` shape {tuple(jnp.shape(delta_time_bias))} must be {(HV,)} with "
                                 "per_channel_gate=False (one decay per head and token).")
            if delta_time_bias is not None:
                delta_time_bias = jnp.repeat(jnp.asarray(delta_time_bias), K)
        elif delta_time_bias is not None and tuple(jnp.shape(delta_time_bias)) != (HV * K,):
            raise ShapeError(f"`{bias_name}` shape {tuple(jnp.shape(delta_time_bias))} must be {(HV * K,)}.")
        if safe_gate and lower_bound is None:
            raise ValueError("`lower_bound` must be specified when `safe_gate=True` and "
                             "`use_gate_in_kernel=True`.")
        if lower_bound is not None and not (-5 <= lower_bound < 0):
            raise ValueError(f"`lower_bound` must be in [-5, 0), got {lower_bound}.")
    else:
        a_log = delta_time_bias = lower_bound = None
    if ext["allow_neg_eigval"] and not ext["use_beta_sigmoid_in_kernel"]:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if ext["chunk_size"] not in (16, 32, 64):
        raise ValueError(f"`chunk_size` must be 64, 32 or 16, got {ext['chunk_size']}.")
    return dict(query=query, key=key, value=value, gate=gate, beta=beta, a_log=a_log,
                delta_time_bias=delta_time_bias, scale=scale, initial_state=initial_state,
                output_final_state=bool(output_final_state), use_qk_l2norm=bool(current["use_qk_l2norm"]),
                use_gate_in_kernel=bool(use_gate_in_kernel), segment_ids=segment_ids, lower_bound=lower_bound,
                num_states=num_states, **ext)


def _leading_arrays(arrays, options):
    """query, key, value, gate from the positionals or their oldest keyword names q, k, v, g."""
    out = list(arrays)
    for i, (old, new) in enumerate(_ARRAY_ALIASES.items()):
        if old in options:
            if out[i] is not None:
                raise TypeError(f"kimi_delta_attention() got both `{new}` and its older name `{old}`")
            out[i] = options.pop(old)
        if out[i] is None:
            raise TypeError(f"kimi_delta_attention() missing required argument '{new}' (or '{old}')")
    return out


def kimi_delta_attention(
    query=None,
    key=None,
    value=None,
    gate=None,
    beta=None,
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
    implementation=None,
    **options,
):
    """Tokamax's ``kimi_delta_attention`` (head-first, tokamax/_src/ops/experimental/kda/api.py)
    on libkda's CPU kernels.

    Args (Tokamax's names and layouts):
      query, key: ``[H, B, T, K]``. value: ``[HV, B, T, V]`` (HV % H == 0; Tokamax has HV = H).
      gate: ``[HV, B, T, K]``, the log decay, or the raw gate with ``use_gate_in_kernel``.
      beta: ``[HV, B, T]`` (logits with ``use_beta_sigmoid_in_kernel``, a libkda extension).
        The four leading arrays may also be passed by the oldest API's keywords ``q``, ``k``,
        ``v``, ``g``.
      a_log: ``[HV]`` (required with ``use_gate_in_kernel``); delta_time_bias: ``[HV * K]`` -- the
        in-kernel gate ``-exp(a_log) * softplus(gate + delta_time_bias)``, or with ``lower_bound``
        (in [-5, 0)) ``lower_bound * sigmoid(exp(a_log) * (gate + delta_time_bias))`` (SPEC.md 1.3).
      scale: query scale, default ``K ** -0.5``.
      initial_state: ``[B, N, HV, K, V]`` (any float dtype); N = 1 without segment_ids.
      output_final_state: also return the final state, float32 ``[B, N, HV, K, V]``.
      use_qk_l2norm: L2-normalize query and key per token inside the kernel.
      segment_ids: ``[B, T]`` int, 1-indexed contiguous runs 1, 2, 3, ... in order; 0 = padding, anywhere
        (leading, between segments, trailing) as in Tokamax's reference: o = 0, no gradient.
      max_num_segments: N with segment_ids (inferred from initial_state when omitted).
      context_parallel_metadata: None, or metadata whose mesh "context" axis has size 1 (ignored);
        real context parallelism raises NotImplementedError.
      implementation: None, "xla", "xla_chunked", "mosaic", "mosaic_tpu", "pallas_tpu" (all run
        libkda's kernels), a callable, or a sequence of them walked as Tokamax walks it: callables
        are tried in order (NotImplementedError falls through to the next entry), the first name
        runs libkda, and an unknown name reached before it raises ``ValueError("Unknown
        implementation: ...")`` (``UnknownImplementationError``).
      **options: libkda extensions -- ``chunk_size`` (64, 32 or 16),
        ``use_beta_sigmoid_in_kernel``, ``allow_neg_eigval``, ``rematerialize_for_backward`` (False:
        the forward saves the state entering every chunk for the backward; True: recompute),
        ``per_channel_gate`` (default True; False: ``gate`` is ``[HV, B, T, 1]``, one decay per
        head and token, broadcast over K, its gradient summed over K; with the gate in kernel
        ``delta_time_bias`` is then ``[HV]``),
        ``bf16_dot_products`` (default False here: every product in fp32, as Tokamax's "xla"
        computes, whose tests compare elementwise at atol = rtol = 0.01; True: with bf16 inputs
        on AVX512_BF16 CPUs the state products run as bf16 dot products with fp32 accumulation,
        within SPEC.md's bf16 bounds and about 1.4x faster) -- and the older experimental
        API's keywords: ``A_log``, ``dt_bias``, ``use_qk_l2norm_in_kernel``,
        ``N_max`` (= max_num_segments), ``cp_context`` (as context_parallel_metadata),
        ``safe_gate`` (True with the gate in kernel requires ``lower_bound``) and
        ``disable_recompute`` (= not rematerialize_for_backward). Unknown keys raise TypeError.

    Bad arguments raise before anything runs, with Tokamax's ``bind`` wording: ``ShapeError``
    (a ValueError, and a ``jaxtyping.TypeCheckError`` when jaxtyping is installed) for shapes,
    ValueError for values.

    Returns ``(output [HV, B, T, V] in query's dtype, final_state or None)``.
    """
    query, key, value, gate = _leading_arrays((query, key, value, gate), options)
    if beta is None:
        raise TypeError("kimi_delta_attention() missing required argument 'beta'")
    named = dict(a_log=a_log, delta_time_bias=delta_time_bias, scale=scale, initial_state=initial_state,
                 output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
                 use_gate_in_kernel=use_gate_in_kernel, segment_ids=segment_ids, lower_bound=lower_bound,
                 context_parallel_metadata=context_parallel_metadata, max_num_segments=max_num_segments)
    done, result = _try_callables(_implementations(implementation, _IMPLEMENTATIONS),
                                  (query, key, value, gate, beta), dict(named, **options))
    if done:
        return result
    a = _bind(query, key, value, gate, beta, **named, **options)
    gate = a["gate"]  # broadcast over K when per_channel_gate=False
    flags = ((_L2NORM if a["use_qk_l2norm"] else 0) | (_GATE if a["use_gate_in_kernel"] else 0)
             | (_BETA_SIGMOID if a["use_beta_sigmoid_in_kernel"] else 0)
             | (_NEG_EIGVAL if a["allow_neg_eigval"] else 0)
             | (0 if bool(a["bf16_dot_products"]) else _FP32_PRODUCTS))
    oracle = jax.dtypes.canonicalize_dtype(query.dtype) == jnp.float64
    arrays = dict(key=key, value=value, gate=gate, beta=beta, a_log=a["a_log"],
                  delta_time_bias=a["delta_time_bias"], initial_state=a["initial_state"])
    if not oracle:
        # float64 arguments beside a narrower query (numpy's default under jax_enable_x64, as
        # np.log(...) gives for a_log) compute in fp32, as Tokamax casts a_log and dt_bias; their
        # cotangents come back in float64 through the cast.
        arrays = {n: (x.astype(jnp.float32) if x is not None and jax.dtypes.canonicalize_dtype(x.dtype) == jnp.float64
                      else x) for n, x in arrays.items()}
    cfg = _Config(
        scale=_opt_float("scale", a["scale"]),
        lower_bound=_opt_float("lower_bound", a["lower_bound"]),
        flags=flags,
        chunk_size=int(a["chunk_size"]),
        num_states=a["num_states"],
        segmented=a["segment_ids"] is not None,
        output_final_state=a["output_final_state"],
        save_states=not a["rematerialize_for_backward"] and not oracle,
    )
    return _kda(query, arrays["key"], arrays["value"], arrays["gate"], arrays["beta"], arrays["a_log"],
                arrays["delta_time_bias"], arrays["initial_state"], a["segment_ids"], cfg)


class _Implementation:
    """An entry of ``IMPLEMENTATIONS``, shaped like Tokamax's op objects: calling it runs
    ``kimi_delta_attention``; ``bind(...)`` validates the arguments the same way (``ShapeError``
    for shapes) and returns them normalized; ``vjp`` is the backward (libkda's fused C++ backward
    behind the ``jax.custom_vjp``)."""

    def __init__(self, name):
        self.name = name
        self.vjp = _kda_bwd

    def __call__(self, *args, **kwargs):
        return kimi_delta_attention(*args, **kwargs)

    def bind(self, query=None, key=None, value=None, gate=None, beta=None, **kwargs):
        kwargs.pop("return_residuals", None)
        kwargs.pop("implementation", None)
        query, key, value, gate = _leading_arrays((query, key, value, gate), kwargs)
        return _bind(query, key, value, gate, beta, **kwargs)

    def __repr__(self):
        return f"libkda.jax.IMPLEMENTATIONS[{self.name!r}]"


# ---------------------------------------------------------------------------------------------
# Tokamax's batch-first API (tokamax/_src/ops/kda/api.py): q [B, T, H, K], state [B, H, K, V].
# It has the same name there, so here it lives in the namespace ``libkda.jax.kda`` (mirroring
# ``tokamax._src.ops.kda.api``) and, flat, as ``kimi_delta_attention_batch_first``.
# ---------------------------------------------------------------------------------------------

def _batch_first_kimi_delta_attention(q, k, v, g, beta, *, scale: float | None = None, initial_state=None,
                                      output_final_state: bool = False, implementation=None):
    """Tokamax's batch-first ``kimi_delta_attention`` (tokamax/_src/ops/kda/api.py) on libkda.

    q, k, g ``[B, T, H, K]``; v ``[B, T, H, V]``; beta ``[B, T, H]``; g is the log decay;
    initial_state ``[B, H, K, V]``. implementation: None, "xla" or "xla_chunked", a callable, or
    a sequence of them walked as the head-first API walks it; an unknown name reached before a
    known one raises ``UnknownImplementationError`` (a ValueError and a NotImplementedError:
    "Unknown implementation: ... (Only XLA implementation is supported.)"), which matches both
    Tokamax versions' tests.
    Runs the head-first ``kimi_delta_attention`` on transposed operands (XLA transposes; the
    gradients flow back through them). Returns ``(output [B, T, H, V] in q's dtype,
    final_state float32 [B, H, K, V] or None)``."""
    done, result = _try_callables(_implementations(implementation, _BATCH_FIRST_IMPLEMENTATIONS, only_xla=True),
                                  (q, k, v, g, beta), dict(scale=scale, initial_state=initial_state,
                                                           output_final_state=output_final_state))
    if done:
        return result
    if q.ndim != 4:
        raise ShapeError(f"`q` must be rank 4, got shape {q.shape}.")
    B, T, H, K = q.shape
    V = v.shape[-1]
    checks = (("k", k, q.shape), ("g", g, q.shape), ("v", v, (B, T, H, V)), ("beta", beta, (B, T, H)))
    for name, x, shape in checks:
        if tuple(x.shape) != tuple(shape):
            raise ShapeError(f"`{name}` shape {tuple(x.shape)} must be {tuple(shape)} (batch-first, q is "
                             f"[B, T, H, K] = {tuple(q.shape)}).")
    if initial_state is not None and tuple(initial_state.shape) != (B, H, K, V):
        raise ShapeError(f"`initial_state` shape {tuple(initial_state.shape)} must be {(B, H, K, V)}.")
    hf = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731  [B, T, H, ...] -> [H, B, T, ...]
    o, fs = kimi_delta_attention(hf(q), hf(k), hf(v), hf(g), jnp.moveaxis(beta, 2, 0), scale=scale,
                                 initial_state=None if initial_state is None else initial_state[:, None],
                                 output_final_state=output_final_state)
    return jnp.moveaxis(o, 0, 2), (None if fs is None else fs[:, 0])


_batch_first_kimi_delta_attention.__name__ = "kimi_delta_attention"
_batch_first_kimi_delta_attention.__qualname__ = "kimi_delta_attention"
kimi_delta_attention_batch_first = _batch_first_kimi_delta_attention

# Tokamax's head-first registries. "mosaic_tpu" is not registered, so the newer Tokamax's tests of
# its TPU kernels (guarded by `"mosaic_tpu" in IMPLEMENTATIONS`) skip; "pallas_tpu" is, with the
# older versions' default order ("pallas_tpu", "xla"), which their registry tests check. Every
# entry and every name in _IMPLEMENTATIONS runs libkda's kernels.
IMPLEMENTATIONS = {"xla": _Implementation("xla"), "pallas_tpu": _Implementation("pallas_tpu")}
_DEFAULT_IMPLEMENTATIONS = ("pallas_tpu", "xla")

kda = types.ModuleType(__name__ + ".kda", "Tokamax's batch-first KDA API (tokamax/_src/ops/kda/api.py) on libkda.")
kda.kimi_delta_attention = _batch_first_kimi_delta_attention
# Tokamax's registries (tests skip the TPU kernels when their name is absent): every entry runs
# libkda's kernels.
kda.IMPLEMENTATIONS = {name: _batch_first_kimi_delta_attention for name in _BATCH_FIRST_IMPLEMENTATIONS}
kda._DEFAULT_IMPLEMENTATIONS = ("xla",)
kda.UnknownImplementationError = UnknownImplementationError  # also libkda.jax.UnknownImplementationError
sys.modules[kda.__name__] = kda  # `from libkda.jax.kda import kimi_delta_attention`


# ---------------------------------------------------------------------------------------------
# Tokamax's standalone inference API (tokamax/_src/ops/experimental/kda/inference.py, the Ant
# Group fork: `kimi_delta_attention_inference`, batch-first, forward only). Here it is the same
# forward as kimi_delta_attention without residuals; also importable as libkda.jax.inference.
# ---------------------------------------------------------------------------------------------

def kimi_delta_attention_inference(q, k, v, g, beta, *, segment_ids, a_log=None, delta_time_bias=None,
                                   scale: float | None = None, initial_state=None, output_final_state: bool = False,
                                   use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                                   safe_gate: bool = True, lower_bound: float | None = None,
                                   max_num_segments: int | None = None):
    """Tokamax's ``kimi_delta_attention_inference``: the KDA forward for packed inference.

    q, k, g ``[B, T, H, K]``; v ``[B, T, H, V]``; beta ``[B, T, H]``, all bf16; g is the raw gate;
    segment_ids ``[B, T]`` or ``[T]`` int32 (1-indexed runs, 0 = padding); a_log ``[H]`` and
    delta_time_bias ``[H * K]`` (required); initial_state fp32 ``[B, N, H, K, V]`` or ``[N, H, K, V]``;
    max_num_segments N (inferred from initial_state when omitted).

    The contract is Tokamax's, checks and all (each a ValueError): bf16 inputs, T a multiple of 64,
    ``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel`` and ``safe_gate`` True, ``lower_bound`` in
    [-5, 0), fp32 states. libkda's kernels need none of these limits: ``kimi_delta_attention`` takes
    any dtype, length and gate form. a_log is clamped at 80, as Tokamax does (exp(a_log) stays
    finite).

    Returns ``(output [B, T, H, V] in q's dtype, final_state fp32 [B, N, H, K, V] or None)``. Not
    differentiated, it writes no chunk states (nothing is kept for a backward); unlike Tokamax's it
    can also be differentiated (kimi_delta_attention's backward).
    """
    if any(d <= 0 for d in q.shape) or v.shape[-1] <= 0:
        raise ValueError("tensor dimensions must be positive")
    if q.dtype != jnp.bfloat16:
        raise ValueError(f"kimi_delta_attention_inference currently requires BF16, got {q.dtype}")
    if not (q.dtype == k.dtype == v.dtype == g.dtype):
        raise ValueError("q, k, v, and g must have the same dtype")
    if beta.dtype != q.dtype:
        raise ValueError("beta must have the same dtype as q")
    if q.shape[:3] != k.shape[:3] or q.shape != g.shape:
        raise ValueError("q, k, and g must agree on [B, T, H, K]")
    if q.shape[:3] != v.shape[:3] or q.shape[:3] != beta.shape:
        raise ValueError("v and beta must agree with q on [B, T, H]")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError("q and k must have the same key dimension")
    if q.shape[1] % 64:
        raise ValueError("T must be padded to a multiple of 64")
    segment_ids = jnp.asarray(segment_ids)
    if segment_ids.shape not in (q.shape[:2], q.shape[1:2]):  # [T]: kimi_delta_attention broadcasts it
        raise ValueError(f"segment_ids must have shape {q.shape[:2]}, got {segment_ids.shape}")
    if segment_ids.dtype != jnp.int32:
        raise ValueError(f"segment_ids must use int32, got {segment_ids.dtype}")
    if use_gate_in_kernel and (a_log is None or delta_time_bias is None):
        raise ValueError("fused gate activation requires a_log and delta_time_bias")
    if not use_qk_l2norm_in_kernel:
        raise ValueError("standalone inference requires in-kernel Q/K L2 normalization to bound the triangular solve")
    if not use_gate_in_kernel or not safe_gate:
        raise ValueError("standalone inference requires safe fused gate activation")
    if lower_bound is None or not (-5 <= lower_bound < 0):
        raise ValueError("safe fused gate activation requires lower_bound in [-5, 0)")
    if max_num_segments is None:
        if initial_state is None:
            raise ValueError("max_num_segments is required when initial_state is None")
        max_num_segments = initial_state.shape[-4]
    if max_num_segments <= 0:
        raise ValueError("max_num_segments must be positive")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if tuple(a_log.shape) != (H,) or tuple(delta_time_bias.shape) != (H * K,):
        raise ValueError("gate parameters must match the head and key dimensions")
    if initial_state is not None:
        if tuple(initial_state.shape) not in ((B, max_num_segments, H, K, V), (max_num_segments, H, K, V)):
            raise ValueError("initial_state shape must match batch, segments, heads, K and V")
        if initial_state.dtype != jnp.float32:
            raise ValueError("initial_state must use float32")
        if initial_state.ndim == 4:  # one set of states for every batch row
            initial_state = jnp.broadcast_to(initial_state[None], (B,) + tuple(initial_state.shape))
    a_log = jnp.minimum(a_log, jnp.asarray(80.0, dtype=a_log.dtype))
    hf = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731  [B, T, H, ...] -> [H, B, T, ...]
    o, final_state = kimi_delta_attention(
        hf(q), hf(k), hf(v), hf(g), jnp.moveaxis(beta, 2, 0), a_log=a_log, delta_time_bias=delta_time_bias,
        scale=scale, initial_state=initial_state, output_final_state=output_final_state, use_qk_l2norm=True,
        use_gate_in_kernel=True, segment_ids=segment_ids, lower_bound=lower_bound,
        max_num_segments=max_num_segments)
    return jnp.moveaxis(o, 0, 2), final_state


inference = types.ModuleType(__name__ + ".inference",
                             "Tokamax's standalone KDA inference API (experimental/kda/inference.py) on libkda.")
inference.kimi_delta_attention_inference = kimi_delta_attention_inference
sys.modules[inference.__name__] = inference  # `from libkda.jax import inference`
