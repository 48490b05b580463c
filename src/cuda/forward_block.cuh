// The fused chunked forward of one work item (segment, value head, V tile) as a thread-block
// algorithm: SPEC.md section 2, forward part, with the numerics of src/cpu/forward_kernels.inc.
//
// Per chunk of C tokens of the segment (the chunk grid restarts at every segment start):
//   G    = inclusive prefix sum of g inside the chunk, fp64              (C, K)
//   Aqk  = tril(scale P(Q, K)),  Pkk = strict_tril(P(K, K))              (C, C)
//   [U | W] = (I + diag(beta) Pkk)^-1 [beta V | beta K e^G]  (forward substitution)
//   Vn   = U - W S0;  O = (scale Q e^G) S0 + Aqk Vn
//   S1   = diag(e^G_last) S0 + (K e^(G_last - G))^T Vn
// with the state tile S (K, VT) resident in shared memory for the whole segment and every
// intra-chunk product in shared memory: nothing O(T) is written to global memory.
//
// P(x, y)[i, j] = sum_d x_i[d] y_j[d] e^(G_i[d] - G_j[d]) is computed per 16-row sub-block I with
// the reference R = G at the token before I, as (x_i e^(G_i - R)) . (y_j e^(R - G_j)): factors
// <= 1 for columns before I; inside I the column factor is used only while R - G_j <= 60, and
// the (j, d) pairs beyond are summed pairwise with e^(G_i - G_j) directly (file comment of
// forward_kernels.inc). No exp overflows; every choice for entry (i, j) depends on tokens <= i
// only, so causality is exact.
//
// Compiled by nvcc as a kernel (src/cuda/forward_*.cu) and by the host compiler as an emulation
// that runs the same phases over a loop of threads (device_math.cuh, "Phase discipline").
#pragma once

#include "cuda/device_math.cuh"
#include "cuda/kernel_args.hpp"

#if !defined(__CUDACC__)
#include <cstring>
#include <vector>
#endif

