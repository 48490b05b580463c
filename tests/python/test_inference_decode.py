"""Inference path, decode against a state pool, intermediate states (SPEC.md section 3).

kda_inference is chunk_kda without residuals (bitwise the same results), optionally reading its
initial states from a pool; chunk_kda(return_intermediate_states=True) returns the state entering
every chunk; kda_decode advances sequences token by token against a pool updated in place
(include/kda/ops.hpp, DecodeParams). The oracle is naive_recurrent_kda (SPEC.md section 4).
"""

import numpy as np
import pytest
from conftest import BF16, BOUND, assert_bitwise, assert_close, make_inputs

import libkda

POISON = np.float32(2.0**100)  # fills pool slots that must come back bitwise unchanged


def pool_of(rng, slots, HV, K, V, v_first, poison=False):
    """A float32 state pool [slots, HV, K, V] ([slots, HV, V, K] V-first), random or poisoned."""
    shape = (slots, HV, V, K) if v_first else (slots, HV, K, V)
    if poison:
        return np.full(shape, POISON, dtype=np.float32)
    return (0.5 * rng.standard_normal(shape)).astype(np.float32)


def gather(pool, idx):
    """pool[idx] with zero states where idx < 0 (what a pooled initial state means)."""
    idx = np.asarray(idx)
    out = pool[np.maximum(idx, 0)].copy()
    out[idx < 0] = 0
    return out


def chunk_starts(lengths, C):
    """Index in h of each segment's first chunk (segments in plan order), and NC."""
    counts = [(L + C - 1) // C for L in lengths]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int)
    return starts, int(sum(counts))


# ---------------------------------------------------------------------------------------------
# kda_inference


@pytest.mark.parametrize("path", ["fused", "staged"])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "cu_seqlens"])
def test_inference_equals_chunk_kda_bitwise(rng, varlen, path):
    if varlen:
        x = make_inputs(rng, B=1, T=150, H=2, HV=4, K=32, V=24)
        opts = dict(cu_seqlens=np.array([0, 37, 37, 101, 150], np.int32))
        N = 4
    else:
        x = make_inputs(rng, B=3, T=70, H=2, HV=4, K=32, V=24)
        opts = {}
        N = 3
    h0 = (0.5 * rng.standard_normal((N, 4, 32, 24))).astype(np.float32)
    o, fs = libkda.chunk_kda(**x, **opts, initial_state=h0, output_final_state=True, path=path)
    oi, fi = libkda.kda_inference(**x, **opts, initial_state=h0, output_final_state=True, path=path)
    assert_bitwise(oi, o, "o")
    assert_bitwise(fi, fs, "final_state")
    oi, fi = libkda.kda_inference(**x, **opts)
    assert fi is None
    assert_bitwise(oi, libkda.chunk_kda(**x, **opts)[0], "o (no initial state)")


@pytest.mark.parametrize("v_first", [False, True], ids=["kfirst", "vfirst"])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "cu_seqlens"])
def test_inference_pooled_initial_state(rng, varlen, v_first):
    # Sequence n starts from pool slot idx[n] (negative: zeros), read in place: bitwise what
    # chunk_kda gives with the gathered states. The pool is a strided view (every other slot of a
    # bigger array) so that its strides are honoured, and it is never written.
    H, HV, K, V = 2, 4, 16, 32
    if varlen:
        x = make_inputs(rng, B=1, T=130, H=H, HV=HV, K=K, V=V)
        opts = dict(cu_seqlens=np.array([0, 50, 51, 130], np.int64))
        idx = np.array([5, -1, 0], np.int64)
    else:
        x = make_inputs(rng, B=3, T=45, H=H, HV=HV, K=K, V=V)
        opts = {}
        idx = np.array([2, 6, -3], np.int32)
    big = pool_of(rng, 14, HV, K, V, v_first)
    pool = big[::2]
    before = big.copy()
    oi, fi = libkda.kda_inference(**x, **opts, initial_state=pool, initial_state_indices=idx,
                                  output_final_state=True, state_v_first=v_first)
    o, fs = libkda.chunk_kda(**x, **opts, initial_state=gather(pool, idx), output_final_state=True,
                             state_v_first=v_first)
    assert fi.shape == (len(idx),) + pool.shape[1:] and fi.dtype == np.float32
    assert_bitwise(oi, o, "o")
    assert_bitwise(fi, fs, "final_state")
    assert_bitwise(big, before, "pool (read only)")


