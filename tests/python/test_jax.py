"""libkda.jax (issue 6): Tokamax's kimi_delta_attention contract (head-first) on XLA FFI custom
calls. Forward and jax.grad against the fp64 oracle (SPEC.md section 4 bounds) and against a
pure-JAX recurrence written here; jit, vmap (and vmap of grad), segment_ids with padding, the
gate in kernel, bf16."""

import numpy as np
import pytest
from conftest import BF16, BOUND, assert_close

import libkda

jax = pytest.importorskip("jax", reason="jax is not installed (pip install jax)")
kj = pytest.importorskip("libkda.jax", reason="libkda.jax could not be imported")
import jax.numpy as jnp  # noqa: E402

F32 = np.dtype(np.float32)


def grad_bound(dtype, name):
    if dtype == F32:
        return 1e-4
    return 8e-3 if name in ("dq", "dk", "dv", "dh0") else 2e-2


def bf(x):
    """Head-first [H, B, T, ...] -> batch-first [B, T, H, ...] (float64, for the oracle)."""
    return np.moveaxis(np.asarray(x, dtype=np.float64), 0, 2)


def hf(x):
    return np.moveaxis(np.asarray(x), 2, 0)


def make(seed, H=2, HV=None, B=2, T=70, K=16, V=8, dtype=F32, gate="log", N=1):
    rng = np.random.default_rng(seed)
    HV = H if HV is None else HV
    q = rng.standard_normal((H, B, T, K))
    k = rng.standard_normal((H, B, T, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    v = rng.standard_normal((HV, B, T, V))
    g = -np.exp(rng.normal(-2.5, 1.0, (HV, B, T, K))) if gate == "log" else rng.standard_normal((HV, B, T, K))
    beta = rng.uniform(0, 1, (HV, B, T))
    x = {n: a.astype(dtype) for n, a in dict(query=q, key=k, value=v, gate=g, beta=beta).items()}
    extra = {}
    if gate != "log":
        extra = dict(a_log=np.log(rng.uniform(0.5, 4.0, HV)).astype(np.float32),
                     delta_time_bias=(0.5 * rng.standard_normal(HV * K)).astype(np.float32))
        if gate == "lower_bound":
            extra["lower_bound"] = -5.0
    h0 = rng.standard_normal((B, N, HV, K, V)).astype(np.float32)
    return x, extra, h0


def oracle_kwargs(extra, segment_ids, N):
    kw = {}
    if "a_log" in extra:
        kw = dict(use_gate_in_kernel=True, A_log=extra["a_log"], dt_bias=extra["delta_time_bias"],
                  lower_bound=extra.get("lower_bound"))
    if segment_ids is not None:
        kw.update(segment_ids=np.asarray(segment_ids, np.int32), max_num_segments=N)
    return kw


def oracle_states(h0, segment_ids):
    """Tokamax [B, N, HV, K, V] -> the library's state shape for the oracle."""
    return h0 if segment_ids is not None else h0[:, 0]


def jax_reference(query, key, value, gate, beta, initial_state, segment_ids=None, use_qk_l2norm=False, scale=None):
    """The recurrence of SPEC.md section 1, head-first, in pure JAX (lax.scan over time), with
    segment_ids resets. Returns (output [HV, B, T, V], final_state [B, N, HV, K, V])."""
    query, key, value, gate, beta = (jnp.asarray(a) for a in (query, key, value, gate, beta))
    H, B, T, K = query.shape
    HV = value.shape[0]
    rep = HV // H
    scale = K ** -0.5 if scale is None else scale
    q = jnp.repeat(query.astype(jnp.float32), rep, axis=0)
    k = jnp.repeat(key.astype(jnp.float32), rep, axis=0)
    if use_qk_l2norm:
        q = q * jax.lax.rsqrt(jnp.sum(q * q, -1, keepdims=True) + 1e-6)
        k = k * jax.lax.rsqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)
    N = initial_state.shape[1]
    seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids

    def step(states, t):  # states [B, N, HV, K, V]
        qt, kt, vt, gt, bt = q[:, :, t], k[:, :, t], value[:, :, t].astype(jnp.float32), gate[:, :, t], beta[:, :, t]
        sid = seg[:, t]
        slot = jnp.clip(sid - 1, 0, N - 1)
        S = states[jnp.arange(B), slot]  # [B, HV, K, V]
        S = S * jnp.exp(jnp.swapaxes(gt, 0, 1))[..., None]
        kb = jnp.swapaxes(kt, 0, 1)
        r = jnp.swapaxes(vt, 0, 1) - jnp.einsum("bhkv,bhk->bhv", S, kb)
        S = S + jnp.swapaxes(bt, 0, 1)[..., None, None] * kb[..., None] * r[..., None, :]
        o = jnp.einsum("bhkv,bhk->bhv", S, jnp.swapaxes(qt, 0, 1) * scale)
        valid = (sid > 0)[:, None, None]
        o = jnp.where(valid, o, 0.0)
        S = jnp.where(valid[..., None], S, states[jnp.arange(B), slot])
        states = states.at[jnp.arange(B), slot].set(S)
        return states, jnp.swapaxes(o, 0, 1)

    states, out = jax.lax.scan(step, initial_state.astype(jnp.float32), jnp.arange(T))
    return jnp.moveaxis(out, 0, 2).astype(query.dtype), states


def segments(B, T, lengths_per_row):
    ids = np.zeros((B, T), np.int32)
    for b, lengths in enumerate(lengths_per_row):
        pos = 0
        for i, n in enumerate(lengths):
            ids[b, pos:pos + n] = i + 1
            pos += n
    return ids


CASES = {
    "fixed": dict(),
    "gva_gate_softplus": dict(H=1, HV=2, gate="softplus"),
    "segments_lower_bound": dict(gate="lower_bound", N=3, seg=[[20, 45], [70]]),  # padding, unused slots
}


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_vs_oracle(case, dtype):
    spec = dict(CASES[case])
    seg = spec.pop("seg", None)
    x, extra, h0 = make(1, dtype=dtype, **spec)
    B, T = x["query"].shape[1:3]
    segment_ids = None if seg is None else segments(B, T, seg)
    N = h0.shape[1]
    o, fs = kj.kimi_delta_attention(**x, **extra, initial_state=h0, output_final_state=True,
                                    use_qk_l2norm=True, use_gate_in_kernel=bool(extra), segment_ids=segment_ids)
    assert o.dtype == dtype and o.shape == x["value"].shape
    assert fs.dtype == jnp.float32 and fs.shape == h0.shape
    ro, rfs = libkda.naive_recurrent_kda(
        bf(x["query"]), bf(x["key"]), bf(x["value"]), bf(x["gate"]), bf(x["beta"]),
        initial_state=oracle_states(h0, segment_ids), output_final_state=True, use_qk_l2norm_in_kernel=True,
        **oracle_kwargs(extra, segment_ids, N))
    assert_close(np.asarray(o, np.float64), hf(ro), BOUND[dtype], "o")
    fs = np.asarray(fs)
    assert_close(fs if segment_ids is not None else fs[:, 0], rfs, BOUND[dtype], "final_state")
    if segment_ids is not None:  # padding tokens: output exactly 0
        assert not np.asarray(o, np.float32)[:, 0, 65:].any()


@pytest.mark.parametrize("remat", [False, True], ids=["saved", "remat"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_grad_vs_oracle(dtype, remat):
    x, extra, h0 = make(2, H=1, HV=2, T=90, dtype=dtype, gate="lower_bound", N=2)
    segment_ids = segments(2, 90, [[33, 57], [10]])
    rng = np.random.default_rng(3)
    do = rng.standard_normal(x["value"].shape).astype(np.float32)
    dht = rng.standard_normal(h0.shape).astype(np.float32)

    def loss(query, key, value, gate, beta, a_log, delta_time_bias, initial_state):
        o, fs = kj.kimi_delta_attention(query, key, value, gate, beta, a_log=a_log, delta_time_bias=delta_time_bias,
                                        initial_state=initial_state, output_final_state=True, use_qk_l2norm=True,
                                        use_gate_in_kernel=True, segment_ids=segment_ids, lower_bound=-5.0,
                                        rematerialize_for_backward=remat)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(fs * dht)

    args = (x["query"], x["key"], x["value"], x["gate"], x["beta"], extra["a_log"], extra["delta_time_bias"], h0)
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(8))))(*args)
    ref = libkda.naive_recurrent_kda_bwd(
        bf(x["query"]), bf(x["key"]), bf(x["value"]), bf(x["gate"]), bf(x["beta"]), bf(do), dht,
        initial_state=h0, use_qk_l2norm_in_kernel=True, **oracle_kwargs(extra, segment_ids, 2))
    names = ["dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"]
    for name, arg, grad in zip(names, args, grads):
        assert grad.shape == arg.shape and grad.dtype == arg.dtype, name
        r = ref[name] if name in ("dA_log", "ddt_bias", "dh0") else hf(ref[name])
        assert_close(np.asarray(grad, np.float64), r.reshape(grad.shape), grad_bound(dtype, name), name)


