"""Tokamax's public KDA test cases, ported onto libkda.jax.

Every test here is named after the Tokamax test it ports (the class says which file). Sources
(github.com/openxla/tokamax; several versions of each file were read, commits named below):

- tokamax/_src/ops/experimental/kda/api_test.py (29fa18c4, 974f1ad0 and an older version that
  had ``test_pallas_tpu_registered_and_falls_back_to_xla``) -- ``TestExperimentalApiTest``. The
  older base_test.py (0f143420) holds the same tests with the same bodies; they are ported once.
- tokamax/_src/ops/experimental/kda/base_test.py (84c7a4fc, bf5fb0db: ``a_log``,
  ``delta_time_bias``, ``max_num_segments`` names) -- ``TestExperimentalBaseTest``.
- tokamax/_src/ops/experimental/kda/xla_chunked_test.py (cbfc557f, 15c9964d) --
  ``TestXlaChunkedKimiDeltaAttentionTest``.
- tokamax/_src/ops/kda/api_test.py, the batch-first API (8fcb8ff5 and a later version with the
  ``xla_chunked`` tests) -- ``TestBatchFirstApiTest``, on ``libkda.jax.kda.kimi_delta_attention``.
- tokamax/_src/ops/experimental/kda/pallas_tpu_test.py -- ``TestPallasTpuTest``:
  ``test_chunk_kda_forward`` from 974f1ad0, ``test_chunk_kda_backward`` from 1ef6dd77 (the newest
  stored version), each against a float64 reference (the backward: libkda.naive_recurrent_kda_bwd).

Mapping: ``api.kimi_delta_attention`` -> ``libkda.jax.kimi_delta_attention`` (head-first) or
``libkda.jax.kda.kimi_delta_attention`` (batch-first), same keyword names; ``api.IMPLEMENTATIONS``
/ ``api._DEFAULT_IMPLEMENTATIONS`` -> ``libkda.jax.IMPLEMENTATIONS`` / ``_DEFAULT_IMPLEMENTATIONS``;
``chex.assert_trees_all_close(a, b, atol, rtol)`` -> ``numpy.testing.assert_allclose`` leaf by
leaf with the same atol / rtol (chex's defaults rtol=1e-6, atol=0 where the test gives none);
``self.assertRaisesRegex`` -> ``pytest.raises(match=...)``; ``jaxtyping.disable_jaxtyping()``
(Tokamax-private) is dropped: libkda validates shapes itself. ``numerics.random_initialize``
(Tokamax-private) is re-implemented below in both of its public versions (the current numpy
``default_rng(seed)`` one and the older ``jax.random`` one, PRNGKey(seed) split per leaf); the
tests that draw inputs from it run once per version. Tokamax's ``CPContext`` /
``ContextParallelMetadata`` (a frozen dataclass of ``mesh`` and ``axis_name``) are replaced by
the same-shaped stand-in ``_ContextParallelMetadata``.

References: where Tokamax compares against its pure-JAX reference (``_reference_kda`` in the
tests, reference.py behind ``implementation="xla"``), ``_reference_kda`` below is an equivalent
token-by-token recurrence (``lax.scan`` over time, vectorized over heads and batch) run in float64
(``jax.enable_x64``): head-first ``[H, B, T, K]``, per-segment state slots ``[B, N, H, K, V]``
with segment id 0 = padding (no update, output 0), the in-kernel gate
``-exp(a_log) * softplus(g + bias)`` or ``lower_bound * sigmoid(exp(a_log) * (g + bias))``,
``x * rsqrt(sum(x^2) + 1e-6)`` for use_qk_l2norm, scale ``K ** -0.5`` by default. Where Tokamax
compares one implementation name with ``"xla"`` (both libkda's kernels here) the test keeps that
comparison and also compares with the float64 reference, at the same tolerances.

Not ported (Tokamax-private modules, nothing of the public API to call):
``test_accumulator_dtype_uses_float32_as_floor`` (reference._accumulator_dtype),
``test_pallas_tpu_rejects_*_before_kernel`` (pallas_tpu.check_inputs_support),
``test_default_execution_config`` and ``test_rejects_unsupported_gate_config``
(xla_chunked.XlaChunkedKimiDeltaAttention / xla_chunked._check_supported).
``test_xla_chunked_gradients_match_xla`` constructs the private
``xla_chunked.XlaChunkedKimiDeltaAttention(chunk_size=8)``; it is ported with the public
``implementation="xla_chunked"`` instead (the batch-first API has no chunk_size).

Conflicts between Tokamax versions follow the newer version (each says so in a comment):
``test_unsupported_implementation`` (older: "xla_chunked" is unknown; newer: "unknown" is, and
xla_chunked_test.py runs "xla_chunked"), ``IMPLEMENTATIONS["pallas_tpu"].vjp`` (older: None;
newer: not None), ``test_fixed_forward_matches_recurrence`` (older: gate in kernel only; newer:
both gate forms).
"""

import dataclasses
import functools
import inspect
import os

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed (pip install jax)")
kj = pytest.importorskip("libkda.jax", reason="libkda.jax could not be imported")
import jax.numpy as jnp  # noqa: E402
import libkda  # noqa: E402  (the float64 backward oracle)

kda_api = kj.kda  # Tokamax's batch-first tokamax/_src/ops/kda/api.py
LARGE = os.environ.get("KDA_LARGE_TESTS") == "1"


# ---------------------------------------------------------------------------------------------
# Helpers: chex's assert_trees_all_close, Tokamax's numerics.random_initialize, CP metadata.
# ---------------------------------------------------------------------------------------------

def _assert_trees_all_close(actual, desired, atol=0.0, rtol=1e-6):
    """chex.assert_trees_all_close(actual, desired, atol=, rtol=) (chex's defaults): same tree
    structure, then numpy.testing.assert_allclose leaf by leaf (compared in float64)."""
    sa, sd = jax.tree.structure(actual), jax.tree.structure(desired)
    assert sa == sd, f"tree structures differ: {sa} vs {sd}"
    for i, (a, d) in enumerate(zip(jax.tree.leaves(actual), jax.tree.leaves(desired))):
        a = np.asarray(a).astype(np.float64)
        d = np.asarray(d).astype(np.float64)
        assert a.shape == d.shape, f"leaf {i}: shape {a.shape} != {d.shape}"
        np.testing.assert_allclose(a, d, atol=atol, rtol=rtol, err_msg=f"leaf {i}")


INIT_SCHEMES = ("numpy", "jax_random")


def _random_initialize(structs, seed=0, scheme="numpy"):
    """tokamax._src.numerics.random_initialize for a tuple of float ShapeDtypeStructs.
    "numpy": the current version (np.random.default_rng(seed), standard_normal in
    promote_types(dtype, float32), cast to dtype). "jax_random": the older version
    (jax.random.PRNGKey(seed), one split per leaf, jax.random.normal in dtype)."""
    out = []
    if scheme == "numpy":
        rng = np.random.default_rng(seed)
        for s in structs:
            dtype = jnp.dtype(s.dtype)
            dtype_ = jnp.promote_types(dtype, jnp.float32)
            y = rng.standard_normal(size=s.shape, dtype=dtype_).astype(dtype)
            out.append(jax.device_put(y))
    else:
        key = jax.random.PRNGKey(seed)
        for s in structs:
            curr_key, key = jax.random.split(key)
            out.append(jax.random.normal(curr_key, s.shape, s.dtype))
    return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)

class _ContextParallelMetadata:
    """Stand-in for Tokamax's cp_utils.ContextParallelMetadata (older: CPContext): a frozen
    dataclass of the mesh and its context axis name, with the same ``cp_size`` /
    ``is_cp_enabled`` properties."""

    mesh: object
    axis_name: str = "context"

    @property
    def cp_size(self):
        return int(self.mesh.shape[self.axis_name])

    @property
    def is_cp_enabled(self):
        return self.cp_size > 1


# ---------------------------------------------------------------------------------------------
# The reference: Tokamax's token-by-token recurrence, in float64.
# ---------------------------------------------------------------------------------------------

def _x64():
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64  # older jax
    return enable_x64()


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "use_qk_l2norm", "use_gate_in_kernel",
                                             "lower_bound", "num_states"))