def test_inference_pool_errors(rng):
    x = make_inputs(rng, B=2, T=20, H=2, K=16, V=16)
    pool = np.zeros((3, 2, 16, 16), np.float32)
    with pytest.raises(ValueError, match=r"'initial_state_indices'.*3"):
        libkda.kda_inference(**x, initial_state=pool, initial_state_indices=np.array([0, 3], np.int32))
    with pytest.raises(ValueError, match=r"'initial_state_indices'.*shape"):
        libkda.kda_inference(**x, initial_state=pool, initial_state_indices=np.array([0], np.int32))
    with pytest.raises(ValueError, match=r"'initial_state_indices'.*segment_ids"):
        libkda.kda_inference(**x, initial_state=pool, initial_state_indices=np.array([0, 1], np.int32),
                             segment_ids=np.ones(20, np.int32), max_num_segments=1)
    with pytest.raises(ValueError, match=r"'initial_state_indices'"):
        libkda.kda_inference(**x, initial_state_indices=np.array([0, 1], np.int32))


# ---------------------------------------------------------------------------------------------
# return_intermediate_states


@pytest.mark.parametrize("C", [64, 16])
@pytest.mark.parametrize("v_first", [False, True], ids=["kfirst", "vfirst"])
@pytest.mark.parametrize("seq", ["fixed", "cu_seqlens", "segment_ids"])
def test_intermediate_states(rng, seq, v_first, C):
    H, HV, K, V = 2, 4, 16, 24
    inner = (HV, V, K) if v_first else (HV, K, V)
    if seq == "fixed":
        x = make_inputs(rng, B=2, T=90, H=H, HV=HV, K=K, V=V)
        opts = {}
        lengths = [90, 90]
        h0 = (0.5 * rng.standard_normal((2,) + inner)).astype(np.float32)
        h0_flat = list(h0)
    elif seq == "cu_seqlens":
        x = make_inputs(rng, B=1, T=160, H=H, HV=HV, K=K, V=V)
        cu = np.array([0, 70, 70, 135, 160], np.int32)  # boundaries off the chunk grid, one empty
        opts = dict(cu_seqlens=cu)
        lengths = list(np.diff(cu))
        h0 = (0.5 * rng.standard_normal((4,) + inner)).astype(np.float32)
        h0_flat = list(h0)
    else:
        x = make_inputs(rng, B=2, T=100, H=H, HV=HV, K=K, V=V)
        ids = np.zeros((2, 100), np.int32)
        ids[0, :30], ids[0, 30:80] = 1, 2  # row 0: 30 + 50 tokens, 20 padding, slot 3 empty
        ids[1, :] = 1                      # row 1: one segment of 100, slots 2 and 3 empty
        opts = dict(segment_ids=ids, max_num_segments=3)
        lengths = [30, 50, 0, 100, 0, 0]   # plan order: row-major over [B, max_num_segments]
        h0 = (0.5 * rng.standard_normal((2, 3) + inner)).astype(np.float32)
        h0_flat = list(h0.reshape((6,) + inner))
    common = dict(**x, **opts, initial_state=h0, output_final_state=True, state_v_first=v_first,
                  chunk_size=C, return_intermediate_states=True)
    o, fs, h = libkda.chunk_kda(**common)
    ro, rfs, rh = libkda.naive_recurrent_kda(**common)
    starts, nc = chunk_starts(lengths, C)
    assert h.dtype == np.float32 and rh.dtype == np.float64
    assert h.shape == (nc,) + inner and rh.shape == h.shape
    assert_close(h, rh, 1e-5, "h")
    assert_close(o, ro, 1e-5, "o")
    for s, L in enumerate(lengths):
        if L > 0:  # the first chunk of a segment enters with that segment's initial state
            assert_bitwise(h[starts[s]], h0_flat[s], f"h[first chunk of segment {s}]")
    # Without an initial state the first chunk of every segment enters with exact zeros.
    _, _, hz = libkda.chunk_kda(**{**common, "initial_state": None})
    for s, L in enumerate(lengths):
        if L > 0:
            assert not hz[starts[s]].any(), f"segment {s}: first chunk state should be 0"
    # The default return value is unchanged.
    assert len(libkda.chunk_kda(**x, **opts)) == 2


