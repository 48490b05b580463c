"""The input contract at the framework edges (a fuzzing pass found each of these): a NaN option
is refused rather than read as "not given", tensors on another device or of a wrong dtype are
named, outputs and pools are checked before anything is written, a decode of no tokens is a
no-op, and outputs whose elements overlap are refused."""

import re

import numpy as np
import pytest
from conftest import make_inputs

import libkda

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
import libkda.flash_kda as flash_kda  # noqa: E402
import libkda.torch as kt  # noqa: E402

N, HV, K, V = 3, 2, 16, 8


def _decode_inputs(T=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(N, T, HV, K, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(N, T, HV, V, generator=g)
    gate = torch.nn.functional.logsigmoid(torch.randn(N, T, HV, K, generator=g))
    beta = torch.rand(N, T, HV, generator=g)
    pool = torch.randn(N + 2, HV, K, V, generator=g)
    return q, k, v, gate, beta, pool


# --- NaN options -------------------------------------------------------------------------------

def test_nan_scale_is_refused_everywhere(rng):
    x = make_inputs(rng, B=1, T=20, H=2, K=16, V=16)
    with pytest.raises(ValueError, match=r"'scale'.*got nan"):
        libkda.chunk_kda(**x, scale=float("nan"))
    q, k, v, g, beta, pool = _decode_inputs()
    with pytest.raises(ValueError, match=r"'scale'.*got nan"):
        kt.chunk_kda(q, k, v, g, beta, scale=float("nan"))
    before = pool.clone()
    with pytest.raises(ValueError, match=r"'scale'.*got nan"):
        kt.kda_decode(q, k, v, g, beta, pool, torch.arange(N), scale=float("nan"))
    assert torch.equal(pool, before)


def test_nan_lower_bound_is_refused_by_torch():
    q, k, v, g, beta, _ = _decode_inputs(T=5)
    with pytest.raises(ValueError, match=r"'lower_bound'.*got nan"):
        kt.chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, A_log=torch.zeros(HV), lower_bound=float("nan"))


def test_nan_scale_is_refused_by_jax():
    jnp = pytest.importorskip("jax.numpy")
    import libkda.jax as kj
    x = jnp.ones((1, 1, 4, 8))
    with pytest.raises(ValueError, match=r"'scale'.*got nan"):
        kj.kimi_delta_attention(x, x, x, -x, jnp.full((1, 1, 4), 0.5), scale=float("nan"))


# --- devices and dtypes --------------------------------------------------------------------------

def test_every_tensor_must_be_on_the_cpu():
    q, k, v, g, beta, pool = _decode_inputs()
    with pytest.raises(NotImplementedError, match=r"argument 'k' is on device 'meta'"):
        kt.chunk_kda(q, k.to("meta"), v, g, beta)
    with pytest.raises(NotImplementedError, match=r"argument 'state_pool' is on device 'meta'"):
        kt.kda_decode(q, k, v, g, beta, pool.to("meta"), torch.arange(N))


def test_torch_dtype_errors_name_the_actual_dtype():
    q, k, v, g, beta, pool = _decode_inputs()
    with pytest.raises(ValueError, match=r"'q'.*float32, bfloat16, float16 or float64, got torch.bool"):
        kt.chunk_kda(q > 0, k, v, g, beta)
    with pytest.raises(ValueError, match=r"'cu_seqlens'.*int32 or int64, got torch.float32"):
        kt.kda_decode(*(x.flatten(0, 1)[None] for x in (q, k, v, g, beta)), pool, torch.arange(N),
                      cu_seqlens=torch.tensor([0.0, 1.0, 2.0, 3.0]))


@pytest.mark.parametrize("cu", [[1, 3, 5, 6], [0, 4, 2, 6], [0, 2, 4, 7], [0]], ids=["start", "decreasing", "past_end",
                                                                                 "no_sequence"])
def test_packed_decode_with_bad_cu_seqlens_shows_them(cu):
    q, k, v, g, beta, pool = _decode_inputs(T=2)
    packed = [x.flatten(0, 1)[None] for x in (q, k, v, g, beta)]  # 6 tokens
    before = pool.clone()
    with pytest.raises(ValueError, match=r"'cu_seqlens'.*got " + re.escape(str(cu))):
        kt.kda_decode(*packed, pool, torch.arange(max(len(cu) - 1, 1)), cu_seqlens=torch.tensor(cu))
    assert torch.equal(pool, before)


def test_ragged_decode_checks_every_index_before_any_group_writes():
    """Sequences of different lengths run a call per length; a bad index in any of them (a slot two
    rows write, an accepted count past its row's tokens, [N, T] indices narrower than the longest
    row) is refused before the first call writes."""
    q, k, v, g, beta, pool = _decode_inputs(T=3)
    packed = [x.flatten(0, 1)[None] for x in (q, k, v, g, beta)]  # 9 tokens: rows of 2, 3 and 4
    cu = torch.tensor([0, 2, 5, 9])
    before = pool.clone()
    with pytest.raises(ValueError, match=r"'ssm_state_indices'.*slot 1 is written by rows 0 and 2"):
        kt.kda_decode(*packed, pool, torch.tensor([1, 0, 1]), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"'ssm_state_indices'.*slot 4 is written by rows 1 and 2"):
        kt.kda_decode(*packed, pool, torch.tensor([[0, 1, -1, -1], [2, 3, 4, -1], [4, -1, -1, -1]]), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"'num_accepted_tokens'.*got 3 at row 0 of 2 tokens"):
        kt.kda_decode(*packed, pool, torch.tensor([[0, 1, -1, -1], [2, 3, -1, -1], [4, -1, -1, -1]]),
                      num_accepted_tokens=torch.tensor([3, 1, 1]), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"'ssm_state_indices'.*\[N, T'\] = \[3, >= 4\].*got.*\[3, 3\]"):
        kt.kda_decode(*packed, pool, torch.zeros(3, 3, dtype=torch.int64), cu_seqlens=cu)
    assert torch.equal(pool, before)


def test_jax_rejects_non_float_inputs_and_float_segment_ids():
    jnp = pytest.importorskip("jax.numpy")
    import libkda.jax as kj
    x, b = jnp.ones((1, 1, 4, 8)), jnp.full((1, 1, 4), 0.5)
    with pytest.raises(ValueError, match=r"'query'.*floating dtype.*got bool"):
        kj.kimi_delta_attention(x > 0, x, x, -x, b)
    with pytest.raises(ValueError, match=r"'segment_ids'.*integer dtype, got float32"):
        kj.kimi_delta_attention(x, x, x, -x, b, segment_ids=jnp.full((1, 4), 1.9), max_num_segments=2)


def test_raw_op_chunk_size_zero_is_a_value_error():
    q, k, v, g, beta, _ = _decode_inputs(T=4)
    with pytest.raises(ValueError, match=r"'chunk_size'.*got 0"):
        torch.ops.libkda.chunk_kda_fwd(q, k, v, g, beta, None, None, None, None, None, None, 0, 0, True, True)


# --- outputs checked before anything is written ----------------------------------------------------

def test_decode_out_of_wrong_shape_writes_nothing():
    q, k, v, g, beta, pool = _decode_inputs()
    before = pool.clone()
    out = torch.full((N, 1, HV, V - 1), 7.0)
    with pytest.raises(ValueError, match=r"'out'.*48 elements.*\[3, 1, 2, 7\]"):
        kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.arange(N), out=out)
    assert torch.equal(pool, before) and bool((out == 7.0).all())
    h0 = pool[:N].clone()
    with pytest.raises(ValueError, match=r"'out'"):
        kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=h0, out=out)
    assert torch.equal(h0, before[:N])
    for bad in (torch.empty(1, 1, 1, 1).expand(N, 1, HV, V), torch.zeros(64).as_strided((N, 1, HV, V), (1, 1, 1, 1))):
        with pytest.raises(ValueError, match=r"'out'.*overlap in memory"):
            kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.arange(N),
                                       out=bad)
        with pytest.raises(ValueError, match=r"'out'.*overlap in memory"):
            kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=h0, out=bad)
    assert torch.equal(pool, before) and torch.equal(h0, before[:N])
    flat = torch.zeros(N * 1, HV, V)  # any shape with o's element count receives o
    o, _ = kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool.clone(), ssm_state_indices=torch.arange(N),
                                      out=flat)
    assert o is flat and bool((flat != 0).any())
    with pytest.raises(ValueError, match=r"'out'.*floating tensor.*int16"):
        kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.arange(N),
                                   out=torch.zeros(N, 1, HV, V, dtype=torch.int16))
    assert torch.equal(pool, before)


