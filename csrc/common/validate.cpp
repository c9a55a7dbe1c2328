// Argument validation for every recurrence entry (SPEC §4): each check names the argument,
// what was expected and what was given.
#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/error.h"
#include "common/problem.h"

namespace cula {

FamilyTraits family_traits(int32_t family) {
  switch (family) {
    case CULA_KDA: return {GateKind::PerChannel, true, "KDA"};
    case CULA_GDN: return {GateKind::Scalar, true, "GDN"};
    case CULA_GLA: return {GateKind::PerChannel, false, "GLA"};
    case CULA_SIMPLE_GLA: return {GateKind::Scalar, false, "simple GLA"};
    case CULA_LIGHTNING: return {GateKind::Constant, false, "Lightning"};
    default: throw_arg("cula", "family", "one of KDA(0), GDN(1), GLA(2), SIMPLE_GLA(3), LIGHTNING(4)",
                       std::to_string(family));
  }
}

namespace {

std::string dims(std::initializer_list<int64_t> d) {
  std::ostringstream os;
  os << "[";
  int i = 0;
  for (int64_t x : d) os << (i++ ? ", " : "") << x;
  os << "]";
  return os.str();
}

std::string strides_string(const cula_tensor& t) {
  std::ostringstream os;
  os << "strides [";
  for (int i = 0; i < t.ndim; ++i) os << (i ? ", " : "") << t.strides[i];
  os << "]";
  return os.str();
}

struct Checker {
  const char* entry;
  int32_t device_type = CULA_CPU;
  int32_t device_id = 0;
  const char* device_of = "q";  // the tensor whose device every other must share

  [[noreturn]] void fail(const std::string& arg, const std::string& expected, const std::string& given) const {
    throw_arg(entry, arg, expected, given);
  }

  void present(const cula_tensor* t, const std::string& name, const std::string& why) const {
    if (!t) fail(name, "a tensor (" + why + ")", "None");
  }
  void absent(const cula_tensor* t, const std::string& name, const std::string& why) const {
    if (t) fail(name, "None (" + why + ")", describe(t));
  }

  void basic(const cula_tensor* t, const std::string& name) const {
    if (t->ndim < 0 || t->ndim > CULA_MAX_DIMS) fail(name, "a tensor of at most 6 dimensions", std::to_string(t->ndim) + " dimensions");
    int64_t n = 1;
    for (int i = 0; i < t->ndim; ++i) {
      if (t->shape[i] < 0) fail(name, "non-negative sizes", "shape " + shape_string(*t));
      if (__builtin_mul_overflow(n, t->shape[i], &n)) fail(name, "sizes whose product fits in 64 bits", "shape " + shape_string(*t));
    }
    if (!t->data && n > 0) fail(name, "a tensor with data", "a null data pointer");
  }

  void on_device(const cula_tensor* t, const std::string& name) const {
    if (t->device_type != device_type || (device_type == CULA_CUDA && t->device_id != device_id)) {
      const std::string want = device_type == CULA_CUDA ? "cuda:" + std::to_string(device_id) : "cpu";
      fail(name, "a tensor on " + want + " (the device of " + device_of + ")", describe(t));
    }
  }

  void float_tensor(const cula_tensor* t, const std::string& name) const {
    basic(t, name);
    on_device(t, name);
    if (!is_float_dtype(t->dtype)) fail(name, "a floating-point tensor (bfloat16, float16, float32 or float64)", describe(t));
    // The CUDA kernels load bfloat16, float16 and float32; float64 arithmetic is the host reference's.
    if (t->dtype == CULA_FLOAT64 && t->device_type == CULA_CUDA)
      fail(name, "a bfloat16, float16 or float32 tensor on a CUDA device (float64 runs on host tensors, in the float64 reference)",
           describe(t));
  }

  void shape(const cula_tensor* t, const std::string& name, std::initializer_list<int64_t> want,
             const std::string& symbolic) const {
    bool ok = t->ndim == static_cast<int>(want.size());
    int i = 0;
    if (ok)
      for (int64_t w : want) ok = ok && t->shape[i++] == w;
    if (!ok) fail(name, "shape " + symbolic + " = " + dims(want), "shape " + shape_string(*t));
  }