def test_intermediate_states_are_prefix_final_states(rng):
    # Entry c of a segment is the final state of its first c * C tokens.
    x = make_inputs(rng, B=1, T=150, H=2, K=16, V=16)
    _, _, h = libkda.chunk_kda(**x, chunk_size=32, return_intermediate_states=True)
    assert h.shape[0] == 5
    for c in range(1, 5):
        _, f = libkda.naive_recurrent_kda(**{k: a[:, : 32 * c] for k, a in x.items()}, output_final_state=True)
        assert_close(h[c], f[0], 1e-5, f"h[{c}]")


# ---------------------------------------------------------------------------------------------
# kda_decode: single tokens


GATES = {
    "log": dict(),
    "softplus": dict(use_gate_in_kernel=True),
    "lower_bound": dict(use_gate_in_kernel=True, lower_bound=-5.0),
}


def gate_opts(rng, gate, HV, K):
    opts = dict(GATES[gate])
    if gate != "log":
        opts["A_log"] = rng.uniform(-1.0, 1.0, HV).astype(np.float32)
        opts["dt_bias"] = (0.3 * rng.standard_normal(HV * K)).astype(np.float32)
    return opts


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("v_first", [False, True], ids=["kfirst", "vfirst"])
def test_decode_single_token(rng, poison_outputs, v_first, gate, dtype):
    # One token per sequence from its pool slot: o and the written slot vs the fp64 oracle on T=1
    # with the slot as initial state; grouped heads; one padding row; other slots bitwise unchanged.
    N, H, HV, K, V = 4, 2, 4, 32, 24
    dtype = np.dtype(dtype)
    x = make_inputs(rng, B=N, T=1, H=H, HV=HV, K=K, V=V, dtype=dtype, gate="raw" if gate != "log" else "log",
                    l2norm=gate == "softplus", beta_sigmoid=gate == "lower_bound")
    opts = gate_opts(rng, gate, HV, K)
    opts.update(use_qk_l2norm_in_kernel=gate == "softplus", use_beta_sigmoid_in_kernel=gate == "lower_bound",
                state_v_first=v_first)
    slots = np.array([5, -1, 2, 7], np.int32)
    pool0 = pool_of(rng, 9, HV, K, V, v_first, poison=True)
    live = slots[slots >= 0]
    pool0[live] = pool_of(rng, len(live), HV, K, V, v_first)
    pool = pool0.copy()
    o = libkda.kda_decode(**x, state_pool=pool, slot_indices=slots, **opts)
    assert o.dtype == dtype and o.shape == (N, 1, HV, V)
    rows = np.flatnonzero(slots >= 0)
    ro, rf = libkda.naive_recurrent_kda(**{k: a[rows] for k, a in x.items()}, initial_state=pool0[live],
                                        output_final_state=True, **opts)
    assert_close(o[rows], ro, BOUND[dtype], "o")
    assert_close(pool[live], rf, BOUND[dtype], "written slots")
    assert not o[1].astype(np.float32).any(), "padding row: o must be 0"
    others = np.setdiff1d(np.arange(9), live)
    assert_bitwise(pool[others], pool0[others], "untouched slots")