def test_out_of_place_decode_checks_indices_as_the_in_place_one_does():
    q, k, v, g, beta, pool = _decode_inputs(T=3)
    idx = torch.arange(N * 3).reshape(N, 3) % pool.shape[0]
    call = lambda **kw: kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool,  # noqa: E731
                                                    inplace_final_state=False, **kw)
    with pytest.raises(ValueError, match=r"'num_accepted_tokens'.*\[1, T = 3\].*\[0, 1\]"):
        call(ssm_state_indices=idx, num_accepted_tokens=torch.tensor([1, 0, 1]))
    with pytest.raises(ValueError, match=r"'num_accepted_tokens'.*\[1, T = 3\]"):
        call(ssm_state_indices=idx, num_accepted_tokens=torch.tensor([1, 4, 1]))
    with pytest.raises(ValueError, match=r"'num_accepted_tokens'.*needs ssm_state_indices of shape \[N, T\]"):
        call(ssm_state_indices=torch.arange(N), num_accepted_tokens=torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match=r"'ssm_state_indices'.*< slots = 5.*got 5"):
        call(ssm_state_indices=torch.tensor([0, 1, 5]))
    packed = [x.flatten(0, 1)[None] for x in (q, k, v, g, beta)]  # 9 tokens: ragged rows of 1 and 8
    with pytest.raises(ValueError, match=r"'ssm_state_indices'.*< slots = 5.*got 7"):
        kt.fused_recurrent_kda_fwd(*packed, initial_state=pool, inplace_final_state=False,
                                   ssm_state_indices=torch.tensor([0, 7]), cu_seqlens=torch.tensor([0, 1, 9]))