  void backend(int32_t b) const {
    if (b < CULA_BACKEND_AUTO || b > CULA_BACKEND_CUDA_FP32)
      fail("backend", "AUTO(0), ORACLE(1), CPU(2), CUDA(3) or CUDA_FP32(4)", std::to_string(b));
  }

  // A per-channel dt_bias: [HV*K] or [HV, K].
  void per_channel_dt_bias(const cula_tensor* t, int64_t HV, int64_t K) const {
    float_tensor(t, "dt_bias");
    const bool flat = t->ndim == 1 && t->shape[0] == HV * K;
    const bool two = t->ndim == 2 && t->shape[0] == HV && t->shape[1] == K;
    if (!flat && !two)
      fail("dt_bias", "shape [HV*K] = [" + std::to_string(HV * K) + "] or [HV, K] = [" + std::to_string(HV) + ", " + std::to_string(K) + "]",
           "shape " + shape_string(*t));
  }

  void contiguous_output(const cula_tensor* t, const std::string& name) const {
    if (!is_contiguous(*t)) fail(name, "a contiguous output buffer", strides_string(*t));
  }

  void state_dtype(const cula_tensor* t, const std::string& name) const {
    const bool host64 = t->dtype == CULA_FLOAT64 && t->device_type == CULA_CPU;
    if (t->dtype != CULA_FLOAT32 && t->dtype != CULA_BFLOAT16 && !host64)
      fail(name, "a float32 or bfloat16 state (float64 also on the host)", describe(t));
  }