@pytest.mark.parametrize("v_first", [False, True], ids=["kfirst", "vfirst"])
def test_decode_token_by_token_equals_prefill(rng, v_first):
    # T tokens decoded one call at a time give the chunked prefill of the same T tokens.
    N, H, HV, K, V, T = 3, 2, 4, 32, 32, 40
    x = make_inputs(rng, B=N, T=T, H=H, HV=HV, K=K, V=V)
    slots = np.array([4, 0, 2], np.int64)
    pool0 = pool_of(rng, 6, HV, K, V, v_first, poison=True)
    pool0[slots] = pool_of(rng, N, HV, K, V, v_first)
    o_ref, f_ref = libkda.chunk_kda(**x, initial_state=pool0[slots], output_final_state=True,
                                    state_v_first=v_first)
    pool = pool0.copy()
    o = np.stack([libkda.kda_decode(**{k: a[:, t : t + 1] for k, a in x.items()}, state_pool=pool,
                                    slot_indices=slots, state_v_first=v_first)[:, 0] for t in range(T)], axis=1)
    assert_close(o, o_ref, 1e-5, "o")
    assert_close(pool[slots], f_ref, 1e-5, "final state")
    # T tokens in one call ([N] indices: read the slot, write it after the last token) agree too.
    pool2 = pool0.copy()
    o2 = libkda.kda_decode(**x, state_pool=pool2, slot_indices=slots, state_v_first=v_first)
    assert_close(o2, o_ref, 1e-5, "o (one call)")
    assert_close(pool2[slots], f_ref, 1e-5, "final state (one call)")
    others = [1, 3, 5]
    assert_bitwise(pool[others], pool0[others], "untouched slots")
    assert_bitwise(pool2[others], pool0[others], "untouched slots (one call)")


@pytest.mark.parametrize("v_first", [False, True], ids=["kfirst", "vfirst"])
def test_prefill_final_state_feeds_decode(rng, v_first):
    # Packed prefill writes per-sequence final states; stored in the pool in the same layout they
    # continue the sequences in decode exactly as the oracle over the whole sequences does.
    H, HV, K, V = 2, 4, 16, 32
    P, D = [37, 64, 5], 3  # prefill lengths, decode tokens per sequence
    N = len(P)
    full = [make_inputs(rng, B=1, T=p + D, H=H, HV=HV, K=K, V=V) for p in P]
    cat = lambda name, part: np.concatenate(
        [f[name][:, :p] if part == "pre" else f[name][:, p:] for f, p in zip(full, P)], axis=1)
    pre = {name: cat(name, "pre") for name in full[0]}
    cu = np.concatenate([[0], np.cumsum(P)]).astype(np.int32)
    _, fs = libkda.kda_inference(**pre, cu_seqlens=cu, output_final_state=True, state_v_first=v_first)
    slots = np.array([3, 0, 6], np.int32)
    pool = pool_of(rng, 8, HV, K, V, v_first, poison=True)
    pool[slots] = fs
    dec = {name: np.stack([f[name][0, p:] for f, p in zip(full, P)]) for name in full[0]}  # [N, D, ...]
    o = np.stack([libkda.kda_decode(**{k: a[:, t : t + 1] for k, a in dec.items()}, state_pool=pool,
                                    slot_indices=slots, state_v_first=v_first)[:, 0] for t in range(D)], axis=1)
    whole = {name: np.concatenate([f[name] for f in full], axis=1) for name in full[0]}
    cu_all = np.concatenate([[0], np.cumsum([p + D for p in P])]).astype(np.int32)
    ro, rf = libkda.naive_recurrent_kda(**whole, cu_seqlens=cu_all, output_final_state=True,
                                        state_v_first=v_first)
    ro_dec = np.stack([ro[0, cu_all[n + 1] - D : cu_all[n + 1]] for n in range(N)])
    assert_close(o, ro_dec, 1e-5, "decoded o")
    assert_close(pool[slots], rf, 1e-5, "pool after decode")
    others = np.setdiff1d(np.arange(8), slots)
    assert (pool[others].view(np.uint32) == POISON.view(np.uint32)).all(), "untouched slots changed"


