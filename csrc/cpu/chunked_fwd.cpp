// Fast CPU forward: the chunked (WY/UT) form of SPEC §2 in float32, one task per
// (sequence, value head, V-slice), tasks spread over threads.
//
// Per chunk of L tokens with state S0 (K x V) and cumulative log-decay G_i = a_1 + ... + a_i:
//   P_qk[i][j] = sum_d q_i[d] k_j[d] e^{G_i[d]-G_j[d]}   (j <= i)
//   P_kk[i][j] = sum_d k_i[d] k_j[d] e^{G_i[d]-G_j[d]}   (j <  i)
//   delta rule:  w_j = b_j (v_j - S0^T (e^{G_j} k_j)) - b_j sum_{l<j} P_kk[j][l] w_l
//   otherwise:   w_j = v_j
//   o_i = S0^T (e^{G_i} q_i) + sum_{j<=i} P_qk[i][j] w_j
//   S   = diag(e^{G_L}) S0 + sum_j (e^{G_L - G_j} k_j) w_j^T
// Every exponent above is <= 0 for decaying gates, so nothing overflows. Pairs across 16-token
// sub-blocks factor through the token r just before the later block (e^{G_i-G_r} e^{G_r-G_j},
// both factors <= 1), which turns most of the K*L^2 exponentials into dot products.
// The columns of S evolve independently given k, g and beta, so a task may own a V-slice.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/parallel.h"
#include "cpu/cpu_backend.h"

// This file is compiled once per instruction set (CULA_CPU_ISA = baseline, avx2); cpu/isa.cpp
// picks the build that the processor runs.
#ifndef CULA_CPU_ISA
#define CULA_CPU_ISA baseline
#endif
#define CULA_CAT2(a, b) a##_##b
#define CULA_CAT(a, b) CULA_CAT2(a, b)

