// Test helpers: owned host tensors, random fills, poisoning, comparisons, call builders.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cula/cula.h"

namespace cula_test {

uint64_t fresh_seed();  // a new seed per call (time + counter), printed by tests on failure
size_t dtype_bytes(int32_t dtype);  // bytes per element of a cula_dtype

struct HostTensor {
  std::vector<unsigned char> bytes;
  cula_tensor t{};
  HostTensor() = default;
  HostTensor(std::vector<int64_t> shape, int32_t dtype);
  HostTensor(const HostTensor& o) { *this = o; }
  HostTensor& operator=(const HostTensor& o) {
    bytes = o.bytes;
    t = o.t;
    t.data = bytes.data();
    return *this;
  }
  int64_t numel() const;
  double get(int64_t i) const;  // flat, contiguous
  void set(int64_t i, double v);
  void fill_normal(std::mt19937_64& rng, double mean = 0.0, double std = 1.0);
  void fill_uniform(std::mt19937_64& rng, double lo, double hi);
  void fill(double v);
  void poison() { fill(NAN); }
  cula_tensor* ptr() { return &t; }
  const cula_tensor* cptr() const { return &t; }
  std::vector<double> values() const;
};

// ||a - b|| / ||b||
double rel_err(const HostTensor& a, const HostTensor& ref);
bool all_finite(const HostTensor& a);
bool all_nan(const HostTensor& a);  // still poisoned: nothing written

cula_recurrence_options default_options(int32_t family, int32_t backend);
// A KDA gate call on g into g_out with the KDA defaults (A_log may be null; no dt_bias).
cula_kda_gate_args kda_gate_args(const HostTensor& g, const HostTensor* A_log, HostTensor& g_out, int32_t backend);

// A random problem for one family with the options a test sets before calling make().
struct Problem {
  int32_t family = CULA_KDA;
  int64_t B = 2, T = 37, H = 2, HV = 2, K = 16, V = 8;
  int32_t dtype = CULA_FLOAT32;
  std::vector<int64_t> seqlens;  // varlen when non-empty (B must be 1, T = sum)
  bool cu_int64 = false;
  bool l2norm = true, gate_in_kernel = false, has_lb = false, safe_gate = false, beta_sigmoid = false, neg_eig = false;
  double lb = -5.0;
  bool use_A_log = true, use_dt_bias = true, dt_bias_2d = false;
  bool initial_state = true, final_state = true;
  int32_t state_dtype = CULA_FLOAT32;
  int32_t layout = CULA_STATE_K_LAST;
  int64_t chunk = 16;
  bool intermediate = false;
  double gate_scale = 0.1;  // raw gate magnitude

  HostTensor q, k, v, g, beta, decay, A_log, dt_bias, cu, h0, out, ht, inter;
  int64_t N = 0;

  void make(uint64_t seed);
  cula_recurrence_options options(int32_t backend) const;
  cula_chunk_fwd_args fwd_args(int32_t backend);
  // The decode entry on the problem's inputs (its batch as the N sequences); idx and acc may be null.
  cula_decode_args decode_args(int32_t backend, HostTensor& pool, const HostTensor* idx, const HostTensor* acc,
                               HostTensor& out) const;
  // The backward entry on the problem's inputs; a null gradient is not asked for.
  cula_chunk_bwd_args bwd_args(int32_t backend, const HostTensor& d_out, HostTensor* dq, HostTensor* dk, HostTensor* dv,
                               HostTensor* dg) const;
  std::vector<int64_t> state_shape(int64_t n) const;
  int64_t total_chunks() const;
};

}  // namespace cula_test