@pytest.mark.parametrize("K,V", [(32, 64), (100, 48), (16, 16), (24, 40), (128, 128)],
                         ids=["K32V64", "K100V48", "K16V16", "K24V40", "K128V128"])
def test_decode_v_first_pool_in_place(rng, K, V):
    """A V-first pool is decoded in place in one pass over its rows (K contiguous floats each; K
    not a multiple of 16 included): outputs and new states match the same states decoded K-first
    to fp32 rounding (the two layouts sum in different orders) and the oracle; padding rows and
    other slots stay bitwise untouched."""
    N, H, HV = 3, 2, 4
    x = make_inputs(rng, B=N, T=1, H=H, HV=HV, K=K, V=V, gate="raw", l2norm=True)
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                A_log=rng.uniform(-1, 1, HV).astype(np.float32),
                dt_bias=(0.3 * rng.standard_normal(HV * K)).astype(np.float32))
    slots = np.array([2, -1, 0], np.int32)
    kfirst = pool_of(rng, 4, HV, K, V, False)
    vfirst = np.ascontiguousarray(kfirst.transpose(0, 1, 3, 2))  # V-first in memory
    k0, v0 = kfirst.copy(), vfirst.copy()
    o_k = libkda.kda_decode(**x, state_pool=kfirst, slot_indices=slots, **opts)
    o_v = libkda.kda_decode(**x, state_pool=vfirst, slot_indices=slots, state_v_first=True, **opts)
    assert_close(o_v, o_k, 1e-6, "o (V-first vs K-first)")
    assert_close(vfirst.transpose(0, 1, 3, 2), kfirst, 1e-6, "pool (V-first vs K-first)")
    assert_bitwise(vfirst[[1, 3]], v0[[1, 3]], "untouched slots")
    assert not o_v[1].any(), "padding row: o must be 0"
    ro, rf = libkda.naive_recurrent_kda(**{n: a[[0, 2]] for n, a in x.items()}, initial_state=k0[[2, 0]],
                                        output_final_state=True, **opts)
    for name, o, pool in (("V-first", o_v, vfirst.transpose(0, 1, 3, 2)), ("K-first", o_k, kfirst)):
        assert_close(o[[0, 2]], ro, BOUND[np.dtype(np.float32)], f"o vs oracle ({name})")
        assert_close(pool[[2, 0]], rf, BOUND[np.dtype(np.float32)], f"pool vs oracle ({name})")
    # Deterministic: the same call again gives bitwise the same result.
    again = v0.copy()
    o_again = libkda.kda_decode(**x, state_pool=again, slot_indices=slots, state_v_first=True, **opts)
    assert_bitwise(o_again, o_v, "o (repeat)")
    assert_bitwise(again, vfirst, "pool (repeat)")


@pytest.mark.parametrize("K,V", [(16, 32), (1, 5), (7, 1)], ids=["K16V32", "K1V5", "K7V1"])
def test_decode_v_first_pool_view_with_padded_rows(rng, K, V):
    """A V-first pool view whose rows are padded (row stride K + 3, a slice of a wider array) is
    decoded in place: the padding columns stay bitwise untouched and the result matches the same
    states decoded from a contiguous K-first pool (to fp32 rounding); tiny K and V included."""
    N, H, HV = 2, 1, 2
    x = make_inputs(rng, B=N, T=1, H=H, HV=HV, K=K, V=V)
    slots = np.array([1, 2], np.int32)
    kfirst = pool_of(rng, 3, HV, K, V, False)
    wide = rng.standard_normal((3, HV, V, K + 3)).astype(np.float32)
    wide[..., :K] = kfirst.transpose(0, 1, 3, 2)
    wide0 = wide.copy()
    o_v = libkda.kda_decode(**x, state_pool=wide[..., :K], slot_indices=slots, state_v_first=True)
    o_k = libkda.kda_decode(**x, state_pool=kfirst, slot_indices=slots)
    assert_close(o_v, o_k, 1e-6, "o")
    assert_close(wide[..., :K].transpose(0, 1, 3, 2), kfirst, 1e-6, "pool")
    assert_bitwise(wide[..., K:], wide0[..., K:], "row padding")
    assert_bitwise(wide[0], wide0[0], "untouched slot")