  void state_shape(const cula_tensor* t, const std::string& name, int64_t n, const Recurrence& r,
                   const std::string& lead) const {
    basic(t, name);
    on_device(t, name);
    state_dtype(t, name);
    if (r.state_layout == CULA_STATE_K_LAST)
      shape(t, name, {n, r.HV, r.V, r.K}, "[" + lead + ", HV, V, K] (K-last layout)");
    else
      shape(t, name, {n, r.HV, r.K, r.V}, "[" + lead + ", HV, K, V] (K-first layout)");
  }
};

void check_options(const Checker& c, const cula_recurrence_options& o, Recurrence& r) {
  r.family = o.family;
  r.tr = family_traits(o.family);
  if (o.state_layout != CULA_STATE_K_LAST && o.state_layout != CULA_STATE_K_FIRST)
    c.fail("state_layout", "K_LAST(0) or K_FIRST(1)", std::to_string(o.state_layout));
  r.state_layout = o.state_layout;
  c.backend(o.backend);
  if (!std::isnan(o.scale) && !std::isfinite(o.scale)) c.fail("scale", "a finite number (or None for K^-0.5)", std::to_string(o.scale));
  r.l2norm = o.use_qk_l2norm != 0;
  r.gate_in_kernel = o.use_gate_in_kernel != 0;
  r.has_lb = o.has_lower_bound != 0;
  r.lb = o.lower_bound;
  r.beta_sigmoid = o.use_beta_sigmoid != 0;
  r.neg_eig = o.allow_neg_eigval != 0;
  if (r.gate_in_kernel && o.family != CULA_KDA && o.family != CULA_GDN)
    c.fail("use_gate_in_kernel", "False for " + std::string(r.tr.name) + " (only KDA and GDN compute the gate in kernel)", "True");
  if (r.has_lb && !(std::isfinite(r.lb) && r.lb < 0))
    c.fail("lower_bound", "a finite negative number (the gate's log-space lower bound)", std::to_string(r.lb));
  if (o.safe_gate && r.gate_in_kernel) {
    if (!r.has_lb) c.fail("lower_bound", "a value in [-5, 0) with safe_gate=True and use_gate_in_kernel=True", "None");
    if (!(r.lb >= -5.0 && r.lb < 0.0)) c.fail("lower_bound", "a value in [-5, 0) with safe_gate=True", std::to_string(r.lb));
  }
  if (r.beta_sigmoid && !r.tr.delta)
    c.fail("use_beta_sigmoid_in_kernel", "False for " + std::string(r.tr.name) + " (it has no beta)", "True");
  if (r.neg_eig && !r.beta_sigmoid) c.fail("allow_neg_eigval", "False unless use_beta_sigmoid_in_kernel=True", "True");
}

// q, k, v, g, beta, decay, A_log, dt_bias: shared by all entries. `lead` names q's first dimension.
void check_inputs(Checker& c, const cula_tensor* q, const cula_tensor* k, const cula_tensor* v, const cula_tensor* g,
                  const cula_tensor* beta, const cula_tensor* decay, const cula_tensor* A_log,
                  const cula_tensor* dt_bias, const cula_recurrence_options& o, Recurrence& r, const char* lead) {
  c.present(q, "q", "queries [" + std::string(lead) + ", T, H, K]");
  c.basic(q, "q");
  c.device_type = q->device_type;
  c.device_id = q->device_id;
  c.float_tensor(q, "q");
  if (q->ndim != 4) c.fail("q", "a 4-D tensor [" + std::string(lead) + ", T, H, K]", describe(q));
  r.B = q->shape[0];
  r.T = q->shape[1];
  r.H = q->shape[2];
  r.K = q->shape[3];
  if (r.H < 1 || r.K < 1) c.fail("q", "at least one head and K >= 1", "shape " + shape_string(*q));
  c.present(k, "k", "keys shaped like q");
  c.float_tensor(k, "k");
  c.shape(k, "k", {r.B, r.T, r.H, r.K}, "[" + std::string(lead) + ", T, H, K] (the shape of q)");
  c.present(v, "v", "values [" + std::string(lead) + ", T, HV, V]");
  c.float_tensor(v, "v");
  if (v->ndim != 4 || v->shape[0] != r.B || v->shape[1] != r.T)
    c.fail("v", "a 4-D tensor [" + std::string(lead) + ", T, HV, V] = [" + std::to_string(r.B) + ", " + std::to_string(r.T) + ", HV, V]", describe(v));
  r.HV = v->shape[2];
  r.V = v->shape[3];
  r.v_cols = r.V;
  if (r.HV < 1 || r.V < 1) c.fail("v", "at least one value head and V >= 1", "shape " + shape_string(*v));
  if (r.HV % r.H != 0)
    c.fail("v", "a number of value heads HV divisible by the number of q/k heads H = " + std::to_string(r.H),
           "HV = " + std::to_string(r.HV));
  r.q = View(q);
  r.k = View(k);
  r.v = View(v);

  const std::string fam = r.tr.name;
  if (r.tr.gate == GateKind::Constant) {
    c.absent(g, "g", fam + " takes a constant per-head decay, not g");
    c.present(decay, "decay", fam + " needs the per-head decay rate [H] or [HV]");
    c.float_tensor(decay, "decay");
    if (decay->ndim != 1 || (decay->shape[0] != r.H && decay->shape[0] != r.HV))
      c.fail("decay", "shape [H] = [" + std::to_string(r.H) + "] or [HV] = [" + std::to_string(r.HV) + "]", "shape " + shape_string(*decay));
    r.decay = View(decay);
    r.decay_heads = decay->shape[0];
  } else {
    c.absent(decay, "decay", fam + " takes its decay from g");
    c.present(g, "g", fam + " needs the gate g");
    c.float_tensor(g, "g");
    if (r.tr.gate == GateKind::PerChannel)
      c.shape(g, "g", {r.B, r.T, r.HV, r.K}, "[" + std::string(lead) + ", T, HV, K]");
    else
      c.shape(g, "g", {r.B, r.T, r.HV}, "[" + std::string(lead) + ", T, HV]");
    r.g = View(g);
  }
  if (r.tr.delta) {
    c.present(beta, "beta", fam + " needs beta [" + std::string(lead) + ", T, HV]");
    c.float_tensor(beta, "beta");
    c.shape(beta, "beta", {r.B, r.T, r.HV}, "[" + std::string(lead) + ", T, HV]");
    r.beta = View(beta);
  } else {
    c.absent(beta, "beta", fam + " has no delta rule");
  }
  if (r.gate_in_kernel) {
    if (!A_log && !r.has_lb)
      c.fail("A_log", "a tensor [HV] when use_gate_in_kernel=True and lower_bound is None", "None");
    if (A_log) {
      c.float_tensor(A_log, "A_log");
      c.shape(A_log, "A_log", {r.HV}, "[HV]");
      r.A_log = View(A_log);
    }
    if (dt_bias) {
      if (r.tr.gate == GateKind::PerChannel) {
        c.per_channel_dt_bias(dt_bias, r.HV, r.K);
        if (!is_contiguous(*dt_bias)) c.fail("dt_bias", "a contiguous tensor", "a strided view");
        r.dt_bias_per_channel = true;
      } else {
        c.float_tensor(dt_bias, "dt_bias");
        c.shape(dt_bias, "dt_bias", {r.HV}, "[HV]");
      }
      r.dt_bias = View(dt_bias);
    }
  } else {
    c.absent(A_log, "A_log", "only used with use_gate_in_kernel=True");
    c.absent(dt_bias, "dt_bias", "only used with use_gate_in_kernel=True");
  }
  r.scale = std::isnan(o.scale) ? 1.0 / std::sqrt(static_cast<double>(r.K)) : o.scale;
}

// r.seq_start from host offsets [N+1] (cu_seqlens, or the host copy of device offsets), checked.
void read_host_offsets(const Checker& c, const cula_tensor& cu, const std::string& name, Recurrence& r) {
  for (int64_t n = 0; n <= r.N; ++n) r.seq_start[n] = load_index(cu, n * cu.strides[0]);
  if (r.seq_start[0] != 0) c.fail(name, name + "[0] == 0", name + "[0] = " + std::to_string(r.seq_start[0]));
  for (int64_t n = 0; n < r.N; ++n)
    if (r.seq_start[n + 1] < r.seq_start[n])
      c.fail(name, "non-decreasing offsets", name + "[" + std::to_string(n + 1) + "] = " + std::to_string(r.seq_start[n + 1]) +
                                                  " < " + name + "[" + std::to_string(n) + "] = " + std::to_string(r.seq_start[n]));
  if (r.seq_start[r.N] != r.T)
    c.fail(name, name + "[-1] == T = " + std::to_string(r.T), name + "[-1] = " + std::to_string(r.seq_start[r.N]));
}

void check_cu_seqlens(const Checker& c, const cula_tensor* cu, Recurrence& r) {
  if (!cu) {
    r.N = r.B;
    r.seq_start.resize(r.N + 1);
    for (int64_t n = 0; n <= r.N; ++n) r.seq_start[n] = n * r.T;
    return;
  }
  c.basic(cu, "cu_seqlens");
  if (cu->dtype != CULA_INT32 && cu->dtype != CULA_INT64) c.fail("cu_seqlens", "an int32 or int64 tensor", describe(cu));
  if (cu->ndim != 1 || cu->shape[0] < 2) c.fail("cu_seqlens", "a 1-D tensor [N+1] with N >= 1", describe(cu));
  if (cu->device_type != CULA_CPU && cu->device_type != c.device_type)
    c.fail("cu_seqlens", "a tensor on the host or on the device of q", describe(cu));
  if (r.B != 1) c.fail("q", "batch size 1 when cu_seqlens is given (sequences packed along T)", "batch size " + std::to_string(r.B));
  r.N = cu->shape[0] - 1;
  r.seq_start.resize(r.N + 1);
  if (cu->device_type != CULA_CPU) return;  // device-side offsets: checked by the kernel's launcher
  read_host_offsets(c, *cu, "cu_seqlens", r);
}

// The host copy of device offsets (cula_chunk_fwd_args.cu_seqlens_host): the same [N+1] offsets.
bool check_host_copy(const Checker& c, const cula_tensor* host, const cula_tensor* cu, Recurrence& r) {
  if (!host) return false;
  c.basic(host, "cu_seqlens_host");
  if (!cu) c.fail("cu_seqlens_host", "None when cu_seqlens is None", describe(host));
  if (host->device_type != CULA_CPU) c.fail("cu_seqlens_host", "a host tensor (cu_seqlens' offsets on the host)", describe(host));
  if (host->dtype != CULA_INT32 && host->dtype != CULA_INT64) c.fail("cu_seqlens_host", "an int32 or int64 tensor", describe(host));
  if (host->ndim != 1 || host->shape[0] != r.N + 1)
    c.fail("cu_seqlens_host", "a 1-D tensor [N+1] = [" + std::to_string(r.N + 1) + "] like cu_seqlens", describe(host));
  read_host_offsets(c, *host, "cu_seqlens_host", r);
  return true;
}

void check_pool_indices(const Checker& c, const cula_tensor* idx, const std::string& name, int64_t pool_size,
                        std::initializer_list<int64_t> want, const std::string& symbolic) {
  c.basic(idx, name);
  if (idx->dtype != CULA_INT32) c.fail(name, "an int32 tensor", describe(idx));
  c.shape(idx, name, want, symbolic);
  if (idx->device_type != CULA_CPU && idx->device_type != c.device_type)
    c.fail(name, "a tensor on the host or on the device of q", describe(idx));
  if (idx->device_type != CULA_CPU) return;
  const int64_t n = numel(*idx);
  const int64_t cols = idx->ndim == 2 ? idx->shape[1] : 1;
  // Every read sees the pool as it was before the call, so two sequences naming one slot would race
  // on it: the named slots with their sequence (row), sorted, so that a slot's sequences are adjacent
  // (work in the indices' count, not the pool's size)
  std::vector<std::pair<int64_t, int64_t>> named;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t off = idx->ndim == 2 ? (i / cols) * idx->strides[0] + (i % cols) * idx->strides[1] : i * idx->strides[0];
    const int64_t s = static_cast<const int32_t*>(idx->data)[off];
    if (s >= pool_size)
      c.fail(name, "slot indices < pool size P = " + std::to_string(pool_size) + " (negative = padding)",
             name + "[" + std::to_string(i) + "] = " + std::to_string(s));
    if (s >= 0) named.emplace_back(s, i / cols);
  }
  std::sort(named.begin(), named.end());
  for (size_t j = 1; j < named.size(); ++j)
    if (named[j].first == named[j - 1].first && named[j].second != named[j - 1].second)
      c.fail(name, "slots of different sequences distinct (a slot is read and written by one sequence per call)",
             "slot " + std::to_string(named[j].first) + " named by sequences " + std::to_string(named[j - 1].second) +
                 " and " + std::to_string(named[j].second));
}

}  // namespace

