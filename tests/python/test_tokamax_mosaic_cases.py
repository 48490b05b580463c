"""Tokamax's Pallas/Mosaic TPU KDA tests, ported onto libkda.jax: the cases the other ports
(test_tokamax_cases.py, test_jax.py) do not cover yet.

Sources (github.com/openxla/tokamax @84c7a4fc3b0dafcde51b25d5b830724e30459a77, the newest stored
version of both files):

- tokamax/_src/ops/experimental/kda/pallas_mosaic_tpu_test.py --
  ``TestPallasMosaicTpuKimiDeltaAttentionTest``. Its one older stored version called the private
  ``pallas_mosaic_tpu.check_inputs_support`` with the A_log-era names (N_max, cp_context) and had
  one more CP subcase, ("N_max", segment_ids without N_max); the newer version dropped it (bind
  now rejects that call first with a ValueError), and the newer version is followed.
- tokamax/_src/ops/experimental/kda/pallas_mosaic_tpu_kernel_test.py -- ``TestPallasMosaicTpuKernelTest``.

Mapping as in test_tokamax_cases.py (whose helpers and float64 reference ``_reference_kda`` are
imported from there): ``api.kimi_delta_attention`` -> ``libkda.jax.kimi_delta_attention``,
same keyword names; Tokamax's ``PallasMosaicTpuKimiDeltaAttention(config=Config(safe_gate=...,
rematerialize_for_backward=...))`` (a private class) -> ``implementation="mosaic"`` with libkda's
``rematerialize_for_backward`` option (Config's ``safe_gate`` has no public counterpart; no case
here has the gate in kernel, where it would matter); ``ContextParallelMetadata`` -> the stand-in
``_ContextParallelMetadata``; ``self.assertRaisesRegex`` -> ``pytest.raises`` plus ``re.search``
on the message.

pallas_mosaic_tpu_test.py's ``_call_attention("mosaic", ...)`` mocks ``supported_on`` so that the
TPU kernel's input checks run on any platform, and asserts NotImplementedError (so that
Tokamax's default ("mosaic", "xla") falls through to "xla"). libkda's "mosaic" runs libkda's own
kernels, which do not have the TPU kernel's limits (docs/PYTHON.md; test_jax.py's
test_large_key_dimension_runs_through_xla ports this file's K = 257 test that way). So each
port asserts what libkda does with the same inputs, for every implementation name, and says how
Tokamax differs: K = 0, V = 0 and H = 0 are ShapeErrors (ValueErrors) raised by validation and
naming the argument, as the numpy and torch entries reject them (Tokamax's "mosaic": a
NotImplementedError; its "xla" fallback returns zeros for K = 0 and fails with an IndexError for
H = 0); B = 0 and T = 0 give empty outputs of v's shape (Tokamax's "mosaic": NotImplementedError);
two fixed states without segment_ids are a ValueError naming N (Tokamax's "xla" fallback runs on
slot 0); context parallelism over more than one device is a NotImplementedError naming the mesh
axis (libkda has none; Tokamax's "mosaic" names the first option its kernel cannot shard).

pallas_mosaic_tpu_kernel_test.py's ``test_chunk_kda_forward`` / ``test_chunk_kda_backward``
without context parallelism are the case matrix of pallas_tpu_test.py (ported in
test_tokamax_cases.py's TestPallasTpuTest, which has one more case, varlen_e2e_5), with the
current keyword names. New here and ported: ``varlen_shallow_tail``,
``varlen_shallow_tail_large_head`` and ``varlen_single_seq_tail`` are checked against the
reference in the backward now (pallas_tpu_test.py only checked them finite), with the float32
criterion this version uses: RMS error ratio (rms(diff) / (rms(reference) + 1e-8)) below 8e-3 for
dq, dk, dv and 2e-2 for dg, dbeta, on the valid tokens. Its 42 context-parallel cases (cp 2 or 4
over a "context" mesh axis) are not ported: libkda has no context parallelism, and test_jax.py's
test_context_parallel_metadata_single_device_runs asserts the NotImplementedError.

Not ported (TPU-kernel internals, nothing of the public API to call): test_tpu_limits_use_pallas_
hardware_info (common.get_tpu_limits over pltpu.get_tpu_info), test_default_execution_config
(Config(chunk_size=64) heuristics / autotuning sets), test_safe_gate_is_selected_internally and
test_safe_gate_config_override (the private _resolve_safe_gate). test_large_key_dimension_is_
mosaic_specific is test_jax.py's test_large_key_dimension_runs_through_xla.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed (pip install jax)")
kj = pytest.importorskip("libkda.jax", reason="libkda.jax could not be imported")
import jax.numpy as jnp  # noqa: E402

from test_tokamax_cases import (  # noqa: E402
    _ContextParallelMetadata,
    _f64,
    _pallas_case,
    _pallas_tpu_cotangents,
    _pallas_tpu_inputs,
    _reference_kda,
    _valid_gradient_values,
    _x64,
)


# ---------------------------------------------------------------------------------------------
# pallas_mosaic_tpu_test.py
# ---------------------------------------------------------------------------------------------

def _call_attention(implementation, q, v, **kwargs):
    """pallas_mosaic_tpu_test.py's _call_attention: key ones, gate zeros, beta ones, scale 1.0."""
    return kj.kimi_delta_attention(q, jnp.ones_like(q), v, jnp.zeros_like(q), jnp.ones(q.shape[:-1], dtype=q.dtype),
                                   scale=1.0, implementation=implementation, **kwargs)