namespace cula {
namespace CULA_CAT(isa, CULA_CPU_ISA) {
namespace {

constexpr int64_t kSub = 16;

// exp for x <= ~88 with relative error ~2e-7; vectorizes (no libm call).
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : x;  // ternaries (not std::min/max) keep the loops branch-free
  x = x > 88.0f ? 88.0f : x;
  const float t = x * 1.44269504088896341f;
  const float r = (t + 12582912.0f) - 12582912.0f;  // round to nearest
  const float f = x - r * 0.693145751953125f - r * 1.428606765330187e-06f;
  float p = 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const uint32_t bits = (static_cast<uint32_t>(static_cast<int32_t>(r)) + 127u) << 23;  // unsigned: a NaN x stays defined
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

struct Workspace {
  std::vector<float> q, k, G, v, beta, S, Pqk, Pkk, W, O, rowf, colf, tmp;
  void resize(int64_t C, int64_t K, int64_t V) {
    q.resize(C * K);
    k.resize(C * K);
    G.resize(C * K);
    v.resize(C * V);
    beta.resize(C);
    S.resize(K * V);
    Pqk.resize(C * C);
    Pkk.resize(C * C);
    W.resize(C * V);
    O.resize(C * V);
    rowf.resize(C * K);
    colf.resize(C * K);
    tmp.resize(K);
  }
};

// Pairwise decayed dot products for one chunk (per-channel gates).
void pair_products_channel(int64_t L, int64_t K, bool delta, Workspace& w) {
  const float* G = w.G.data();
  for (int64_t s = 0; s < L; s += kSub) {
    const int64_t e = std::min(L, s + kSub);
    // Diagonal block: direct exponentials.
    for (int64_t i = s; i < e; ++i) {
      for (int64_t j = s; j <= i; ++j) {
        float aq = 0, ak = 0;
        const float *gi = G + i * K, *gj = G + j * K, *qi = &w.q[i * K], *ki = &w.k[i * K], *kj = &w.k[j * K];
#pragma omp simd reduction(+ : aq, ak)
        for (int64_t d = 0; d < K; ++d) {
          const float ex = fast_exp(gi[d] - gj[d]) * kj[d];
          aq += qi[d] * ex;
          ak += ki[d] * ex;
        }
        w.Pqk[i * L + j] = aq;
        if (j < i) w.Pkk[i * L + j] = ak;
      }
    }
    if (s == 0) continue;
    // Earlier tokens j < s: factor through r = s - 1.
    const float* gr = G + (s - 1) * K;
    for (int64_t j = 0; j < s; ++j) {
      const float *gj = G + j * K, *kj = &w.k[j * K];
      float* c = &w.colf[j * K];
#pragma omp simd
      for (int64_t d = 0; d < K; ++d) c[d] = kj[d] * fast_exp(gr[d] - gj[d]);
    }
    for (int64_t i = s; i < e; ++i) {
      const float* gi = G + i * K;
      float* rf = &w.rowf[(i - s) * K];
#pragma omp simd
      for (int64_t d = 0; d < K; ++d) rf[d] = fast_exp(gi[d] - gr[d]);
      const float *qi = &w.q[i * K], *ki = &w.k[i * K];
      for (int64_t j = 0; j < s; ++j) {
        const float* c = &w.colf[j * K];
        float aq = 0, ak = 0;
#pragma omp simd reduction(+ : aq, ak)
        for (int64_t d = 0; d < K; ++d) {
          const float x = rf[d] * c[d];
          aq += qi[d] * x;
          ak += ki[d] * x;
        }
        w.Pqk[i * L + j] = aq;
        if (delta) w.Pkk[i * L + j] = ak;
      }
    }
  }
}

// a = lb * sigmoid(eA * (x + bias)), in place.
void activate_lower_bound_gate(float* x, const float* bias, float eA, float lb, int64_t K) {
#pragma omp simd
  for (int64_t d = 0; d < K; ++d) x[d] = lb / (1.0f + fast_exp(-eA * (x[d] + bias[d])));
}

// Scalar gates: one exponential per pair.
void pair_products_scalar(int64_t L, int64_t K, Workspace& w) {
  for (int64_t i = 0; i < L; ++i) {
    const float *qi = &w.q[i * K], *ki = &w.k[i * K];
    const float gi = w.G[i * K];
    for (int64_t j = 0; j <= i; ++j) {
      const float* kj = &w.k[j * K];
      float aq = 0, ak = 0;
#pragma omp simd reduction(+ : aq, ak)
      for (int64_t d = 0; d < K; ++d) {
        aq += qi[d] * kj[d];
        ak += ki[d] * kj[d];
      }
      const float ex = fast_exp(gi - w.G[j * K]);
      w.Pqk[i * L + j] = aq * ex;
      w.Pkk[i * L + j] = ak * ex;
    }
  }
}

typedef float v8 __attribute__((vector_size(32)));

// C[M x N] += alpha * A[M x Kd] B[Kd x N] (row-major), in 4 x 16 register blocks.
void gemm_acc(int64_t M, int64_t N, int64_t Kd, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
              int64_t ldc, float alpha) {
  constexpr int MR = 4, NR = 16;
  int64_t n0 = 0;
  for (; n0 + NR <= N; n0 += NR) {
    int64_t m0 = 0;
    for (; m0 + MR <= M; m0 += MR) {
      // GCC vector types keep the 4 x 16 accumulators in registers (8 ymm on AVX2).
      v8 acc[MR][2] = {};
      for (int64_t d = 0; d < Kd; ++d) {
        v8 b0, b1;
        std::memcpy(&b0, B + d * ldb + n0, sizeof(v8));
        std::memcpy(&b1, B + d * ldb + n0 + 8, sizeof(v8));
        for (int r = 0; r < MR; ++r) {
          const float a = A[(m0 + r) * lda + d];
          const v8 av = {a, a, a, a, a, a, a, a};
          acc[r][0] += av * b0;
          acc[r][1] += av * b1;
        }
      }
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NR; ++j) C[(m0 + r) * ldc + n0 + j] += alpha * acc[r][j / 8][j % 8];
    }
    for (; m0 < M; ++m0) {
      float acc[NR] = {};
      for (int64_t d = 0; d < Kd; ++d) {
        const float a = A[m0 * lda + d];
        const float* b = B + d * ldb + n0;
#pragma omp simd
        for (int j = 0; j < NR; ++j) acc[j] += a * b[j];
      }
#pragma omp simd
      for (int j = 0; j < NR; ++j) C[m0 * ldc + n0 + j] += alpha * acc[j];
    }
  }
  if (n0 < N) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t d = 0; d < Kd; ++d) {
        const float a = alpha * A[m * lda + d];
        for (int64_t j = n0; j < N; ++j) C[m * ldc + j] += a * B[d * ldb + j];
      }
  }
}