def expect_same_grads(ours, ref, args, bound=1e-4):
    """jax.grad of sum(sin(outputs)) through `ours` and `ref` agrees for all six inputs."""
    def loss(f):
        return lambda *a: sum(jnp.sum(jnp.sin(t)) for t in f(*a))

    g_ours = jax.grad(loss(ours), argnums=tuple(range(6)))(*args)
    g_ref = jax.grad(loss(ref), argnums=tuple(range(6)))(*args)
    for a, b_, name in zip(g_ours, g_ref, ["dq", "dk", "dv", "dg", "dbeta", "dh0"]):
        assert_close(np.asarray(a), np.asarray(b_), bound, name)


def test_matches_pure_jax_reference_forward_and_grad():
    x, _, h0 = make(4, H=2, B=2, T=50, N=2)
    segment_ids = jnp.asarray(segments(2, 50, [[17, 30], [50]]))

    def ours(q, k, v, g, b, s):
        return kj.kimi_delta_attention(q, k, v, g, b, initial_state=s, output_final_state=True, use_qk_l2norm=True,
                                       segment_ids=segment_ids)

    def ref(q, k, v, g, b, s):
        return jax_reference(q, k, v, g, b, s, segment_ids=segment_ids, use_qk_l2norm=True)

    args = (x["query"], x["key"], x["value"], x["gate"], x["beta"], h0)
    for a, b_, name in zip(ours(*args), ref(*args), ["o", "final_state"]):
        assert_close(np.asarray(a), np.asarray(b_), 1e-5, name)

    expect_same_grads(ours, ref, args)


def test_segment_ids_padding_anywhere_matches_the_pure_jax_reference():
    """Tokamax's reference skips id 0 anywhere in a row: leading and middle padding, not only
    trailing; forward and gradients agree, and padding outputs are exactly 0."""
    x, _, h0 = make(6, H=2, B=2, T=50, N=2)
    ids = np.zeros((2, 50), np.int32)
    ids[0, 5:20], ids[0, 24:44] = 1, 2  # leading, middle and trailing padding
    ids[1, 0:30], ids[1, 33:50] = 1, 2  # middle padding
    segment_ids = jnp.asarray(ids)

    def ours(q, k, v, g, b, s):
        return kj.kimi_delta_attention(q, k, v, g, b, initial_state=s, output_final_state=True, segment_ids=segment_ids)

    def ref(q, k, v, g, b, s):
        return jax_reference(q, k, v, g, b, s, segment_ids=segment_ids)

    args = (x["query"], x["key"], x["value"], x["gate"], x["beta"], h0)
    o, fs = ours(*args)
    ro, rfs = ref(*args)
    assert_close(np.asarray(o), np.asarray(ro), 1e-5, "o")
    assert_close(np.asarray(fs), np.asarray(rfs), 1e-5, "final_state")
    pad = np.broadcast_to((ids == 0)[None, :, :, None], o.shape)
    assert np.all(np.asarray(o)[pad] == 0.0)

    expect_same_grads(ours, ref, args)


def test_head_first_shape_errors_use_tokamax_wording():
    x, _, _ = _small()
    bad = dict(x, key=x["key"][:, :, :-1])
    with pytest.raises(ValueError, match="`k` shape .* must match `q` shape"):
        kj.kimi_delta_attention(**bad)
    with pytest.raises(ValueError, match="`g` shape"):
        kj.kimi_delta_attention(**dict(x, gate=x["gate"][..., :-1]))
    with pytest.raises(ValueError, match="`v` shape"):
        kj.kimi_delta_attention(**dict(x, value=x["value"][:, :, :-1]))
    with pytest.raises(ValueError, match="`beta` shape"):
        kj.kimi_delta_attention(**dict(x, beta=x["beta"][..., :-1]))
    with pytest.raises(ValueError, match="`q` must be rank 4"):
        kj.kimi_delta_attention(**dict(x, query=x["query"][0]))