def _cp_metadata():
    """Tokamax's ContextParallelMetadata(mesh=SimpleNamespace(shape={"context": 2})): a two-device
    context axis without devices."""
    import types
    return _ContextParallelMetadata(mesh=types.SimpleNamespace(shape={"context": 2}))


_IMPLEMENTATIONS = ["mosaic", "xla"]


class TestPallasMosaicTpuKimiDeltaAttentionTest:
    """tokamax/_src/ops/experimental/kda/pallas_mosaic_tpu_test.py (PallasMosaicTpuKimiDeltaAttentionTest),
    as libkda's behaviour for the same calls (module docstring)."""

    @pytest.mark.parametrize("implementation", _IMPLEMENTATIONS)
    @pytest.mark.parametrize("key_dim,value_dim,pattern", [
        (0, 1, r"'query'.*expected K >= 1, got K = 0"),
        (1, 0, r"'value'.*expected V >= 1, got V = 0"),
    ], ids=["k0_v1", "k1_v0"])
    def test_rejects_empty_kv_dimension_before_kernel(self, key_dim, value_dim, pattern, implementation):
        q = jnp.ones((1, 1, 64, key_dim), dtype=jnp.float32)
        v = jnp.ones((1, 1, 64, value_dim), dtype=jnp.float32)
        with pytest.raises(kj.ShapeError, match=pattern):
            _call_attention(implementation, q, v)

    @pytest.mark.parametrize("implementation", _IMPLEMENTATIONS)
    @pytest.mark.parametrize("heads,batch,seq_len", [(0, 1, 64), (1, 0, 64), (1, 1, 0)], ids=["h0", "b0", "t0"])
    def test_rejects_empty_grid_dimension_before_kernel(self, heads, batch, seq_len, implementation):
        q = jnp.ones((heads, batch, seq_len, 1), dtype=jnp.float32)
        v = jnp.ones((heads, batch, seq_len, 1), dtype=jnp.float32)
        if heads == 0:
            with pytest.raises(kj.ShapeError, match=r"'query'.*expected H >= 1, got H = 0"):
                _call_attention(implementation, q, v)
            return
        output, final_state = _call_attention(implementation, q, v)
        assert output.shape == v.shape and output.dtype == q.dtype and final_state is None

    @pytest.mark.parametrize("implementation", _IMPLEMENTATIONS)
    def test_rejects_multiple_fixed_states_before_kernel(self, implementation):
        q = jnp.ones((1, 1, 64, 1), dtype=jnp.float32)
        v = jnp.ones((1, 1, 64, 1), dtype=jnp.float32)
        initial_state = jnp.zeros((1, 2, 1, 1, 1), dtype=jnp.float32)
        with pytest.raises(ValueError, match=r"without segment_ids there is one state per batch row \(N = 1\), "
                                             r"got N = 2"):
            _call_attention(implementation, q, v, initial_state=initial_state)

    @pytest.mark.parametrize("key_dim,value_dim", [(64, 128), (128, 64)])
    def test_rejects_unaligned_cp_dimensions_before_kernel(self, key_dim, value_dim):
        q = jnp.ones((1, 1, 64, key_dim), dtype=jnp.float32)
        v = jnp.ones((1, 1, 64, value_dim), dtype=jnp.float32)
        segment_ids = jnp.ones((1, 64), dtype=jnp.int32)
        with pytest.raises(NotImplementedError, match=r"context parallelism is not supported.*'context' has 2"):
            _call_attention("mosaic", q, v, segment_ids=segment_ids, max_num_segments=1,
                            context_parallel_metadata=_cp_metadata())

    @pytest.mark.parametrize("error_fragment", ["initial_state", "output_final_state", "segment_ids"])
    def test_rejects_cp_contract_gaps_before_kernel(self, error_fragment):
        """Tokamax's subTests, one parameter each."""
        q = jnp.ones((1, 1, 64, 128), dtype=jnp.float32)
        v = jnp.ones((1, 1, 64, 128), dtype=jnp.float32)
        segment_ids = jnp.ones((1, 64), dtype=jnp.int32)
        initial_state = jnp.zeros((1, 1, 1, 128, 128), dtype=jnp.float32)
        overrides = {
            "initial_state": dict(initial_state=initial_state, segment_ids=segment_ids, max_num_segments=1),
            "output_final_state": dict(output_final_state=True, segment_ids=segment_ids, max_num_segments=1),
            "segment_ids": dict(max_num_segments=1),
        }[error_fragment]
        with pytest.raises(NotImplementedError, match=r"context parallelism is not supported.*'context' has 2"):
            _call_attention("mosaic", q, v, context_parallel_metadata=_cp_metadata(), **overrides)