std::vector<int64_t> chunk_bases(const Recurrence& r, int64_t chunk) {
  std::vector<int64_t> base(r.N + 1, 0);
  for (int64_t n = 0; n < r.N; ++n) base[n + 1] = base[n] + (r.seq_len(n) + chunk - 1) / chunk;
  return base;
}

int64_t chunk_count(const Recurrence& r, int64_t chunk) {
  int64_t total = 0;
  for (int64_t n = 0; n < r.N; ++n) total += (r.seq_len(n) + chunk - 1) / chunk;
  return total;
}

Recurrence validate_chunk_fwd(const cula_chunk_fwd_args& a) {
  Checker c{"chunk_fwd"};
  Recurrence r;
  r.entry = "chunk_fwd";
  if (a.struct_size < sizeof(cula_chunk_fwd_args))
    c.fail("args.struct_size", ">= " + std::to_string(sizeof(cula_chunk_fwd_args)), std::to_string(a.struct_size));
  check_options(c, a.opt, r);
  check_inputs(c, a.q, a.k, a.v, a.g, a.beta, a.decay, a.A_log, a.dt_bias, a.opt, r, "B");
  if (a.value_dim != 0) {  // v holds the first columns; the rest read as zeros
    if (a.value_dim < r.V)
      c.fail("value_dim", "0 or a value size at least v's V = " + std::to_string(r.V), std::to_string(a.value_dim));
    r.V = a.value_dim;
  }
  check_cu_seqlens(c, a.cu_seqlens, r);
  const bool host_copy = check_host_copy(c, a.cu_seqlens_host, a.cu_seqlens, r);
  const bool host_offsets = host_copy || (a.cu_seqlens && a.cu_seqlens->device_type == CULA_CPU);
  const std::string lead = a.cu_seqlens ? "N" : "B";
  if (a.state_pool) {
    c.absent(a.initial_state, "initial_state", "state_pool is given: initial states come from the pool");
    c.absent(a.final_state, "final_state", "state_pool is given: final states go back to the pool");
    c.basic(a.state_pool, "state_pool");
    if (a.state_pool->ndim != 4) c.fail("state_pool", "a 4-D state pool [P, HV, ., .]", describe(a.state_pool));
    c.state_shape(a.state_pool, "state_pool", a.state_pool->shape[0], r, "P");
    c.contiguous_output(a.state_pool, "state_pool");
    if (a.state_indices)
      check_pool_indices(c, a.state_indices, "state_indices", a.state_pool->shape[0], {r.N}, "[N]");
    else if (a.state_pool->shape[0] < r.N)
      c.fail("state_pool", "at least N = " + std::to_string(r.N) + " slots when state_indices is None", "shape " + shape_string(*a.state_pool));
  } else {
    c.absent(a.state_indices, "state_indices", "only used together with state_pool");
  }
  if (a.initial_state) c.state_shape(a.initial_state, "initial_state", r.N, r, lead);
  if (a.final_state) {
    c.state_shape(a.final_state, "final_state", r.N, r, lead);
    c.contiguous_output(a.final_state, "final_state");
  }
  c.present(a.out, "out", "the output buffer [B, T, HV, V]");
  c.float_tensor(a.out, "out");
  c.shape(a.out, "out", {r.B, r.T, r.HV, r.V}, "[B, T, HV, V]");
  c.contiguous_output(a.out, "out");
  if (a.chunk_size < 0) c.fail("chunk_size", "a positive chunk size (or 0 for 64)", std::to_string(a.chunk_size));
  if (a.intermediate_states) {
    const int64_t C = a.chunk_size ? a.chunk_size : 64;
    const cula_tensor* h = a.intermediate_states;
    c.basic(h, "intermediate_states");
    c.on_device(h, "intermediate_states");
    c.state_dtype(h, "intermediate_states");
    if (a.cu_seqlens && !host_offsets)
      c.fail("cu_seqlens_host", "the offsets on the host when cu_seqlens lives on the device and intermediate_states is "
             "given (their count needs them)", "None");
    const int64_t b = a.cu_seqlens ? 1 : r.B;
    const int64_t nt = a.cu_seqlens ? chunk_count(r, C) : (r.T + C - 1) / C;
    if (r.state_layout == CULA_STATE_K_LAST)
      c.shape(h, "intermediate_states", {b, nt, r.HV, r.V, r.K}, "[B, NT, HV, V, K] with NT chunks of " + std::to_string(C));
    else
      c.shape(h, "intermediate_states", {b, nt, r.HV, r.K, r.V}, "[B, NT, HV, K, V] with NT chunks of " + std::to_string(C));
    c.contiguous_output(h, "intermediate_states");
  }
  if (a.segment_len != 0) {  // a dense call cut into segments: the engine's own summary states
    if (a.segment_len < 0 || a.segment_len % 64)
      c.fail("segment_len", "0 or a positive multiple of 64 tokens", std::to_string(a.segment_len));
    const char* conflict = a.cu_seqlens ? "cu_seqlens" : a.state_pool ? "state_pool"
                         : a.intermediate_states ? "intermediate_states" : a.value_dim ? "value_dim" : nullptr;
    if (conflict)
      c.fail("segment_len", std::string("0 when ") + conflict + " is given (segments cut dense calls only)",
             std::to_string(a.segment_len));
    r.segment_len = a.segment_len;
  }
  return r;
}