def test_implementation_registries_and_unknown_names():
    """Tokamax's tests skip the TPU kernels when "mosaic_tpu" is not registered; newer batch-first
    tests run "xla_chunked" and expect ValueError("Unknown implementation"), older ones
    NotImplementedError("Only XLA"): one exception satisfies both."""
    assert "mosaic_tpu" not in kj.IMPLEMENTATIONS and kj.IMPLEMENTATIONS["xla"].vjp is not None
    assert kj.IMPLEMENTATIONS["pallas_tpu"].vjp is not None
    assert kj._DEFAULT_IMPLEMENTATIONS == ("pallas_tpu", "xla") and kj.kda._DEFAULT_IMPLEMENTATIONS == ("xla",)
    assert set(kj.kda.IMPLEMENTATIONS) == {"xla", "xla_chunked"} and "mosaic_tpu" not in kj.kda.IMPLEMENTATIONS
    x, _, _ = _small(21, B=1, T=9)
    q, k, v, g = (np.moveaxis(np.asarray(x[n], np.float32), 0, 2) for n in ("query", "key", "value", "gate"))
    beta = np.moveaxis(np.asarray(x["beta"], np.float32), 0, 2)  # [HV, B, T] -> [B, T, HV]
    ref = kj.kda.kimi_delta_attention(q, k, v, g, beta)
    _same(kj.kda.kimi_delta_attention(q, k, v, g, beta, implementation="xla_chunked"), ref)
    _same(kj.kda.kimi_delta_attention(q, k, v, g, beta, implementation=("xla_chunked", "xla")), ref)
    for exc, pattern in ((ValueError, "Unknown implementation: mosaic_tpu"), (NotImplementedError, "Only XLA")):
        with pytest.raises(exc, match=pattern):
            kj.kda.kimi_delta_attention(q, k, v, g, beta, implementation="mosaic_tpu")


def test_jit_matches_eager():
    x, extra, h0 = make(5, gate="softplus")
    f = lambda **kw: kj.kimi_delta_attention(**kw, **extra, initial_state=h0, output_final_state=True,
                                             use_gate_in_kernel=True)
    eager = f(**x)
    jitted = jax.jit(f)(**x)
    for a, b in zip(eager, jitted):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_vmap():
    """vmap (method: expand_dims; unmapped operands broadcast in the handler, which loops over the
    mapped axes) equals per-example calls bitwise, for the forward, nested vmap and grad."""
    xs = [make(10 + i, B=1, T=40)[0] for i in range(3)]
    h0 = make(9, B=1, T=40)[2]
    stacked = {n: np.stack([x[n] for x in xs]) for n in ("query", "value")}
    fixed = xs[0]

    def f(query, value):
        o, fs = kj.kimi_delta_attention(query, fixed["key"], value, fixed["gate"], fixed["beta"], initial_state=h0,
                                        output_final_state=True)
        return o, fs

    o, fs = jax.vmap(f)(stacked["query"], stacked["value"])
    assert o.shape == (3,) + fixed["value"].shape and fs.shape == (3,) + h0.shape
    for i in range(3):
        oi, fsi = f(stacked["query"][i], stacked["value"][i])
        assert np.array_equal(np.asarray(o[i]), np.asarray(oi)) and np.array_equal(np.asarray(fs[i]), np.asarray(fsi))

    # nested vmap: two leading axes on query, one on value (broadcast over the inner axis)
    q2 = np.stack([stacked["query"], stacked["query"][::-1]])  # [2, 3, H, B, T, K]
    o2, _ = jax.vmap(jax.vmap(f, in_axes=(0, None)), in_axes=(0, 0))(q2, stacked["value"][:2])
    assert o2.shape == (2, 3) + fixed["value"].shape
    for a in range(2):
        for b in range(3):
            assert np.array_equal(np.asarray(o2[a, b]), np.asarray(f(q2[a, b], stacked["value"][a])[0]))

    def loss(query, value):
        o, fs = f(query, value)
        return jnp.sum(o * o) + jnp.sum(fs)

    gv = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1))))(stacked["query"], stacked["value"])
    for i in range(3):
        gi = jax.grad(loss, argnums=(0, 1))(stacked["query"][i], stacked["value"][i])
        for a, b in zip(gv, gi):
            assert np.array_equal(np.asarray(a[i]), np.asarray(b))


def test_errors():
    x, extra, h0 = make(6, N=2)
    with pytest.raises(ValueError, match="max_num_segments"):
        kj.kimi_delta_attention(**x, segment_ids=np.ones((2, 70), np.int32))
    with pytest.raises(ValueError, match="one state per batch row"):
        kj.kimi_delta_attention(**x, initial_state=h0)
    with pytest.raises(ValueError, match="a_log"):
        kj.kimi_delta_attention(**x, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="'gate'"):
        kj.kimi_delta_attention(x["query"], x["key"], x["value"], x["gate"][..., :4], x["beta"])
    with pytest.raises(Exception, match="'segment_ids'"):  # the library's data check, through the FFI
        o, _ = kj.kimi_delta_attention(**x, segment_ids=segments(2, 70, [[10, 10], [5]])[:, ::-1].copy(),
                                       max_num_segments=2)
        o.block_until_ready()


def test_float64_runs_the_oracle_and_check_grads():
    """float64 (jax_enable_x64) runs the fp64 oracle forward and its exact adjoint, so
    finite-difference gradient checks pass on a tiny case."""
    if not hasattr(jax, "enable_x64"):
        pytest.skip("this jax has no jax.enable_x64 context manager")
    from jax.test_util import check_grads
    rng = np.random.default_rng(7)
    H, B, T, K, V = 1, 1, 7, 3, 2
    with jax.enable_x64(True):
        args = [jnp.asarray(rng.standard_normal(s)) for s in
                [(H, B, T, K), (H, B, T, K), (H, B, T, V), (H, B, T, K), (H, B, T), (H,), (H * K,), (B, 1, H, K, V)]]

        def f(q, k, v, g, beta, a_log, dt_bias, h0):
            o, fs = kj.kimi_delta_attention(q, k, v, g, beta, a_log=a_log, delta_time_bias=dt_bias, initial_state=h0,
                                            output_final_state=True, use_gate_in_kernel=True, use_qk_l2norm=True)
            assert o.dtype == jnp.float64 and fs.dtype == jnp.float64
            return jnp.sum(jnp.sin(o)) + jnp.sum(fs * fs)

        check_grads(f, args, order=1, modes=["rev"])