def test_decode_padding_rows(rng, poison_outputs):
    # Every row padding: o is all zeros, the pool bitwise unchanged (it would be NaN-poisoned
    # output otherwise, see poison_outputs).
    x = make_inputs(rng, B=3, T=2, H=2, K=16, V=16)
    pool0 = pool_of(rng, 4, 2, 16, 16, False)
    pool = pool0.copy()
    o = libkda.kda_decode(**x, state_pool=pool, slot_indices=np.array([-1, -5, -1], np.int64))
    assert (o == 0).all()
    assert_bitwise(pool, pool0, "pool")


def test_decode_pool_views_are_updated_in_place(rng):
    # A strided pool view is updated in its base array; a V-first pool given as the transposed
    # view of a K-first array decodes exactly as the K-first pool.
    HV, K, V = 2, 16, 24
    x = make_inputs(rng, B=2, T=1, H=2, HV=HV, K=K, V=V)
    slots = np.array([1, 0], np.int32)
    base0 = pool_of(rng, 3, HV, K, V, False)
    ref_pool = base0.copy()
    o_ref = libkda.kda_decode(**x, state_pool=ref_pool, slot_indices=slots)

    big = np.zeros((6, HV, K, V), np.float32)
    big[::2] = base0
    o = libkda.kda_decode(**x, state_pool=big[::2], slot_indices=slots)
    assert_bitwise(o, o_ref, "o (strided pool)")
    assert_bitwise(big[::2], ref_pool, "strided pool")
    assert not big[1::2].any()

    kfirst = base0.copy()
    o = libkda.kda_decode(**x, state_pool=kfirst.transpose(0, 1, 3, 2), slot_indices=slots, state_v_first=True)
    assert_bitwise(o, o_ref, "o (V-first view)")
    assert_bitwise(kfirst, ref_pool, "V-first view of a K-first pool")


# ---------------------------------------------------------------------------------------------
# kda_decode: speculative decoding ([N, T] slot indices, num_accepted_tokens)


def spec_oracle(x, pool0, idx, acc, opts):
    """The [N, T] contract from naive_recurrent_kda: row n starts from slot idx[n, a - 1] and the
    state after token t goes to slot idx[n, t] (skipped when negative; a later token of the same
    row wins); a negative read slot makes the row padding (o = 0, nothing written)."""
    N, T = idx.shape
    pool = pool0.copy()
    o = np.zeros(x["v"].shape, np.float64)
    for n in range(N):
        a = 1 if acc is None else int(acc[n])
        read = idx[n, a - 1]
        if read < 0:
            continue
        row = {k: v[n : n + 1] for k, v in x.items()}
        # chunk_size=1: h[t] is the state after t tokens (h[0] the initial state).
        ro, rf, h = libkda.naive_recurrent_kda(**row, initial_state=pool0[read][None], output_final_state=True,
                                               return_intermediate_states=True, chunk_size=1, **opts)
        o[n] = ro[0]
        after = list(h[1:]) + [rf[0]]
        for t in range(T):
            if idx[n, t] >= 0:
                pool[idx[n, t]] = after[t]
    return o, pool