Recurrence validate_decode(const cula_decode_args& a) {
  Checker c{"decode"};
  Recurrence r;
  r.entry = "decode";
  if (a.struct_size < sizeof(cula_decode_args))
    c.fail("args.struct_size", ">= " + std::to_string(sizeof(cula_decode_args)), std::to_string(a.struct_size));
  check_options(c, a.opt, r);
  check_inputs(c, a.q, a.k, a.v, a.g, a.beta, a.decay, a.A_log, a.dt_bias, a.opt, r, "N");
  check_cu_seqlens(c, nullptr, r);
  c.present(a.state_pool, "state_pool", "the decode state pool [P, HV, V, K]");
  c.basic(a.state_pool, "state_pool");
  if (a.state_pool->ndim != 4) c.fail("state_pool", "a 4-D state pool [P, HV, ., .]", describe(a.state_pool));
  const int64_t P = a.state_pool->shape[0];
  c.state_shape(a.state_pool, "state_pool", P, r, "P");
  c.contiguous_output(a.state_pool, "state_pool");
  if (a.state_indices) {
    if (a.state_indices->ndim == 2)
      check_pool_indices(c, a.state_indices, "state_indices", P, {r.N, r.T}, "[N, T] (one slot per draft token)");
    else
      check_pool_indices(c, a.state_indices, "state_indices", P, {r.N}, "[N]");
  } else if (P < r.N) {
    c.fail("state_pool", "at least N = " + std::to_string(r.N) + " slots when state_indices is None", "shape " + shape_string(*a.state_pool));
  }
  if (a.num_accepted_tokens) {
    if (!a.state_indices || a.state_indices->ndim != 2)
      c.fail("num_accepted_tokens", "None unless state_indices is [N, T] (speculative decoding)", describe(a.num_accepted_tokens));
    c.basic(a.num_accepted_tokens, "num_accepted_tokens");
    if (a.num_accepted_tokens->dtype != CULA_INT32) c.fail("num_accepted_tokens", "an int32 tensor", describe(a.num_accepted_tokens));
    c.shape(a.num_accepted_tokens, "num_accepted_tokens", {r.N}, "[N]");
    if (a.num_accepted_tokens->device_type != CULA_CPU && a.num_accepted_tokens->device_type != c.device_type)
      c.fail("num_accepted_tokens", "a tensor on the host or on the device of q", describe(a.num_accepted_tokens));
  }
  c.present(a.out, "out", "the output buffer [N, T, HV, V]");
  c.float_tensor(a.out, "out");
  c.shape(a.out, "out", {r.B, r.T, r.HV, r.V}, "[N, T, HV, V]");
  c.contiguous_output(a.out, "out");
  if (a.final_state_out) {
    c.basic(a.final_state_out, "final_state_out");
    if (a.state_indices)
      c.fail("final_state_out", "None with state_indices (out is indexed by sequence, the pool by slot)",
             describe(a.final_state_out));
    if (a.final_state_out->dtype != a.state_pool->dtype)
      c.fail("final_state_out", std::string("the dtype of state_pool (") + dtype_name(a.state_pool->dtype) + ")",
             describe(a.final_state_out));
    c.state_shape(a.final_state_out, "final_state_out", r.N, r, "N");
    c.contiguous_output(a.final_state_out, "final_state_out");
  }
  return r;
}