def test_float64_uses_scale_and_lower_bound_unrounded():
    """The float64 path computes with scale and lower_bound as given: K^-0.5 and -4.9 are not
    float32 numbers, and rounding them (the FFI attributes were float32) put o 2e-8 (relative) off
    the float64 recurrence; now within float64 rounding."""
    if not hasattr(jax, "enable_x64"):
        pytest.skip("this jax has no jax.enable_x64 context manager")
    rng = np.random.default_rng(11)
    H, B, T, K, V = 2, 1, 24, 128, 8
    q, k = (rng.standard_normal((H, B, T, K)) for _ in range(2))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v, g_raw = rng.standard_normal((H, B, T, V)), rng.standard_normal((H, B, T, K))
    beta, a_log, lb = rng.random((H, B, T)), rng.standard_normal(H) * 0.5, -4.9
    g = lb / (1.0 + np.exp(-np.exp(a_log)[:, None, None, None] * g_raw))  # lower_bound * sigmoid(e^a_log g)
    S = np.zeros((H, K, V))
    ref = np.zeros((H, B, T, V))
    for t in range(T):
        for h in range(H):
            S[h] *= np.exp(g[h, 0, t])[:, None]
            S[h] += np.outer(k[h, 0, t], beta[h, 0, t] * (v[h, 0, t] - S[h].T @ k[h, 0, t]))
            ref[h, 0, t] = K ** -0.5 * (S[h].T @ q[h, 0, t])
    with jax.enable_x64(True):
        o, _ = kj.kimi_delta_attention(*(jnp.asarray(x) for x in (q, k, v, g_raw, beta)), a_log=jnp.asarray(a_log),
                                       scale=K ** -0.5, use_gate_in_kernel=True, lower_bound=lb)
        err = float(np.abs(np.asarray(o) - ref).max() / np.abs(ref).max())
    assert err < 1e-12, f"max relative error {err:.3e} against the float64 recurrence"


def test_float64_arguments_beside_a_float32_query_compute_in_float32():
    """Under jax_enable_x64, numpy's float64 a_log / dt_bias / keys / initial state beside a float32
    query compute in fp32 (as Tokamax casts a_log and dt_bias): the same o and gradients as the
    all-float32 call, bit for bit, the gradients in each argument's own dtype."""
    if not hasattr(jax, "enable_x64"):
        pytest.skip("this jax has no jax.enable_x64 context manager")
    rng = np.random.default_rng(13)
    H, B, T, K, V = 2, 1, 20, 8, 4
    shapes = [(H, B, T, K), (H, B, T, K), (H, B, T, V), (H, B, T, K), (H, B, T), (H,), (H * K,), (B, 1, H, K, V)]
    xs = [rng.standard_normal(s) for s in shapes]
    xs[4] = rng.random(shapes[4])

    def loss(q, k, v, g, beta, a_log, dt_bias, h0):
        o, fs = kj.kimi_delta_attention(q, k, v, g, beta, a_log=a_log, delta_time_bias=dt_bias, initial_state=h0,
                                        output_final_state=True, use_gate_in_kernel=True, use_qk_l2norm=True)
        return jnp.sum(o * o) + jnp.sum(fs), o

    with jax.enable_x64(True):
        f32 = [jnp.asarray(x, jnp.float32) for x in xs]
        mixed = [f32[0]] + [jnp.asarray(x) for x in xs[1:]]  # float64 but for the query
        assert all(x.dtype == jnp.float64 for x in mixed[1:])
        (l32, o32), g32 = jax.value_and_grad(loss, argnums=tuple(range(8)), has_aux=True)(*f32)
        (lmx, omx), gmx = jax.value_and_grad(loss, argnums=tuple(range(8)), has_aux=True)(*mixed)
    assert omx.dtype == jnp.float32 and np.array_equal(np.asarray(omx), np.asarray(o32))
    for i, (a, b) in enumerate(zip(gmx, g32)):
        assert a.dtype == mixed[i].dtype, (i, a.dtype)
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b)), f"gradient {i}"


# --- Tokamax API compatibility: implementation names, context parallel metadata, signature /
# --- **options (libkda extensions and the older experimental API's keywords), batch-first API.

def _small(seed=20, **kw):
    spec = dict(H=2, B=2, T=21, K=8, V=4)
    spec.update(kw)
    return make(seed, **spec)


def _same(a, b):
    for x, y in zip(a, b):
        assert (x is None and y is None) or np.array_equal(np.asarray(x), np.asarray(y))


def test_implementation_names():
    """Every Tokamax name runs libkda's kernels, "xla_chunked" too (its newer tests compare it with
    "xla"); a sequence is walked as Tokamax walks it: the first known name runs, so names after it
    are never looked at, and an unknown name before it raises."""
    x, _, _ = _small()
    ref = kj.kimi_delta_attention(**x)
    for impl in ("xla", "xla_chunked", "mosaic", "mosaic_tpu", "pallas_tpu", ("mosaic", "xla"),
                 ("xla_chunked", "xla"), ["xla"], ("xla", "triton")):
        _same(kj.kimi_delta_attention(**x, implementation=impl), ref)
    with pytest.raises(ValueError, match="^Unknown implementation: triton$"):
        kj.kimi_delta_attention(**x, implementation="triton")
    with pytest.raises(ValueError, match="Unknown implementation: triton"):
        kj.kimi_delta_attention(**x, implementation=("triton", "xla"))
    with pytest.raises(ValueError, match="must not be an empty sequence"):
        kj.kimi_delta_attention(**x, implementation=())


def test_implementation_callables_fall_through_on_not_implemented():
    x, _, _ = _small()
    ref = kj.kimi_delta_attention(**x)
    seen = []

    def declines(*args, **kwargs):
        seen.append(len(args))
        raise NotImplementedError("not for this shape")

    _same(kj.kimi_delta_attention(**x, implementation=(declines, "xla")), ref)
    assert seen == [5]
    marker = object()
    assert kj.kimi_delta_attention(**x, implementation=lambda *a, **k: marker) is marker
    # Every entry declines: a single entry's own error, else Tokamax's ExceptionGroup of them all.
    with pytest.raises(NotImplementedError, match="^not for this shape$"):
        kj.kimi_delta_attention(**x, implementation=(declines,))
    with pytest.raises(ExceptionGroup, match="all implementations failed") as group:
        kj.kimi_delta_attention(**x, implementation=[declines, declines])
    assert [str(e) for e in group.value.exceptions] == ["not for this shape"] * 2