@pytest.mark.parametrize("v_first", [False, True], ids=["kfirst", "vfirst"])
@pytest.mark.parametrize("accepted", [False, True], ids=["no_accept", "num_accepted"])
def test_spec_decode(rng, poison_outputs, accepted, v_first):
    N, T, H, HV, K, V, slots = 5, 4, 2, 4, 16, 24, 24
    x = make_inputs(rng, B=N, T=T, H=H, HV=HV, K=K, V=V)
    opts = dict(state_v_first=v_first)
    idx = np.array([
        [0, 1, 2, 3],
        [4, -1, 5, 6],      # a skipped write
        [7, 8, 7, 9],       # one row may write a slot twice: the later token wins
        [10, 11, 12, -1],   # the read slot is idx[n, a - 1]
        [13, 14, -1, 15],   # padding row when a = 3 (negative read slot)
    ], np.int64)
    acc = np.array([1, 3, 2, 4, 3], np.int32) if accepted else None
    pool0 = pool_of(rng, slots, HV, K, V, v_first, poison=True)
    for n in range(N):
        a = 1 if acc is None else acc[n]
        if idx[n, a - 1] >= 0:
            pool0[idx[n, a - 1]] = pool_of(rng, 1, HV, K, V, v_first)[0]
    pool = pool0.copy()
    o = libkda.kda_decode(**x, state_pool=pool, slot_indices=idx, num_accepted_tokens=acc, **opts)
    ro, rpool = spec_oracle(x, pool0, idx, acc, opts)
    live = [n for n in range(N) if idx[n, (1 if acc is None else acc[n]) - 1] >= 0]
    assert_close(o[live], ro[live], 1e-5, "o")
    dead = [n for n in range(N) if n not in live]
    assert (o[dead] == 0).all(), "padding rows: o must be 0"
    written = np.flatnonzero((rpool != pool0).any(axis=(1, 2, 3)))
    assert len(written) > 0
    assert_close(pool[written], rpool[written], 1e-5, "written slots")
    others = np.setdiff1d(np.arange(slots), written)
    assert_bitwise(pool[others], pool0[others], "untouched slots")
    if accepted:  # row 4 is padding: its non-negative write slots stay poisoned
        assert (pool[[13, 14, 15]].view(np.uint32) == POISON.view(np.uint32)).all()


@pytest.mark.parametrize("v_first", [False, True], ids=["kfirst", "vfirst"])
@pytest.mark.parametrize("pool_dtype", [BF16, np.float16], ids=["bf16_pool", "f16_pool"])
def test_spec_decode_narrow_pool(rng, poison_outputs, pool_dtype, v_first):
    """A bfloat16 or float16 pool (FLA's kernel stores whatever dtype the pool has): each state is
    read converted, the row's tokens run in fp32 (o as accurate as with an fp32 pool), and each
    written state is the oracle's rounded to nearest in the pool's dtype: within half an ulp of the
    fp64 state plus the fp32 computation's error (1e-5 of the largest element). Untouched slots
    keep their bits."""
    N, T, H, HV, K, V, slots = 4, 3, 2, 4, 32, 40, 16
    x = make_inputs(rng, B=N, T=T, H=H, HV=HV, K=K, V=V, gate="raw", beta_sigmoid=True)
    opts = dict(state_v_first=v_first, use_gate_in_kernel=True, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True,
                A_log=rng.uniform(-1.0, 1.0, HV).astype(np.float32))
    idx = np.array([[0, 1, 2], [3, -1, 4], [5, 6, 7], [8, 9, 10]], np.int64)
    acc = np.array([1, 1, 2, 3], np.int32)
    pool0 = pool_of(rng, slots, HV, K, V, v_first).astype(pool_dtype)
    pool = pool0.copy()
    o = libkda.kda_decode(**x, state_pool=pool, slot_indices=idx, num_accepted_tokens=acc, **opts)
    ro, rpool = spec_oracle(x, pool0.astype(np.float64), idx, acc, opts)
    assert pool.dtype == np.dtype(pool_dtype)
    assert_close(o, ro, 1e-5, "o")
    written = np.flatnonzero((rpool != pool0.astype(np.float64)).any(axis=(1, 2, 3)))
    assert len(written) == 11  # every non-negative slot of idx
    got, want = pool[written].astype(np.float64), rpool[written]
    bits = 8 if np.dtype(pool_dtype) == np.dtype(BF16) else 11  # significand bits
    half_ulp = np.ldexp(0.5, np.frexp(want)[1] - bits)
    err = np.abs(got - want) - (half_ulp + 1e-5 * np.abs(want).max())
    assert (err <= 0).all(), f"written slots: {int((err > 0).sum())} elements off by more than half an ulp"
    others = np.setdiff1d(np.arange(slots), written)
    assert_bitwise(pool[others], pool0[others], "untouched slots")