def test_flash_kda_fwd_checks_its_buffers_before_writing():
    B, T, H, D = 1, 8, 2, 16
    q = torch.nn.functional.normalize(torch.randn(B, T, H, D), dim=-1).to(torch.bfloat16)
    k, v, g = q.clone(), torch.randn(B, T, H, D, dtype=torch.bfloat16), torch.randn(B, T, H, D, dtype=torch.bfloat16)
    beta = torch.randn(B, T, H, dtype=torch.bfloat16)
    a = (D ** -0.5,)
    gate = (torch.zeros(H), torch.zeros(H, D), -5.0)
    out = torch.full((B, T, H, D), 3.0, dtype=torch.bfloat16)
    broadcast = torch.zeros(1, 1, D, D).expand(B, H, D, D)
    with pytest.raises(ValueError, match=r"'final_state'.*broadcast or overlapping view"):
        flash_kda.fwd(q, k, v, g, beta, *a, out, *gate, final_state=broadcast)
    assert bool((out == 3.0).all())
    with pytest.raises(ValueError, match=r"'out'.*floating dtype, got torch.int32"):
        flash_kda.fwd(q, k, v, g, beta, *a, torch.zeros(B, T, H, D, dtype=torch.int32), *gate)
    overlapping = torch.zeros(64).as_strided((B, H, D, D), (0, 1, 1, 1))
    with pytest.raises(ValueError, match=r"'final_state'.*overlapping view"):
        flash_kda.fwd(q, k, v, g, beta, *a, out, *gate, final_state=overlapping)
    assert bool((out == 3.0).all())
    with pytest.raises(ValueError, match=r"'out'.*got None"):
        flash_kda.fwd(q, k, v, g, beta, *a, None, *gate)
    with pytest.raises(ValueError, match=r"'q'.*\[B, T, H, D\]"):
        flash_kda.fwd(q[0], k, v, g, beta, *a, out, *gate, final_state=torch.zeros(B, H, D, D))