def test_registry_entry_binds_with_shape_checks():
    """Tokamax's newer base_test: IMPLEMENTATIONS["xla"].bind(...) raises jaxtyping.TypeCheckError
    for every mismatched shape (ShapeError is also a ValueError, the older bind's error)."""
    jt = pytest.importorskip("jaxtyping")
    x, extra, h0 = _small(gate="lower_bound", N=1)
    impl = kj.IMPLEMENTATIONS["xla"]
    args = [x[n] for n in ("query", "key", "value", "gate", "beta")]
    bound = impl.bind(*args, initial_state=h0)
    assert bound["num_states"] == 1 and bound["initial_state"] is h0
    bad = {
        "query": [args[0][:, :, 0]] + args[1:],
        "key": [args[0], args[1][..., :-1]] + args[2:],
        "value": args[:2] + [args[2][:, :-1]] + args[3:],
        "gate": args[:3] + [args[3][:, :, :-1]] + args[4:],
        "beta": args[:4] + [args[4][..., :-1]],
    }
    for name, a in bad.items():
        with pytest.raises(jt.TypeCheckError):
            impl.bind(*a)
        with pytest.raises(ValueError):
            kj.kimi_delta_attention(*a)
    B, T = args[0].shape[1:3]
    with pytest.raises(jt.TypeCheckError, match="trailing dimensions"):
        impl.bind(*args, initial_state=h0[..., :-1])
    with pytest.raises(jt.TypeCheckError, match=r"must have shape \[B, N, H, K, V\]"):
        impl.bind(*args, initial_state=h0[:1] if B > 1 else h0[None])
    with pytest.raises(jt.TypeCheckError, match="`segment_ids` shape"):
        impl.bind(*args, segment_ids=np.ones((B, T + 1), np.int32), max_num_segments=1)
    out = impl(*args, initial_state=h0, output_final_state=True)
    _same(out, kj.kimi_delta_attention(*args, initial_state=h0, output_final_state=True))


def test_gate_argument_checks_match_tokamax_bind():
    x, extra, _ = _small(gate="lower_bound")
    a_log, bias = extra["a_log"], extra["delta_time_bias"]
    with pytest.raises(ValueError, match="^`a_log` must be provided when `use_gate_in_kernel=True`.$"):
        kj.kimi_delta_attention(**x, use_gate_in_kernel=True, lower_bound=-5.0)
    with pytest.raises(ValueError, match="^`A_log` must be provided"):
        kj.kimi_delta_attention(**x, use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=True)
    with pytest.raises(ValueError, match=r"`a_log` shape \(3,\) must be \(2,\)"):
        kj.kimi_delta_attention(**x, use_gate_in_kernel=True, a_log=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"`delta_time_bias` shape \(15,\) must be \(16,\)"):
        kj.kimi_delta_attention(**x, use_gate_in_kernel=True, a_log=a_log, delta_time_bias=bias[:-1])
    with pytest.raises(ValueError, match=r"`dt_bias` shape"):
        kj.kimi_delta_attention(**x, use_gate_in_kernel=True, A_log=a_log, dt_bias=bias[:-1])
    for lb in (-6.0, 0.0, 0.5):
        with pytest.raises(ValueError, match=r"`lower_bound` must be in \[-5, 0\)"):
            kj.kimi_delta_attention(**x, use_gate_in_kernel=True, a_log=a_log, lower_bound=lb)
    # The gate's parameters and bound are ignored without the gate in kernel, as in Tokamax.
    _same(kj.kimi_delta_attention(**x, a_log=np.zeros(3, np.float32), lower_bound=2.0), kj.kimi_delta_attention(**x))


def test_oldest_keyword_names_of_the_arrays():
    """kimi_delta_attention(q=, k=, v=, g=, beta=) (the A_log-era API) equals the positional call."""
    x, _, _ = _small()
    ref = kj.kimi_delta_attention(**x)
    _same(kj.kimi_delta_attention(q=x["query"], k=x["key"], v=x["value"], g=x["gate"], beta=x["beta"]), ref)
    with pytest.raises(TypeError, match="both `query` and its older name `q`"):
        kj.kimi_delta_attention(x["query"], x["key"], x["value"], x["gate"], x["beta"], q=x["query"])
    with pytest.raises(TypeError, match="missing required argument 'gate'"):
        kj.kimi_delta_attention(q=x["query"], k=x["key"], v=x["value"], beta=x["beta"])


def test_context_parallel_metadata_single_device_runs():
    import dataclasses
    import types

    @dataclasses.dataclass(frozen=True)
    class Metadata:  # the fields Tokamax's ContextParallelMetadata / CPContext have
        mesh: object
        axis_name: str = "context"

        @property
        def is_cp_enabled(self):
            return self.mesh.shape[self.axis_name] > 1

    x, _, h0 = _small()
    ref = kj.kimi_delta_attention(**x, initial_state=h0, output_final_state=True)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("context",))
    for md in (Metadata(mesh), types.SimpleNamespace(mesh=mesh)):  # with and without is_cp_enabled
        _same(kj.kimi_delta_attention(**x, initial_state=h0, output_final_state=True, context_parallel_metadata=md,
                                      implementation="xla"), ref)
    _same(kj.kimi_delta_attention(**x, initial_state=h0, output_final_state=True, cp_context=Metadata(mesh)), ref)
    two = types.SimpleNamespace(shape={"context": 2})  # a 2-device context axis (no second device needed)
    for md in (Metadata(two), types.SimpleNamespace(mesh=two)):
        with pytest.raises(NotImplementedError, match="context parallelism is not supported.*'context' has 2"):
            kj.kimi_delta_attention(**x, context_parallel_metadata=md)