# ---------------------------------------------------------------------------------------------
# kda_decode: errors (nothing written)


@pytest.fixture
def dec(rng):
    x = make_inputs(rng, B=2, T=1, H=2, K=16, V=16)
    return x, pool_of(rng, 4, 2, 16, 16, False)


def assert_rejected(match, x, pool, **kw):
    before = pool.copy()
    with pytest.raises(ValueError, match=match) as info:
        libkda.kda_decode(**x, state_pool=pool, **kw)
    print(info.value)
    assert_bitwise(pool, before, "pool after a rejected call")


def test_decode_invalid_slot(dec):
    x, pool = dec
    assert_rejected(r"'slot_indices'.*< slots = 4.*got 4", x, pool, slot_indices=np.array([0, 4], np.int32))
    assert_rejected(r"'slot_indices'.*shape", x, pool, slot_indices=np.array([0, 1, 2], np.int32))
    assert_rejected(r"'slot_indices'.*int32 or int64", x, pool, slot_indices=np.array([0.0, 1.0]))


def test_decode_invalid_slot_is_checked_before_writing(rng):
    # Row 0 is valid and would be written first; row 1's bad write slot must stop the whole call.
    x = make_inputs(rng, B=2, T=2, H=2, K=16, V=16)
    pool = pool_of(rng, 4, 2, 16, 16, False)
    assert_rejected(r"'slot_indices'.*got 9", x, pool, slot_indices=np.array([[0, 1], [2, 9]], np.int32))


def test_decode_duplicate_write_slots(rng):
    x = make_inputs(rng, B=3, T=2, H=2, K=16, V=16)
    pool = pool_of(rng, 6, 2, 16, 16, False)
    assert_rejected(r"'slot_indices'.*slot 2.*rows 0 and 2", x, pool,
                    slot_indices=np.array([2, 1, 2], np.int32))
    assert_rejected(r"'slot_indices'.*slot 5", x, pool,
                    slot_indices=np.array([[0, 5], [1, 3], [5, 4]], np.int64))


def test_decode_bad_num_accepted_tokens(rng):
    x = make_inputs(rng, B=2, T=3, H=2, K=16, V=16)
    pool = pool_of(rng, 6, 2, 16, 16, False)
    idx = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
    assert_rejected(r"'num_accepted_tokens'.*\[1, T = 3\].*got 4", x, pool, slot_indices=idx,
                    num_accepted_tokens=np.array([1, 4], np.int32))
    assert_rejected(r"'num_accepted_tokens'.*\[1, T = 3\].*got 0", x, pool, slot_indices=idx,
                    num_accepted_tokens=np.array([0, 1], np.int64))
    assert_rejected(r"'num_accepted_tokens'.*\[N, T\]", x, pool, slot_indices=idx[:, 0],
                    num_accepted_tokens=np.array([1, 1], np.int32))


def test_decode_pool_must_be_updatable_in_place(dec):
    x, pool = dec
    slots = np.array([0, 1], np.int32)
    ro = pool.copy()
    ro.flags.writeable = False
    assert_rejected(r"'state_pool'.*read-only", x, ro, slot_indices=slots)
    assert_rejected(r"'state_pool'.*strides", x, pool[::-1], slot_indices=slots)
    assert_rejected(r"'state_pool'.*float32, bfloat16 or float16.*float64", x, pool.astype(np.float64),
                    slot_indices=slots)
    assert_rejected(r"'state_pool'.*float32, bfloat16 or float16.*int32", x, pool.astype(np.int32), slot_indices=slots)
    with pytest.raises(ValueError, match=r"'state_pool'.*list"):
        libkda.kda_decode(**x, state_pool=pool.tolist(), slot_indices=slots)
    assert_rejected(r"'state_pool'.*\[slots, 2, 16, 16\]", x, pool[:, :, :8], slot_indices=slots)
    assert_rejected(r"'state_pool'.*\[slots, 2, 16, 16\]", x, pool[:, :1], slot_indices=slots)