def _reference_core(q, k, v, g, beta, a_log, delta_time_bias, initial_state, segment_ids, *, scale,
                    output_final_state, use_qk_l2norm, use_gate_in_kernel, lower_bound, num_states):
    heads, batch, seq_len, key_dim = q.shape
    value_dim = v.shape[-1]
    acc = jnp.promote_types(q.dtype, jnp.float32)
    if scale is None:
        scale = key_dim ** -0.5
    if use_gate_in_kernel:
        g_f = g.astype(acc)
        if delta_time_bias is not None:
            g_f = g_f + delta_time_bias.astype(acc).reshape(heads, 1, 1, key_dim)
        A = jnp.exp(a_log.astype(acc)).reshape(heads, 1, 1, 1)
        g = -A * jax.nn.softplus(g_f) if lower_bound is None else lower_bound * jax.nn.sigmoid(A * g_f)
    q_h, k_h = q.astype(acc), k.astype(acc)
    if use_qk_l2norm:
        q_h = q_h * jax.lax.rsqrt(jnp.sum(q_h * q_h, axis=-1, keepdims=True) + 1e-6)
        k_h = k_h * jax.lax.rsqrt(jnp.sum(k_h * k_h, axis=-1, keepdims=True) + 1e-6)
    q_h = q_h * scale
    v_h, g_h, beta_h = v.astype(acc), g.astype(acc), beta.astype(acc)
    states = jnp.zeros((batch, num_states, heads, key_dim, value_dim), acc)
    if initial_state is not None:
        states = states + initial_state.astype(acc)
    seg = jnp.ones((batch, seq_len), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    rows = jnp.arange(batch)
    bh = lambda x: jnp.swapaxes(x, 0, 1)  # noqa: E731  [H, B, ...] -> [B, H, ...]

    def step(states, t):
        sid = seg[:, t]
        idx = jnp.clip(sid - 1, 0, num_states - 1)
        valid = (sid > 0) & (sid <= num_states)  # [B]
        previous = states[rows, idx]  # [B, H, K, V]
        state = previous * jnp.exp(bh(g_h[:, :, t]))[..., None]
        kt = bh(k_h[:, :, t])
        residual = bh(v_h[:, :, t]) - jnp.einsum("bhk,bhkv->bhv", kt, state)
        new_state = state + (bh(beta_h[:, :, t])[..., None] * kt)[..., None] * residual[..., None, :]
        out = jnp.einsum("bhk,bhkv->bhv", bh(q_h[:, :, t]), new_state)
        out = jnp.where(valid[:, None, None], out, jnp.zeros_like(out))
        states = states.at[rows, idx].set(jnp.where(valid[:, None, None, None], new_state, previous))
        return states, out  # out [B, H, V]

    states, outs = jax.lax.scan(step, states, jnp.arange(seq_len))  # outs [T, B, H, V]
    output = jnp.transpose(outs, (2, 1, 0, 3))
    return output, (states if output_final_state else None)


def _reference_kda(q, k, v, g, beta, *, a_log=None, delta_time_bias=None, scale=None, initial_state=None,
                   output_final_state=False, use_qk_l2norm=False, use_gate_in_kernel=False, segment_ids=None,
                   lower_bound=None, max_num_segments=None):
    """Tokamax's reference KDA, head-first, in the inputs' precision (float32 floor); pure JAX, so
    differentiable. The state count is initial_state's N, else max_num_segments with segment_ids
    (Tokamax's test reference hard-codes 3 there), else 1. Returns (output [H, B, T, V] in the
    accumulation dtype, final_state [B, N, H, K, V] or None)."""
    if initial_state is not None:
        num_states = initial_state.shape[1]
    elif segment_ids is not None:
        num_states = 3 if max_num_segments is None else int(max_num_segments)
    else:
        num_states = 1
    if not use_gate_in_kernel:
        a_log = delta_time_bias = lower_bound = None
    return _reference_core(q, k, v, g, beta, a_log, delta_time_bias, initial_state, segment_ids,
                           scale=scale, output_final_state=bool(output_final_state),
                           use_qk_l2norm=bool(use_qk_l2norm), use_gate_in_kernel=bool(use_gate_in_kernel),
                           lower_bound=lower_bound, num_states=num_states)


def _f64(x):
    if x is None:
        return None
    a = np.asarray(x)
    if np.issubdtype(a.dtype, np.integer):
        return jnp.asarray(a)
    return jnp.asarray(a.astype(np.float64))


def _run_reference(q, k, v, g, beta, **kw):
    """_reference_kda in float64; the output is cast to q's dtype as Tokamax's reference does
    (``output.astype(q.dtype)``). Returns numpy (output, final_state or None)."""
    out_dtype = np.asarray(q).dtype
    with _x64():
        args = [_f64(x) for x in (q, k, v, g, beta)]
        kw = {n: (_f64(x) if n in ("a_log", "delta_time_bias", "initial_state", "segment_ids") else x)
              for n, x in kw.items()}
        out, fs = _reference_kda(*args, **kw)
        out = np.asarray(out).astype(out_dtype)
        fs = None if fs is None else np.asarray(fs)
    return out, fs


def _reference_grad(fn, args, argnums):
    """jax.grad(fn, argnums)(*args) with args promoted to float64 (fn calls _reference_kda)."""
    with _x64():
        grads = jax.grad(fn, argnums=argnums)(*[_f64(a) if not isinstance(a, str) else a for a in args])
        return jax.tree.map(lambda x: np.asarray(x, np.float64), grads)


def _reference_batch_first(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False):
    """Tokamax's batch-first reference (tokamax/_src/ops/kda/api_test.py): q [B, T, H, K], state
    [B, H, K, V]; the head-first recurrence on transposed operands."""
    hf = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731
    o, fs = _reference_kda(hf(q), hf(k), hf(v), hf(g), hf(beta), scale=scale,
                           initial_state=None if initial_state is None else initial_state[:, None],
                           output_final_state=output_final_state)
    return jnp.moveaxis(o, 0, 2), (None if fs is None else fs[:, 0])


def _run_reference_batch_first(q, k, v, g, beta, **kw):
    out_dtype = np.asarray(q).dtype
    with _x64():
        args = [_f64(x) for x in (q, k, v, g, beta)]
        kw = {n: (_f64(x) if n == "initial_state" else x) for n, x in kw.items()}
        out, fs = _reference_batch_first(*args, **kw)
        return np.asarray(out).astype(out_dtype), (None if fs is None else np.asarray(fs))


# ---------------------------------------------------------------------------------------------
# tokamax/_src/ops/experimental/kda/api_test.py (and base_test.py @0f143420, the same bodies)
# ---------------------------------------------------------------------------------------------

def _make_inputs_api(dtype, scheme="numpy"):
    """api_test.py's _make_inputs: H=3, B=2, T=7, K=8, V=5, initial_state [2, 1, 3, 8, 5]."""
    structs = (
        jax.ShapeDtypeStruct((3, 2, 7, 8), dtype),
        jax.ShapeDtypeStruct((3, 2, 7, 8), dtype),
        jax.ShapeDtypeStruct((3, 2, 7, 5), dtype),
        jax.ShapeDtypeStruct((3, 2, 7, 8), dtype),
        jax.ShapeDtypeStruct((3, 2, 7), dtype),
        jax.ShapeDtypeStruct((2, 1, 3, 8, 5), jnp.float32),
    )
    return _activated_inputs(structs, scheme)


@pytest.fixture(params=INIT_SCHEMES)
def scheme(request):
    """Which version of Tokamax's numerics.random_initialize draws the inputs."""
    return request.param



def _check_matches_reference(kda_fn, run_reference, inputs):
    """test_kimi_delta_attention_matches_reference of both Tokamax API files: jit'd forward with
    an initial state, shapes and dtypes, then output and final state at atol = rtol = 0.01."""
    q, k, v, g, beta, initial_state = inputs

    @jax.jit
    def f(q, k, v, g, beta, initial_state):
        return kda_fn(q, k, v, g, beta, initial_state=initial_state, output_final_state=True)

    output, final_state = f(q, k, v, g, beta, initial_state)
    ref_output, ref_final_state = run_reference(q, k, v, g, beta, initial_state=initial_state,
                                                output_final_state=True)
    assert output.shape == v.shape
    assert output.dtype == q.dtype
    assert final_state.shape == initial_state.shape
    assert final_state.dtype == jnp.float32
    _assert_trees_all_close(output, ref_output, atol=0.01, rtol=0.01)
    _assert_trees_all_close(final_state, ref_final_state, atol=0.01, rtol=0.01)


def _check_gradients_match_reference(kda_fn, reference_fn, inputs):
    """test_kimi_delta_attention_gradients_match_reference of both API files: jax.grad of
    sum(o * o) w.r.t. q, k, v, g, beta at atol = rtol = 0.01."""
    q, k, v, g, beta, _ = inputs

    def loss(fn, q, k, v, g, beta):
        output, _ = fn(q, k, v, g, beta)
        return jnp.sum(output * output)

    grad = jax.grad(lambda q, k, v, g, beta: loss(kda_fn, q, k, v, g, beta), argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)
    ref_grad = _reference_grad(lambda q, k, v, g, beta: loss(reference_fn, q, k, v, g, beta), (q, k, v, g, beta),
                               argnums=(0, 1, 2, 3, 4))
    _assert_trees_all_close(grad, ref_grad, atol=0.01, rtol=0.01)


def _three_segment_inputs():
    """Both Tokamax versions' missing-N test: ones [1, 1, 65, 1], segments of 20, 20 and 25."""
    q = k = v = beta_4d = jnp.ones((1, 1, 65, 1), dtype=jnp.float32)
    segment_ids = jnp.concatenate([jnp.ones((1, 20), dtype=jnp.int32), jnp.full((1, 20), 2, dtype=jnp.int32),
                                   jnp.full((1, 25), 3, dtype=jnp.int32)], axis=1)
    return q, k, v, jnp.zeros_like(q), beta_4d[..., 0], segment_ids


def _check_padding_preserves_final_state(**n_kwarg):
    """test_padding_preserves_final_state of both versions (n_kwarg: N_max or max_num_segments):
    trailing padding leaves the final state as the unpadded call's and outputs 0 there."""
    q = k = v = jnp.ones((1, 1, 3, 1), dtype=jnp.float32)
    g = jnp.full_like(q, jnp.log(0.5))
    beta = jnp.ones((1, 1, 3), dtype=jnp.float32)
    segment_ids = jnp.array([[1, 0, 0]], dtype=jnp.int32)
    output, final_state = kj.kimi_delta_attention(q, k, v, g, beta, segment_ids=segment_ids, output_final_state=True,
                                                  implementation="xla", **n_kwarg)
    _, unpadded_final_state = kj.kimi_delta_attention(
        q[:, :, :1], k[:, :, :1], v[:, :, :1], g[:, :, :1], beta[:, :, :1], segment_ids=segment_ids[:, :1],
        output_final_state=True, implementation="xla", **n_kwarg)
    _assert_trees_all_close(final_state, unpadded_final_state)
    _assert_trees_all_close(output[:, :, 1:], jnp.zeros_like(output[:, :, 1:]))


class TestExperimentalApiTest:
    """tokamax/_src/ops/experimental/kda/api_test.py (KimiDeltaAttentionTest); base_test.py
    @0f143420 has the same tests (older A_log / dt_bias / N_max / cp_context names)."""

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bfloat16", "float32"])
    def test_kimi_delta_attention_matches_reference(self, dtype, scheme):
        _check_matches_reference(kj.kimi_delta_attention, _run_reference, _make_inputs_api(dtype, scheme))

    def test_kimi_delta_attention_gradients_match_reference(self, scheme):
        _check_gradients_match_reference(kj.kimi_delta_attention, _reference_kda,
                                         _make_inputs_api(jnp.float32, scheme))

    def test_varlen_gate_l2norm_matches_reference(self, scheme):
        q, k, v, g, beta, _ = _make_inputs_api(jnp.float32, scheme)
        segment_ids = jnp.array([[1, 1, 2, 2, 2, 0, 0], [1, 2, 2, 3, 3, 3, 0]], dtype=jnp.int32)
        initial_state = jnp.zeros((2, 3, 3, 8, 5), dtype=jnp.float32)
        A_log = jnp.log(jnp.array([1.0, 1.5, 2.0], dtype=jnp.float32))
        dt_bias = jnp.linspace(-0.2, 0.2, 3 * 8, dtype=jnp.float32)

        # The older API's keyword names (A_log, dt_bias, use_qk_l2norm_in_kernel, safe_gate, N_max).
        output, final_state = kj.kimi_delta_attention(
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state, output_final_state=True,
            use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, segment_ids=segment_ids, safe_gate=False,
            N_max=3, implementation="xla")
        ref_output, ref_final_state = _run_reference(
            q, k, v, g, beta, a_log=A_log, delta_time_bias=dt_bias, initial_state=initial_state,
            output_final_state=True, use_gate_in_kernel=True, use_qk_l2norm=True, segment_ids=segment_ids)

        assert final_state.shape == initial_state.shape
        _assert_trees_all_close(output, ref_output, atol=0.01, rtol=0.01)
        _assert_trees_all_close(final_state, ref_final_state, atol=0.01, rtol=0.01)

    @pytest.mark.parametrize("implementation", [None, ("pallas_tpu", "xla")], ids=["default", "explicit"])
    def test_pallas_tpu_registered_and_default_falls_back_to_xla(self, implementation):
        """Also the oldest api_test's test_pallas_tpu_registered_and_falls_back_to_xla, which passed
        ("pallas_tpu", "xla") explicitly (the "explicit" case)."""
        q, k, v, g, beta, initial_state = _make_inputs_api(jnp.float32)
        assert "pallas_tpu" in kj.IMPLEMENTATIONS
        # Newer version (29fa18c4, which added pallas_tpu_bwd.py): the vjp is not None; the older
        # 974f1ad0 and the oldest asserted it was None.
        assert kj.IMPLEMENTATIONS["pallas_tpu"].vjp is not None
        assert kj._DEFAULT_IMPLEMENTATIONS == ("pallas_tpu", "xla")

        output, final_state = kj.kimi_delta_attention(q, k, v, g, beta, initial_state=initial_state,
                                                      output_final_state=True, implementation=implementation)
        ref_output, ref_final_state = kj.kimi_delta_attention(q, k, v, g, beta, initial_state=initial_state,
                                                              output_final_state=True, implementation="xla")

        _assert_trees_all_close(output, ref_output, atol=0.01, rtol=0.01)
        _assert_trees_all_close(final_state, ref_final_state, atol=0.01, rtol=0.01)

    def test_pallas_tpu_alone_is_not_supported_in_cpu_test_shape(self):
        """Deliberate deviation (docs/PYTHON.md): Tokamax's TPU kernel needs T to be a multiple of
        64 and its test expects NotImplementedError for T = 7; libkda has no such limit, so
        "pallas_tpu" runs and equals "xla" (both are libkda's kernels)."""
        q, k, v, g, beta, _ = _make_inputs_api(jnp.float32)
        assert q.shape[2] % 64 != 0
        out = kj.kimi_delta_attention(q, k, v, g, beta, implementation="pallas_tpu")
        ref = kj.kimi_delta_attention(q, k, v, g, beta, implementation="xla")
        np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ref[0]))
        assert out[1] is None and ref[1] is None

    def test_no_final_state_by_default(self):
        q, k, v, g, beta, _ = _make_inputs_api(jnp.float32)
        output, final_state = kj.kimi_delta_attention(q, k, v, g, beta)
        assert output.shape == v.shape
        assert final_state is None

    def test_varlen_requires_n_max_without_initial_state(self):
        q, k, v, g, beta, segment_ids = _three_segment_inputs()
        with pytest.raises(ValueError, match="`N_max` is required"):
            kj.kimi_delta_attention(q, k, v, g, beta, segment_ids=segment_ids, implementation="xla")

    def test_n_max_must_match_initial_state_segment_dimension(self):
        q, k, v, g, beta, initial_state = _make_inputs_api(jnp.float32)

        with pytest.raises(ValueError, match="must match"):
            kj.kimi_delta_attention(q, k, v, g, beta, initial_state=initial_state, N_max=2, implementation="xla")

    def test_padding_preserves_final_state(self):
        _check_padding_preserves_final_state(N_max=1)  # the older API's name

    def test_cp_context_does_not_break_public_op_metadata(self):
        q, k, v, g, beta, _ = _make_inputs_api(jnp.float32)
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("context",))

        output, _ = kj.kimi_delta_attention(q, k, v, g, beta, cp_context=_ContextParallelMetadata(mesh=mesh),
                                            implementation="xla")

        assert output.shape == v.shape

    def test_invalid_shape(self):
        q, k, v, g, beta, _ = _make_inputs_api(jnp.float32)
        with pytest.raises(ValueError, match="`k` shape"):
            kj.kimi_delta_attention(q, k[:, :, :-1], v, g, beta)

    def test_unsupported_implementation(self):
        q, k, v, g, beta, _ = _make_inputs_api(jnp.float32)
        # Conflict between versions: this file (and base_test.py up to 84c7a4fc) passed
        # implementation="xla_chunked" as the unknown name; the newer base_test.py (bf5fb0db)
        # passes "unknown", and xla_chunked_test.py runs "xla_chunked". The newer version wins.
        with pytest.raises(ValueError, match="Unknown implementation"):
            kj.kimi_delta_attention(q, k, v, g, beta, implementation="unknown")


# ---------------------------------------------------------------------------------------------
# tokamax/_src/ops/experimental/kda/base_test.py (84c7a4fc, bf5fb0db)
# ---------------------------------------------------------------------------------------------

def _l2_normalize(x):
    x_f32 = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.sum(jnp.square(x_f32), axis=-1) + 1e-6)
    return (x_f32 * rstd[..., None]).astype(x.dtype)


def _activated_inputs(structs, scheme):
    """Both _make_inputs of Tokamax's base_test and the batch-first api_test: random leaves, then
    silu(q), silu(k), g = -0.1 softplus(g), sigmoid(beta)."""
    q, k, v, g, beta, initial_state = _random_initialize(structs, scheme=scheme)
    return jax.nn.silu(q), jax.nn.silu(k), v, -0.1 * jax.nn.softplus(g), jax.nn.sigmoid(beta), initial_state