namespace kda::cuda {

constexpr int kSub = 16;  // rows per intra-chunk sub-block
constexpr float kMaxColumnExponent = 60.0f;
constexpr int kTcLd = kSub + 1;  // row stride of the transposed column block (banks)

// Shared-memory layout of one forward block, in bytes from the start of dynamic shared memory.
// Host (launch size) and device (carving) compute it from the same runtime (C, K, VT).
struct FwdLayout {
  int ldk = 0, ldx = 0;  // row strides (floats) of qn/kn and of X
  i64 G = 0, qn = 0, kn = 0, aqk = 0, pkk = 0, S = 0, X = 0, rq = 0, rk = 0, tc = 0;
  i64 beta = 0, glast = 0, bias = 0, flag = 0, total = 0;
};

KDA_HDI FwdLayout fwd_layout(int C, int K, int VT) {
  FwdLayout L;
  L.ldk = K + 1;  // odd: a thread per row reading one column hits distinct banks
  L.ldx = VT + K;
  i64 off = 0;
  auto take = [&off](i64 bytes) {
    const i64 at = off;
    off += round_up64(bytes, 16);
    return at;
  };
  L.G = take(8 * static_cast<i64>(C) * K);       // (C, K) fp64
  L.qn = take(4 * static_cast<i64>(C) * L.ldk);  // (C, K) q, then scale q e^G
  L.kn = take(4 * static_cast<i64>(C) * L.ldk);  // (C, K) k, then k e^(G_last - G)
  L.aqk = take(4 * static_cast<i64>(C) * C);     // (C, C) lower triangle
  L.pkk = take(4 * static_cast<i64>(C) * C);     // (C, C) strict lower triangle
  L.S = take(4 * static_cast<i64>(K) * VT);      // (K, VT) the running state tile
  const i64 rq_bytes = round_up64(4 * static_cast<i64>(kSub) * K, 16);
  const i64 scratch = 2 * rq_bytes + 4 * static_cast<i64>(K) * kTcLd;
  const i64 xbytes = 4 * static_cast<i64>(C) * L.ldx;
  L.X = take(xbytes > scratch ? xbytes : scratch);  // (C, VT + K) [U | W]; before: the scratch below
  L.rq = L.X;                                       // (16, K)  scale q e^(G - R) of one sub-block
  L.rk = L.X + rq_bytes;                            // (16, K)  k e^(G - R)
  L.tc = L.X + 2 * rq_bytes;                        // (K, 17)  k_j e^(R - G_j), transposed
  L.beta = take(4 * static_cast<i64>(C));
  L.glast = take(4 * static_cast<i64>(K));  // e^G_last
  L.bias = take(4 * static_cast<i64>(K));   // dt_bias row of the value head
  L.flag = take(16);                        // "some column factor was cut" flag
  L.total = off;
  return L;
}

// The log decay, raised to -1000 where it is below (the CPU kernels' kMinLogDecay: e^g is 0 in
// fp32 either way, and the prefix sums stay finite; NaN is kept).
KDA_DI float activate_gate(const DTransforms& tr, float raw, float bias, float a) {
  float g;
  switch (tr.gate) {
    case 0:
      g = raw;
      break;
    case 1:
      g = -a * softplus_f32(raw + bias);
      break;
    default:
      g = tr.lower_bound * sigmoid_f32(a * (raw + bias));
      break;
  }
  return g < -1000.0f ? -1000.0f : g;
}

KDA_DI float activate_beta(const DTransforms& tr, float raw) {
  return tr.beta_sigmoid ? tr.beta_scale * sigmoid_f32(raw) : raw;
}

KDA_DI i64 state_base(const DState& st, i64 slot, int hv) {
  return (slot / st.per_row) * st.stride_row + (slot % st.per_row) * st.stride_slot + hv * st.stride_hv;
}

// Part of a phase: thread tid's share of copying state `slot` (columns v0 .. v0 + vt) into the
// tile S (K, TV) (zero where absent, and in columns >= vt). The element order follows the
// state tensor's faster dimension so a warp reads consecutive addresses.
template <int TV>
KDA_DI void state_tile_in(const DState& st, i64 slot, int hv, int v0, int vt, int K, float* S, int tid) {
  const bool have = st.data != nullptr && slot >= 0;
  const bool vfast = !have || st.stride_v == 1;
  const i64 base = have ? state_base(st, slot, hv) : 0;
  for (int idx = tid; idx < K * TV; idx += kThreads) {
    const int d = vfast ? idx / TV : idx % K;
    const int v = vfast ? idx % TV : idx / K;
    float x = 0.0f;
    if (have && v < vt) x = load_f32<kAnyDtype>(st.data, st.dtype, base + d * st.stride_k + (v0 + v) * st.stride_v);
    S[d * TV + v] = x;
  }
}

// Part of a phase: thread tid's share of writing the tile S (K, TV), columns < vt, into state
// `slot` of an fp32 state tensor.
template <int TV>
KDA_DI void state_tile_out(const DState& st, i64 slot, int hv, int v0, int vt, int K, const float* S, int tid) {
  const bool vfast = st.stride_v == 1;
  const i64 base = state_base(st, slot, hv);
  float* out = static_cast<float*>(st.data);
  for (int idx = tid; idx < K * vt; idx += kThreads) {
    const int d = vfast ? idx / vt : idx % K;
    const int v = vfast ? idx % vt : idx / K;
    out[base + d * st.stride_k + (v0 + v) * st.stride_v] = S[d * TV + v];
  }
}

// KMAX: largest K (register tiles of the state update); VT: V tile; CMAX: largest chunk;
// DT: dtype of q, k, v, g and o (kAnyDtype: each read at run time).
template <int KMAX, int VT, int CMAX, int DT>
struct FusedForward {
  static_assert(kThreads % VT == 0, "V tile must divide the block");
  static_assert(CMAX % kSub == 0 && CMAX <= 64, "chunk must be a multiple of 16, at most 64");
  static constexpr int NG = kThreads / VT;          // row groups of the (rows, VT) products
  static constexpr int RPT = (CMAX + NG - 1) / NG;  // chunk rows per thread
  static constexpr int DPT = (KMAX + NG - 1) / NG;  // state rows per thread

