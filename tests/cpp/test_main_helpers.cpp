#include <atomic>
#include <chrono>

#include "helpers.h"

namespace cula_test {

uint64_t fresh_seed() {
  static std::atomic<uint64_t> counter{0};
  const uint64_t now = static_cast<uint64_t>(std::chrono::high_resolution_clock::now().time_since_epoch().count());
  return now * 6364136223846793005ull + (++counter) * 1442695040888963407ull;
}

size_t dtype_bytes(int32_t dtype) { return static_cast<size_t>(dtype & 0xff) / 8; }

HostTensor::HostTensor(std::vector<int64_t> shape, int32_t dtype) {
  t.dtype = dtype;
  t.ndim = static_cast<int32_t>(shape.size());
  int64_t n = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.strides[i] = n;
    n *= shape[i];
  }
  bytes.assign(static_cast<size_t>(n) * dtype_bytes(dtype) + 16, 0);
  t.data = bytes.data();
  t.device_type = CULA_CPU;
  t.device_id = 0;
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  return n;
}

static float bf16f(uint16_t h) {
  uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
static uint16_t f2bf(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40);
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

double HostTensor::get(int64_t i) const {
  const void* p = bytes.data();
  switch (t.dtype) {
    case CULA_FLOAT32: return static_cast<const float*>(p)[i];
    case CULA_FLOAT64: return static_cast<const double*>(p)[i];
    case CULA_BFLOAT16: return bf16f(static_cast<const uint16_t*>(p)[i]);
    case CULA_INT32: return static_cast<const int32_t*>(p)[i];
    case CULA_INT64: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    default: return NAN;
  }
}

void HostTensor::set(int64_t i, double v) {
  void* p = bytes.data();
  switch (t.dtype) {
    case CULA_FLOAT32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case CULA_FLOAT64: static_cast<double*>(p)[i] = v; break;
    case CULA_BFLOAT16: static_cast<uint16_t*>(p)[i] = f2bf(static_cast<float>(v)); break;
    case CULA_INT32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case CULA_INT64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); break;
    default: break;
  }
}

void HostTensor::fill_normal(std::mt19937_64& rng, double mean, double std) {
  std::normal_distribution<double> d(mean, std);
  for (int64_t i = 0; i < numel(); ++i) {
    double x = d(rng);
    if (x == 0.0) x = 1e-3;  // never exactly zero
    set(i, x);
  }
}

void HostTensor::fill_uniform(std::mt19937_64& rng, double lo, double hi) {
  std::uniform_real_distribution<double> d(lo, hi);
  for (int64_t i = 0; i < numel(); ++i) set(i, d(rng));
}

void HostTensor::fill(double v) {
  for (int64_t i = 0; i < numel(); ++i) set(i, v);
}

std::vector<double> HostTensor::values() const {
  std::vector<double> out(numel());
  for (int64_t i = 0; i < numel(); ++i) out[i] = get(i);
  return out;
}

double rel_err(const HostTensor& a, const HostTensor& ref) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const double d = a.get(i) - ref.get(i);
    num += d * d;
    den += ref.get(i) * ref.get(i);
  }
  if (std::isnan(num)) return INFINITY;
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

bool all_finite(const HostTensor& a) {
  for (int64_t i = 0; i < a.numel(); ++i)
    if (!std::isfinite(a.get(i))) return false;
  return true;
}

cula_kda_gate_args kda_gate_args(const HostTensor& g, const HostTensor* A_log, HostTensor& g_out, int32_t backend) {
  cula_kda_gate_args a{};
  a.struct_size = sizeof(a);
  a.opt = default_options(CULA_KDA, backend);
  a.g = g.cptr();
  if (A_log) a.A_log = A_log->cptr();
  a.g_out = g_out.ptr();
  return a;
}

bool all_nan(const HostTensor& a) {
  for (int64_t i = 0; i < a.numel(); ++i)
    if (!std::isnan(a.get(i))) return false;
  return true;
}

cula_recurrence_options default_options(int32_t family, int32_t backend) {
  cula_recurrence_options o{};
  o.family = family;
  o.scale = NAN;
  o.state_layout = CULA_STATE_K_LAST;
  o.backend = backend;
  return o;
}

std::vector<int64_t> Problem::state_shape(int64_t n) const {
  return layout == CULA_STATE_K_LAST ? std::vector<int64_t>{n, HV, V, K} : std::vector<int64_t>{n, HV, K, V};
}

int64_t Problem::total_chunks() const {
  if (seqlens.empty()) return (T + chunk - 1) / chunk;
  int64_t c = 0;
  for (int64_t l : seqlens) c += (l + chunk - 1) / chunk;
  return c;
}