def _make_inputs_base(dtype, *, heads=3, batch=2, seq_len=7, key_dim=8, value_dim=5, scheme="numpy"):
    structs = (
        jax.ShapeDtypeStruct((heads, batch, seq_len, key_dim), dtype),
        jax.ShapeDtypeStruct((heads, batch, seq_len, key_dim), dtype),
        jax.ShapeDtypeStruct((heads, batch, seq_len, value_dim), dtype),
        jax.ShapeDtypeStruct((heads, batch, seq_len, key_dim), dtype),
        jax.ShapeDtypeStruct((heads, batch, seq_len), dtype),
        jax.ShapeDtypeStruct((batch, 1, heads, key_dim, value_dim), jnp.float32),
    )
    return _activated_inputs(structs, scheme)


class TestExperimentalBaseTest:
    """tokamax/_src/ops/experimental/kda/base_test.py (KimiDeltaAttentionTest), the versions with
    the descriptive names (a_log, delta_time_bias, use_qk_l2norm, max_num_segments,
    context_parallel_metadata)."""

    def test_chunk_size_is_not_public(self):
        assert "chunk_size" not in inspect.signature(kj.kimi_delta_attention).parameters

    def test_public_api_uses_descriptive_names(self):
        parameters = inspect.signature(kj.kimi_delta_attention).parameters
        for name in ("delta_time_bias", "use_qk_l2norm", "context_parallel_metadata"):
            assert name in parameters, name
        for name in ("dt_bias", "use_qk_l2norm_in_kernel", "cp_context", "safe_gate", "disable_recompute"):
            assert name not in parameters, name

    @pytest.mark.parametrize(
        "dtype, use_qk_l2norm, use_gate_in_kernel, variable_length",
        [
            (jnp.bfloat16, False, False, False),
            (jnp.float32, False, False, False),
            (jnp.float32, True, False, False),
            (jnp.float32, False, True, False),
            (jnp.float32, True, True, True),
        ],
        ids=["bfloat16", "float32", "qk_l2norm", "raw_gate", "varlen_gate_l2norm"],
    )
    def test_default_implementation_matches_xla(self, dtype, use_qk_l2norm, use_gate_in_kernel, variable_length,
                                                 scheme):
        if variable_length:
            q, k, v, g, beta, _ = _make_inputs_base(dtype, heads=2, batch=2, key_dim=64, value_dim=64, scheme=scheme)
            segment_ids = jnp.array([[1, 1, 2, 2, 2, 0, 0], [1, 2, 2, 3, 3, 3, 0]], dtype=jnp.int32)
            initial_state = jnp.zeros((2, 3, 2, 64, 64), dtype=jnp.float32)
            max_num_segments = 3
        else:
            q, k, v, g, beta, initial_state = _make_inputs_base(dtype, heads=2, batch=1, seq_len=64, key_dim=64,
                                                                value_dim=64, scheme=scheme)
            segment_ids = None
            max_num_segments = None

        if not use_qk_l2norm:
            q = _l2_normalize(q)
            k = _l2_normalize(k)
        initial_state = 0.1 * initial_state

        heads, _, _, key_dim = q.shape
        if use_gate_in_kernel:
            a_log = jnp.log(jnp.linspace(1.0, 2.0, heads, dtype=jnp.float32))
            delta_time_bias = jnp.linspace(-0.2, 0.2, heads * key_dim, dtype=jnp.float32)
        else:
            a_log = delta_time_bias = None

        def call(implementation):
            @jax.jit
            def f(q, k, v, g, beta, initial_state, a_log, delta_time_bias, segment_ids):
                return kj.kimi_delta_attention(
                    q, k, v, g, beta, a_log=a_log, delta_time_bias=delta_time_bias, initial_state=initial_state,
                    output_final_state=True, use_qk_l2norm=use_qk_l2norm, use_gate_in_kernel=use_gate_in_kernel,
                    segment_ids=segment_ids, max_num_segments=max_num_segments, implementation=implementation)

            return f(q, k, v, g, beta, initial_state, a_log, delta_time_bias, segment_ids)

        actual = call(None)
        expected = call("xla")
        _assert_trees_all_close(actual, expected, atol=0.05, rtol=0.05)
        # Tokamax's "xla" is its reference recurrence: the same check against the float64 one.
        reference = _run_reference(q, k, v, g, beta, a_log=a_log, delta_time_bias=delta_time_bias,
                                   initial_state=initial_state, output_final_state=True, use_qk_l2norm=use_qk_l2norm,
                                   use_gate_in_kernel=use_gate_in_kernel, segment_ids=segment_ids,
                                   max_num_segments=max_num_segments)
        _assert_trees_all_close(actual, reference, atol=0.05, rtol=0.05)

    def test_mosaic_registered(self):
        if "mosaic_tpu" not in kj.IMPLEMENTATIONS:
            pytest.skip("mosaic_tpu implementation is not registered.")  # as Tokamax's test does
        assert "mosaic_tpu" in kj.IMPLEMENTATIONS
        assert kj.IMPLEMENTATIONS["mosaic_tpu"].vjp is not None
        assert kj._DEFAULT_IMPLEMENTATIONS == ("mosaic", "xla")

    def test_no_final_state_by_default(self):
        q, k, v, g, beta, _ = _make_inputs_base(jnp.float32)
        output, final_state = kj.kimi_delta_attention(query=q, key=k, value=v, gate=g, beta=beta)
        assert output.shape == v.shape
        assert final_state is None

    @pytest.mark.parametrize("implementation", ["xla", "mosaic"])
    def test_varlen_requires_max_num_segments_without_initial_state(self, implementation):
        if implementation == "mosaic" and "mosaic_tpu" not in kj.IMPLEMENTATIONS:
            pytest.skip("mosaic_tpu implementation is not registered.")  # as Tokamax's test does
        q, k, v, g, beta, segment_ids = _three_segment_inputs()
        with pytest.raises(ValueError, match="`max_num_segments` is required"):
            kj.kimi_delta_attention(q, k, v, g, beta, segment_ids=segment_ids, implementation=implementation)

    def test_max_num_segments_must_match_initial_state_segment_dimension(self):
        q, k, v, g, beta, initial_state = _make_inputs_base(jnp.float32)

        with pytest.raises(ValueError, match="must match"):
            kj.kimi_delta_attention(q, k, v, g, beta, initial_state=initial_state, max_num_segments=2,
                                    implementation="xla")

    def test_padding_preserves_final_state(self):
        _check_padding_preserves_final_state(max_num_segments=1)

    def test_context_parallel_metadata_does_not_break_public_op_metadata(self):
        q, k, v, g, beta, _ = _make_inputs_base(jnp.float32)
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("context",))

        output, _ = kj.kimi_delta_attention(q, k, v, g, beta,
                                            context_parallel_metadata=_ContextParallelMetadata(mesh=mesh),
                                            implementation="xla")

        assert output.shape == v.shape

    def test_bind_uses_jaxtyping_validation(self):
        jt = pytest.importorskip("jaxtyping", reason="jaxtyping is not installed (Tokamax's test imports it)")
        q, k, v, g, beta, initial_state = _make_inputs_base(jnp.float32)
        implementation = kj.IMPLEMENTATIONS["xla"]

        with pytest.raises(jt.TypeCheckError):
            implementation.bind(q[:, :, 0], k, v, g, beta)

        mismatched_inputs = (
            ("key", (q, k[..., :-1], v, g, beta)),
            ("value", (q, k, v[:, :-1], g, beta)),
            ("gate", (q, k, v, g[:, :, :-1], beta)),
            ("beta", (q, k, v, g, beta[..., :-1])),
        )
        for name, inputs in mismatched_inputs:
            with pytest.raises(jt.TypeCheckError):
                implementation.bind(*inputs)

        with pytest.raises(jt.TypeCheckError):  # subTest "initial_state"
            implementation.bind(q, k, v, g, beta, initial_state=initial_state[:, :, :, :-1])

        with pytest.raises(jt.TypeCheckError):  # subTest "segment_ids"
            implementation.bind(q, k, v, g, beta, segment_ids=jnp.ones((q.shape[1], q.shape[2] + 1), jnp.int32),
                                max_num_segments=1)

    def test_unsupported_implementation(self):
        q, k, v, g, beta, _ = _make_inputs_base(jnp.float32)
        # bf5fb0db (newer): "unknown". 84c7a4fc (older) used "xla_chunked", which the newer
        # xla_chunked_test.py runs as an implementation; the newer version is followed.
        with pytest.raises(ValueError, match="Unknown implementation"):
            kj.kimi_delta_attention(q, k, v, g, beta, implementation="unknown")


# ---------------------------------------------------------------------------------------------
# tokamax/_src/ops/experimental/kda/xla_chunked_test.py (cbfc557f, 15c9964d)
# ---------------------------------------------------------------------------------------------

def _make_inputs_chunked(*, heads=2, batch=1, seq_len=64, key_dim=8, value_dim=6):
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    q = 0.1 * jax.random.normal(keys[0], (heads, batch, seq_len, key_dim))
    k = 0.1 * jax.random.normal(keys[1], q.shape)
    v = 0.1 * jax.random.normal(keys[2], (heads, batch, seq_len, value_dim))
    raw_gate = 0.1 * jax.random.normal(keys[3], q.shape)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (heads, batch, seq_len)))
    initial_state = 0.01 * jax.random.normal(keys[5], (batch, 1, heads, key_dim, value_dim))
    return q, k, v, raw_gate, beta, initial_state


def _call_chunked(implementation, q, k, v, gate, beta, initial_state, *, use_gate_in_kernel, segment_ids=None,
                  max_num_segments=None, fn=None):
    """xla_chunked_test.py's _call; fn=None calls libkda.jax.kimi_delta_attention, fn=
    _run_reference the float64 reference with the same arguments."""
    a_log = None
    delta_time_bias = None
    if use_gate_in_kernel:
        a_log = jnp.log(jnp.linspace(1.0, 1.5, q.shape[0]))
        delta_time_bias = jnp.linspace(-0.2, 0.2, q.shape[0] * q.shape[-1])
    else:
        gate = -0.05 * jax.nn.softplus(gate)
    kwargs = dict(a_log=a_log, delta_time_bias=delta_time_bias, initial_state=initial_state, output_final_state=True,
                  use_gate_in_kernel=use_gate_in_kernel, segment_ids=segment_ids,
                  lower_bound=-5.0 if use_gate_in_kernel else None, max_num_segments=max_num_segments)
    if fn is not None:
        return fn(q, k, v, gate, beta, **kwargs)
    return kj.kimi_delta_attention(q, k, v, gate, beta, implementation=implementation, **kwargs)


def _packed_segment_ids():
    return jnp.concatenate([
        jnp.ones((1, 17), dtype=jnp.int32),
        jnp.full((1, 40), 2, dtype=jnp.int32),
        jnp.zeros((1, 7), dtype=jnp.int32),
    ], axis=1)


