"""Randomized decode calls through FLA's vLLM entry (libkda.torch.fused_recurrent_kda_fwd with
ssm_state_indices) against a float64 token-by-token recurrence per row: in place and out of
place, [N] slot indices and [N, T] indices with num_accepted_tokens (speculative decoding),
padding rows and skipped writes (negative indices), the packed layout (cu_seqlens = [0, T, 2T,
...]), K-first and V-first pools, gate in kernel or log decay, l2norm and beta sigmoid in kernel,
grouped value heads, bf16 / fp16 / fp32 inputs, float32 / bfloat16 / float16 pools (a narrow pool's
written slots within its rounding of the reference). Every slot no row writes is asserted bitwise
unchanged. 12 in CI; KDA_LARGE_TESTS=1 runs 150."""

import os

import numpy as np
import pytest
from conftest import torch_rel

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
kt = pytest.importorskip("libkda.torch", reason="libkda.torch could not be imported")
F = torch.nn.functional
F64 = torch.float64

COUNT = 150 if os.environ.get("KDA_LARGE_TESTS") else 12


def config(seed):
    rng = np.random.default_rng(9000 + seed)
    H = int(rng.choice([1, 2]))
    c = dict(dtype=[torch.float32, torch.bfloat16, torch.float16][int(rng.integers(0, 3))], H=H,
             HV=H * int(rng.choice([1, 2])), K=int(rng.choice([16, 32, 60, 128])), V=int(rng.choice([16, 33, 64, 128])),
             N=int(rng.integers(1, 7)), T=int(rng.choice([1, 1, 2, 3, 4])), v_first=bool(rng.integers(0, 2)),
             gate_in_kernel=bool(rng.integers(0, 2)), l2norm=bool(rng.integers(0, 2)),
             beta_sigmoid=bool(rng.integers(0, 2)), packed=bool(rng.integers(0, 2)),
             per_token_slots=bool(rng.integers(0, 2)), inplace=bool(rng.integers(0, 3) > 0))
    c["lower_bound"] = c["gate_in_kernel"] and bool(rng.integers(0, 2))
    # (a generator of its own, so the other draws of each seed stay what they were)
    c["pool_dtype"] = [torch.float32, torch.float32, torch.bfloat16, torch.float16][
        int(np.random.default_rng(500 + seed).integers(0, 4))]
    return c, rng


