"""Packed variable-length sequences: cu_seqlens and segment_ids (SPEC.md 1.2)."""

import numpy as np
import pytest
from conftest import BF16, BOUND, assert_bitwise, assert_close, make_inputs

import libkda


def check(x, bound, **kw):
    o, s = libkda.chunk_kda(**x, output_final_state=True, **kw)
    ro, rs = libkda.naive_recurrent_kda(**x, output_final_state=True, **kw)
    assert_close(o, ro, bound, "o")
    assert_close(s, rs, bound, "final_state")
    return o, s


@pytest.mark.parametrize("path", ["fused", "staged"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_cu_seqlens_vs_oracle(rng, index_dtype, dtype, path):
    # Boundaries off every chunk edge, plus an empty segment.
    cu = np.array([0, 15, 15, 100, 171, 300], dtype=index_dtype)
    HV, K, V = 4, 32, 32
    x = make_inputs(rng, B=1, T=300, H=2, HV=HV, K=K, V=V, dtype=dtype)
    h0 = rng.standard_normal((5, HV, K, V)).astype(np.float32)
    o, s = check(x, BOUND[dtype], cu_seqlens=cu, initial_state=h0, path=path)
    assert s.shape == (5, HV, K, V)
    # The empty segment passes its initial state through.
    np.testing.assert_array_equal(s[1], h0[1])


def test_cu_seqlens_long(rng):
    # The FLA-style split [0, 15, 100, 300, 1200, 2000], scaled to T = 1000.
    cu = np.array([0, 15, 100, 300, 601, 1000], dtype=np.int64)
    x = make_inputs(rng, B=1, T=1000, H=2, K=32, V=32)
    check(x, 1e-5, cu_seqlens=cu, chunk_size=64)


@pytest.mark.parametrize("path", ["fused", "staged"])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_packed_equals_separate_calls(rng, chunk_size, path):
    # Batch invariance (SPEC.md 4): each packed sequence's outputs and state are bitwise
    # those of the sequence run alone.
    cu = np.array([0, 15, 100, 171, 300], dtype=np.int32)
    HV, K, V = 2, 32, 48
    x = make_inputs(rng, B=1, T=300, H=2, HV=HV, K=K, V=V, gate="raw")
    kw = dict(use_gate_in_kernel=True, lower_bound=-5.0, use_qk_l2norm_in_kernel=True,
              chunk_size=chunk_size, path=path)
    h0 = rng.standard_normal((4, HV, K, V)).astype(np.float32)
    o, s = libkda.chunk_kda(**x, cu_seqlens=cu, initial_state=h0, output_final_state=True, **kw)
    for n in range(len(cu) - 1):
        a, b = cu[n], cu[n + 1]
        xs = {name: arr[:, a:b] for name, arr in x.items()}
        on, sn = libkda.chunk_kda(**xs, initial_state=h0[n:n + 1], output_final_state=True, **kw)
        assert_bitwise(o[:, a:b], on, f"o of segment {n}")
        assert_bitwise(s[n:n + 1], sn, f"final_state of segment {n}")


@pytest.mark.parametrize("fn", [libkda.chunk_kda, libkda.kda_inference], ids=["chunk_kda", "inference"])
@pytest.mark.parametrize("path", ["fused", "staged"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=["fp32", "bf16"])
def test_cu_seqlens_trailing_tokens_are_padding(rng, poison_outputs, dtype, path, fn):
    # cu_seqlens may end before T (FLA's graph mode packs into a fixed-size buffer): the tokens
    # after it are padding, output exactly 0, and the sequences are bitwise those of the buffer
    # cut at cu_seqlens[-1]. An empty last sequence, and padding inputs that are NaN / Inf.
    cu = np.array([0, 40, 131, 131], dtype=np.int64)
    end, HV, K, V = 131, 4, 32, 32
    x = make_inputs(rng, B=1, T=200, H=2, HV=HV, K=K, V=V, dtype=dtype)
    for name, bad in zip(x, [np.nan, np.inf, np.nan, -np.inf, np.nan]):
        x[name][0, end:] = bad
    h0 = rng.standard_normal((3, HV, K, V)).astype(np.float32)
    kw = dict(cu_seqlens=cu, initial_state=h0, output_final_state=True, path=path)
    o, s = fn(**x, **kw)
    assert np.all(o[0, end:].astype(np.float32) == 0.0), "padding tokens' output is not 0"
    cut = {name: arr[:, :end] for name, arr in x.items()}
    oc, sc = fn(**cut, **kw)
    assert_bitwise(o[:, :end], oc, "o")
    assert_bitwise(s, sc, "final_state")
    np.testing.assert_array_equal(s[2], h0[2])  # the empty sequence passes its state through
    ro, rs = libkda.naive_recurrent_kda(**cut, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    assert_close(oc, ro, BOUND[dtype], "o")
    assert_close(sc, rs, BOUND[dtype], "final_state")


def test_cu_seqlens_past_the_tokens_is_an_error(rng):
    x = make_inputs(rng, B=1, T=40, H=2, K=16, V=16)
    with pytest.raises(ValueError, match=r"'cu_seqlens'.*<= the total tokens T = 40, got 41"):
        libkda.chunk_kda(**x, cu_seqlens=np.array([0, 20, 41], np.int32))


@pytest.mark.parametrize("path", ["fused", "staged"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=["fp32", "bf16"])
def test_segment_ids_with_padding(rng, poison_outputs, dtype, path):
    B, T, HV, K, V, max_seg = 2, 200, 2, 32, 32, 4
    ids = np.zeros((B, T), dtype=np.int32)
    ids[0, :37] = 1
    ids[0, 37:150] = 2
    ids[0, 150:181] = 3        # 19 padding tokens at the tail, slot 4 unused
    ids[1, :120] = 1
    ids[1, 120:200] = 2        # no padding
    x = make_inputs(rng, B=B, T=T, H=2, HV=HV, K=K, V=V, dtype=dtype)
    h0 = rng.standard_normal((B, max_seg, HV, K, V)).astype(np.float32)
    o, s = check(x, BOUND[dtype], segment_ids=ids, max_num_segments=max_seg, initial_state=h0,
                 path=path)
    assert s.shape == (B, max_seg, HV, K, V)
    # Padding tokens: output exactly 0 (outputs were poisoned with NaN before the call).
    assert np.all(o[0, 181:].astype(np.float32) == 0.0)
    assert np.isfinite(o.astype(np.float32)).all()
    # Unused slots: final state = initial state.
    np.testing.assert_array_equal(s[0, 3], h0[0, 3])
    np.testing.assert_array_equal(s[1, 2:], h0[1, 2:])


def test_segment_ids_broadcast_over_batch(rng):
    # A [T] map applies to every batch row: the same as the explicit [B, T] map.
    B, T = 3, 120
    ids = np.zeros(T, dtype=np.int32)
    ids[:50], ids[50:77], ids[77:110] = 1, 2, 3
    x = make_inputs(rng, B=B, T=T, H=2, K=16, V=32)
    o1, s1 = check(x, 1e-5, segment_ids=ids, max_num_segments=3)
    o2, s2 = libkda.chunk_kda(**x, segment_ids=np.tile(ids, (B, 1)), max_num_segments=3,
                              output_final_state=True)
    assert_bitwise(o1, o2)
    assert_bitwise(s1, s2, "final_state")
    assert np.all(o1[:, 110:] == 0.0)


def test_segment_ids_equal_cu_seqlens(rng):
    # The two packed descriptions of the same segmentation agree bitwise.
    cu = np.array([0, 33, 90, 150], dtype=np.int32)
    ids = np.repeat(np.arange(1, 4, dtype=np.int32), np.diff(cu))
    x = make_inputs(rng, B=1, T=150, H=2, K=32, V=32)
    o1, s1 = libkda.chunk_kda(**x, cu_seqlens=cu, output_final_state=True)
    o2, s2 = libkda.chunk_kda(**x, segment_ids=ids, max_num_segments=3, output_final_state=True)
    assert_bitwise(o1, o2)
    assert_bitwise(s1, s2[0], "final_state")


def test_segment_isolation_nonfinite(rng):
    # NaN/Inf in one segment's inputs never reach another segment (SPEC.md 4).
    cu = np.array([0, 40, 100, 130], dtype=np.int32)
    x = make_inputs(rng, B=1, T=130, H=2, K=32, V=32)
    x["v"][0, 50, 0, 3] = np.inf
    x["q"][0, 60, 1, 0] = np.nan
    o, s = libkda.chunk_kda(**x, cu_seqlens=cu, output_final_state=True)
    assert np.isfinite(o[:, :40]).all() and np.isfinite(o[:, 100:]).all()
    assert np.isfinite(s[0]).all() and np.isfinite(s[2]).all()