Recurrence validate_chunk_bwd(const cula_chunk_bwd_args& a) {
  Checker c{"chunk_bwd"};
  Recurrence r;
  r.entry = "chunk_bwd";
  if (a.struct_size < sizeof(cula_chunk_bwd_args))
    c.fail("args.struct_size", ">= " + std::to_string(sizeof(cula_chunk_bwd_args)), std::to_string(a.struct_size));
  check_options(c, a.opt, r);
  check_inputs(c, a.q, a.k, a.v, a.g, a.beta, a.decay, a.A_log, a.dt_bias, a.opt, r, "B");
  check_cu_seqlens(c, a.cu_seqlens, r);
  const std::string lead = a.cu_seqlens ? "N" : "B";
  if (a.initial_state) c.state_shape(a.initial_state, "initial_state", r.N, r, lead);
  c.present(a.d_out, "d_out", "the gradient of the output [B, T, HV, V]");
  c.float_tensor(a.d_out, "d_out");
  c.shape(a.d_out, "d_out", {r.B, r.T, r.HV, r.V}, "[B, T, HV, V]");
  if (a.d_final_state) c.state_shape(a.d_final_state, "d_final_state", r.N, r, lead);
  auto like = [&](cula_tensor* gt, const char* name, const cula_tensor* src, const char* src_name) {
    if (!gt) return;
    if (!src) c.fail(name, std::string("None (") + src_name + " is None)", describe(gt));
    c.float_tensor(gt, name);
    bool same = gt->ndim == src->ndim;
    for (int i = 0; same && i < src->ndim; ++i) same = gt->shape[i] == src->shape[i];
    if (!same) c.fail(name, "the shape of " + std::string(src_name) + " " + shape_string(*src), "shape " + shape_string(*gt));
    c.contiguous_output(gt, name);
  };
  like(a.dq, "dq", a.q, "q");
  like(a.dk, "dk", a.k, "k");
  like(a.dv, "dv", a.v, "v");
  like(a.dg, "dg", a.g, "g");
  like(a.dbeta, "dbeta", a.beta, "beta");
  like(a.dA_log, "dA_log", a.A_log, "A_log");
  like(a.ddt_bias, "ddt_bias", a.dt_bias, "dt_bias");
  like(a.d_initial_state, "d_initial_state", a.initial_state, "initial_state");
  return r;
}