class TestXlaChunkedKimiDeltaAttentionTest:
    """tokamax/_src/ops/experimental/kda/xla_chunked_test.py (XlaChunkedKimiDeltaAttentionTest).
    Tokamax compares "xla_chunked" with "xla" (its reference recurrence); here both names run
    libkda's kernels, so each test also compares with the float64 reference."""

    # cbfc557f (newer) parameterizes over use_gate_in_kernel; 15c9964d ran True only (and
    # rejected the pre-activated gate in xla_chunked). The newer version is followed.
    @pytest.mark.parametrize("use_gate_in_kernel", [False, True])
    def test_fixed_forward_matches_recurrence(self, use_gate_in_kernel):
        args = _make_inputs_chunked()
        expected = _call_chunked("xla", *args, use_gate_in_kernel=use_gate_in_kernel)
        actual = _call_chunked("xla_chunked", *args, use_gate_in_kernel=use_gate_in_kernel)

        _assert_trees_all_close(actual, expected, atol=2e-4, rtol=2e-4)
        reference = _call_chunked(None, *args, use_gate_in_kernel=use_gate_in_kernel, fn=_run_reference)
        _assert_trees_all_close(actual, reference, atol=2e-4, rtol=2e-4)

    def test_unsupported_gate_config_falls_back_to_xla(self):
        args = _make_inputs_chunked()
        expected = _call_chunked("xla", *args, use_gate_in_kernel=False)
        actual = _call_chunked(("xla_chunked", "xla"), *args, use_gate_in_kernel=False)

        _assert_trees_all_close(actual, expected, atol=2e-4, rtol=2e-4)
        reference = _call_chunked(None, *args, use_gate_in_kernel=False, fn=_run_reference)
        _assert_trees_all_close(actual, reference, atol=2e-4, rtol=2e-4)

    def test_packed_forward_matches_recurrence(self):
        q, k, v, gate, beta, _ = _make_inputs_chunked()
        segment_ids = _packed_segment_ids()
        initial_state = jnp.zeros((1, 2, q.shape[0], q.shape[-1], v.shape[-1]), dtype=jnp.float32)

        expected = _call_chunked("xla", q, k, v, gate, beta, initial_state, use_gate_in_kernel=True,
                                 segment_ids=segment_ids, max_num_segments=2)
        actual = _call_chunked("xla_chunked", q, k, v, gate, beta, initial_state, use_gate_in_kernel=True,
                               segment_ids=segment_ids, max_num_segments=2)

        _assert_trees_all_close(actual, expected, atol=3e-4, rtol=3e-4)
        reference = _call_chunked(None, q, k, v, gate, beta, initial_state, use_gate_in_kernel=True,
                                  segment_ids=segment_ids, max_num_segments=2, fn=_run_reference)
        _assert_trees_all_close(actual, reference, atol=3e-4, rtol=3e-4)

    def test_vjp_matches_recurrence(self):
        q, k, v, gate, beta, initial_state = _make_inputs_chunked(heads=1, key_dim=4, value_dim=3)
        a_log = jnp.zeros((1,), dtype=jnp.float32)
        delta_time_bias = jnp.zeros((4,), dtype=jnp.float32)

        def loss(implementation, q, k, v, gate, beta, a_log, bias, state):
            fn = _reference_kda if implementation == "reference" else functools.partial(
                kj.kimi_delta_attention, implementation=implementation)
            output, final_state = fn(q, k, v, gate, beta, a_log=a_log, delta_time_bias=bias, initial_state=state,
                                     output_final_state=True, use_gate_in_kernel=True, lower_bound=-5.0)
            assert final_state is not None
            # Tokamax sums output.astype(float32); the float64 reference keeps float64.
            acc = output.dtype if implementation == "reference" else jnp.float32
            return jnp.sum(output.astype(acc)) + 0.1 * jnp.sum(final_state)

        argnums = tuple(range(1, 9))
        args = (q, k, v, gate, beta, a_log, delta_time_bias, initial_state)
        expected = jax.grad(loss, argnums=argnums)("xla", *args)
        actual = jax.grad(loss, argnums=argnums)("xla_chunked", *args)

        _assert_trees_all_close(actual, expected, atol=1e-3, rtol=1e-3)
        reference = _reference_grad(functools.partial(loss, "reference"), args, argnums=tuple(range(8)))
        _assert_trees_all_close(actual, reference, atol=1e-3, rtol=1e-3)

    def test_packed_vjp_without_final_state_matches_recurrence(self):
        q, k, v, gate, beta, _ = _make_inputs_chunked(heads=1, key_dim=4, value_dim=3)
        segment_ids = _packed_segment_ids()
        a_log = jnp.zeros((1,), dtype=jnp.float32)
        delta_time_bias = jnp.zeros((4,), dtype=jnp.float32)

        def loss(implementation, q, k, v, gate, beta, a_log, bias):
            fn = _reference_kda if implementation == "reference" else functools.partial(
                kj.kimi_delta_attention, implementation=implementation)
            output, final_state = fn(q, k, v, gate, beta, a_log=a_log, delta_time_bias=bias, output_final_state=False,
                                     use_gate_in_kernel=True, segment_ids=segment_ids, lower_bound=-5.0,
                                     max_num_segments=2)
            assert final_state is None
            acc = output.dtype if implementation == "reference" else jnp.float32  # as above
            return jnp.sum(output.astype(acc))

        argnums = tuple(range(1, 8))
        args = (q, k, v, gate, beta, a_log, delta_time_bias)
        expected = jax.grad(loss, argnums=argnums)("xla", *args)
        actual = jax.grad(loss, argnums=argnums)("xla_chunked", *args)

        _assert_trees_all_close(actual, expected, atol=2e-3, rtol=2e-3)
        reference = _reference_grad(functools.partial(loss, "reference"), args, argnums=tuple(range(7)))
        _assert_trees_all_close(actual, reference, atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------------------------------------
# tokamax/_src/ops/experimental/kda/pallas_tpu_test.py (974f1ad0): test_chunk_kda_forward, a
# TPU-only test of the public api.kimi_delta_attention that runs each configuration through
# implementation="pallas_tpu" and "xla" and compares them with compare_tensor (allclose at the
# case's atol / rtol, else within one ulp). Here "pallas_tpu" runs libkda's kernels, so it is
# compared with the float64 reference instead, at the same atol / rtol, called exactly as
# _call_attention calls it (the older keywords A_log, dt_bias, N_max, safe_gate,
# disable_recompute, chunk_size=64).
# Ported: the 29 configurations whose shapes or options no other test here has (K != V,
# K = 129 / V = 127, bf16 initial states, per-row segment layouts, N_max above the segment
# count, trailing padding, lower_bound=-0.01, its padding_tail and empty_states checks); its other
# 113 repeat these options at other sizes and dtypes (up to T = 32768) or need context
# parallelism over several devices.
# CI runs one case per option above (_PALLAS_TPU_CI); KDA_LARGE_TESTS=1 runs all 29.
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _PallasTpuCase:
    """pallas_tpu_test.py's TestConfig (the fields a forward case uses)."""

    name: str
    seq_len: int
    heads: int
    batch_size: int = 1
    seq_lens: tuple = None
    batch_seq_lens: tuple = None
    n_max_override: int = None
    key_dim: int = 128
    value_dim: int = 128
    dtype: object = jnp.bfloat16
    input_profile: str = "model"
    seed: int = 42
    scale: float = None
    gate_logit_normalizer: float = 1.0
    gate_mask_probability: float = 0.0
    use_initial_state: bool = False
    output_final_state: bool = False
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    safe_gate: bool = True
    lower_bound: float = None
    disable_recompute: bool = True
    forward_check: str = "reference"
    forward_atol: float = 0.05
    forward_rtol: float = 0.05
    state_atol: float = None
    state_rtol: float = None
    # The backward's fields (pallas_tpu_test.py @1ef6dd77; the forward cases ignore them).
    backward_check: str = "reference"
    backward_atol: float = 0.05
    backward_rtol: float = 0.05
    long: bool = False

    @property
    def layouts(self):
        return self.batch_seq_lens if self.batch_seq_lens is not None else (
            (self.seq_lens,) if self.seq_lens is not None else None)

    @property
    def batch(self):
        return len(self.layouts) if self.layouts is not None else self.batch_size

    @property
    def n_max(self):
        if self.layouts is None:
            return None
        return max(max(len(lens) for lens in self.layouts), self.n_max_override or 0)

    @property
    def effective_scale(self):
        return self.scale if self.scale is not None else self.key_dim ** -0.5


def _pallas_case(name, *, T, H, B=1, D=None, K=None, V=None, seq_lens=None, batch_seq_lens=None, **kwargs):
    """make_test_config: the batch-first names."""
    K = D if K is None else K
    V = D if V is None else V
    if batch_seq_lens is not None:
        B = len(batch_seq_lens)
    return _PallasTpuCase(name=name, seq_len=T, heads=H, batch_size=B, seq_lens=seq_lens,
                          batch_seq_lens=batch_seq_lens, key_dim=K, value_dim=V, **kwargs)


def _chunk_api_case(name, dtype=jnp.float32, has_h0=True, **cfg):
    bf16 = dtype == jnp.bfloat16
    masked_gate = cfg.get("gate_mask_probability", 0.0) > 0 or cfg.get("gate_logit_normalizer", 1.0) != 1.0
    backward_tol = 0.05 if bf16 else (2e-2 if masked_gate else 1e-2)
    return _pallas_case(f"chunk_api_{name}", dtype=dtype, input_profile="chunk_api", use_initial_state=has_h0,
                        output_final_state=True, safe_gate=cfg.pop("safe_gate", False),
                        disable_recompute=cfg.pop("disable_recompute", False), forward_atol=0.05 if bf16 else 5e-3,
                        forward_rtol=0.05 if bf16 else 5e-3, backward_atol=backward_tol, backward_rtol=backward_tol,
                        **cfg)


def _chunk_fwd_case(name, dtype=jnp.float32, **cfg):
    bf16 = dtype == jnp.bfloat16
    return _pallas_case(f"chunk_fwd_{name}", dtype=dtype, input_profile="chunk_fwd", safe_gate=False,
                        disable_recompute=False, forward_atol=0.05 if bf16 else 2e-4,
                        forward_rtol=0.05 if bf16 else 2e-4, backward_atol=0.05 if bf16 else 1e-3,
                        backward_rtol=0.05 if bf16 else 1e-3, use_initial_state=True, output_final_state=True, **cfg)


def _varlen_case(name, *, seq_lens=None, batch_seq_lens=None, T=None, H=2, K=128, V=128, N_pad=None,
                 dtype=jnp.float32, **kwargs):
    T = T or max(sum(lens) for lens in (batch_seq_lens or (seq_lens,)))
    bf16 = dtype == jnp.bfloat16
    tol = dict(forward_atol=0.05 if bf16 else 5e-4, forward_rtol=0.05 if bf16 else 5e-4,
               state_atol=0.05 if bf16 else 2e-3, state_rtol=0.05 if bf16 else 2e-3,
               backward_atol=0.05 if bf16 else 1e-2, backward_rtol=0.05 if bf16 else 5e-3)
    tol.update({n: kwargs.pop(n) for n in list(kwargs) if n in tol})
    kwargs.setdefault("long", T >= 8192)
    return _pallas_case(name, T=T, H=H, K=K, V=V, seq_lens=seq_lens, batch_seq_lens=batch_seq_lens,
                        n_max_override=N_pad, dtype=dtype, output_final_state=True, **tol, **kwargs)


_PROD = dict(safe_gate=True, disable_recompute=False, forward_atol=8e-4, forward_rtol=8e-4, state_atol=5e-3,
             state_rtol=5e-3, backward_atol=2e-2, backward_rtol=1e-2)
_FUSED = dict(H=8, input_profile="prod", use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0,
              forward_atol=8e-4, forward_rtol=8e-4, state_atol=8e-3, state_rtol=8e-3, backward_atol=0.05,
              backward_rtol=0.05)
_PALLAS_TPU_CASES = [
    _chunk_api_case("b2_t64_h4_k16_v32_fp32", B=2, T=64, H=4, K=16, V=32),
    _chunk_api_case("b1_t128_h2_k128_v64_fp32", T=128, H=2, K=128, V=64),
    _chunk_api_case("b1_t128_h2_k64_v128_fp32", T=128, H=2, K=64, V=128),
    _chunk_api_case("b1_t128_h2_k128_v64_bf16", T=128, H=2, K=128, V=64, dtype=jnp.bfloat16),
    _chunk_api_case("b1_t64_h2_d64_fp32_no_h0", T=64, H=2, D=64, has_h0=False),
    _chunk_api_case("normalizer8_mask03", T=256, H=2, D=64, gate_logit_normalizer=8.0, gate_mask_probability=0.3),
    _chunk_api_case("l2norm_in_kernel", T=256, H=2, D=64, scale=0.125, use_qk_l2norm_in_kernel=True),
    _chunk_fwd_case("e2e_3", B=2, T=128, H=4, K=64, V=128),
    _chunk_fwd_case("e2e_7", T=64, H=1, D=32, dtype=jnp.bfloat16),  # bf16 initial state
    _chunk_fwd_case("e2e_8", T=128, H=2, D=64, dtype=jnp.bfloat16),  # bf16 initial state
    _varlen_case("segment_ids_recurrent_2", seq_lens=(30, 50), T=128, disable_recompute=False),
    _varlen_case("segment_ids_recurrent_5", seq_lens=(45, 80, 20), T=256, use_initial_state=True,
                 disable_recompute=False),
    _varlen_case("segment_ids_batch_2_fp32", batch_seq_lens=((64, 64), (128,), (64, 64)), disable_recompute=False),
    _varlen_case("segment_ids_batch_3_fp32", batch_seq_lens=((30, 50), (45, 35)), disable_recompute=False),
    _varlen_case("varlen_e2e_5", seq_lens=(64, 128), T=256, N_pad=8),
    _varlen_case("varlen_e2e_10", seq_lens=(40, 55), T=256, N_pad=8, use_initial_state=True),
    _varlen_case("varlen_e2e_18", seq_lens=(40, 55), T=256, N_pad=8, dtype=jnp.bfloat16, use_initial_state=True),
    _varlen_case("varlen_batch_2", batch_seq_lens=((64, 128), (64, 64, 64)), use_initial_state=True),
    _varlen_case("prod_preactivated_2", seq_lens=(30, 50), T=128, input_profile="prod", **_PROD),
    _varlen_case("prod_preactivated_10", seq_lens=(64, 128), input_profile="low_gate", **_PROD),
    _varlen_case("prod_preactivated_13", seq_lens=(64, 128), input_profile="strong_gate", **_PROD),
    _varlen_case("segment_fused_fwd_3", seq_lens=(45, 80, 20), T=256, **_FUSED),
    _varlen_case("segment_fused_batch_2", batch_seq_lens=((64, 128), (64, 64, 64)), use_initial_state=True,
                 **_FUSED),
    _varlen_case("tokamax_varlen_fused", seq_lens=(45, 80, 20), T=256, use_initial_state=True,
                 use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-0.01, disable_recompute=False,
                 forward_atol=0.05, forward_rtol=0.05, state_atol=0.05, state_rtol=0.05),
    _pallas_case("tokamax_fixed_unaligned_kv", T=64, H=1, K=129, V=127, dtype=jnp.bfloat16),
    _pallas_case("varlen_shallow_tail", T=256, H=2, D=128, seq_lens=(30, 50), dtype=jnp.float32),
    _pallas_case("varlen_padding_tail", T=128, H=2, D=128, seq_lens=(30, 50), dtype=jnp.float32,
                 forward_check="padding_tail"),
    _varlen_case("varlen_empty_states_h0", seq_lens=(64, 128), T=256, N_pad=8, use_initial_state=True,
                 forward_check="empty_states"),
    _varlen_case("varlen_empty_states_no_h0", seq_lens=(64, 128), T=256, N_pad=8, forward_check="empty_states"),
]

_PALLAS_TPU_CI = {
    "chunk_api_b2_t64_h4_k16_v32_fp32", "chunk_api_b1_t128_h2_k128_v64_bf16", "chunk_api_b1_t64_h2_d64_fp32_no_h0",
    "chunk_api_normalizer8_mask03", "chunk_api_l2norm_in_kernel", "chunk_fwd_e2e_7", "segment_ids_batch_3_fp32",
    "varlen_e2e_18", "varlen_batch_2", "prod_preactivated_2", "prod_preactivated_13", "segment_fused_fwd_3",
    "tokamax_varlen_fused", "tokamax_fixed_unaligned_kv", "varlen_padding_tail", "varlen_empty_states_h0",
    "varlen_empty_states_no_h0",
}
_PALLAS_TPU_PARAMS = [
    pytest.param(case, id=case.name, marks=() if LARGE or case.name in _PALLAS_TPU_CI else
                 pytest.mark.skip(reason="the same options as a CI case; KDA_LARGE_TESTS=1 runs it"))
    for case in _PALLAS_TPU_CASES
]


def _pallas_tpu_inputs(case):
    """pallas_tpu_test.py's _make_inputs: its distributions per input profile, drawn with numpy
    (its jax.random draws compile for every shape, about a second a case on CPU). Returns q, k, v,
    g, beta (head-first, in case.dtype), A_log, dt_bias, initial_state or None, segment_ids or None."""
    rng = np.random.default_rng(case.seed)
    qk_shape = (case.heads, case.batch, case.seq_len, case.key_dim)
    v_shape = (case.heads, case.batch, case.seq_len, case.value_dim)
    beta_shape = (case.heads, case.batch, case.seq_len)
    uniform = lambda shape, lo=0.0, hi=1.0: rng.uniform(lo, hi, shape).astype(np.float32)  # noqa: E731
    normal = lambda shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    sigmoid = lambda x: 0.5 + 0.5 * np.tanh(0.5 * x)  # noqa: E731  (no overflow)
    softplus = lambda x: np.logaddexp(0, x)  # noqa: E731
    segment_ids = None
    valid = np.ones((case.batch, case.seq_len), bool)
    if case.layouts is not None:
        segment_ids = np.zeros((case.batch, case.seq_len), np.int32)
        for b, lens in enumerate(case.layouts):
            segment_ids[b, :sum(lens)] = np.repeat(np.arange(1, len(lens) + 1), lens)
        valid = segment_ids > 0
    profile = case.input_profile
    if profile == "chunk_api":
        q, k, v = uniform(qk_shape), uniform(qk_shape), uniform(v_shape)
        if not case.use_qk_l2norm_in_kernel:
            q, k = _l2_normalize(q), _l2_normalize(k)
        g_raw = uniform(qk_shape)
        A_log, dt_bias = normal((case.heads,)), normal((case.heads * case.key_dim,))
        g = g_raw if case.use_gate_in_kernel else -softplus(-g_raw) / case.gate_logit_normalizer  # log_sigmoid
        if case.safe_gate and not case.use_gate_in_kernel:
            g = np.clip(g, -5.0, 0.0)
        beta = sigmoid(normal(beta_shape))
        initial_scale, initial_dtype = 1.0, jnp.float32
    elif profile == "chunk_fwd":
        q, k, v = 0.1 * normal(qk_shape), 0.1 * normal(qk_shape), 0.1 * normal(v_shape)
        g = -0.05 * np.abs(normal(qk_shape))
        beta = 0.5 * sigmoid(normal(beta_shape))
        A_log, dt_bias = np.zeros(case.heads, np.float32), np.zeros(case.heads * case.key_dim, np.float32)
        initial_scale, initial_dtype = 0.01, case.dtype
    else:  # "model", "prod", "low_gate", "strong_gate"
        silu = lambda x: x * sigmoid(x)  # noqa: E731
        q, k = silu(normal(qk_shape)), silu(normal(qk_shape))
        if not case.use_qk_l2norm_in_kernel:
            q, k = _l2_normalize(jnp.asarray(q, case.dtype)), _l2_normalize(jnp.asarray(k, case.dtype))
        v = {"strong_gate": 2.0, "prod": 1.5, "low_gate": 1.5}.get(profile, 1.0) * normal(v_shape)
        if profile == "model":
            A_log = np.log(uniform((case.heads,), 1.0, 16.0))
            dt = np.exp(uniform((case.heads * case.key_dim,)) * (np.log(0.1) - np.log(0.001))
                        + np.log(0.001)).clip(min=1e-4)
            dt_bias = dt + np.log(-np.expm1(-dt))
            g_raw, beta = normal(qk_shape), sigmoid(normal(beta_shape))
        elif profile == "prod":
            A_log, dt_bias = uniform((case.heads,), 0.2, 3.0), uniform((case.heads * case.key_dim,), -8.0, -1.5)
            g_raw, beta = uniform(qk_shape, -4.5, 4.5), uniform(beta_shape, 0.05, 0.95)
        elif profile == "low_gate":
            A_log = np.full(case.heads, 2.5, np.float32)
            dt_bias = np.full(case.heads * case.key_dim, -10.0, np.float32)
            g_raw, beta = uniform(qk_shape, -1.0, 1.0), uniform(beta_shape, 0.3, 0.95)
        else:
            A_log = np.full(case.heads, 2.7, np.float32)
            dt_bias = np.full(case.heads * case.key_dim, -2.0, np.float32)
            g_raw, beta = uniform(qk_shape, 2.0, 4.5), uniform(beta_shape, 0.05, 0.95)
        if case.use_gate_in_kernel:
            g = g_raw
        else:
            gate_input = g_raw + dt_bias.reshape(case.heads, 1, 1, case.key_dim)
            A = np.exp(A_log).reshape(case.heads, 1, 1, 1)
            g = -5.0 * sigmoid(A * gate_input) if profile != "model" else -A * softplus(gate_input)
        initial_scale, initial_dtype = 0.1, jnp.float32
    if case.gate_mask_probability > 0:
        g = g * (uniform(qk_shape) > case.gate_mask_probability)
    q, k, v, g = (jnp.asarray(np.where(valid[None, :, :, None], np.asarray(x, np.float32), 0), case.dtype)
                  for x in (q, k, v, g))
    beta = jnp.asarray(np.where(valid[None], beta, 0), case.dtype)
    initial_state = None
    if case.use_initial_state:
        shape = (case.batch, case.n_max or 1, case.heads, case.key_dim, case.value_dim)
        initial_state = np.asarray(initial_scale * normal(shape), jnp.dtype(initial_dtype))
        if case.forward_check == "empty_states":
            for b, lens in enumerate(case.layouts):
                initial_state[b, len(lens):] = np.arange(len(lens), case.n_max)[:, None, None, None] + 1.0
        initial_state = jnp.asarray(initial_state)
    if case.forward_check == "padding_tail":
        q, k, v = q.at[:, 0, 0].set(10.0), k.at[:, 0, 0].set(5.0), v.at[:, 0, 0].set(3.0)
    return (q, k, v, g, beta, jnp.asarray(A_log, jnp.float32), jnp.asarray(dt_bias, jnp.float32), initial_state,
            None if segment_ids is None else jnp.asarray(segment_ids))


# ---------------------------------------------------------------------------------------------
# pallas_tpu_test.py's test_chunk_kda_backward (openxla/tokamax @1ef6dd77bede4b557e9171fd52180579cddcf408,
# the newest stored version): its case matrix without context parallelism. Tokamax compares the
# default implementation's jax.grad with implementation="xla" (its reference recurrence); here the
# default runs libkda's kernels, so the reference is libkda's float64 backward oracle
# (libkda.naive_recurrent_kda_bwd, the exact adjoint of the token-by-token recurrence), at the
# case's backward atol / rtol. The 41 context-parallel cases (cp_size 2 / 4: several devices and a
# sharded call; libkda.jax raises NotImplementedError for real context parallelism) are not ported;
# the backward_rms_error_ratio / backward_gate_rms_error_ratio fields of 1ef6dd77 belong to those
# cases only, so every case here uses compare_tensor's allclose-or-one-ulp test.
# CI runs one case per option (_PALLAS_TPU_BWD_CI); KDA_LARGE_TESTS=1 runs all 112, the T = 8192
# ("long") ones too.
# ---------------------------------------------------------------------------------------------

_PROD_BF16 = dict(safe_gate=True, disable_recompute=False, forward_atol=0.05, forward_rtol=0.05, state_atol=0.05,
                  state_rtol=0.05, backward_atol=0.05, backward_rtol=0.05)
_FUSED_BF16 = dict(_FUSED, forward_atol=0.05, forward_rtol=0.05, state_atol=0.05, state_rtol=0.05, backward_atol=0.1,
                   backward_rtol=0.1)
_S3 = (45, 80, 20)
_L5 = (1800, 1500, 2000, 1200, 800)
_PALLAS_TPU_BWD_CASES = [
    # Active end-to-end configurations from test_chunk_kda_tpu.py.
    _chunk_api_case("b1_t128_h2_d16_fp32", T=128, H=2, D=16),
    _chunk_api_case("b1_t256_h2_d32_fp32", T=256, H=2, D=32),
    _chunk_api_case("b1_t256_h2_d64_fp32", T=256, H=2, D=64),
    _chunk_api_case("b2_t128_h4_d32_fp32", B=2, T=128, H=4, D=32),
    _chunk_api_case("b4_t128_h4_d32_fp32", B=4, T=128, H=4, D=32),
    _chunk_api_case("b2_t64_h4_k16_v32_fp32", B=2, T=64, H=4, K=16, V=32),
    _chunk_api_case("b1_t128_h2_k128_v64_fp32", T=128, H=2, K=128, V=64),
    _chunk_api_case("b1_t128_h2_k64_v128_fp32", T=128, H=2, K=64, V=128),
    _chunk_api_case("single_chunk_fp32", T=64, H=2, D=64),
    _chunk_api_case("single_head_fp32", B=2, T=128, H=1, D=32),
    _chunk_api_case("many_chunks_fp32", T=512, H=2, D=32),
    _chunk_api_case("b1_t256_h2_d64_fp32_no_h0", T=256, H=2, D=64, has_h0=False),
    _chunk_api_case("b1_t64_h2_d64_fp32_no_h0", T=64, H=2, D=64, has_h0=False),
    _chunk_api_case("b1_t256_h2_d64_bf16", T=256, H=2, D=64, dtype=jnp.bfloat16),
    _chunk_api_case("b1_t128_h2_k128_v64_bf16", T=128, H=2, K=128, V=64, dtype=jnp.bfloat16),
    _chunk_api_case("normalizer8_mask03", T=256, H=2, D=64, gate_logit_normalizer=8.0, gate_mask_probability=0.3),
    _chunk_api_case("l2norm_in_kernel", T=256, H=2, D=64, scale=0.125, use_qk_l2norm_in_kernel=True),
    _chunk_api_case("b1_t8192_h16_d128_bf16", T=8192, H=16, D=128, scale=0.125, gate_mask_probability=0.3,
                    dtype=jnp.bfloat16, long=True),
    # Full-pipeline cases from test_chunk_fwd_pallas.py (bf16 ones: bf16 initial states).
    _chunk_fwd_case("e2e_0", T=64, H=2, K=64, V=64),
    _chunk_fwd_case("e2e_1", B=2, T=128, H=4, K=64, V=64),
    _chunk_fwd_case("e2e_2", T=256, H=2, K=128, V=128),
    _chunk_fwd_case("e2e_3", B=2, T=128, H=4, K=64, V=128),
    _chunk_fwd_case("e2e_4", T=128, H=2, K=64, V=64),
    _chunk_fwd_case("e2e_5", B=2, T=1024, H=8, K=128, V=128),
    _chunk_fwd_case("e2e_6", T=256, H=2, K=64, V=64),
    _chunk_fwd_case("e2e_7", T=64, H=1, D=32, dtype=jnp.bfloat16),
    _chunk_fwd_case("e2e_8", T=128, H=2, D=64, dtype=jnp.bfloat16),
    _chunk_fwd_case("e2e_9", T=256, H=4, D=128, dtype=jnp.bfloat16),
    _chunk_fwd_case("e2e_10", T=512, H=8, D=256, dtype=jnp.bfloat16),
    _chunk_fwd_case("e2e_11", T=1024, H=16, D=256, dtype=jnp.bfloat16),
    # End-to-end segment_ids coverage from test_segment_ids.py.
    _varlen_case("segment_ids_recurrent_0", seq_lens=(64, 128), disable_recompute=False),
    _varlen_case("segment_ids_recurrent_1", seq_lens=(128, 64, 192), disable_recompute=False),
    _varlen_case("segment_ids_recurrent_2", seq_lens=(30, 50), T=128, disable_recompute=False),
    _varlen_case("segment_ids_recurrent_3", seq_lens=_S3, T=256, disable_recompute=False),
    _varlen_case("segment_ids_recurrent_4", seq_lens=(64, 128), use_initial_state=True, disable_recompute=False),
    _varlen_case("segment_ids_recurrent_5", seq_lens=_S3, T=256, use_initial_state=True, disable_recompute=False),
    _varlen_case("segment_ids_recurrent_6", seq_lens=(64, 128), dtype=jnp.bfloat16, disable_recompute=False),
    _varlen_case("segment_ids_recurrent_7", seq_lens=_S3, T=256, dtype=jnp.bfloat16, use_initial_state=True,
                 disable_recompute=False),
    _varlen_case("segment_ids_batch_0_fp32", batch_seq_lens=((64, 128), (128, 64)), disable_recompute=False),
    _varlen_case("segment_ids_batch_1_fp32", batch_seq_lens=((64, 64), (128,)), disable_recompute=False),
    _varlen_case("segment_ids_batch_2_fp32", batch_seq_lens=((64, 64), (128,), (64, 64)), disable_recompute=False),
    _varlen_case("segment_ids_batch_3_fp32", batch_seq_lens=((30, 50), (45, 35)), disable_recompute=False),
    _varlen_case("segment_ids_batch_0_bf16", batch_seq_lens=((64, 128), (128, 64)), dtype=jnp.bfloat16,
                 disable_recompute=False),
    # Forward and backward public-wrapper cases from test_varlen_e2e.py.
    _varlen_case("varlen_e2e_0", seq_lens=(64, 128)),
    _varlen_case("varlen_e2e_1", seq_lens=(128, 64, 192)),
    _varlen_case("varlen_e2e_2", seq_lens=(30, 50), T=128),
    _varlen_case("varlen_e2e_3", seq_lens=_S3, T=256),
    _varlen_case("varlen_e2e_4", seq_lens=(100,), T=192),
    _varlen_case("varlen_e2e_5", seq_lens=(64, 128), T=256, N_pad=8),
    _varlen_case("varlen_e2e_6", seq_lens=(64, 128), use_initial_state=True),
    _varlen_case("varlen_e2e_7", seq_lens=(128, 64, 192), use_initial_state=True),
    _varlen_case("varlen_e2e_8", seq_lens=(30, 50), T=128, use_initial_state=True),
    _varlen_case("varlen_e2e_9", seq_lens=_S3, T=256, use_initial_state=True),
    _varlen_case("varlen_e2e_10", seq_lens=(40, 55), T=256, N_pad=8, use_initial_state=True),
    _varlen_case("varlen_e2e_11", seq_lens=(64, 128), dtype=jnp.bfloat16),
    _varlen_case("varlen_e2e_12", seq_lens=_S3, T=256, dtype=jnp.bfloat16),
    _varlen_case("varlen_e2e_13", seq_lens=(64, 128), T=256, N_pad=8, dtype=jnp.bfloat16),
    _varlen_case("varlen_e2e_14", seq_lens=(64, 128), dtype=jnp.bfloat16, use_initial_state=True),
    _varlen_case("varlen_e2e_15", seq_lens=_S3, T=256, dtype=jnp.bfloat16, use_initial_state=True),
    _varlen_case("varlen_e2e_16", seq_lens=(450, 800, 200), T=8192, N_pad=64, dtype=jnp.bfloat16,
                 use_initial_state=True),
    _varlen_case("varlen_e2e_17", seq_lens=(450, 800, 200), T=8192, H=8, N_pad=64, dtype=jnp.bfloat16,
                 use_initial_state=True),
    _varlen_case("varlen_e2e_18", seq_lens=(40, 55), T=256, N_pad=8, dtype=jnp.bfloat16, use_initial_state=True),
    _varlen_case("varlen_e2e_19", seq_lens=_L5, T=8192, H=16, N_pad=8, dtype=jnp.bfloat16, use_initial_state=True),
    _varlen_case("varlen_e2e_20", seq_lens=_L5, T=8192, H=16, N_pad=5, dtype=jnp.bfloat16),
    _varlen_case("varlen_batch_0", batch_seq_lens=((64, 128), (128, 64))),
    _varlen_case("varlen_batch_1", batch_seq_lens=((64, 128), (128, 64)), use_initial_state=True),
    _varlen_case("varlen_batch_2", batch_seq_lens=((64, 128), (64, 64, 64)), use_initial_state=True),
    _varlen_case("varlen_batch_3", batch_seq_lens=((30, 50), (45, 35)), T=128, use_initial_state=True),
    _varlen_case("varlen_batch_4", batch_seq_lens=((64, 128), (128, 64)), dtype=jnp.bfloat16, use_initial_state=True),
    # Full-pipeline production-range cases from test_intra_varlen_prod.py (pre-activated gates).
    _varlen_case("prod_preactivated_0", seq_lens=(64, 128), input_profile="prod", **_PROD),
    _varlen_case("prod_preactivated_1", seq_lens=(128, 64, 192), input_profile="prod", **_PROD),
    _varlen_case("prod_preactivated_2", seq_lens=(30, 50), T=128, input_profile="prod", **_PROD),
    _varlen_case("prod_preactivated_3", seq_lens=_S3, T=256, input_profile="prod", **_PROD),
    _varlen_case("prod_preactivated_4", seq_lens=(64, 128), input_profile="prod", use_initial_state=True, **_PROD),
    _varlen_case("prod_preactivated_5", seq_lens=(64, 128), T=256, N_pad=8, input_profile="prod", **_PROD),
    _varlen_case("prod_preactivated_6", seq_lens=(64, 128), input_profile="prod", dtype=jnp.bfloat16, **_PROD_BF16),
    _varlen_case("prod_preactivated_7", seq_lens=_S3, T=256, input_profile="prod", dtype=jnp.bfloat16,
                 **_PROD_BF16),
    _varlen_case("prod_preactivated_8", seq_lens=(64, 128), input_profile="prod", dtype=jnp.bfloat16,
                 use_initial_state=True, **_PROD_BF16),
    _varlen_case("prod_preactivated_9", seq_lens=(450, 800, 200), T=8192, N_pad=64, input_profile="prod",
                 dtype=jnp.bfloat16, use_initial_state=True, **_PROD_BF16),
    _varlen_case("prod_preactivated_10", seq_lens=(64, 128), input_profile="low_gate", **_PROD),
    _varlen_case("prod_preactivated_11", seq_lens=(64, 128), input_profile="low_gate", dtype=jnp.bfloat16,
                 **_PROD_BF16),
    _varlen_case("prod_preactivated_12", seq_lens=_S3, T=256, input_profile="low_gate", dtype=jnp.bfloat16,
                 **_PROD_BF16),
    _varlen_case("prod_preactivated_13", seq_lens=(64, 128), input_profile="strong_gate", **_PROD),
    _varlen_case("prod_preactivated_14", seq_lens=(64, 128), input_profile="strong_gate", dtype=jnp.bfloat16,
                 **_PROD_BF16),
    _varlen_case("prod_preactivated_15", seq_lens=_S3, T=256, input_profile="strong_gate", dtype=jnp.bfloat16,
                 use_initial_state=True, **_PROD_BF16),
    _varlen_case("prod_preactivated_batch_0", batch_seq_lens=((64, 128), (128, 64)), input_profile="prod", **_PROD),
    _varlen_case("prod_preactivated_batch_1", batch_seq_lens=((64, 128), (128, 64)), use_initial_state=True,
                 input_profile="prod", **_PROD),
    _varlen_case("prod_preactivated_batch_2", batch_seq_lens=((64, 128), (64, 64, 64)), use_initial_state=True,
                 input_profile="prod", **_PROD),
    _varlen_case("prod_preactivated_batch_3", batch_seq_lens=((64, 128), (128, 64)), dtype=jnp.bfloat16,
                 use_initial_state=True, input_profile="prod", **_PROD_BF16),
    # Public chunk_kda fused-gate cases from test_segment_e2e.py.
    _varlen_case("segment_fused_fwd_0", seq_lens=(64, 128), **_FUSED),
    _varlen_case("segment_fused_fwd_1", seq_lens=(128, 64, 192), **_FUSED),
    _varlen_case("segment_fused_fwd_2", seq_lens=(30, 50), T=128, **_FUSED),
    _varlen_case("segment_fused_fwd_3", seq_lens=_S3, T=256, **_FUSED),
    _varlen_case("segment_fused_fwd_4", seq_lens=(64, 128), use_initial_state=True, **_FUSED),
    _varlen_case("segment_fused_fwd_5", seq_lens=(45, 80, 20, 1500, 300, 2000, 1200, 800, 1747, 500), T=8192,
                 **_FUSED),
    _varlen_case("segment_fused_fwd_6", seq_lens=(64, 128), dtype=jnp.bfloat16, **_FUSED_BF16),
    _varlen_case("segment_fused_fwd_7", seq_lens=(128, 64, 192), dtype=jnp.bfloat16, **_FUSED_BF16),
    _varlen_case("segment_fused_fwd_8", seq_lens=_S3, T=256, dtype=jnp.bfloat16, **_FUSED_BF16),
    _varlen_case("segment_fused_fwd_9", seq_lens=(64, 128), dtype=jnp.bfloat16, use_initial_state=True,
                 **_FUSED_BF16),
    _varlen_case("segment_fused_batch_0", batch_seq_lens=((64, 128), (128, 64)), **_FUSED),
    _varlen_case("segment_fused_batch_1", batch_seq_lens=((64, 128), (128, 64)), use_initial_state=True, **_FUSED),
    _varlen_case("segment_fused_batch_2", batch_seq_lens=((64, 128), (64, 64, 64)), use_initial_state=True,
                 **_FUSED),
    _varlen_case("segment_fused_batch_3", batch_seq_lens=((64, 128), (128, 64)), dtype=jnp.bfloat16,
                 use_initial_state=True, **_FUSED_BF16),
    # Tokamax's own cases and the public varlen regressions from test_varlen_e2e.py.
    _pallas_case("tokamax_fixed_t8192", T=8192, H=16, D=128, dtype=jnp.bfloat16, output_final_state=True,
                 use_qk_l2norm_in_kernel=True, long=True),
    _varlen_case("tokamax_varlen_fused", seq_lens=_S3, T=256, use_initial_state=True, use_qk_l2norm_in_kernel=True,
                 use_gate_in_kernel=True, lower_bound=-0.01, disable_recompute=False, forward_atol=0.05,
                 forward_rtol=0.05, state_atol=0.05, state_rtol=0.05, backward_atol=0.05, backward_rtol=0.05),
    _pallas_case("tokamax_fixed_unaligned_kv", T=64, H=1, K=129, V=127, dtype=jnp.bfloat16),
    _pallas_case("varlen_shallow_tail", T=256, H=2, D=128, seq_lens=(30, 50), dtype=jnp.float32,
                 backward_check="finite"),
    _pallas_case("varlen_shallow_tail_large_head", T=256, H=2, D=256, seq_lens=(30, 50), dtype=jnp.float32,
                 backward_check="finite"),
    _pallas_case("varlen_single_seq_tail", T=256, H=2, D=128, seq_lens=(45,), dtype=jnp.float32,
                 backward_check="finite"),
    _pallas_case("varlen_padding_tail", T=128, H=2, D=128, seq_lens=(30, 50), dtype=jnp.float32,
                 forward_check="padding_tail"),
    _varlen_case("varlen_empty_states_h0", seq_lens=(64, 128), T=256, N_pad=8, use_initial_state=True,
                 forward_check="empty_states"),
    _varlen_case("varlen_empty_states_no_h0", seq_lens=(64, 128), T=256, N_pad=8, forward_check="empty_states"),
]
assert len(_PALLAS_TPU_BWD_CASES) == 112 and len({c.name for c in _PALLAS_TPU_BWD_CASES}) == 112

_PALLAS_TPU_BWD_CI = {
    "chunk_api_b2_t64_h4_k16_v32_fp32", "chunk_api_b1_t128_h2_k128_v64_bf16", "chunk_api_b1_t64_h2_d64_fp32_no_h0",
    "chunk_api_normalizer8_mask03", "chunk_api_l2norm_in_kernel", "chunk_fwd_e2e_3", "chunk_fwd_e2e_7",
    "segment_ids_batch_3_fp32", "varlen_e2e_10", "varlen_e2e_18", "varlen_batch_2", "prod_preactivated_2",
    "prod_preactivated_13", "prod_preactivated_15", "segment_fused_fwd_3", "segment_fused_batch_2",
    "segment_fused_fwd_9", "tokamax_varlen_fused", "tokamax_fixed_unaligned_kv", "varlen_shallow_tail",
    "varlen_shallow_tail_large_head", "varlen_single_seq_tail", "varlen_padding_tail", "varlen_empty_states_h0",
    "varlen_empty_states_no_h0",
}
_PALLAS_TPU_BWD_PARAMS = [
    pytest.param(case, id=case.name, marks=() if LARGE or case.name in _PALLAS_TPU_BWD_CI else
                 pytest.mark.skip(reason="the same options as a CI case; KDA_LARGE_TESTS=1 runs it"))
    for case in _PALLAS_TPU_BWD_CASES
]


def _pallas_tpu_cotangents(case):
    """_make_inputs' dout ([H, B, T, V] in case.dtype) and dfinal_state (0.1 * normal, float32
    [B, N, H, K, V], only with output_final_state), drawn with numpy like the other inputs (their
    own stream, so the forward cases' inputs are unchanged)."""
    rng = np.random.default_rng((case.seed, 8))
    dout = jnp.asarray(rng.standard_normal((case.heads, case.batch, case.seq_len, case.value_dim), np.float32),
                       case.dtype)
    dfinal_state = None
    if case.output_final_state:
        shape = (case.batch, case.n_max or 1, case.heads, case.key_dim, case.value_dim)
        dfinal_state = jnp.asarray(0.1 * rng.standard_normal(shape, np.float32))
    return dout, dfinal_state


def _pallas_tpu_oracle_grads(case, q, k, v, g, beta, A_log, dt_bias, initial_state, segment_ids, dout,
                             dfinal_state):
    """libkda.naive_recurrent_kda_bwd (float64) with the arguments _call_attention gives libkda.jax:
    head-first [H, B, T, ...] -> batch-first [B, T, H, ...]; without segment_ids the states are the
    fixed-length [B, H, K, V] (N = 1), with them [B, N, H, K, V] as Tokamax's. Returns the head-first
    (dq, dk, dv, dg, dbeta[, dh0]) in float64."""
    bf = lambda x: np.moveaxis(np.asarray(x, np.float64), 0, 2)  # noqa: E731
    hf = lambda x: np.moveaxis(x, 2, 0)  # noqa: E731
    f64 = lambda x: None if x is None else np.asarray(x, np.float64)  # noqa: E731
    fixed = segment_ids is None
    state = (lambda x: None if x is None else f64(x)[:, 0]) if fixed else f64  # noqa: E731
    gate = case.use_gate_in_kernel
    ref = libkda.naive_recurrent_kda_bwd(
        bf(q), bf(k), bf(v), bf(g), bf(beta), bf(dout), state(dfinal_state), scale=case.effective_scale,
        initial_state=state(initial_state), output_final_state=case.output_final_state,
        use_qk_l2norm_in_kernel=case.use_qk_l2norm_in_kernel, use_gate_in_kernel=gate,
        A_log=f64(A_log) if gate else None, dt_bias=f64(dt_bias) if gate else None,
        lower_bound=case.lower_bound if gate else None,
        segment_ids=None if fixed else np.asarray(segment_ids, np.int32), max_num_segments=case.n_max)
    grads = tuple(hf(ref[n]) for n in ("dq", "dk", "dv", "dg", "dbeta"))
    if initial_state is not None:
        grads += (ref["dh0"][:, None] if fixed else ref["dh0"],)
    return grads


def _compute_ulp(x, dtype):
    """pallas_tpu_test.py's compute_ulp: one unit in the last place of dtype at each |x|."""
    finfo = jnp.finfo(dtype)
    mantissa_bits = round(-np.log2(float(finfo.eps)))
    min_ulp = float(finfo.tiny) * float(finfo.eps)
    abs_x = np.abs(x).astype(np.float64)
    _, exponent = np.frexp(abs_x)
    ulp = np.maximum(np.ldexp(1.0, exponent.astype(np.int32) - mantissa_bits - 1), min_ulp)
    return np.where(abs_x == 0, min_ulp, ulp)


def _compare_tensor(name, expected, actual, *, atol, rtol, dtype, max_ulp=1):
    """pallas_tpu_test.py's compare_tensor (compared in float64): allclose(actual, expected, atol,
    rtol), else every element within max(atol + rtol |expected|, max_ulp ulps of dtype). Returns
    (passed, the printed diagnostics)."""
    e = np.asarray(expected, np.float64)
    a = np.asarray(actual, np.float64)
    assert e.shape == a.shape, f"[{name}] shape {a.shape} != expected {e.shape}"
    diff = np.abs(e - a)
    close = bool(np.allclose(a, e, atol=atol, rtol=rtol, equal_nan=True))
    tolerance = np.maximum(atol + rtol * np.abs(e), max_ulp * _compute_ulp(np.maximum(np.abs(e), np.abs(a)), dtype))
    if not close:
        close = bool(np.all(diff <= tolerance))
    ratio = diff / (tolerance + 1e-12)
    worst = np.unravel_index(np.argmax(np.nan_to_num(ratio, nan=np.inf)), ratio.shape) if ratio.size else ()
    rms_e = float(np.sqrt(np.mean(e * e))) if e.size else 0.0
    rel = float(np.sqrt(np.mean(diff * diff))) / rms_e if rms_e > 0 else 0.0
    msg = (f"[{name}] {'PASS' if close else 'FAIL'} (atol={atol:g}, rtol={rtol:g}): max|expected|="
           f"{np.max(np.abs(e)) if e.size else 0:.4e} max_abs_diff={np.max(diff) if diff.size else 0:.4e} "
           f"rel_rms={rel:.3e}; worst at {tuple(int(i) for i in worst)}: expected={e[worst] if e.size else 0:.6e} "
           f"actual={a[worst] if a.size else 0:.6e} diff/tolerance={ratio[worst] if ratio.size else 0:.3f}")
    print(msg)
    return close, msg


def _valid_gradient_values(name, gradient, case, segment_ids):
    """pallas_tpu_test.py's _valid_gradient_values: the valid tokens (segment id > 0) of dq, dk,
    dv, dg, dbeta and the used state slots of dh0; everything without segment_ids."""
    gradient = np.asarray(gradient, np.float64)
    if case.layouts is None:
        return gradient
    if name == "dh0":
        state_mask = np.zeros((case.batch, case.n_max or 1), dtype=bool)
        for b, lens in enumerate(case.layouts):
            state_mask[b, :len(lens)] = True
        mask = state_mask[:, :, None, None, None]
    else:
        token_mask = np.asarray(segment_ids) > 0
        mask = token_mask[None, :, :, None] if gradient.ndim == 4 else token_mask[None, :, :]
    return gradient[np.broadcast_to(mask, gradient.shape)]


class TestPallasTpuTest:
    """tokamax/_src/ops/experimental/kda/pallas_tpu_test.py: test_chunk_kda_forward (974f1ad0),
    test_chunk_kda_backward (1ef6dd77)."""

    @pytest.mark.parametrize("case", _PALLAS_TPU_PARAMS)
    def test_chunk_kda_forward(self, case):
        q, k, v, g, beta, A_log, dt_bias, initial_state, segment_ids = _pallas_tpu_inputs(case)
        gate_params = dict(A_log=A_log, dt_bias=dt_bias) if case.use_gate_in_kernel else dict(A_log=None, dt_bias=None)
        output, final_state = kj.kimi_delta_attention(
            q, k, v, g, beta, segment_ids=segment_ids, cp_context=None, implementation="pallas_tpu", **gate_params,
            scale=case.effective_scale, initial_state=initial_state, output_final_state=case.output_final_state,
            use_qk_l2norm_in_kernel=case.use_qk_l2norm_in_kernel, use_gate_in_kernel=case.use_gate_in_kernel,
            safe_gate=case.safe_gate, lower_bound=case.lower_bound, disable_recompute=case.disable_recompute,
            chunk_size=64, N_max=case.n_max)
        ref_output, ref_final_state = _run_reference(
            q, k, v, g, beta, a_log=gate_params["A_log"], delta_time_bias=gate_params["dt_bias"],
            scale=case.effective_scale, initial_state=initial_state, output_final_state=case.output_final_state,
            use_qk_l2norm=case.use_qk_l2norm_in_kernel, use_gate_in_kernel=case.use_gate_in_kernel,
            segment_ids=segment_ids, lower_bound=case.lower_bound, max_num_segments=case.n_max)

        _assert_trees_all_close(output, ref_output, atol=case.forward_atol, rtol=case.forward_rtol)
        _assert_trees_all_close(final_state, ref_final_state,
                                atol=case.forward_atol if case.state_atol is None else case.state_atol,
                                rtol=case.forward_rtol if case.state_rtol is None else case.state_rtol)
        if case.forward_check == "padding_tail":
            # The padding's outputs are not token 0's (which q = 10, k = 5, v = 3 makes large).
            padding = np.asarray(output[:, 0, sum(case.layouts[0]):], np.float64)
            token_zero = np.asarray(output[:, 0, :1], np.float64)
            assert np.max(np.abs(padding - token_zero)) > 1e-3
            assert np.max(np.abs(padding)) < 50.0
        elif case.forward_check == "empty_states":
            for b, lens in enumerate(case.layouts):
                for s in range(len(lens), case.n_max):  # untouched slots keep their initial state
                    expected = (np.asarray(initial_state[b, s]) if initial_state is not None
                                else np.zeros(final_state.shape[-3:]))
                    _assert_trees_all_close(final_state[b, s], expected, atol=0.01, rtol=0.0)
                assert np.isfinite(np.asarray(final_state[b, :len(lens)])).all()

    @pytest.mark.parametrize("case", _PALLAS_TPU_BWD_PARAMS)
    def test_chunk_kda_backward(self, case):
        """test_chunk_kda_backward (tokamax/_src/ops/experimental/kda/pallas_tpu_test.py @1ef6dd77bede4b55):
        jax.grad of sum(output.astype(float32) * dout) + sum(final_state * dfinal_state) with
        respect to q, k, v, g, beta (and initial_state when the case has one), through the default
        implementation called as _call_attention calls it (A_log, dt_bias, N_max, safe_gate,
        disable_recompute, chunk_size=64, cp_context=None). Tokamax's "xla" reference gradients are
        replaced by the float64 oracle's (libkda.naive_recurrent_kda_bwd), compared with
        compare_tensor on the valid tokens / used state slots at the case's backward atol / rtol
        (bf16 cases in float32, as Tokamax casts them). The "finite" cases (Tokamax: gradients and
        output finite, no reference) are also compared with the oracle here, at TestConfig's default
        backward atol = rtol = 0.05."""
        q, k, v, g, beta, A_log, dt_bias, initial_state, segment_ids = _pallas_tpu_inputs(case)
        dout, dfinal_state = _pallas_tpu_cotangents(case)
        gate_params = dict(A_log=A_log, dt_bias=dt_bias) if case.use_gate_in_kernel else dict(A_log=None, dt_bias=None)

        def call(q, k, v, g, beta, initial_state):
            return kj.kimi_delta_attention(
                q, k, v, g, beta, segment_ids=segment_ids, cp_context=None, implementation=None, **gate_params,
                scale=case.effective_scale, initial_state=initial_state, output_final_state=case.output_final_state,
                use_qk_l2norm_in_kernel=case.use_qk_l2norm_in_kernel, use_gate_in_kernel=case.use_gate_in_kernel,
                safe_gate=case.safe_gate, lower_bound=case.lower_bound, disable_recompute=case.disable_recompute,
                chunk_size=64, N_max=case.n_max)

        def loss_fn(q, k, v, g, beta, initial_state):
            output, final_state = call(q, k, v, g, beta, initial_state)
            loss = jnp.sum(output.astype(jnp.float32) * dout)
            if dfinal_state is not None:
                assert final_state is not None, "Expected a final state for the backward case."
                loss += jnp.sum(final_state * dfinal_state)
            return loss

        primals = (q, k, v, g, beta, initial_state)
        argnums = (0, 1, 2, 3, 4) + ((5,) if case.use_initial_state else ())
        grads = jax.grad(loss_fn, argnums=argnums)(*primals)
        grad_names = ("dq", "dk", "dv", "dg", "dbeta") + (("dh0",) if case.use_initial_state else ())
        for name, i, grad in zip(grad_names, argnums, grads, strict=True):
            assert grad.shape == primals[i].shape and grad.dtype == primals[i].dtype, (
                f"{name}: {grad.dtype}{grad.shape} vs the primal's {primals[i].dtype}{primals[i].shape}")

        atol, rtol = case.backward_atol, case.backward_rtol
        if case.backward_check == "finite":
            output, _ = call(q, k, v, g, beta, initial_state)
            for name, grad in zip(grad_names, grads, strict=True):
                assert bool(jnp.all(jnp.isfinite(grad))), f"{name} contains NaN/Inf"
            assert bool(jnp.all(jnp.isfinite(output))), "output contains NaN/Inf"
            atol, rtol = _PallasTpuCase.backward_atol, _PallasTpuCase.backward_rtol  # the dataclass defaults
        else:
            assert case.backward_check == "reference", case.backward_check

        reference_grads = _pallas_tpu_oracle_grads(case, q, k, v, g, beta, A_log, dt_bias, initial_state, segment_ids,
                                                   dout, dfinal_state)
        failures = []
        for name, actual, expected in zip(grad_names, grads, reference_grads, strict=True):
            actual = _valid_gradient_values(name, actual, case, segment_ids)
            expected = _valid_gradient_values(name, expected, case, segment_ids)
            # Tokamax compares in the gradients' dtype (float32 for bf16 cases, which it casts):
            # one ulp of float32 is the fallback tolerance either way.
            ok, msg = _compare_tensor(name, expected, actual, atol=atol, rtol=rtol, dtype=jnp.float32)
            if not ok:
                failures.append(msg)
        assert not failures, "Gradient mismatch:\n" + "\n".join(failures)


# ---------------------------------------------------------------------------------------------
# tokamax/_src/ops/kda/api_test.py (batch-first API: libkda.jax.kda.kimi_delta_attention)
# ---------------------------------------------------------------------------------------------

def _make_inputs_batch_first(dtype, scheme="numpy"):
    structs = (
        jax.ShapeDtypeStruct((2, 7, 3, 8), dtype),
        jax.ShapeDtypeStruct((2, 7, 3, 8), dtype),
        jax.ShapeDtypeStruct((2, 7, 3, 5), dtype),
        jax.ShapeDtypeStruct((2, 7, 3, 8), dtype),
        jax.ShapeDtypeStruct((2, 7, 3), dtype),
        jax.ShapeDtypeStruct((2, 3, 8, 5), jnp.float32),
    )
    return _activated_inputs(structs, scheme)


class TestBatchFirstApiTest:
    """tokamax/_src/ops/kda/api_test.py (KimiDeltaAttentionTest): the batch-first API."""

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bfloat16", "float32"])
    def test_kimi_delta_attention_matches_reference(self, dtype, scheme):
        _check_matches_reference(kda_api.kimi_delta_attention, _run_reference_batch_first,
                                 _make_inputs_batch_first(dtype, scheme))

    def test_kimi_delta_attention_gradients_match_reference(self, scheme):
        _check_gradients_match_reference(kda_api.kimi_delta_attention, _reference_batch_first,
                                         _make_inputs_batch_first(jnp.float32, scheme))

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
    def test_xla_chunked_matches_xla(self, dtype, scheme):
        q, k, v, g, beta, initial_state = _make_inputs_batch_first(dtype, scheme)
        q = jnp.concatenate([q, q[:, :2]], axis=1)
        k = jnp.concatenate([k, k[:, :2]], axis=1)
        v = jnp.concatenate([v, v[:, :2]], axis=1)
        g = jnp.concatenate([g, g[:, :2]], axis=1)
        beta = jnp.concatenate([beta, beta[:, :2]], axis=1)

        output, final_state = kda_api.kimi_delta_attention(q, k, v, g, beta, initial_state=initial_state,
                                                           output_final_state=True, implementation="xla_chunked")
        ref_output, ref_final_state = kda_api.kimi_delta_attention(q, k, v, g, beta, initial_state=initial_state,
                                                                   output_final_state=True, implementation="xla")

        _assert_trees_all_close(output, ref_output, atol=0.02, rtol=0.02)
        _assert_trees_all_close(final_state, ref_final_state, atol=0.02, rtol=0.02)
        # Tokamax's "xla" is its reference recurrence: the same check against the float64 one.
        f64_output, f64_final_state = _run_reference_batch_first(q, k, v, g, beta, initial_state=initial_state,
                                                                 output_final_state=True)
        _assert_trees_all_close(output, f64_output, atol=0.02, rtol=0.02)
        _assert_trees_all_close(final_state, f64_final_state, atol=0.02, rtol=0.02)

    def test_xla_chunked_gradients_match_xla(self, scheme):
        q, k, v, g, beta, _ = _make_inputs_batch_first(jnp.float32, scheme)
        q = (jnp.tile(q, (1, 3, 1, 1))[:, :16]) * 0.25
        k = (jnp.tile(k, (1, 3, 1, 1))[:, :16]) * 0.25
        v = (jnp.tile(v, (1, 3, 1, 1))[:, :16]) * 0.25
        g = (jnp.tile(g, (1, 3, 1, 1))[:, :16]) * 0.25
        beta = (jnp.tile(beta, (1, 3, 1))[:, :16]) * 0.25
        # Tokamax: xla_chunked.XlaChunkedKimiDeltaAttention(chunk_size=8), a private class; the
        # public API's implementation="xla_chunked" stands in for it.
        chunked = functools.partial(kda_api.kimi_delta_attention, implementation="xla_chunked")

        def loss(fn, q, k, v, g, beta):
            output, _ = fn(q, k, v, g, beta)
            return jnp.mean(output * output)

        grad = jax.grad(lambda q, k, v, g, beta: loss(chunked, q, k, v, g, beta),
                        argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)
        ref_grad = jax.grad(lambda q, k, v, g, beta: loss(kda_api.kimi_delta_attention, q, k, v, g, beta),
                            argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)

        _assert_trees_all_close(grad, ref_grad, atol=0.02, rtol=0.02)
        f64_grad = _reference_grad(lambda q, k, v, g, beta: loss(_reference_batch_first, q, k, v, g, beta),
                                   (q, k, v, g, beta), argnums=(0, 1, 2, 3, 4))
        _assert_trees_all_close(grad, f64_grad, atol=0.02, rtol=0.02)

    def test_no_final_state_by_default(self):
        q, k, v, g, beta, _ = _make_inputs_batch_first(jnp.float32)
        output, final_state = kda_api.kimi_delta_attention(q, k, v, g, beta)
        assert output.shape == v.shape
        assert final_state is None

    def test_invalid_shape(self):
        q, k, v, g, beta, _ = _make_inputs_batch_first(jnp.float32)
        with pytest.raises(ValueError, match="`k` shape"):
            kda_api.kimi_delta_attention(q, k[:, :-1], v, g, beta)

    def test_unsupported_implementation(self):
        """The later version (with the xla_chunked tests): ValueError("Unknown implementation")."""
        q, k, v, g, beta, _ = _make_inputs_batch_first(jnp.float32)
        with pytest.raises(ValueError, match="Unknown implementation"):
            kda_api.kimi_delta_attention(q, k, v, g, beta, implementation="mosaic_tpu")

    def test_unsupported_implementation_only_xla(self):
        """The same test in the earlier version (8fcb8ff5): NotImplementedError("Only XLA ...").
        Both versions' expectations can hold at once, so both are kept."""
        q, k, v, g, beta, _ = _make_inputs_batch_first(jnp.float32)
        with pytest.raises(NotImplementedError, match="Only XLA"):
            kda_api.kimi_delta_attention(q, k, v, g, beta, implementation="mosaic_tpu")


# ---------------------------------------------------------------------------------------------
# The Ant Group fork's standalone inference API: tokamax/_src/ops/experimental/kda/inference_test.py
# (github.com/antgroup/tokamax @6e2b3721), on libkda.jax.inference.kimi_delta_attention_inference.
# Its reference is api.kimi_delta_attention(implementation="xla") -- libkda's kernels here -- so
# each case also compares with the float64 recurrence at the same tolerances. `_assert_close` is
# the fork's helper (pallas_mosaic_tpu_fwd_fused_test.py): same tree, shapes, dtypes, finite
# values, then assert_allclose(rtol=atol=tolerance).
# ---------------------------------------------------------------------------------------------

def _inference_assert_close(actual, expected, *, tolerance):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.shape == b.shape
        assert a.dtype == b.dtype
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all()
        assert np.isfinite(b).all()
        np.testing.assert_allclose(a, b, rtol=tolerance, atol=tolerance)


def _inference_expected(q, k, v, g, beta, **kw):
    """api.kimi_delta_attention(implementation="xla") on head-first transposes, as the test calls
    it, and the float64 recurrence on the same inputs (cast as Tokamax's reference casts)."""
    hf = [x.transpose(2, 0, 1, 3) for x in (q, k, v, g)] + [beta.transpose(2, 0, 1)]
    xla = kj.kimi_delta_attention(*hf, **kw, implementation="xla")
    ref_kw = {n: x for n, x in kw.items() if n != "segment_ids"}
    seg = kw["segment_ids"]
    if np.ndim(seg) == 1:
        seg = np.broadcast_to(np.asarray(seg)[None], (q.shape[0], np.shape(seg)[0]))
    out, fs = _run_reference(*hf, segment_ids=seg, **ref_kw)
    ref = (jnp.asarray(out), None if fs is None else jnp.asarray(fs, jnp.float32))
    return xla, ref


class TestInferenceTest:
    """tokamax/_src/ops/experimental/kda/inference_test.py (antgroup/tokamax)."""

    @pytest.mark.parametrize("lengths", [(64, 64), (17, 79), (1, 62, 2), (0, 0), (1,) * 9])
    @pytest.mark.parametrize("states", [False, True])
    def test_inference(self, lengths, states):
        h, b, t, d = 2, 1, 128, 128
        keys = jax.random.split(jax.random.key(19), 6)
        q, k, v, g = [jax.random.normal(key, (b, t, h, d)).astype(jnp.bfloat16) for key in keys[:4]]
        beta = jnp.full((b, t, h), 0.5, jnp.bfloat16)
        ids = np.zeros((b, t), np.int32)
        start = 0
        for i, length in enumerate(lengths):
            ids[:, start:start + length] = i + 1
            start += length
        ids = jnp.array(ids)
        n = len(lengths) + 1
        h0 = jax.random.normal(keys[4], (b, n, h, d, d)) * 0.1 if states else None
        alog = jnp.zeros((h,), jnp.float32)
        bias = jnp.full((h * d,), -2.0, jnp.float32)
        actual = kj.inference.kimi_delta_attention_inference(
            q, k, v, g, beta, segment_ids=ids, a_log=alog, delta_time_bias=bias, initial_state=h0,
            output_final_state=states, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0,
            max_num_segments=n)
        jax.block_until_ready(actual)
        kw = dict(segment_ids=ids, a_log=alog, delta_time_bias=bias, initial_state=h0, output_final_state=states,
                  use_qk_l2norm=True, use_gate_in_kernel=True, lower_bound=-5.0, max_num_segments=n)
        for expected in _inference_expected(q, k, v, g, beta, **kw):
            _inference_assert_close((actual[0].transpose(2, 0, 1, 3), actual[1]), expected, tolerance=0.05)
            # A scale-relative check prevents the absolute BF16 tolerance from hiding missing
            # low-magnitude outputs (for example an omitted middle segment).
            for a, e in zip(jax.tree.leaves((actual[0].transpose(2, 0, 1, 3), actual[1])),
                            jax.tree.leaves(expected), strict=True):
                a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
                assert np.linalg.norm(a - e) <= 0.02 * np.linalg.norm(e) + 1e-6
        np.testing.assert_array_equal(np.asarray(actual[0])[:, start:], 0)

    @pytest.mark.parametrize("invalid", ["dtype", "normalization", "gate", "bound", "segments", "state_dtype"])
    def test_reject_unsupported_options(self, invalid):
        q = jnp.zeros((1, 64, 2, 128), jnp.bfloat16)
        beta = jnp.ones((1, 64, 2), jnp.bfloat16)
        kwargs = dict(segment_ids=jnp.ones((1, 64), jnp.int32), a_log=jnp.zeros((2,)),
                      delta_time_bias=jnp.zeros((256,)), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                      lower_bound=-5.0, max_num_segments=1)
        if invalid == "dtype":
            q = q.astype(jnp.float32)
        if invalid == "normalization":
            kwargs["use_qk_l2norm_in_kernel"] = False
        if invalid == "gate":
            kwargs["use_gate_in_kernel"] = False
        if invalid == "bound":
            kwargs["lower_bound"] = -6.0
        if invalid == "segments":
            kwargs["max_num_segments"] = 0
        if invalid == "state_dtype":
            kwargs["initial_state"] = jnp.zeros((1, 1, 2, 128, 128), jnp.bfloat16)
        with pytest.raises(ValueError):
            kj.inference.kimi_delta_attention_inference(q, q, q, q, beta, **kwargs)

    @pytest.mark.parametrize("batch", [1, 3])
    def test_inference_shared_segment_map(self, batch):
        """A 1D [T] segment_ids must work for every batch size (the head-first API's too)."""
        h, t, d = 2, 128, 128
        keys = jax.random.split(jax.random.key(53), 6)
        q, k, v, g = [jax.random.normal(key, (batch, t, h, d)).astype(jnp.bfloat16) for key in keys[:4]]
        beta = jnp.full((batch, t, h), 0.5, jnp.bfloat16)
        lengths = (64, 64)
        ids_1d = np.zeros((t,), np.int32)
        start = 0
        for i, length in enumerate(lengths):
            ids_1d[start:start + length] = i + 1
            start += length
        n = len(lengths) + 1
        alog = jnp.zeros((h,), jnp.float32)
        bias = jnp.full((h * d,), -2.0, jnp.float32)
        actual = kj.inference.kimi_delta_attention_inference(
            q, k, v, g, beta, segment_ids=jnp.array(ids_1d), a_log=alog, delta_time_bias=bias,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0, max_num_segments=n)
        jax.block_until_ready(actual)
        kw = dict(segment_ids=jnp.array(ids_1d), a_log=alog, delta_time_bias=bias, use_qk_l2norm=True,
                  use_gate_in_kernel=True, lower_bound=-5.0, max_num_segments=n)
        for expected in _inference_expected(q, k, v, g, beta, **kw):
            _inference_assert_close((actual[0].transpose(2, 0, 1, 3), actual[1]), expected, tolerance=0.05)