@pytest.mark.parametrize("seed", range(COUNT))
def test_vllm_decode_matches_float64_recurrence(seed):
    c, rng = config(seed)
    torch.manual_seed(seed)
    N, T, H, HV, K, V, dt = c["N"], c["T"], c["H"], c["HV"], c["K"], c["V"], c["dtype"]
    q, k = torch.randn(N, T, H, K).to(dt), torch.randn(N, T, H, K).to(dt)
    if not c["l2norm"]:
        q, k = F.normalize(q.float(), dim=-1).to(dt), F.normalize(k.float(), dim=-1).to(dt)
    v = torch.randn(N, T, HV, V).to(dt)
    g = torch.randn(N, T, HV, K) if c["gate_in_kernel"] else F.logsigmoid(torch.randn(N, T, HV, K)) / 8
    beta = torch.randn(N, T, HV) if c["beta_sigmoid"] else torch.rand(N, T, HV)
    g, beta = g.to(dt), beta.to(dt)
    A_log = torch.log(torch.empty(HV).uniform_(1, 16)) if c["gate_in_kernel"] else None
    dt_bias = torch.randn(HV * K) * 0.5 if c["gate_in_kernel"] else None

    slots = N * T + 3
    perm = torch.from_numpy(rng.permutation(slots)).long()
    pool = (torch.randn((slots, HV, V, K) if c["v_first"] else (slots, HV, K, V)) * 0.1).to(c["pool_dtype"])
    accepted = None
    if c["per_token_slots"] and T > 1:  # [N, T]: read slot idx[n, acc - 1], token t's state to idx[n, t]
        idx = perm[:N * T].reshape(N, T).clone()
        accepted = torch.from_numpy(rng.integers(1, T + 1, N)).long()
        if T > 2:
            idx[0, T - 1 if int(accepted[0]) != T else 0] = -1  # a skipped write (never the read slot)
    else:
        idx = perm[:N].clone()
    if N > 1 and rng.integers(0, 2):
        row = int(rng.integers(0, N))
        if idx.dim() == 1:
            idx[row] = -1
        else:
            idx[row, int(accepted[row]) - 1] = -1  # padding row: its read slot is negative
    read = idx if idx.dim() == 1 else idx.gather(1, (accepted - 1)[:, None])[:, 0]

    before = pool.clone()
    args = [q, k, v, g, beta]
    kw = dict(A_log=A_log, dt_bias=dt_bias, initial_state=pool, inplace_final_state=c["inplace"],
              output_final_state=True, state_v_first=c["v_first"], ssm_state_indices=idx,
              num_accepted_tokens=accepted, use_qk_l2norm_in_kernel=c["l2norm"],
              use_gate_in_kernel=c["gate_in_kernel"], use_beta_sigmoid_in_kernel=c["beta_sigmoid"],
              lower_bound=-5.0 if c["lower_bound"] else None)
    if c["packed"]:
        args = [x.reshape(1, N * T, *x.shape[2:]) for x in args]
        kw["cu_seqlens"] = torch.arange(0, N * T + 1, T)
    o, fs = kt.fused_recurrent_kda_fwd(*args, **kw)
    o = o.reshape(N, T, HV, V)

    # float64 reference, row by row, every token's state
    qq, kk = q.to(F64), k.to(F64)
    if c["l2norm"]:
        qq, kk = F.normalize(qq, dim=-1), F.normalize(kk, dim=-1)
    gg = g.to(F64)
    if c["gate_in_kernel"]:
        gate = kt.naive_kda_lowerbound_gate if c["lower_bound"] else kt.naive_kda_gate
        gg = (gate(gg, A_log.to(F64), dt_bias.to(F64), -5.0, output_dtype=F64) if c["lower_bound"] else
              gate(gg, A_log.to(F64), dt_bias.to(F64), output_dtype=F64))
    bb = beta.to(F64).sigmoid() if c["beta_sigmoid"] else beta.to(F64)
    tag = f"seed {seed}: {c}"
    bound = 5e-3 if dt != torch.float32 else 1e-5
    written = set()
    for n in range(N):
        r = int(read[n])
        if r < 0:
            assert torch.all(o[n] == 0), f"padding row {n}: o not 0 | {tag}"
            continue
        h = before[r].to(F64)
        h = h.transpose(-1, -2) if c["v_first"] else h
        states = []
        for t in range(T):
            ot, h = kt.naive_recurrent_kda(qq[n:n + 1, t:t + 1], kk[n:n + 1, t:t + 1], v[n:n + 1, t:t + 1].to(F64),
                                           gg[n:n + 1, t:t + 1], bb[n:n + 1, t:t + 1], initial_state=h[None] if
                                           h.dim() == 3 else h, output_final_state=True)
            states.append(h[0])
            e = torch_rel(ot[0, 0], o[n, t])
            assert e <= bound, f"row {n} token {t}: o rel={e:.3e} (bound {bound}) | {tag}"
        ref_states = [s.transpose(-1, -2) if c["v_first"] else s for s in states]
        if not c["inplace"]:  # the pool untouched; the state after every token returned
            fs_rows = fs.reshape(N, T, *pool.shape[1:])
            for t in range(T):
                e = torch_rel(ref_states[t], fs_rows[n, t])
                assert e <= 1e-5, f"row {n} token {t}: returned state rel={e:.3e} | {tag}"
            continue
        if idx.dim() == 1:
            targets = [(int(idx[n]), T - 1)]
        else:
            targets = [(int(idx[n, t]), t) for t in range(T) if int(idx[n, t]) >= 0]
        # a narrow pool holds the state rounded: rel (an rms ratio) within its half ulp
        pool_bound = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -9, torch.float16: 2.0 ** -12}[c["pool_dtype"]]
        for s, t in targets:
            e = torch_rel(ref_states[t], pool[s])
            assert e <= pool_bound, f"row {n}: slot {s} (state after token {t}) rel={e:.3e} | {tag}"
            written.add(s)
    untouched = [s for s in range(slots) if s not in written]
    assert torch.equal(pool[untouched], before[untouched]), f"a slot no row writes changed | {tag}"