// w_i = b_i (r_i - sum_{l<i} P[i][l] w_l), row by row, 16 columns held in registers.
void forward_substitution(int64_t L, int64_t Vs, const float* P, const float* beta, float* W) {
  constexpr int NR = 16;
  for (int64_t i = 0; i < L; ++i) {
    float* Wi = W + i * Vs;
    int64_t j0 = 0;
    for (; j0 + NR <= Vs; j0 += NR) {
      float acc[NR];
#pragma omp simd
      for (int j = 0; j < NR; ++j) acc[j] = Wi[j0 + j];
      for (int64_t l = 0; l < i; ++l) {
        const float c = P[i * L + l];
        const float* Wl = W + l * Vs + j0;
#pragma omp simd
        for (int j = 0; j < NR; ++j) acc[j] -= c * Wl[j];
      }
#pragma omp simd
      for (int j = 0; j < NR; ++j) Wi[j0 + j] = acc[j] * beta[i];
    }
    for (int64_t j = j0; j < Vs; ++j) {
      float acc = Wi[j];
      for (int64_t l = 0; l < i; ++l) acc -= P[i * L + l] * W[l * Vs + j];
      Wi[j] = acc * beta[i];
    }
  }
}

// One chunk on columns [0, Vs) of the slice: reads S (K x Vs), writes O and the new S.
void chunk_step(int64_t L, int64_t K, int64_t Vs, bool delta, Workspace& w) {
  float* S = w.S.data();
  float* W = w.W.data();
  float* O = w.O.data();
  const float* G = w.G.data();
  float* cq = w.rowf.data();  // [L][K] e^{G_i} q_i
  float* ck = w.colf.data();  // [L][K] e^{G_i} k_i
  for (int64_t i = 0; i < L; ++i) {
    const float *gi = G + i * K, *qi = &w.q[i * K], *ki = &w.k[i * K];
#pragma omp simd
    for (int64_t d = 0; d < K; ++d) {
      const float e = fast_exp(gi[d]);
      cq[i * K + d] = qi[d] * e;
      ck[i * K + d] = ki[d] * e;
    }
  }
  std::memcpy(W, w.v.data(), sizeof(float) * L * Vs);
  std::fill(O, O + L * Vs, 0.0f);
  gemm_acc(L, Vs, K, cq, K, S, Vs, O, Vs, 1.0f);
  if (delta) {
    gemm_acc(L, Vs, K, ck, K, S, Vs, W, Vs, -1.0f);
    forward_substitution(L, Vs, w.Pkk.data(), w.beta.data(), W);
  }
  // O += P_qk W with P_qk lower triangular (its upper part is zero).
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = i + 1; j < L; ++j) w.Pqk[i * L + j] = 0.0f;
  gemm_acc(L, Vs, L, w.Pqk.data(), L, W, Vs, O, Vs, 1.0f);
  // S = diag(e^{G_L}) S + sum_i (e^{G_L - G_i} k_i) w_i^T
  const float* gl = G + (L - 1) * K;
  for (int64_t d = 0; d < K; ++d) {
    float* Sd = S + d * Vs;
    const float e = fast_exp(gl[d]);
#pragma omp simd
    for (int64_t j = 0; j < Vs; ++j) Sd[j] *= e;
  }
  float* kdT = w.rowf.data();  // [K][L]
  for (int64_t i = 0; i < L; ++i) {
    const float *gi = G + i * K, *ki = &w.k[i * K];
    for (int64_t d = 0; d < K; ++d) kdT[d * L + i] = ki[d] * fast_exp(gl[d] - gi[d]);
  }
  gemm_acc(K, Vs, L, kdT, L, W, Vs, S, Vs, 1.0f);
}

void write_state_slice(const Recurrence& r, const cula_tensor& s, int64_t slot, int64_t hv, int64_t j0, int64_t Vs,
                       const float* S) {
  for (int64_t i = 0; i < r.K; ++i)
    for (int64_t j = 0; j < Vs; ++j) store_from_double(s.data, s.dtype, r.state_off(s, slot, hv, i, j0 + j), S[i * Vs + j]);
}

void read_state_slice(const Recurrence& r, const cula_tensor& s, int64_t slot, int64_t hv, int64_t j0, int64_t Vs,
                      float* S) {
  for (int64_t i = 0; i < r.K; ++i)
    for (int64_t j = 0; j < Vs; ++j)
      S[i * Vs + j] = static_cast<float>(load_as_double(s.data, s.dtype, r.state_off(s, slot, hv, i, j0 + j)));
}

}  // namespace