KdaGateShape validate_kda_gate(const cula_kda_gate_args& a) {
  Checker c{"kda_gate"};
  c.device_of = "g";
  if (a.struct_size < sizeof(cula_kda_gate_args))
    c.fail("args.struct_size", ">= " + std::to_string(sizeof(cula_kda_gate_args)), std::to_string(a.struct_size));
  c.present(a.g, "g", "the raw gate [B, T, HV, K]");
  c.basic(a.g, "g");
  c.device_type = a.g->device_type;
  c.device_id = a.g->device_id;
  if (a.g->ndim != 4 || !is_float_dtype(a.g->dtype)) c.fail("g", "a 4-D floating-point tensor [B, T, HV, K]", describe(a.g));
  const int64_t HV = a.g->shape[2], K = a.g->shape[3];
  const cula_recurrence_options& o = a.opt;
  if (o.has_lower_bound && !(std::isfinite(o.lower_bound) && o.lower_bound < 0))
    c.fail("lower_bound", "a finite negative number", std::to_string(o.lower_bound));
  if (o.safe_gate && !(o.has_lower_bound && o.lower_bound >= -5.0))
    c.fail("lower_bound", "a value in [-5, 0) with safe_gate=True",
           o.has_lower_bound ? std::to_string(o.lower_bound) : std::string("None"));
  c.backend(o.backend);
  if (!a.A_log && !o.has_lower_bound) c.fail("A_log", "a tensor [HV] when lower_bound is None", "None");
  if (a.A_log) {
    c.float_tensor(a.A_log, "A_log");
    c.shape(a.A_log, "A_log", {HV}, "[HV]");
  }
  if (a.dt_bias) c.per_channel_dt_bias(a.dt_bias, HV, K);
  c.present(a.g_out, "g_out", "an output tensor shaped like g");
  c.basic(a.g_out, "g_out");
  c.on_device(a.g_out, "g_out");
  bool same_shape = a.g_out->ndim == 4;
  for (int i = 0; same_shape && i < 4; ++i) same_shape = a.g_out->shape[i] == a.g->shape[i];
  if (!same_shape) c.fail("g_out", "the shape of g " + shape_string(*a.g), "shape " + shape_string(*a.g_out));
  if (a.g_out->dtype != CULA_FLOAT32 && a.g_out->dtype != CULA_BFLOAT16)
    c.fail("g_out", "a float32 or bfloat16 tensor", describe(a.g_out));
  c.contiguous_output(a.g_out, "g_out");
  return {HV, K};
}

