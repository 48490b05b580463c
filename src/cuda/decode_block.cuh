// Decode against a state pool (SPEC.md section 3) as a thread-block algorithm: one block per
// (row, value head, V tile), the token recurrence of SPEC.md section 1 in fp32 with the state
// tile (K, 64) in shared memory, read from the pool once and written back after the tokens the
// slot map asks for. Same arithmetic as src/cpu/decode_kernels.inc:
//   u = sum_d (e^g_d k_d) S_d;  r = beta (v - u);  S_d <- e^g_d S_d + k_d r;  o = sum_d (scale q_d) S_d
// Compiled by nvcc (src/cuda/decode.cu) and by the host compiler as an emulation
// (device_math.cuh, "Phase discipline").
#pragma once

#include "cuda/device_math.cuh"
#include "cuda/forward_block.cuh"
#include "cuda/kernel_args.hpp"

namespace kda::cuda {

constexpr int kDecVT = 64;                    // V tile of a decode block
constexpr int kDecParts = kThreads / kDecVT;  // threads per column (K split)
constexpr int kDecLanes = 32;                 // partial sums of the l2 norms

struct DecLayout {
  i64 S = 0, qs = 0, kn = 0, eg = 0, bias = 0, vv = 0, part_u = 0, part_o = 0, red = 0, misc = 0, total = 0;
};

KDA_HDI DecLayout dec_layout(int K) {
  DecLayout L;
  i64 off = 0;
  auto take = [&off](i64 bytes) {
    const i64 at = off;
    off += round_up64(bytes, 16);
    return at;
  };
  L.S = take(4 * static_cast<i64>(K) * kDecVT);  // (K, 64)
  L.qs = take(4 * static_cast<i64>(K));          // scale * q_hat
  L.kn = take(4 * static_cast<i64>(K));          // k_hat
  L.eg = take(4 * static_cast<i64>(K));          // e^g
  L.bias = take(4 * static_cast<i64>(K));
  L.vv = take(4 * kDecVT);
  L.part_u = take(4 * kDecParts * kDecVT);
  L.part_o = take(4 * kDecParts * kDecVT);
  L.red = take(4 * 2 * kDecLanes);
  L.misc = take(16);  // beta
  L.total = off;
  return L;
}

KDA_BLOCK_FN inline void decode_block(const DecArgs& a, unsigned char* smem, i64 item) {
  const i64 per_row = static_cast<i64>(a.HV) * a.ntiles;
  const i64 n = item / per_row;
  const int hv = static_cast<int>((item % per_row) / a.ntiles);
  const int tile = static_cast<int>(item % a.ntiles);
  const int h = hv / a.group;
  const int K = a.K;
  const int v0 = tile * kDecVT;
  const int vt = imin(kDecVT, a.V - v0);
  const DecLayout L = dec_layout(K);
  float* S = reinterpret_cast<float*>(smem + L.S);
  float* qs = reinterpret_cast<float*>(smem + L.qs);
  float* kn = reinterpret_cast<float*>(smem + L.kn);
  float* eg = reinterpret_cast<float*>(smem + L.eg);
  float* bias = reinterpret_cast<float*>(smem + L.bias);
  float* vv = reinterpret_cast<float*>(smem + L.vv);
  float* part_u = reinterpret_cast<float*>(smem + L.part_u);
  float* part_o = reinterpret_cast<float*>(smem + L.part_o);
  float* red = reinterpret_cast<float*>(smem + L.red);
  float* beta = reinterpret_cast<float*>(smem + L.misc);
  const DTransforms& tr = a.tr;
  const i64 read = a.read[n];

  if (read < 0) {  // padding row: o = 0, the pool untouched
    KDA_PHASE(tid) {
      for (int idx = tid; idx < a.T * vt; idx += kThreads) {
        const int t = idx / vt, v = idx % vt;
        store_f32<kAnyDtype>(const_cast<void*>(a.o.data), a.o.dtype,
                             n * a.o.s[0] + t * a.o.s[1] + hv * a.o.s[2] + (v0 + v) * a.o.s[3], 0.0f);
      }
    }
    KDA_SYNC();
    return;
  }

  const float gate_a =
      tr.A_log.data ? kexp(load_f32<kAnyDtype>(tr.A_log.data, tr.A_log.dtype, hv * tr.A_log.s[0])) : 1.0f;
  KDA_PHASE(tid) {
    for (int d = tid; d < K; d += kThreads) {
      bias[d] = tr.dt_bias.data
                    ? load_f32<kAnyDtype>(tr.dt_bias.data, tr.dt_bias.dtype, hv * tr.dt_bias.s[0] + d * tr.dt_bias.s[1])
                    : 0.0f;
    }
    state_tile_in<kDecVT>(a.pool, read, hv, v0, vt, K, S, tid);
  }
  KDA_SYNC();

  for (int t = 0; t < a.T; ++t) {
    // One token's inputs: q, k, e^g (activated), the v tile, beta.
    KDA_PHASE(tid) {
      for (int d = tid; d < K; d += kThreads) {
        qs[d] = load_f32<kAnyDtype>(a.q.data, a.q.dtype, n * a.q.s[0] + t * a.q.s[1] + h * a.q.s[2] + d * a.q.s[3]);
        kn[d] = load_f32<kAnyDtype>(a.k.data, a.k.dtype, n * a.k.s[0] + t * a.k.s[1] + h * a.k.s[2] + d * a.k.s[3]);
        const float graw =
            load_f32<kAnyDtype>(a.g.data, a.g.dtype, n * a.g.s[0] + t * a.g.s[1] + hv * a.g.s[2] + d * a.g.s[3]);
        eg[d] = kexp(activate_gate(tr, graw, bias[d], gate_a));
      }
      for (int v = tid; v < kDecVT; v += kThreads) {
        vv[v] = v < vt ? load_f32<kAnyDtype>(a.v.data, a.v.dtype,
                                             n * a.v.s[0] + t * a.v.s[1] + hv * a.v.s[2] + (v0 + v) * a.v.s[3])
                       : 0.0f;
      }
      if (tid == 0) {
        beta[0] = activate_beta(
            tr, load_f32<kAnyDtype>(a.beta.data, a.beta.dtype, n * a.beta.s[0] + t * a.beta.s[1] + hv * a.beta.s[2]));
      }
    }
    KDA_SYNC();
    if (tr.l2norm) {
      // Partial sums of squares: lanes 0..31 for q, 32..63 for k.
      KDA_PHASE(tid) {
        if (tid < 2 * kDecLanes) {
          const float* x = tid < kDecLanes ? qs : kn;
          float ss = 0.0f;
          for (int d = tid % kDecLanes; d < K; d += kDecLanes) ss += x[d] * x[d];
          red[tid] = ss;
        }
      }
      KDA_SYNC();
    }
    // q <- scale * q_hat, k <- k_hat (every thread sums the 32 partials itself).
    KDA_PHASE(tid) {
      float rq = 1.0f, rk = 1.0f;
      if (tr.l2norm) {
        float sq = 0.0f, sk = 0.0f;
        for (int l = 0; l < kDecLanes; ++l) {
          sq += red[l];
          sk += red[kDecLanes + l];
        }
        rq = 1.0f / ksqrt(sq + 1e-6f);
        rk = 1.0f / ksqrt(sk + 1e-6f);
      }
      for (int d = tid; d < K; d += kThreads) {
        qs[d] = qs[d] * rq * tr.scale;
        kn[d] = kn[d] * rk;
      }
    }
    KDA_SYNC();
    // u = S~^T k: partial sums over d = p, p + kDecParts, ...
    KDA_PHASE(tid) {
      const int v = tid % kDecVT, p = tid / kDecVT;
      float acc = 0.0f;
      for (int d = p; d < K; d += kDecParts) acc += (eg[d] * kn[d]) * S[d * kDecVT + v];
      part_u[p * kDecVT + v] = acc;
    }
    KDA_SYNC();
    // r = beta (v - u); S = diag(e^g) S + k r^T; partial sums of o = S^T (scale q).
    KDA_PHASE(tid) {
      const int v = tid % kDecVT, p = tid / kDecVT;
      float u = 0.0f;
      for (int q = 0; q < kDecParts; ++q) u += part_u[q * kDecVT + v];
      const float r = beta[0] * (vv[v] - u);
      float acc = 0.0f;
      for (int d = p; d < K; d += kDecParts) {
        const float s = eg[d] * S[d * kDecVT + v] + kn[d] * r;
        S[d * kDecVT + v] = s;
        acc += qs[d] * s;
      }
      part_o[p * kDecVT + v] = acc;
    }
    KDA_SYNC();
    // o of this token; the state after it to its write slot, if any.
    const i64 w = a.write[n * a.T + t];
    KDA_PHASE(tid) {
      for (int v = tid; v < vt; v += kThreads) {
        float o = 0.0f;
        for (int q = 0; q < kDecParts; ++q) o += part_o[q * kDecVT + v];
        store_f32<kAnyDtype>(const_cast<void*>(a.o.data), a.o.dtype,
                             n * a.o.s[0] + t * a.o.s[1] + hv * a.o.s[2] + (v0 + v) * a.o.s[3], o);
      }
      if (w >= 0) state_tile_out<kDecVT>(a.pool, w, hv, v0, vt, K, S, tid);
    }
    KDA_SYNC();
  }
}

#if !defined(__CUDACC__)

inline void emulate_decode(const DecArgs& a) {
  const DecLayout L = dec_layout(a.K);
  std::vector<double> buf(static_cast<std::size_t>((L.total + 7) / 8));
  for (i64 item = 0; item < a.num_items; ++item) {
    std::memset(buf.data(), 0xff, buf.size() * sizeof(double));
    decode_block(a, reinterpret_cast<unsigned char*>(buf.data()), item);
  }
}

#endif

}  // namespace kda::cuda