void cpu_chunk_fwd(const Recurrence& r, const cula_chunk_fwd_args& a) {
  const int64_t C = a.chunk_size ? a.chunk_size : 64;
  const int64_t K = r.K, V = r.V;
  const std::vector<int64_t> chunk_base = chunk_bases(r, C);
  const bool varlen = a.cu_seqlens != nullptr;
  // Split V across tasks only when there are fewer (sequence, head) pairs than threads.
  const int64_t pairs = r.N * r.HV;
  int64_t slices = 1;
  while (pairs * slices < num_threads() && V / (slices * 2) >= 16) slices *= 2;
  const int64_t Vs_max = (V + slices - 1) / slices;
  const View out(a.out);

  parallel_for(pairs * slices, [&](int64_t task) {
    const int64_t n = task / (r.HV * slices), hv = (task / slices) % r.HV, sl = task % slices;
    const int64_t j0 = sl * Vs_max, Vs = std::min(V, j0 + Vs_max) - j0;
    if (Vs <= 0) return;
    Workspace w;
    w.resize(C, K, Vs);
    std::fill(w.S.begin(), w.S.end(), 0.0f);
    int64_t slot = -1;
    if (a.state_pool) slot = a.state_indices ? load_index(*a.state_indices, n * a.state_indices->strides[0]) : n;
    if (a.state_pool && slot >= 0) read_state_slice(r, *a.state_pool, slot, hv, j0, Vs, w.S.data());
    if (a.initial_state) read_state_slice(r, *a.initial_state, n, hv, j0, Vs, w.S.data());
    std::vector<float> af(K), bias(K, 0.0f);
    // The bounded per-channel gate (the safe-gate path) is computed here, vectorized.
    const bool fast_gate = r.gate_in_kernel && r.has_lb && r.tr.gate == GateKind::PerChannel;
    float eA = 1.0f;
    if (fast_gate) {
      if (r.A_log) eA = std::exp(static_cast<float>(r.A_log.at(hv)));
      if (r.dt_bias) r.dt_bias.row(hv * K, K, 1, bias.data());
    }
    const int64_t len = r.seq_len(n), start = r.seq_start[n];
    for (int64_t c0 = 0; c0 < len; c0 += C) {
      const int64_t L = std::min(C, len - c0);
      if (a.intermediate_states) {
        const cula_tensor& h = *a.intermediate_states;
        const int64_t b = varlen ? 0 : n, c = varlen ? chunk_base[n] + c0 / C : c0 / C;
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < Vs; ++j)
            store_from_double(h.data, h.dtype, intermediate_off(r, h, b, c, hv, i, j0 + j), w.S[i * Vs + j]);
      }
      for (int64_t i = 0; i < L; ++i) {
        const int64_t f = start + c0 + i;
        r.load_qk<float>(f, hv, &w.q[i * K], &w.k[i * K]);
        w.beta[i] = r.load_beta<float>(r.tb(f), r.tt(f), hv);
        if (fast_gate) {
          r.g.row(r.g.off(r.tb(f), r.tt(f), hv, 0), K, r.g.t->strides[3], af.data());
          activate_lower_bound_gate(af.data(), bias.data(), eA, static_cast<float>(r.lb), K);
        } else {
          r.load_gate<float>(r.tb(f), r.tt(f), hv, af.data());
        }
        for (int64_t d = 0; d < K; ++d)
          if (af[d] < kMinChunkLogDecay) af[d] = kMinChunkLogDecay;  // -inf: a reset, not NaN; NaN stays NaN
        for (int64_t d = 0; d < K; ++d) w.G[i * K + d] = af[d] + (i ? w.G[(i - 1) * K + d] : 0.0f);
        // (columns of v past r.v_cols read as zeros: value_dim)
        const int64_t given = std::clamp<int64_t>(r.v_cols - j0, 0, Vs);
        if (given > 0) r.v.row(r.v.off(r.tb(f), r.tt(f), hv, j0), given, r.v.t->strides[3], &w.v[i * Vs]);
        std::fill(w.v.begin() + i * Vs + given, w.v.begin() + (i + 1) * Vs, 0.0f);
      }
      if (r.tr.gate == GateKind::PerChannel)
        pair_products_channel(L, K, r.tr.delta, w);
      else
        pair_products_scalar(L, K, w);
      chunk_step(L, K, Vs, r.tr.delta, w);
      for (int64_t i = 0; i < L; ++i) {
        const int64_t f = start + c0 + i;
        const int64_t base = out.off(r.tb(f), r.tt(f), hv, j0);
        if (a.out->dtype == CULA_FLOAT32) {
          std::memcpy(static_cast<float*>(a.out->data) + base, &w.O[i * Vs], sizeof(float) * Vs);
        } else {
          for (int64_t j = 0; j < Vs; ++j) store_from_double(a.out->data, a.out->dtype, base + j, w.O[i * Vs + j]);
        }
      }
    }
    if (a.final_state) write_state_slice(r, *a.final_state, n, hv, j0, Vs, w.S.data());
    if (a.state_pool && slot >= 0) write_state_slice(r, *a.state_pool, slot, hv, j0, Vs, w.S.data());
  });
}

}  // namespace isa_*
}  // namespace cula
