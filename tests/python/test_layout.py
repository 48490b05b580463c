"""Strided inputs: views are read in place, any layout gives the same bits (SPEC.md 1.1)."""

import numpy as np
import pytest
from conftest import BF16, assert_bitwise, make_inputs

import libkda


def head_first_view(x):
    """The same logical [B, T, H, D] tensor, stored head-first [H, B, T, D] (Tokamax layout)
    and handed over as a transposed, non-contiguous view."""
    if x.ndim == 3:  # beta [B, T, HV] stored as [HV, B, T]
        stored = np.ascontiguousarray(x.transpose(2, 0, 1))
        view = stored.transpose(1, 2, 0)
    else:
        stored = np.ascontiguousarray(x.transpose(2, 0, 1, 3))
        view = stored.transpose(1, 2, 0, 3)
    assert not view.flags.c_contiguous and np.shares_memory(view, stored)
    return view


@pytest.mark.parametrize("path", ["fused", "staged"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16, np.dtype(np.float16)],
                         ids=["fp32", "bf16", "fp16"])
def test_head_first_view_bitwise(rng, dtype, path):
    x = make_inputs(rng, B=2, T=100, H=2, HV=4, K=32, V=16, dtype=dtype)
    o1, s1 = libkda.chunk_kda(**x, output_final_state=True, path=path)
    xv = {n: head_first_view(a) for n, a in x.items()}
    o2, s2 = libkda.chunk_kda(**xv, output_final_state=True, path=path)
    assert_bitwise(o1, o2)
    assert_bitwise(s1, s2, "final_state")
    r1, _ = libkda.naive_recurrent_kda(**x)
    r2, _ = libkda.naive_recurrent_kda(**xv)
    assert_bitwise(r1, r2, "oracle o")


def test_varlen_head_first_and_strided_state(rng):
    cu = np.array([0, 21, 80, 100], dtype=np.int64)
    x = make_inputs(rng, B=1, T=100, H=2, K=16, V=16)
    h0 = rng.standard_normal((3, 2, 16, 16)).astype(np.float32)
    o1, s1 = libkda.chunk_kda(**x, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    xv = {n: head_first_view(a) for n, a in x.items()}
    h0_view = np.ascontiguousarray(h0.transpose(1, 0, 3, 2)).transpose(1, 0, 3, 2)
    cu_view = np.stack([cu, cu], axis=1)[:, 0]  # stride 2 elements
    assert not cu_view.flags.c_contiguous
    o2, s2 = libkda.chunk_kda(**xv, cu_seqlens=cu_view, initial_state=h0_view,
                              output_final_state=True)
    assert_bitwise(o1, o2)
    assert_bitwise(s1, s2, "final_state")


def test_odd_strides_fall_back_to_copies(rng):
    # Negative strides and strides that are not whole elements are made contiguous.
    x = make_inputs(rng, B=1, T=40, H=2, K=16, V=16)
    o1, _ = libkda.chunk_kda(**x)
    flipped = np.ascontiguousarray(x["q"][:, ::-1])[:, ::-1]  # same values, negative T stride
    assert flipped.strides[1] < 0
    packed = np.zeros(x["k"].shape, dtype=[("a", np.float32), ("b", np.float16)])
    packed["a"] = x["k"]
    k_view = packed["a"]  # 6-byte element stride: not a whole number of float32 elements
    assert k_view.strides[-1] == 6
    o2, _ = libkda.chunk_kda(**{**x, "q": flipped, "k": k_view})
    assert_bitwise(o1, o2)


def test_broadcast_and_readonly_inputs(rng):
    # Zero strides (np.broadcast_to, read-only) are valid inputs.
    x = make_inputs(rng, B=2, T=30, H=1, K=8, V=8)
    beta_row = x["beta"][:1]
    beta_b = np.broadcast_to(beta_row, x["beta"].shape)
    assert not beta_b.flags.writeable and beta_b.strides[0] == 0
    o1, _ = libkda.chunk_kda(**{**x, "beta": np.ascontiguousarray(beta_b)})
    o2, _ = libkda.chunk_kda(**{**x, "beta": beta_b})
    assert_bitwise(o1, o2)
    for a in x.values():
        a.flags.writeable = False
    libkda.chunk_kda(**x)
