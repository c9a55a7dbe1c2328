// CPU decode: the recurrence token by token in float32, one task per (sequence, value head).
// All initial states are read before any is written, so every read sees the pool as it was
// before the call (the reference's semantics).
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/parallel.h"
#include "cpu/cpu_backend.h"

namespace cula {

void cpu_decode(const Recurrence& r, const cula_decode_args& a) {
  const int64_t K = r.K, V = r.V;
  const cula_tensor& pool = *a.state_pool;
  const DecodeSlots slots{a, r.T};
  const bool per_token = slots.per_token();
  std::vector<float> states(r.N * r.HV * K * V, 0.0f);
  parallel_for(r.N * r.HV, [&](int64_t task) {
    const int64_t n = task / r.HV, hv = task % r.HV, s = slots.read(n);
    if (s < 0) return;
    float* S = &states[task * K * V];
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j)
        S[i * V + j] = static_cast<float>(load_as_double(pool.data, pool.dtype, r.state_off(pool, s, hv, i, j)));
  });
  const View out(a.out);
  parallel_for(r.N * r.HV, [&](int64_t task) {
    const int64_t n = task / r.HV, hv = task % r.HV, s = slots.read(n);
    if (s < 0) {
      for (int64_t t = 0; t < r.T; ++t)
        for (int64_t j = 0; j < V; ++j) out.set(0.0, n, t, hv, j);
      return;
    }
    float* S = &states[task * K * V];
    std::vector<float> q(K), k(K), g(K), u(V);
    auto store = [&](int64_t slot) {
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < V; ++j) store_from_double(pool.data, pool.dtype, r.state_off(pool, slot, hv, i, j), S[i * V + j]);
    };
    for (int64_t t = 0; t < r.T; ++t) {
      const int64_t f = n * r.T + t;
      const float beta = r.load_token<float>(f, hv, q.data(), k.data(), g.data());
      for (int64_t j = 0; j < V; ++j) u[j] = static_cast<float>(r.v.at(n, t, hv, j));
      for (int64_t i = 0; i < K; ++i) {
        const float d = std::exp(g[i]);
        for (int64_t j = 0; j < V; ++j) S[i * V + j] *= d;
      }
      if (r.tr.delta) {
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < V; ++j) u[j] -= S[i * V + j] * k[i];
        for (int64_t j = 0; j < V; ++j) u[j] *= beta;
      }
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < V; ++j) S[i * V + j] += k[i] * u[j];
      for (int64_t j = 0; j < V; ++j) {
        float acc = 0;
        for (int64_t i = 0; i < K; ++i) acc += S[i * V + j] * q[i];
        out.set(acc, n, t, hv, j);
      }
      if (per_token) {
        const int64_t ws = slots.at(n, t);
        if (ws >= 0) store(ws);
      }
    }
    if (!per_token) store(s);
  });
}

}  // namespace cula