def test_signature_matches_tokamax():
    import inspect
    params = inspect.signature(kj.kimi_delta_attention).parameters
    assert "chunk_size" not in params  # Tokamax base_test: test_chunk_size_is_not_public
    for name in ("delta_time_bias", "use_qk_l2norm", "context_parallel_metadata", "a_log", "max_num_segments",
                 "implementation"):
        assert name in params, name
    for name in ("dt_bias", "use_qk_l2norm_in_kernel", "cp_context", "safe_gate", "disable_recompute",
                 "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "rematerialize_for_backward"):
        assert name not in params, name
    assert list(params)[:5] == ["query", "key", "value", "gate", "beta"]


def test_options_extensions_and_older_api_aliases():
    x, extra, h0 = _small(21, gate="lower_bound", N=2, T=30)
    seg = segments(2, 30, [[12, 15], [30]])
    new = kj.kimi_delta_attention(**x, a_log=extra["a_log"], delta_time_bias=extra["delta_time_bias"],
                                  use_qk_l2norm=True, use_gate_in_kernel=True, lower_bound=-5.0, segment_ids=seg,
                                  max_num_segments=2, output_final_state=True)
    old = kj.kimi_delta_attention(**x, A_log=extra["a_log"], dt_bias=extra["delta_time_bias"],
                                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0,
                                  segment_ids=seg, N_max=2, output_final_state=True, safe_gate=True,
                                  disable_recompute=False, cp_context=None, chunk_size=64)
    _same(old, new)
    ro, rfs = libkda.naive_recurrent_kda(*(bf(x[n]) for n in ("query", "key", "value", "gate", "beta")),
                                         output_final_state=True, use_qk_l2norm_in_kernel=True,
                                         **oracle_kwargs(extra, seg, 2))
    assert_close(np.asarray(new[0], np.float64), hf(ro), 1e-5, "o")
    # chunk_size through **options (32, 16), and the gradients of disable_recompute vs rematerialize
    for cs in (32, 16):
        o, _ = kj.kimi_delta_attention(**x, a_log=extra["a_log"], use_gate_in_kernel=True, lower_bound=-5.0,
                                       chunk_size=cs)
        r, _ = kj.kimi_delta_attention(**x, a_log=extra["a_log"], use_gate_in_kernel=True, lower_bound=-5.0)
        assert_close(np.asarray(o), np.asarray(r), 1e-5, f"o chunk_size={cs}")

    def grad(**opt):
        f = lambda q: jnp.sum(kj.kimi_delta_attention(q, *list(x.values())[1:], **opt)[0] * x["value"])  # noqa: E731
        return jax.jit(jax.grad(f))(x["query"])

    g1, g2, g3 = grad(disable_recompute=True), grad(disable_recompute=False), grad(rematerialize_for_backward=True)
    assert np.array_equal(g1, g2) and np.array_equal(g2, g3)

    def forward_results(**opt):  # the shapes the differentiated forward's custom call returns
        f = lambda q: kj.kimi_delta_attention(q, *list(x.values())[1:], **opt)[0]  # noqa: E731
        jaxpr = jax.make_jaxpr(lambda q: jax.vjp(f, q)[0])(x["query"])
        return [tuple(v.aval.shape) for e in jaxpr.jaxpr.eqns if e.primitive.name == "ffi_call" for v in e.outvars]

    # saved-state residual: the output, the chunk states and every token's delta v_new (shaped
    # like the output); rematerialized: the output alone
    out_shape = tuple(x["value"].shape)
    saved, remat = forward_results(), forward_results(rematerialize_for_backward=True)
    assert saved[0] == out_shape and saved[-1] == out_shape and len(saved) == 3, saved
    assert remat == [out_shape], remat
    # validation
    with pytest.raises(TypeError, match="unexpected keyword argument 'chunksize'"):
        kj.kimi_delta_attention(**x, chunksize=32)
    with pytest.raises(TypeError, match="both `a_log` and its older alias `A_log`"):
        kj.kimi_delta_attention(**x, a_log=extra["a_log"], A_log=extra["a_log"], use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="disagree"):
        kj.kimi_delta_attention(**x, disable_recompute=True, rematerialize_for_backward=True)
    with pytest.raises(ValueError, match="`lower_bound` must be specified when `safe_gate=True`"):
        kj.kimi_delta_attention(**x, A_log=extra["a_log"], use_gate_in_kernel=True, safe_gate=True)
    with pytest.raises(ValueError, match=r"`lower_bound` must be in \[-5, 0\)"):
        kj.kimi_delta_attention(**x, A_log=extra["a_log"], use_gate_in_kernel=True, safe_gate=True, lower_bound=-6.0)
    with pytest.raises(ValueError, match="`chunk_size` must be 64, 32 or 16"):
        kj.kimi_delta_attention(**x, chunk_size=48)


def test_missing_max_num_segments_matches_both_tokamax_regexes():
    o1 = jnp.ones((1, 1, 65, 1), jnp.float32)  # Tokamax base_test's shapes
    seg = jnp.concatenate([jnp.ones((1, 20), jnp.int32), jnp.full((1, 20), 2, jnp.int32),
                           jnp.full((1, 25), 3, jnp.int32)], axis=1)
    for pattern in ("`max_num_segments` is required", "`N_max` is required"):
        with pytest.raises(ValueError, match=pattern):
            kj.kimi_delta_attention(o1, o1, o1, jnp.zeros_like(o1), o1[..., 0], segment_ids=seg, implementation="xla")
    x, _, h0 = _small(N=1)
    for kw in (dict(max_num_segments=2), dict(N_max=2)):
        with pytest.raises(ValueError, match="must match"):
            kj.kimi_delta_attention(**x, initial_state=h0, **kw)


def test_batch_first_api():
    """tokamax/_src/ops/kda/api.py: q [B, T, H, K], state [B, H, K, V]; forward and gradients
    against the fp64 oracle, Tokamax's errors."""
    from libkda.jax.kda import kimi_delta_attention as kda_bf
    assert kda_bf is kj.kimi_delta_attention_batch_first and kda_bf.__name__ == "kimi_delta_attention"
    import inspect
    assert list(inspect.signature(kda_bf).parameters) == ["q", "k", "v", "g", "beta", "scale", "initial_state",
                                                          "output_final_state", "implementation"]
    x, _, h0 = _small(22, B=2, T=23)
    q, k, v, g, beta = (np.ascontiguousarray(bf(x[n]).astype(np.float32))
                        for n in ("query", "key", "value", "gate", "beta"))
    s0 = np.ascontiguousarray(h0[:, 0])  # [B, H, K, V]
    o, fs = kda_bf(q, k, v, g, beta, scale=0.3, initial_state=s0, output_final_state=True)
    assert o.shape == v.shape and o.dtype == jnp.float32 and fs.shape == s0.shape and fs.dtype == jnp.float32
    ro, rfs = libkda.naive_recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=s0, output_final_state=True)
    assert_close(np.asarray(o), ro, 1e-5, "o")
    assert_close(np.asarray(fs), rfs, 1e-5, "final_state")
    assert kda_bf(q, k, v, g, beta)[1] is None

    rng = np.random.default_rng(23)
    do = rng.standard_normal(v.shape).astype(np.float32)
    dht = rng.standard_normal(s0.shape).astype(np.float32)

    def loss(q, k, v, g, beta, s):
        o, fs = kda_bf(q, k, v, g, beta, initial_state=s, output_final_state=True)
        return jnp.sum(o * do) + jnp.sum(fs * dht)

    grads = jax.jit(jax.grad(loss, argnums=tuple(range(6))))(q, k, v, g, beta, s0)  # jit: under trace too
    ref = libkda.naive_recurrent_kda_bwd(q, k, v, g, beta, do, dht, initial_state=s0)
    for grad, arg, name in zip(grads, (q, k, v, g, beta, s0), ["dq", "dk", "dv", "dg", "dbeta", "dh0"]):
        assert grad.shape == arg.shape, name
        assert_close(np.asarray(grad, np.float64), ref[name], 1e-4, name)
    with pytest.raises(NotImplementedError, match="Only XLA"):
        kda_bf(q, k, v, g, beta, implementation="mosaic_tpu")
    kda_bf(q, k, v, g, beta, implementation=("xla",))
    with pytest.raises(ValueError, match="`k` shape"):
        kda_bf(q, k[:, :-1], v, g, beta)
    with pytest.raises(ValueError, match="`initial_state` shape"):
        kda_bf(q, k, v, g, beta, initial_state=h0)  # the head-first [B, N, H, K, V] state is not guessed