  KDA_BLOCK_FN static void run(const FwdArgs& a, unsigned char* smem, i64 item) {
    const i64 per_seg = static_cast<i64>(a.HV) * a.ntiles;
    const DSeg seg = a.segs[item / per_seg];
    const int hv = static_cast<int>((item % per_seg) / a.ntiles);
    const int tile = static_cast<int>(item % a.ntiles);
    const int h = hv / a.group;
    const int K = a.K, C = a.C;
    const int v0 = tile * VT;
    const int vt = imin(VT, a.V - v0);
    const FwdLayout L = fwd_layout(C, K, VT);
    const int ldk = L.ldk, ldx = L.ldx;
    double* G = reinterpret_cast<double*>(smem + L.G);
    float* qn = reinterpret_cast<float*>(smem + L.qn);
    float* kn = reinterpret_cast<float*>(smem + L.kn);
    float* aqk = reinterpret_cast<float*>(smem + L.aqk);
    float* pkk = reinterpret_cast<float*>(smem + L.pkk);
    float* S = reinterpret_cast<float*>(smem + L.S);
    float* X = reinterpret_cast<float*>(smem + L.X);
    float* rq = reinterpret_cast<float*>(smem + L.rq);
    float* rk = reinterpret_cast<float*>(smem + L.rk);
    float* tc = reinterpret_cast<float*>(smem + L.tc);
    float* beta = reinterpret_cast<float*>(smem + L.beta);
    float* glast = reinterpret_cast<float*>(smem + L.glast);
    float* bias = reinterpret_cast<float*>(smem + L.bias);
    int* flag = reinterpret_cast<int*>(smem + L.flag);
    const DTransforms& tr = a.tr;
    const float scale = tr.scale;
    const float gate_a =
        tr.A_log.data ? kexp(load_f32<kAnyDtype>(tr.A_log.data, tr.A_log.dtype, hv * tr.A_log.s[0])) : 1.0f;
    const i64 b = seg.batch;

    // The dt_bias row of this value head and the initial state tile.
    KDA_PHASE(tid) {
      for (int d = tid; d < K; d += kThreads) {
        bias[d] = tr.dt_bias.data ? load_f32<kAnyDtype>(tr.dt_bias.data, tr.dt_bias.dtype,
                                                        hv * tr.dt_bias.s[0] + d * tr.dt_bias.s[1])
                                  : 0.0f;
      }
      state_tile_in<VT>(a.init, seg.init_slot, hv, v0, vt, K, S, tid);
    }
    KDA_SYNC();

    const i64 nchunks = (seg.length + C - 1) / C;
    for (i64 c = 0; c < nchunks; ++c) {
      const i64 t0 = c * C;
      const int n = static_cast<int>(seg.length - t0 < C ? seg.length - t0 : C);
      const int np = static_cast<int>(round_up64(n, kSub));
      const i64 tok0 = seg.start + t0;

      // Load: the state entering the chunk to chunk_states; q, k, the activated log decay (into
      // G, summed next) and beta for rows < n; zero rows (g = 0) up to np.
      KDA_PHASE(tid) {
        if (a.cs.data != nullptr && c % a.cs_every == 0) {
          state_tile_out<VT>(a.cs, seg.chunk_offset + c / a.cs_every, hv, v0, vt, K, S, tid);
        }
        for (int idx = tid; idx < np * K; idx += kThreads) {
          const int i = idx / K, d = idx % K;
          float qv = 0.0f, kv = 0.0f, gv = 0.0f;
          if (i < n) {
            const i64 t = tok0 + i;
            qv = load_f32<DT>(a.q.data, a.q.dtype, b * a.q.s[0] + t * a.q.s[1] + h * a.q.s[2] + d * a.q.s[3]);
            kv = load_f32<DT>(a.k.data, a.k.dtype, b * a.k.s[0] + t * a.k.s[1] + h * a.k.s[2] + d * a.k.s[3]);
            const float graw =
                load_f32<DT>(a.g.data, a.g.dtype, b * a.g.s[0] + t * a.g.s[1] + hv * a.g.s[2] + d * a.g.s[3]);
            gv = activate_gate(tr, graw, bias[d], gate_a);
          }
          qn[i * ldk + d] = qv;
          kn[i * ldk + d] = kv;
          G[i * K + d] = static_cast<double>(gv);
        }
        for (int i = tid; i < np; i += kThreads) {
          float bt = 0.0f;
          if (i < n) {
            const i64 t = tok0 + i;
            bt = activate_beta(tr, load_f32<kAnyDtype>(a.beta.data, a.beta.dtype,
                                                       b * a.beta.s[0] + t * a.beta.s[1] + hv * a.beta.s[2]));
          }
          beta[i] = bt;
        }
      }
      KDA_SYNC();

      // l2norm of the q and k rows (a thread per row); prefix sums of g per channel in fp64.
      KDA_PHASE(tid) {
        if (tr.l2norm) {
          for (int r = tid; r < 2 * n; r += kThreads) {
            float* x = r < n ? qn + r * ldk : kn + (r - n) * ldk;
            float ss = 0.0f;
            for (int d = 0; d < K; ++d) ss += x[d] * x[d];
            const float inv = 1.0f / ksqrt(ss + 1e-6f);
            for (int d = 0; d < K; ++d) x[d] *= inv;
          }
        }
        for (int d = tid; d < K; d += kThreads) {
          double acc = 0.0;
          for (int i = 0; i < np; ++i) {
            acc += G[i * K + d];
            G[i * K + d] = acc;
          }
        }
      }
      KDA_SYNC();

      // Aqk and Pkk, one 16-row sub-block at a time.
      for (int sb = 0; sb < np / kSub; ++sb) {
        const int r0 = sb * kSub;
        KDA_PHASE(tid) {
          for (int idx = tid; idx < kSub * K; idx += kThreads) {
            const int ii = idx / K, d = idx % K;
            const double R = r0 > 0 ? G[(r0 - 1) * K + d] : 0.0;
            const float f = kexp(static_cast<float>(G[(r0 + ii) * K + d] - R));
            rq[ii * K + d] = scale * qn[(r0 + ii) * ldk + d] * f;
            rk[ii * K + d] = kn[(r0 + ii) * ldk + d] * f;
          }
          if (tid == 0) *flag = 0;
        }
        KDA_SYNC();
        for (int cb = 0; cb <= sb; ++cb) {
          const int c0 = cb * kSub;
          // Column factors of columns c0 .. c0 + 15 against this sub-block's reference.
          KDA_PHASE(tid) {
            for (int idx = tid; idx < kSub * K; idx += kThreads) {
              const int jj = idx / K, d = idx % K;
              const int j = c0 + jj;
              const double R = r0 > 0 ? G[(r0 - 1) * K + d] : 0.0;
              const float x = static_cast<float>(R - G[j * K + d]);
              const bool cut = x > kMaxColumnExponent;
              tc[d * kTcLd + jj] = cut ? 0.0f : kn[j * ldk + d] * kexp(x);
              if (cut && cb == sb && j < n) *flag = 1;  // same value from any writer
            }
          }
          KDA_SYNC();
          KDA_PHASE(tid) {
            for (int idx = tid; idx < kSub * kSub; idx += kThreads) {
              const int ii = idx / kSub, jj = idx % kSub;
              float sa = 0.0f, sp = 0.0f;
              for (int d = 0; d < K; ++d) {
                const float t = tc[d * kTcLd + jj];
                sa += rq[ii * K + d] * t;
                sp += rk[ii * K + d] * t;
              }
              if (cb == sb) {  // causal masks inside the diagonal block
                if (jj > ii) sa = 0.0f;
                if (jj >= ii) sp = 0.0f;
              }
              aqk[(r0 + ii) * C + c0 + jj] = sa;
              pkk[(r0 + ii) * C + c0 + jj] = sp;
            }
          }
          KDA_SYNC();
        }
        if (*flag) {  // uniform: read after the barrier
          // The (j, d) pairs whose column factor was cut, summed pairwise: a thread per (i, j).
          KDA_PHASE(tid) {
            for (int idx = tid; idx < kSub * kSub; idx += kThreads) {
              const int ii = idx / kSub, jj = idx % kSub;
              const int i = r0 + ii, j = r0 + jj;
              if (jj <= ii && j < n) {
                float sa = 0.0f, sp = 0.0f;
                for (int d = 0; d < K; ++d) {
                  const double R = r0 > 0 ? G[(r0 - 1) * K + d] : 0.0;
                  if (!(static_cast<float>(R - G[j * K + d]) > kMaxColumnExponent)) continue;
                  const float e = kexp(static_cast<float>(G[i * K + d] - G[j * K + d]));
                  const float kj = kn[j * ldk + d];
                  sa += scale * qn[i * ldk + d] * kj * e;
                  if (i > j) sp += kn[i * ldk + d] * kj * e;
                }
                aqk[i * C + j] += sa;
                pkk[i * C + j] += sp;
              }
            }
          }
          KDA_SYNC();
        }
      }

      // Right-hand sides and the factors of the inter-chunk terms, in place:
      //   X[:, VT + d] = beta k e^G (W), X[:, v] = beta v (U), qn <- scale q e^G, kn <- k e^(G_last - G).
      KDA_PHASE(tid) {
        for (int idx = tid; idx < np * (K + VT); idx += kThreads) {
          const int i = idx / (K + VT), col = idx % (K + VT);
          if (col < K) {
            const int d = col;
            const double gi = G[i * K + d];
            const double gl = G[(n - 1) * K + d];
            const float e = kexp(static_cast<float>(gi));
            const float el = kexp(static_cast<float>(gl - gi));
            const float kv = kn[i * ldk + d];
            X[i * ldx + VT + d] = beta[i] * kv * e;
            qn[i * ldk + d] = scale * qn[i * ldk + d] * e;
            kn[i * ldk + d] = kv * el;
            if (i == 0) glast[d] = kexp(static_cast<float>(gl));
          } else {
            const int v = col - K;
            float x = 0.0f;
            if (i < n && v < vt) {
              const i64 t = tok0 + i;
              x = beta[i] *
                  load_f32<DT>(a.v.data, a.v.dtype, b * a.v.s[0] + t * a.v.s[1] + hv * a.v.s[2] + (v0 + v) * a.v.s[3]);
            }
            X[i * ldx + v] = x;
          }
        }
      }
      KDA_SYNC();

      // [U | W] = (I + diag(beta) Pkk)^-1 [U | W]: forward substitution, a thread per column.
      KDA_PHASE(tid) {
        for (int col = tid; col < VT + K; col += kThreads) {
          for (int i = 1; i < np; ++i) {
            float dot = 0.0f;
            for (int j = 0; j < i; ++j) dot += pkk[i * C + j] * X[j * ldx + col];
            X[i * ldx + col] -= beta[i] * dot;
          }
        }
      }
      KDA_SYNC();

      // Vn = U - W S0, in place of U. Thread: column v, rows rg, rg + NG, ...
      KDA_PHASE(tid) {
        const int v = tid % VT, rg = tid / VT;
        float acc[RPT];
        KDA_UNROLL
        for (int r = 0; r < RPT; ++r) {
          const int i = rg + NG * r;
          acc[r] = i < np ? X[i * ldx + v] : 0.0f;
        }
        for (int d = 0; d < K; ++d) {
          const float s = S[d * VT + v];
          KDA_UNROLL
          for (int r = 0; r < RPT; ++r) {
            const int i = rg + NG * r;
            if (i < np) acc[r] -= X[i * ldx + VT + d] * s;
          }
        }
        KDA_UNROLL
        for (int r = 0; r < RPT; ++r) {
          const int i = rg + NG * r;
          if (i < np) X[i * ldx + v] = acc[r];
        }
      }
      KDA_SYNC();

      // O = (scale Q e^G) S0 + Aqk Vn, straight to the packed output.
      KDA_PHASE(tid) {
        const int v = tid % VT, rg = tid / VT;
        float acc[RPT];
        KDA_UNROLL
        for (int r = 0; r < RPT; ++r) acc[r] = 0.0f;
        for (int d = 0; d < K; ++d) {
          const float s = S[d * VT + v];
          KDA_UNROLL
          for (int r = 0; r < RPT; ++r) {
            const int i = rg + NG * r;
            if (i < n) acc[r] += qn[i * ldk + d] * s;
          }
        }
        for (int j = 0; j < n; ++j) {
          const float vn = X[j * ldx + v];
          KDA_UNROLL
          for (int r = 0; r < RPT; ++r) {
            const int i = rg + NG * r;
            if (i < n && j <= i) acc[r] += aqk[i * C + j] * vn;
          }
        }
        if (v < vt) {
          KDA_UNROLL
          for (int r = 0; r < RPT; ++r) {
            const int i = rg + NG * r;
            if (i < n) {
              const i64 t = tok0 + i;
              store_f32<DT>(const_cast<void*>(a.o.data), a.o.dtype,
                            b * a.o.s[0] + t * a.o.s[1] + hv * a.o.s[2] + (v0 + v) * a.o.s[3], acc[r]);
            }
          }
        }
      }
      KDA_SYNC();

      // S1 = diag(e^G_last) S0 + Kb^T Vn, in place. Thread: column v, state rows dg, dg + NG, ...
      KDA_PHASE(tid) {
        const int v = tid % VT, dg = tid / VT;
        float acc[DPT];
        KDA_UNROLL
        for (int r = 0; r < DPT; ++r) {
          const int d = dg + NG * r;
          acc[r] = d < K ? glast[d] * S[d * VT + v] : 0.0f;
        }
        for (int i = 0; i < np; ++i) {
          const float vn = X[i * ldx + v];
          KDA_UNROLL
          for (int r = 0; r < DPT; ++r) {
            const int d = dg + NG * r;
            if (d < K) acc[r] += kn[i * ldk + d] * vn;
          }
        }
        KDA_UNROLL
        for (int r = 0; r < DPT; ++r) {
          const int d = dg + NG * r;
          if (d < K) S[d * VT + v] = acc[r];
        }
      }
      KDA_SYNC();
    }

    if (a.fin.data != nullptr) {
      KDA_PHASE(tid) {
        state_tile_out<VT>(a.fin, seg.state, hv, v0, vt, K, S, tid);
      }
      KDA_SYNC();
    }
  }
};

// Zero output rows of the padding tokens (segment_ids with trailing 0): one block per row.
KDA_BLOCK_FN inline void zero_padding_row(const PadArgs& a, i64 row) {
  const DRow r = a.rows[row];
  KDA_PHASE(tid) {
    for (int idx = tid; idx < a.HV * a.V; idx += kThreads) {
      const int hv = idx / a.V, v = idx % a.V;
      store_f32<kAnyDtype>(const_cast<void*>(a.o.data), a.o.dtype,
                           r.batch * a.o.s[0] + r.t * a.o.s[1] + hv * a.o.s[2] + v * a.o.s[3], 0.0f);
    }
  }
  KDA_SYNC();
}

#if defined(__CUDACC__)

template <int KMAX, int VT, int CMAX, int DT>
__global__ void __launch_bounds__(kThreads, 1) fused_forward_kernel(const FwdArgs a) {
  extern __shared__ __align__(16) unsigned char kda_smem[];
  FusedForward<KMAX, VT, CMAX, DT>::run(a, kda_smem, static_cast<i64>(blockIdx.x));
}

#else

// The emulation: every work item in turn, its phases as loops over the block's threads. Shared
// memory starts as NaN for every item, so a read of anything not written first shows up.
template <int KMAX, int VT, int CMAX, int DT>
void emulate_fused_forward(const FwdArgs& a) {
  const FwdLayout L = fwd_layout(a.C, a.K, VT);
  std::vector<double> buf(static_cast<std::size_t>((L.total + 7) / 8));
  for (i64 item = 0; item < a.num_items; ++item) {
    std::memset(buf.data(), 0xff, buf.size() * sizeof(double));
    FusedForward<KMAX, VT, CMAX, DT>::run(a, reinterpret_cast<unsigned char*>(buf.data()), item);
  }
}

inline void emulate_zero_padding(const PadArgs& a) {
  for (i64 r = 0; r < a.num_rows; ++r) zero_padding_row(a, r);
}

#endif

}  // namespace kda::cuda
