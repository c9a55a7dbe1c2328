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

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CULA_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define CULA_MULTIVERSION
#endif

namespace cula {
namespace {

constexpr int64_t kSub = 16;

// exp for x <= ~88 with relative error ~2e-7; vectorizes (no libm call).
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
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
  const int32_t bits = (static_cast<int32_t>(r) + 127) << 23;
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
CULA_MULTIVERSION
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
CULA_MULTIVERSION
void activate_lower_bound_gate(float* x, const float* bias, float eA, float lb, int64_t K) {
#pragma omp simd
  for (int64_t d = 0; d < K; ++d) x[d] = lb / (1.0f + fast_exp(-eA * (x[d] + bias[d])));
}

// Scalar gates: one exponential per pair.
CULA_MULTIVERSION
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

// One chunk on columns [0, Vs) of the slice: reads S (K x Vs), writes O and the new S.
CULA_MULTIVERSION
void chunk_step(int64_t L, int64_t K, int64_t Vs, bool delta, Workspace& w) {
  float* S = w.S.data();
  float* W = w.W.data();
  float* O = w.O.data();
  const float* G = w.G.data();
  // W = v (then the delta correction), O = 0
  std::memcpy(W, w.v.data(), sizeof(float) * L * Vs);
  std::fill(O, O + L * Vs, 0.0f);
  // O = (e^G . q) S0 and W -= (e^G . k) S0, four rows at a time so each row of S0 is read once per four.
  float* cq = w.rowf.data();  // [L][K] decayed q
  float* ck = w.colf.data();  // [L][K] decayed k
  for (int64_t i = 0; i < L; ++i) {
    const float *gi = G + i * K, *qi = &w.q[i * K], *ki = &w.k[i * K];
#pragma omp simd
    for (int64_t d = 0; d < K; ++d) {
      const float e = fast_exp(gi[d]);
      cq[i * K + d] = qi[d] * e;
      ck[i * K + d] = delta ? ki[d] * e : 0.0f;
    }
  }
  for (int64_t i0 = 0; i0 < L; i0 += 4) {
    const int64_t nr = std::min<int64_t>(4, L - i0);
    for (int64_t d = 0; d < K; ++d) {
      const float* Sd = S + d * Vs;
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t i = i0 + r;
        const float a = cq[i * K + d], b = ck[i * K + d];
        float* Oi = O + i * Vs;
        float* Wi = W + i * Vs;
#pragma omp simd
        for (int64_t j = 0; j < Vs; ++j) {
          Oi[j] += a * Sd[j];
          Wi[j] -= b * Sd[j];
        }
      }
    }
  }
  if (delta) {
    for (int64_t i = 0; i < L; ++i) {
      float* Wi = W + i * Vs;
      for (int64_t l = 0; l < i; ++l) {
        const float c = w.Pkk[i * L + l];
        const float* Wl = W + l * Vs;
#pragma omp simd
        for (int64_t j = 0; j < Vs; ++j) Wi[j] -= c * Wl[j];
      }
      const float b = w.beta[i];
#pragma omp simd
      for (int64_t j = 0; j < Vs; ++j) Wi[j] *= b;
    }
    // The b_j factor multiplies the whole row including the correction: w_j = b_j (r_j - sum P w).
  }
  for (int64_t i = 0; i < L; ++i) {
    float* Oi = O + i * Vs;
    for (int64_t j = 0; j <= i; ++j) {
      const float c = w.Pqk[i * L + j];
      const float* Wj = W + j * Vs;
#pragma omp simd
      for (int64_t x = 0; x < Vs; ++x) Oi[x] += c * Wj[x];
    }
  }
  const float* gl = G + (L - 1) * K;
  for (int64_t d = 0; d < K; ++d) {
    float* Sd = S + d * Vs;
    const float e = fast_exp(gl[d]);
#pragma omp simd
    for (int64_t j = 0; j < Vs; ++j) Sd[j] *= e;
  }
  // S += sum_i (e^{G_L - G_i} . k_i) w_i^T, row d of S held while the rows of W stream past.
  float* kd = w.rowf.data();  // [L][K]
  for (int64_t i = 0; i < L; ++i) {
    const float *gi = G + i * K, *ki = &w.k[i * K];
#pragma omp simd
    for (int64_t d = 0; d < K; ++d) kd[i * K + d] = ki[d] * fast_exp(gl[d] - gi[d]);
  }
  for (int64_t d = 0; d < K; ++d) {
    float* Sd = S + d * Vs;
    for (int64_t i = 0; i < L; ++i) {
      const float cd = kd[i * K + d];
      const float* Wi = W + i * Vs;
#pragma omp simd
      for (int64_t j = 0; j < Vs; ++j) Sd[j] += cd * Wi[j];
    }
  }
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
  std::vector<int64_t> chunk_base(r.N + 1, 0);
  for (int64_t n = 0; n < r.N; ++n) chunk_base[n + 1] = chunk_base[n] + (r.seq_len(n) + C - 1) / C;
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
          for (int64_t j = 0; j < Vs; ++j) {
            const int64_t jj = j0 + j;
            const int64_t off = b * h.strides[0] + c * h.strides[1] + hv * h.strides[2] +
                                (r.state_layout == CULA_STATE_K_LAST ? jj * h.strides[3] + i * h.strides[4]
                                                                     : i * h.strides[3] + jj * h.strides[4]);
            store_from_double(h.data, h.dtype, off, w.S[i * Vs + j]);
          }
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
        for (int64_t d = 0; d < K; ++d) w.G[i * K + d] = af[d] + (i ? w.G[(i - 1) * K + d] : 0.0f);
        r.v.row(r.v.off(r.tb(f), r.tt(f), hv, j0), Vs, r.v.t->strides[3], &w.v[i * Vs]);
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

}  // namespace cula