# ---------------------------------------------------------------------------------------------
# pallas_mosaic_tpu_kernel_test.py
# ---------------------------------------------------------------------------------------------

def _rms_close(name, expected, actual, max_rms_error_ratio):
    """compare_tensor with max_rms_error_ratio (this version's float32 criterion): max |diff| <= 1e-6
    or rms(diff) / (rms(expected) + 1e-8) < max_rms_error_ratio. Returns (passed, message)."""
    e = np.asarray(expected, np.float64)
    a = np.asarray(actual, np.float64)
    assert e.shape == a.shape, f"[{name}] shape {a.shape} != expected {e.shape}"
    diff = np.abs(e - a)
    max_diff = float(np.max(diff)) if diff.size else 0.0
    ratio = float(np.sqrt(np.mean(diff * diff)) / (np.sqrt(np.mean(e * e)) + 1e-8)) if diff.size else 0.0
    close = bool(max_diff <= 1e-6 or ratio < max_rms_error_ratio)
    msg = (f"[{name}] {'PASS' if close else 'FAIL'}: rms error ratio {ratio:.3e} (limit {max_rms_error_ratio:g}), "
           f"max |diff| {max_diff:.3e}, max |expected| {float(np.max(np.abs(e))) if e.size else 0.0:.3e}")
    print(msg)
    return close, msg


def _reference_grads(q, k, v, g, beta, dout, **kw):
    """jax.grad of sum(output * dout) through _reference_kda in float64, w.r.t. q, k, v, g, beta."""
    dout = np.asarray(dout, np.float64)
    kw = {n: (_f64(x) if n == "segment_ids" else x) for n, x in kw.items()}

    def loss(q, k, v, g, beta):
        output, _ = _reference_kda(q, k, v, g, beta, **kw)
        return jnp.sum(output * dout)

    with _x64():
        grads = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*(_f64(x) for x in (q, k, v, g, beta)))
        return tuple(np.asarray(x, np.float64) for x in grads)


# The three public varlen regressions whose backward this version checks against the reference
# (make_test_config, dtype float32: forward 5e-3, backward 8e-3, gate 2e-2 RMS error ratios).
_TAIL_CASES = [
    _pallas_case("varlen_shallow_tail", T=256, H=2, D=128, seq_lens=(30, 50), dtype=jnp.float32),
    _pallas_case("varlen_shallow_tail_large_head", T=256, H=2, D=256, seq_lens=(30, 50), dtype=jnp.float32),
    _pallas_case("varlen_single_seq_tail", T=256, H=2, D=128, seq_lens=(45,), dtype=jnp.float32),
]


class TestPallasMosaicTpuKernelTest:
    """tokamax/_src/ops/experimental/kda/pallas_mosaic_tpu_kernel_test.py: the varlen tail
    regressions' backward against the reference (see the module docstring)."""

    @pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in _TAIL_CASES])
    def test_chunk_kda_backward(self, case):
        """_direct_backward through implementation="mosaic" (jax.grad of sum(output.astype(float32)
        * dout) w.r.t. q, k, v, g, beta) against the float64 reference's, on the valid tokens, at the
        RMS error ratios 8e-3 (dq, dk, dv) and 2e-2 (dg, dbeta)."""
        names = ("dq", "dk", "dv", "dg", "dbeta")
        q, k, v, g, beta, _, _, _, segment_ids = _pallas_tpu_inputs(case)
        dout, _ = _pallas_tpu_cotangents(case)
        kw = dict(scale=case.effective_scale, segment_ids=segment_ids, max_num_segments=case.n_max)

        def loss(q, k, v, g, beta):
            output, final_state = kj.kimi_delta_attention(
                q, k, v, g, beta, a_log=None, delta_time_bias=None, initial_state=None, output_final_state=False,
                use_qk_l2norm=False, use_gate_in_kernel=False, lower_bound=None, context_parallel_metadata=None,
                implementation="mosaic", rematerialize_for_backward=not case.disable_recompute, **kw)
            assert final_state is None
            return jnp.sum(output.astype(jnp.float32) * dout)

        primals = (q, k, v, g, beta)
        grads = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*primals)
        expected = _reference_grads(q, k, v, g, beta, np.asarray(dout, np.float64), **kw)
        ratios = (8e-3,) * 3 + (2e-2,) * 2
        valid = lambda name, grad: _valid_gradient_values(name, grad, case, segment_ids)  # noqa: E731

        failures = []
        for name, primal, grad, ref, ratio in zip(names, primals, grads, expected, ratios, strict=True):
            assert grad.shape == primal.shape and grad.dtype == primal.dtype, (
                f"{name}: {grad.dtype}{grad.shape} vs the primal's {primal.dtype}{primal.shape}")
            assert np.isfinite(np.asarray(grad, np.float64)).all(), f"{name} contains NaN/Inf"
            ok, msg = _rms_close(name, valid(name, ref), valid(name, grad), ratio)
            if not ok:
                failures.append(msg)
        assert not failures, "Gradient mismatch:\n" + "\n".join(failures)
