"""Invalid arguments raise ValueError whose message names the argument."""

import numpy as np
import pytest
from conftest import make_inputs

import libkda

FNS = [libkda.chunk_kda, libkda.naive_recurrent_kda]
FN_IDS = ["chunk", "oracle"]


@pytest.fixture
def x(rng):
    return make_inputs(rng, B=1, T=40, H=2, K=16, V=16)


def raises(match, fn, *args, **kw):
    with pytest.raises(ValueError, match=match) as info:
        fn(*args, **kw)
    print(info.value)
    return str(info.value)


@pytest.mark.parametrize("fn", FNS, ids=FN_IDS)
def test_wrong_shape(x, fn):
    raises(r"'q'.*4 dims", fn, **{**x, "q": x["q"][0]})
    raises(r"'beta'.*\[1, 40, 2\]", fn, **{**x, "beta": x["beta"][..., None]})
    raises(r"'g'", fn, **{**x, "g": x["g"][..., :8]})


@pytest.mark.parametrize("fn", FNS, ids=FN_IDS)
def test_mismatched_k_shape(x, fn):
    msg = raises(r"'k'", fn, **{**x, "k": x["k"][:, :39]})
    assert "[1, 39, 2, 16]" in msg  # the actual shape


@pytest.mark.parametrize("fn", FNS, ids=FN_IDS)
def test_bad_dtype(x, fn):
    msg = raises(r"'q'.*float32.*int8", fn, **{**x, "q": x["q"].astype(np.int8)})
    raises(r"'v'.*list", fn, **{**x, "v": x["v"].tolist()})
    raises(r"'cu_seqlens'.*float32", fn, **x, cu_seqlens=np.array([0, 40], dtype=np.float32))
    raises(r"'segment_ids'.*int32.*int64", fn, **x, segment_ids=np.ones(40, dtype=np.int64),
           max_num_segments=1)


def test_float64_only_for_oracle(x):
    raises(r"'q'.*float64", libkda.chunk_kda, **{**x, "q": x["q"].astype(np.float64)})


@pytest.mark.parametrize("fn", FNS, ids=FN_IDS)
def test_non_monotonic_cu_seqlens(x, fn):
    raises(r"'cu_seqlens'.*non-decreasing", fn, **x, cu_seqlens=np.array([0, 30, 20, 40], np.int32))
    raises(r"'cu_seqlens'.*<= the total tokens T = 40, got 50", fn, **x, cu_seqlens=np.array([0, 20, 50], np.int32))


@pytest.mark.parametrize("fn", FNS, ids=FN_IDS)
def test_segment_ids_out_of_order(x, fn):
    ids = np.concatenate([np.full(10, 2), np.full(30, 1)]).astype(np.int32)
    raises(r"'segment_ids'.*order", fn, **x, segment_ids=ids, max_num_segments=2)
    # padding (0) may sit between segments, but a segment cannot resume after it
    ids = np.concatenate([np.full(10, 1), np.zeros(10), np.full(20, 1)]).astype(np.int32)
    raises(r"'segment_ids'.*expected id 2, got 1", fn, **x, segment_ids=ids, max_num_segments=2)
    raises(r"'max_num_segments'", fn, **x, segment_ids=np.ones(40, np.int32))


def test_bad_options(x):
    raises(r"'chunk_size'", libkda.chunk_kda, **x, chunk_size=48)
    raises(r"'path'.*'slow'", libkda.chunk_kda, **x, path="slow")
    raises(r"'lower_bound'", libkda.chunk_kda, **x, lower_bound=-5.0)
    raises(r"'A_log'", libkda.chunk_kda, **x, use_gate_in_kernel=True)
    raises(r"'allow_neg_eigval'", libkda.chunk_kda, **x, allow_neg_eigval=True)
    raises(r"'initial_state'.*\[1, 2, 16, 16\]", libkda.chunk_kda, **x,
           initial_state=np.zeros((1, 2, 16, 8), np.float32))


def test_failed_call_writes_nothing(x, monkeypatch):
    outs = []

    def alloc(shape, dtype):
        outs.append(np.full(shape, 7.0, dtype=dtype))
        return outs[-1]

    monkeypatch.setattr(libkda, "_alloc", alloc)
    with pytest.raises(ValueError):
        libkda.chunk_kda(**x, output_final_state=True, chunk_size=48)
    assert len(outs) == 2 and all(np.all(o == 7.0) for o in outs)