def test_bf16_dot_products_option():
    """libkda's bf16_dot_products through **options: the same results as the numpy binding
    with the same setting."""
    x, extra, h0 = make(41, T=90, dtype=BF16)
    xb = {n: np.moveaxis(a, 0, 2) for n, a in x.items()}  # head-first -> batch-first, same values
    xb = dict(q=xb["query"], k=xb["key"], v=xb["value"], g=xb["gate"], beta=xb["beta"])
    for bf16_products in (True, False):
        o, fs = kj.kimi_delta_attention(**x, initial_state=h0, output_final_state=True,
                                        bf16_dot_products=bf16_products)
        ro, rfs = libkda.chunk_kda(**xb, initial_state=h0[:, 0], output_final_state=True,
                                   bf16_dot_products=bf16_products)
        assert np.array_equal(np.asarray(o), hf(ro)), bf16_products
        assert np.array_equal(np.asarray(fs)[:, 0], rfs), bf16_products


def test_scalar_gate_per_head_and_token():
    """per_channel_gate=False: gate [HV, B, T, 1] (one log decay per head and token) runs as that
    value on every K channel -- forward bitwise equal to the broadcast gate, the gate's gradient
    the sum over K of the per-channel one -- and against the oracle; a [HV, B, T, K] gate is then
    a shape error."""
    x, _, h0 = make(7, H=2, B=2, T=45, K=16, V=8)
    scalar = x["gate"][..., :1]
    full = np.broadcast_to(scalar, x["gate"].shape).copy()
    common = dict(initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    o1, s1 = kj.kimi_delta_attention(x["query"], x["key"], x["value"], scalar, x["beta"], per_channel_gate=False,
                                     **common)
    o2, s2 = kj.kimi_delta_attention(x["query"], x["key"], x["value"], full, x["beta"], **common)
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s2))
    ro, rfs = libkda.naive_recurrent_kda(bf(x["query"]), bf(x["key"]), bf(x["value"]), bf(full), bf(x["beta"]),
                                         initial_state=h0[:, 0], output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_close(np.asarray(o1, np.float64), hf(ro), BOUND[F32], "o")
    assert_close(np.asarray(s1)[:, 0], rfs, BOUND[F32], "final_state")

    def loss(gate, per_channel):
        o, s = kj.kimi_delta_attention(x["query"], x["key"], x["value"], gate, x["beta"],
                                       per_channel_gate=per_channel, **common)
        return jnp.sum(jnp.sin(o)) + jnp.sum(jnp.cos(s))

    d_scalar = jax.grad(loss)(scalar, False)
    d_full = jax.grad(loss)(full, True)
    assert d_scalar.shape == scalar.shape
    assert_close(np.asarray(d_scalar, np.float64), np.asarray(d_full, np.float64).sum(-1, keepdims=True), 1e-5, "dg")
    with pytest.raises(ValueError, match=r"per_channel_gate=False"):
        kj.kimi_delta_attention(x["query"], x["key"], x["value"], full, x["beta"], per_channel_gate=False, **common)


def test_scalar_gate_in_kernel_takes_a_per_head_bias():
    """per_channel_gate=False with the gate in kernel: delta_time_bias is [HV] (one decay per head
    and token), equal bitwise to the per-channel call with the gate and bias broadcast over K, its
    gradient the sum over K; a per-channel [HV * K] bias is then a shape error."""
    x, extra, h0 = make(8, H=1, HV=2, B=1, T=40, K=16, V=8, gate="softplus")
    HV, K = 2, 16
    scalar = x["gate"][..., :1]
    bias_h = extra["delta_time_bias"][::K].copy()  # [HV]
    full_gate = np.broadcast_to(scalar, x["gate"].shape).copy()
    full_bias = np.repeat(bias_h, K)
    common = dict(initial_state=h0, output_final_state=True, use_gate_in_kernel=True, a_log=extra["a_log"])

    def run(gate, bias, per_channel):
        return kj.kimi_delta_attention(x["query"], x["key"], x["value"], gate, x["beta"], delta_time_bias=bias,
                                       per_channel_gate=per_channel, **common)

    o1, s1 = run(scalar, bias_h, False)
    o2, s2 = run(full_gate, full_bias, True)
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s2))

    def loss(gate, bias, per_channel):
        o, s = run(gate, bias, per_channel)
        return jnp.sum(jnp.sin(o)) + jnp.sum(jnp.cos(s))

    dg1, db1 = jax.grad(loss, argnums=(0, 1))(scalar, bias_h, False)
    dg2, db2 = jax.grad(loss, argnums=(0, 1))(full_gate, full_bias, True)
    assert db1.shape == (HV,)
    assert_close(np.asarray(dg1, np.float64), np.asarray(dg2, np.float64).sum(-1, keepdims=True), 1e-5, "dg")
    assert_close(np.asarray(db1, np.float64), np.asarray(db2, np.float64).reshape(HV, K).sum(-1), 1e-5, "dbias")
    with pytest.raises(ValueError, match=r"per_channel_gate=False"):
        run(scalar, full_bias, False)


SHARD_MAP_SCRIPT = r"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
try:
    from jax import shard_map
except ImportError:
    from jax.experimental.shard_map import shard_map