@pytest.mark.parametrize("seed", range(6 if COUNT < 150 else 60))
def test_ragged_packed_decode_matches_float64_recurrence(seed):
    """Packed sequences of different lengths (0 to 5 tokens; a call per length inside) through
    fused_recurrent_kda_fwd: [N] indices (read and written back) or [N, T_max] indices with
    num_accepted_tokens (row n reads idx[n, a_n - 1], token t's state to idx[n, t] for its own
    tokens), in place or out of place, fp32 or narrow pools, both layouts; o and every kept state
    against the float64 recurrence, every other slot bitwise unchanged."""
    rng = np.random.default_rng(7000 + seed)
    N, H, K, V = int(rng.integers(2, 6)), 2, 32, 24
    v_first, inplace = bool(rng.integers(0, 2)), bool(rng.integers(0, 2))
    pool_dtype = [torch.float32, torch.bfloat16, torch.float16][int(rng.integers(0, 3))]
    lengths = [int(x) for x in rng.integers(0, 6, N)]
    lengths[0], lengths[1] = 2, 5  # at least two lengths
    T_all, T_max = sum(lengths), max(lengths)
    cu = torch.tensor([0] + list(np.cumsum(lengths)))
    torch.manual_seed(seed)
    q, k = torch.randn(1, T_all, H, K), F.normalize(torch.randn(1, T_all, H, K), dim=-1)
    v, g = torch.randn(1, T_all, H, V), F.logsigmoid(torch.randn(1, T_all, H, K)) / 4
    beta = torch.rand(1, T_all, H)
    slots = N * T_max + 2
    perm = torch.from_numpy(rng.permutation(slots)).long()
    per_token = bool(rng.integers(0, 2))
    accepted = None
    if per_token:
        idx = perm[:N * T_max].reshape(N, T_max).clone()
        accepted = torch.tensor([int(rng.integers(1, max(n, 1) + 1)) for n in lengths])
    else:
        idx = perm[:N].clone()
    pool = (torch.randn((slots, H, V, K) if v_first else (slots, H, K, V)) * 0.2).to(pool_dtype)
    before = pool.clone()
    o, fs = kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, inplace_final_state=inplace,
                                       output_final_state=True, state_v_first=v_first, cu_seqlens=cu,
                                       ssm_state_indices=idx, num_accepted_tokens=accepted)
    tag = f"seed {seed}: lengths {lengths}, per_token {per_token}, v_first {v_first}, inplace {inplace}, {pool_dtype}"
    pool_bound = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -9, torch.float16: 2.0 ** -12}[pool_dtype]
    written = set()
    for n in range(N):
        s, e = int(cu[n]), int(cu[n + 1])
        if s == e:
            continue
        read = int(idx[n, int(accepted[n]) - 1]) if per_token else int(idx[n])
        h = before[read].to(F64)
        h = h.transpose(-1, -2) if v_first else h
        for t in range(e - s):
            sl = slice(s + t, s + t + 1)
            ot, h = kt.naive_recurrent_kda(q[:, sl].to(F64), k[:, sl].to(F64), v[:, sl].to(F64), g[:, sl].to(F64),
                                           beta[:, sl].to(F64), initial_state=h[None] if h.dim() == 3 else h,
                                           output_final_state=True)
            e_o = torch_rel(ot[0, 0], o[0, s + t])
            assert e_o <= 1e-5, f"row {n} token {t}: o rel={e_o:.3e} | {tag}"
            state = h[0].transpose(-1, -2) if v_first else h[0]
            if not inplace:
                e_s = torch_rel(state, fs[s + t])
                assert e_s <= 1e-5, f"row {n} token {t}: returned state rel={e_s:.3e} | {tag}"
                continue
            target = int(idx[n, t]) if per_token else (int(idx[n]) if t == e - s - 1 else -1)
            if target >= 0:
                e_s = torch_rel(state, pool[target])
                assert e_s <= pool_bound, f"row {n}: slot {target} after token {t} rel={e_s:.3e} | {tag}"
                written.add(target)
    if inplace:
        assert fs is pool
    untouched = [s for s in range(slots) if s not in written]
    assert torch.equal(pool[untouched], before[untouched]), f"a slot no row writes changed | {tag}"