def test_overlapping_pool_rows_are_refused_and_left_alone():
    q, k, v, g, beta, pool = _decode_inputs()
    # consecutive slots share half their floats
    overlapping = pool.flatten().as_strided((N + 1, HV, K, V), (HV * K * V // 2, K * V, V, 1))
    before = pool.clone()
    with pytest.raises(ValueError, match=r"'state_pool'.*overlap in memory"):
        kt.kda_decode(q, k, v, g, beta, overlapping, torch.arange(N))
    assert torch.equal(pool, before)
    arr = np.lib.stride_tricks.as_strided(before.numpy().copy(), (N + 1, HV, K, V), (HV * K * V * 2, K * V * 4, V * 4, 4))
    with pytest.raises(ValueError, match=r"'state_pool'.*overlap in memory"):
        libkda.kda_decode(*(x.numpy() for x in (q, k, v, g, beta)), arr, np.arange(N))


# --- no tokens -----------------------------------------------------------------------------------

def _no_token_decode(per_token):
    """Decode inputs of T = 0 tokens, a copy of the pool, and [N, 0] or [N] slot indices."""
    q, k, v, g, beta, pool = _decode_inputs()
    tokens = tuple(x[:, :0] for x in (q, k, v, g, beta))
    idx = torch.zeros(N, 0, dtype=torch.int64) if per_token else torch.arange(N)
    return tokens, pool, pool.clone(), idx


@pytest.mark.parametrize("per_token", [False, True], ids=["[N]", "[N, 0]"])
def test_decode_of_no_tokens_is_a_no_op(per_token):
    (q, k, v, g, beta), pool, before, idx = _no_token_decode(per_token)
    o = kt.kda_decode(q, k, v, g, beta, pool, idx)
    assert tuple(o.shape) == (N, 0, HV, V) and torch.equal(pool, before)
    o = libkda.kda_decode(*(x.numpy() for x in (q, k, v, g, beta)), pool.numpy(), idx.numpy())
    assert o.shape == (N, 0, HV, V) and torch.equal(pool, before)


@pytest.mark.parametrize("per_token", [False, True], ids=["[N]", "[N, 0]"])
def test_out_of_place_decode_of_no_tokens_returns_empty_results(per_token):
    (q, k, v, g, beta), pool, before, idx = _no_token_decode(per_token)
    o, states = kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, inplace_final_state=False,
                                           output_final_state=True, ssm_state_indices=idx)
    assert tuple(o.shape) == (N, 0, HV, V) and tuple(states.shape) == (0, HV, K, V)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("inplace", [True, False], ids=["in_place", "out_of_place"])
def test_decode_of_no_tokens_still_checks_the_pool(inplace):
    """vLLM's all-padding batch (cu_seqlens [0, 0, ...]) decodes nothing, but a pool of the wrong
    shape or dtype is still an error naming it, as for a batch with tokens."""
    q, k, v, g, beta, pool = _decode_inputs()
    cu = torch.zeros(N + 1, dtype=torch.int32)
    tokens = tuple(x[:1] for x in (q, k, v, g, beta))  # [1, T, ...]: a packed buffer of padding tokens
    kw = dict(cu_seqlens=cu, ssm_state_indices=torch.full((N,), -1, dtype=torch.int32), inplace_final_state=inplace)
    with pytest.raises(ValueError, match=r"'state_pool'.*\[slots, 2, 16, 8\], got \[5, 2, 16, 4\]"):
        kt.fused_recurrent_kda_fwd(*tokens, initial_state=pool[..., : V // 2], **kw)
    with pytest.raises(ValueError, match=r"'state_pool'.*float32, bfloat16 or float16, got float64"):
        kt.fused_recurrent_kda_fwd(*tokens, initial_state=pool.double(), **kw)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "cu_seqlens"])
def test_out_of_place_decode_checks_the_pool_it_only_copies_from(packed):
    """Out of place the pool is only read (copied into the returned float32 states), so the copy
    would take any dtype and the kernel never sees the pool: its dtype and shape are checked as the
    in-place decode checks them, with tokens or without."""
    q, k, v, g, beta, pool = _decode_inputs()
    tokens = (q, k, v, g, beta)
    kw = dict(ssm_state_indices=torch.arange(N), inplace_final_state=False, output_final_state=True)
    if packed:
        tokens = tuple(x.flatten(0, 1)[None] for x in tokens)
        kw["cu_seqlens"] = torch.arange(N + 1)
    for T in (1, 0):
        part = tuple(x[:, :T] if not packed else x[:, :T * N] for x in tokens)
        if packed:
            kw["cu_seqlens"] = torch.arange(N + 1) * T
        with pytest.raises(ValueError, match=r"'state_pool'.*float32, bfloat16 or float16, got float64"):
            kt.fused_recurrent_kda_fwd(*part, initial_state=pool.double(), **kw)
        with pytest.raises(ValueError, match=r"'state_pool'.*\[slots, 2, 16, 8\], got \[5, 2, 16, 3\]"):
            kt.fused_recurrent_kda_fwd(*part, initial_state=pool[..., :3], **kw)


def test_out_of_place_ragged_rows_may_share_a_read_slot():
    """Out of place the pool is only read, so sequences may start from the same slot (FLA accepts
    it, as libkda's equal-length path does); with different lengths too, each row's o and states
    then equal those of its own call bit for bit, and the pool stays untouched."""
    q, k, v, g, beta, pool = _decode_inputs(T=3)
    packed = [x.flatten(0, 1)[None] for x in (q, k, v, g, beta)]  # 9 tokens
    cu, idx = torch.tensor([0, 2, 5, 9]), torch.tensor([1, 1, 1])
    before = pool.clone()
    kw = dict(inplace_final_state=False, output_final_state=True)
    o, states = kt.fused_recurrent_kda_fwd(*packed, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx, **kw)
    assert torch.equal(pool, before)
    for n in range(3):
        s, e = int(cu[n]), int(cu[n + 1])
        o_n, st_n = kt.fused_recurrent_kda_fwd(*(x[:, s:e] for x in packed), initial_state=pool,
                                               cu_seqlens=torch.tensor([0, e - s]), ssm_state_indices=idx[n:n + 1],
                                               **kw)
        assert torch.equal(o[:, s:e], o_n) and torch.equal(states[s:e], st_n), f"row {n}"


def test_out_of_place_decode_blames_inconsistent_tokens_not_the_pool():
    """The pool's expected shape comes from the tokens; when they disagree among themselves (v with
    another head count than g), the error names a token argument, as the in-place decode does."""
    q, k, v, g, beta, pool = _decode_inputs()
    for inplace in (True, False):
        with pytest.raises(ValueError, match=r"argument '(v|g|beta)'") as info:
            kt.fused_recurrent_kda_fwd(q, k, v.repeat(1, 1, 2, 1), g, beta, initial_state=pool,
                                       ssm_state_indices=torch.arange(N), inplace_final_state=inplace,
                                       output_final_state=True)
        assert "state_pool" not in str(info.value)