import libkda.jax as kj
rng = np.random.default_rng(0)
H, HV, B, T, K, V, N = 1, 2, 4, 40, 16, 8, 2
mk = lambda *s: rng.standard_normal(s).astype(np.float32)
q, k, v, g = mk(H, B, T, K), mk(H, B, T, K), mk(HV, B, T, V), mk(HV, B, T, K)
beta = rng.uniform(0, 1, (HV, B, T)).astype(np.float32)
a_log = np.log(rng.uniform(0.5, 2, HV)).astype(np.float32)
bias = 0.3 * mk(HV * K)
h0 = 0.1 * mk(B, N, HV, K, V)
seg = np.zeros((B, T), np.int32)
seg[:, :15] = 1
seg[:, 15:33] = 2
def f(q, k, v, g, b, a, dt, h, s):
    return kj.kimi_delta_attention(q, k, v, g, b, a_log=a, delta_time_bias=dt, initial_state=h,
                                   output_final_state=True, use_qk_l2norm=True, use_gate_in_kernel=True,
                                   lower_bound=-5.0, segment_ids=s, max_num_segments=N)
mesh = Mesh(np.array(jax.devices()), ("data",))
tb = P(None, "data")
sm = shard_map(f, mesh=mesh, in_specs=(tb, tb, tb, tb, tb, P(), P(), P("data"), P("data")),
               out_specs=(tb, P("data")))
args = (q, k, v, g, beta, a_log, bias, h0, seg)
(o1, s1), (o0, s0) = jax.jit(sm)(*args), f(*args)
assert (np.asarray(o1) == np.asarray(o0)).all() and (np.asarray(s1) == np.asarray(s0)).all(), "forward"
loss = lambda fn: (lambda *a: sum(jnp.sum(jnp.sin(t)) for t in fn(*a, seg)))
g1 = jax.jit(jax.grad(loss(sm), argnums=tuple(range(8))))(*args[:8])
g0 = jax.grad(loss(f), argnums=tuple(range(8)))(*args[:8])
for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "da_log", "dbias", "dh0"], g1, g0):
    err = float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
    assert a.shape == b.shape and err < 1e-5, (name, err)
print("ok")
"""


def test_shard_map_over_the_batch_forward_and_grad():
    """Inside shard_map (two host devices, batch split over a "data" axis, a_log / delta_time_bias
    replicated): forward bitwise equal to the unsharded call, gradients equal to rounding (the
    replicated parameters' gradients are the sum over shards). Run in a subprocess: the device
    count is fixed when JAX starts."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", SHARD_MAP_SCRIPT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


def test_zero_heads_is_a_shape_error_naming_query():
    """H = 0 (query [0, B, T, K]) is a ShapeError (a ValueError) naming the argument with the
    expected and the actual value -- not the ZeroDivisionError of the `HV % H` check it precedes.
    The batch-first API ([B, T, 0, K]) reaches the same check."""
    x, _, _ = _small(B=1, T=5)
    zero = dict(query=x["query"][:0], key=x["key"][:0], value=x["value"][:0], gate=x["gate"][:0],
                beta=x["beta"][:0])
    pattern = r"'query'.*expected H >= 1, got H = 0"
    with pytest.raises(ValueError, match=pattern) as info:
        kj.kimi_delta_attention(**zero)
    assert isinstance(info.value, kj.ShapeError) and not isinstance(info.value, ZeroDivisionError)
    with pytest.raises(ValueError, match=pattern):  # value heads present, query heads absent
        kj.kimi_delta_attention(zero["query"], zero["key"], x["value"], x["gate"], x["beta"])
    with pytest.raises(ValueError, match=pattern):
        kj.IMPLEMENTATIONS["xla"].bind(**zero)
    bf_zero = [np.moveaxis(np.asarray(zero[n]), 0, 2) for n in ("query", "key", "value", "gate", "beta")]
    with pytest.raises(ValueError, match=pattern):
        kj.kda.kimi_delta_attention(*bf_zero)


@pytest.mark.parametrize("dim", ["K", "V"])
def test_zero_key_or_value_dimension_is_a_shape_error_before_running(dim):
    """K = 0 or V = 0 is a ShapeError (a ValueError) raised by validation, naming the argument and
    the expected and actual value, as the numpy and torch entries reject it: not a JaxRuntimeError
    from the custom call at run time (K = 0 was), nor an empty output (V = 0 was). Head-first,
    batch-first and ``bind``."""
    x, _, _ = _small(B=1, T=5)
    if dim == "K":
        zero = dict(x, query=x["query"][..., :0], key=x["key"][..., :0], gate=x["gate"][..., :0])
        pattern = r"'query'.*expected K >= 1, got K = 0"
    else:
        zero = dict(x, value=x["value"][..., :0])
        pattern = r"'value'.*expected V >= 1, got V = 0"
    zero = {n: zero[n] for n in ("query", "key", "value", "gate", "beta")}
    with pytest.raises(ValueError, match=pattern) as info:
        kj.kimi_delta_attention(**zero)
    assert isinstance(info.value, kj.ShapeError)
    with pytest.raises(ValueError, match=pattern):
        kj.IMPLEMENTATIONS["xla"].bind(**zero)
    bf_zero = [np.moveaxis(np.asarray(zero[n]), 0, 2) for n in ("query", "key", "value", "gate", "beta")]
    with pytest.raises(ValueError, match=pattern):
        kj.kda.kimi_delta_attention(*bf_zero)


def test_large_key_dimension_runs_through_xla():
    """Tokamax's test_large_key_dimension_is_mosaic_specific (openxla/tokamax
    tokamax/_src/ops/experimental/kda/pallas_mosaic_tpu_test.py @84c7a4fc): K = 257 through
    implementation="xla" -- q = k = ones [1, 1, 1, 257], v ones [1, 1, 1, 1], g zeros, beta ones,
    scale = 1.0 -- returns output of v's shape and no final state. Also checked against the fp64
    oracle (one token: o = scale * |k|^2 * beta * v = 257). Its second half (the TPU "mosaic"
    kernel raises NotImplementedError "up to 256") is a TPU kernel limit: here "mosaic" runs
    libkda's kernels too, so it is checked to give the same result instead."""
    q = jnp.ones((1, 1, 1, 257), dtype=jnp.float32)
    v = jnp.ones((1, 1, 1, 1), dtype=jnp.float32)

    def call(implementation):
        return kj.kimi_delta_attention(q, jnp.ones_like(q), v, jnp.zeros_like(q), jnp.ones(q.shape[:-1], q.dtype),
                                       scale=1.0, implementation=implementation)

    output, final_state = call("xla")
    assert output.shape == v.shape
    assert final_state is None
    ro, _ = libkda.naive_recurrent_kda(bf(q), bf(jnp.ones_like(q)), bf(v), bf(jnp.zeros_like(q)),
                                       bf(jnp.ones(q.shape[:-1])), scale=1.0)
    assert ro.reshape(-1)[0] == 257.0
    assert_close(np.asarray(output, np.float64), hf(ro), BOUND[F32], "o")
    _same(call("mosaic"), (output, final_state))