void Problem::make(uint64_t seed) {
  std::mt19937_64 rng(seed);
  if (!seqlens.empty()) {
    B = 1;
    T = 0;
    for (int64_t l : seqlens) T += l;
  }
  N = seqlens.empty() ? B : static_cast<int64_t>(seqlens.size());
  const bool per_channel = family == CULA_KDA || family == CULA_GLA;
  const bool delta = family == CULA_KDA || family == CULA_GDN;
  const int32_t fdt = dtype == CULA_FLOAT64 ? CULA_FLOAT64 : CULA_FLOAT32;  // gates, beta, parameters
  q = HostTensor({B, T, H, K}, dtype);
  k = HostTensor({B, T, H, K}, dtype);
  v = HostTensor({B, T, HV, V}, dtype);
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  if (!l2norm) {  // keep the recurrence contractive: small keys for the delta rule
    for (int64_t i = 0; i < k.numel(); ++i) k.set(i, k.get(i) / std::sqrt(static_cast<double>(K)));
  }
  if (family == CULA_LIGHTNING) {
    decay = HostTensor({H}, fdt);
    decay.fill_uniform(rng, 0.01, 0.5);
  } else {
    g = per_channel ? HostTensor({B, T, HV, K}, fdt) : HostTensor({B, T, HV}, fdt);
    if (gate_in_kernel) {
      g.fill_normal(rng, 0.0, 1.0);
    } else {
      g.fill_uniform(rng, -gate_scale * 3, -gate_scale * 0.01);  // log-space decay, < 0
    }
  }
  if (delta) {
    beta = HostTensor({B, T, HV}, fdt);
    if (beta_sigmoid)
      beta.fill_normal(rng);
    else
      beta.fill_uniform(rng, 0.05, 0.95);
  }
  if (gate_in_kernel) {
    A_log = HostTensor({HV}, fdt);
    A_log.fill_uniform(rng, -1.0, 0.5);
    if (per_channel)
      dt_bias = dt_bias_2d ? HostTensor({HV, K}, fdt) : HostTensor({HV * K}, fdt);
    else
      dt_bias = HostTensor({HV}, fdt);
    dt_bias.fill_normal(rng, 0.0, 0.5);
  }
  if (!seqlens.empty()) {
    cu = HostTensor({N + 1}, cu_int64 ? CULA_INT64 : CULA_INT32);
    int64_t acc = 0;
    cu.set(0, 0);
    for (int64_t i = 0; i < N; ++i) cu.set(i + 1, acc += seqlens[i]);
  }
  if (initial_state) {
    h0 = HostTensor(state_shape(N), state_dtype);
    h0.fill_normal(rng, 0.0, 0.5);
  }
  out = HostTensor({B, T, HV, V}, CULA_FLOAT32);
  out.poison();
  if (final_state) {
    ht = HostTensor(state_shape(N), state_dtype);
    ht.poison();
  }
  if (intermediate) {
    const int64_t b = seqlens.empty() ? B : 1;
    inter = layout == CULA_STATE_K_LAST ? HostTensor({b, total_chunks(), HV, V, K}, CULA_FLOAT32)
                                        : HostTensor({b, total_chunks(), HV, K, V}, CULA_FLOAT32);
    inter.poison();
  }
}

cula_recurrence_options Problem::options(int32_t backend) const {
  cula_recurrence_options o = default_options(family, backend);
  o.use_qk_l2norm = l2norm;
  o.use_gate_in_kernel = gate_in_kernel;
  o.safe_gate = safe_gate;
  o.has_lower_bound = has_lb;
  o.lower_bound = lb;
  o.use_beta_sigmoid = beta_sigmoid;
  o.allow_neg_eigval = neg_eig;
  o.state_layout = layout;
  return o;
}

// The members that the forward, decode and backward argument structs share, from problem p (the
// forward's, decode's and backward's decay is set by their builders).
template <typename Args>
static void fill_inputs(const Problem& p, Args& a, int32_t backend) {
  a.struct_size = sizeof(a);
  a.opt = p.options(backend);
  a.q = p.q.cptr();
  a.k = p.k.cptr();
  a.v = p.v.cptr();
  if (p.g.t.ndim) a.g = p.g.cptr();
  if (p.beta.t.ndim) a.beta = p.beta.cptr();
  if (p.gate_in_kernel && p.use_A_log) a.A_log = p.A_log.cptr();
  if (p.gate_in_kernel && p.use_dt_bias) a.dt_bias = p.dt_bias.cptr();
}

cula_chunk_fwd_args Problem::fwd_args(int32_t backend) {
  cula_chunk_fwd_args a{};
  fill_inputs(*this, a, backend);
  if (decay.t.ndim) a.decay = decay.cptr();
  if (!seqlens.empty()) a.cu_seqlens = cu.cptr();
  if (initial_state) a.initial_state = h0.cptr();
  a.out = out.ptr();
  if (final_state) a.final_state = ht.ptr();
  if (intermediate) a.intermediate_states = inter.ptr();
  a.chunk_size = static_cast<int32_t>(chunk);
  return a;
}

cula_decode_args Problem::decode_args(int32_t backend, HostTensor& pool, const HostTensor* idx, const HostTensor* acc,
                                      HostTensor& out_) const {
  cula_decode_args a{};
  fill_inputs(*this, a, backend);
  if (decay.t.ndim) a.decay = decay.cptr();
  a.state_pool = pool.ptr();
  if (idx) a.state_indices = idx->cptr();
  if (acc) a.num_accepted_tokens = acc->cptr();
  a.out = out_.ptr();
  return a;
}

cula_chunk_bwd_args Problem::bwd_args(int32_t backend, const HostTensor& d_out, HostTensor* dq, HostTensor* dk,
                                      HostTensor* dv, HostTensor* dg) const {
  cula_chunk_bwd_args a{};
  fill_inputs(*this, a, backend);
  if (!seqlens.empty()) a.cu_seqlens = cu.cptr();
  if (initial_state) a.initial_state = h0.cptr();
  a.d_out = d_out.cptr();
  if (dq) a.dq = dq->ptr();
  if (dk) a.dk = dk->ptr();
  if (dv) a.dv = dv->ptr();
  if (dg) a.dg = dg->ptr();
  return a;
}

}  // namespace cula_test