CpCorrectShape validate_cp_correct(const cula_cp_correct_args& a) {
  Checker c{"cp_correct"};
  c.device_of = "ow";
  if (a.struct_size < sizeof(cula_cp_correct_args))
    c.fail("args.struct_size", ">= " + std::to_string(sizeof(cula_cp_correct_args)), std::to_string(a.struct_size));
  c.backend(a.opt.backend);
  c.present(a.ow, "ow", "the extended pass's float32 output [L, HV, V + K]");
  c.basic(a.ow, "ow");
  c.device_type = a.ow->device_type;
  c.device_id = a.ow->device_id;
  if (a.ow->ndim != 3 || a.ow->dtype != CULA_FLOAT32) c.fail("ow", "a 3-D float32 tensor [L, HV, V + K]", describe(a.ow));
  c.present(a.state, "state", "the incoming state [HV, V, K] in float32");
  c.float_tensor(a.state, "state");
  if (a.state->ndim != 3 || a.state->dtype != CULA_FLOAT32 || !is_contiguous(*a.state))
    c.fail("state", "a contiguous float32 tensor [HV, V, K]", describe(a.state));
  const int64_t L = a.ow->shape[0], HV = a.ow->shape[1], V = a.state->shape[1], K = a.state->shape[2];
  if (a.state->shape[0] != HV || V + K != a.ow->shape[2])
    c.fail("state", "shape [HV, V, K] with HV = " + std::to_string(HV) + " and V + K = " + std::to_string(a.ow->shape[2]) +
                        " (the columns of ow)",
           "shape " + shape_string(*a.state));
  if (L > 0 && a.ow->strides[2] != 1) c.fail("ow", "a unit last stride", strides_string(*a.ow));
  c.present(a.o, "o", "the corrected output [L, HV, V]");
  c.float_tensor(a.o, "o");
  c.shape(a.o, "o", {L, HV, V}, "[L, HV, V]");
  if (a.o->dtype == CULA_FLOAT64) c.fail("o", "a bfloat16, float16 or float32 tensor", describe(a.o));
  if (L > 0 && a.o->strides[2] != 1) c.fail("o", "a unit last stride", strides_string(*a.o));
  return {L, HV, V, K};
}

}  // namespace cula
