// Random calls through the C ABI on the host backends (SPEC §4):
//  - a strided view (permuted, padded or reversed dimensions) of the same values gives the bits
//    the contiguous call gives, for every input of every entry;
//  - a valid call broken in one random place (a tensor dropped, added, reshaped, retyped, moved,
//    made strided or given no data; an option out of range; a bad offset or slot index) either
//    runs or is refused with a message naming the argument, and a refused call leaves every
//    output and the state pool as they were.
// CULA_TEST_RANDOM_CALLS sets the number of broken calls per entry (default 400), so a sanitizer
// build can run many more.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <functional>
#include <initializer_list>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "helpers.h"

using namespace cula_test;

namespace {

// A tensor with storage of its own and any strides (negative ones included): `data` points into
// `bytes` where element [0, .., 0] lives. The padding between elements holds NaN bits.
struct StridedTensor {
  std::vector<unsigned char> bytes;
  cula_tensor t{};
};

// The values of `src` (contiguous) in a random layout: dimensions in a random order, each padded
// by 0-2 elements and reversed with probability 1/4.
StridedTensor strided_copy(const cula_tensor& src, std::mt19937_64& rng) {
  StridedTensor s;
  s.t = src;
  const int nd = src.ndim;
  const size_t es = dtype_bytes(src.dtype);
  std::vector<int> order(nd);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  int64_t extent = 1, base = 0;
  for (int d : order) {  // innermost first
    const int64_t pad = static_cast<int64_t>(rng() % 3);
    const bool reversed = rng() % 4 == 0;
    s.t.strides[d] = reversed ? -extent : extent;
    if (reversed) base += (src.shape[d] - 1) * extent;
    extent *= src.shape[d] + pad;
  }
  s.bytes.assign(static_cast<size_t>(std::max<int64_t>(extent, 1)) * es, 0xff);  // NaN in every float type
  s.t.data = s.bytes.data() + base * es;
  int64_t n = 1;
  for (int d = 0; d < nd; ++d) n *= src.shape[d];
  std::vector<int64_t> idx(nd, 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = 0, src_off = 0;
    for (int d = 0; d < nd; ++d) {
      off += idx[d] * s.t.strides[d];
      src_off += idx[d] * src.strides[d];
    }
    std::memcpy(static_cast<unsigned char*>(s.t.data) + off * static_cast<int64_t>(es),
                static_cast<const unsigned char*>(src.data) + src_off * static_cast<int64_t>(es), es);
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < src.shape[d]) break;
      idx[d] = 0;
    }
  }
  return s;
}

bool same_bits(const HostTensor& a, const HostTensor& b) { return a.bytes == b.bytes; }

int random_calls() {
  const char* e = std::getenv("CULA_TEST_RANDOM_CALLS");
  return e ? std::max(1, std::atoi(e)) : 400;
}

// One entry's call over tensor slots that a test can replace, drop or add.
struct Slot {
  const char* name;
  const cula_tensor** field;  // the argument struct's member
  bool integer = false;       // offsets or slot indices
};

// The slots of the inputs that the forward, decode and backward argument structs share, followed
// by `more` (each entry's own members).
template <typename Args>
std::vector<Slot> input_slots(Args& a, std::initializer_list<Slot> more) {
  std::vector<Slot> slots = {{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, {"g", &a.g}, {"beta", &a.beta}, {"A_log", &a.A_log}};
  slots.insert(slots.end(), more);
  return slots;
}
// An output member as a slot (the structs' outputs are not const).
inline const cula_tensor** out_field(cula_tensor** f) { return const_cast<const cula_tensor**>(f); }

// A random valid problem of small size for any family, on a host backend.
Problem random_problem(std::mt19937_64& rng, bool for_backward = false) {
  Problem p;
  p.family = static_cast<int32_t>(rng() % (for_backward ? 4 : 5));
  const bool delta = p.family == CULA_KDA || p.family == CULA_GDN;
  p.H = 1 + static_cast<int64_t>(rng() % 2);
  p.HV = p.H * (1 + static_cast<int64_t>(rng() % 2));
  p.K = 2 + static_cast<int64_t>(rng() % 7);
  p.V = 1 + static_cast<int64_t>(rng() % 6);
  p.chunk = 4 << (rng() % 3);
  if (rng() % 3 == 0) {
    p.seqlens.clear();
    const int n = 1 + static_cast<int>(rng() % 3);
    for (int i = 0; i < n; ++i) p.seqlens.push_back(static_cast<int64_t>(rng() % 13));
    p.cu_int64 = rng() % 2;
  } else {
    p.B = 1 + static_cast<int64_t>(rng() % 2);
    p.T = static_cast<int64_t>(rng() % 19);
  }
  const int32_t dtypes[] = {CULA_FLOAT32, CULA_BFLOAT16, CULA_FLOAT64};
  p.dtype = dtypes[rng() % 3];
  p.l2norm = rng() % 2;
  p.gate_in_kernel = delta && rng() % 2;
  p.has_lb = p.gate_in_kernel && rng() % 2;
  p.safe_gate = p.has_lb && rng() % 2;
  p.lb = p.has_lb ? -1.0 - static_cast<double>(rng() % 4) : -5.0;
  p.beta_sigmoid = delta && rng() % 2;
  p.neg_eig = p.beta_sigmoid && rng() % 2;
  p.use_A_log = !p.has_lb || rng() % 2;
  p.dt_bias_2d = rng() % 2;
  p.initial_state = rng() % 2;
  p.final_state = !for_backward && rng() % 2;
  p.state_dtype = rng() % 3 == 0 ? CULA_BFLOAT16 : CULA_FLOAT32;
  p.layout = static_cast<int32_t>(rng() % 2);
  p.intermediate = !for_backward && rng() % 3 == 0;
  p.make(rng());
  return p;
}

int32_t random_host_backend(std::mt19937_64& rng, const Problem& p) {
  // The CPU backend takes no float64 inputs; AUTO sends those to the reference.
  const int32_t b[] = {CULA_BACKEND_AUTO, CULA_BACKEND_CPU, CULA_BACKEND_ORACLE};
  const int32_t pick = b[rng() % 3];
  return pick == CULA_BACKEND_CPU && p.dtype == CULA_FLOAT64 ? CULA_BACKEND_AUTO : pick;
}

// Replaces every input in `slots` with a strided copy of its values (outputs must stay contiguous).
void stride_inputs(std::vector<Slot>& slots, std::deque<StridedTensor>& keep, std::mt19937_64& rng) {
  for (auto& s : slots) {
    if (!*s.field) continue;
    keep.push_back(strided_copy(**s.field, rng));
    *s.field = &keep.back().t;
  }
}

}  // namespace

TEST(RandomCalls, StridedInputsGiveTheContiguousResult) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 60; ++trial) {
    Problem p = random_problem(rng);
    SCOPED_TRACE("seed " + std::to_string(seed) + ", trial " + std::to_string(trial) + ", family " +
                 std::to_string(p.family));
    const int32_t backend = random_host_backend(rng, p);
    auto a = p.fwd_args(backend);
    ASSERT_EQ(cula_chunk_fwd(&a), CULA_OK) << cula_last_error();
    const HostTensor out = p.out, ht = p.ht, inter = p.inter;
    p.out.poison();
    if (p.final_state) p.ht.poison();
    if (p.intermediate) p.inter.poison();

    std::deque<StridedTensor> keep;
    std::vector<Slot> inputs =
        input_slots(a, {{"decay", &a.decay}, {"cu_seqlens", &a.cu_seqlens}, {"initial_state", &a.initial_state}});
    if (p.family == CULA_GDN) inputs.push_back({"dt_bias", &a.dt_bias});  // KDA's must be contiguous
    stride_inputs(inputs, keep, rng);
    ASSERT_EQ(cula_chunk_fwd(&a), CULA_OK) << cula_last_error();
    EXPECT_TRUE(same_bits(p.out, out)) << "out differs with strided inputs";
    if (p.final_state) EXPECT_TRUE(same_bits(p.ht, ht)) << "final_state differs with strided inputs";
    if (p.intermediate) EXPECT_TRUE(same_bits(p.inter, inter)) << "intermediate_states differ with strided inputs";
  }
}

TEST(RandomCalls, StridedDecodeInputsGiveTheContiguousResult) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 60; ++trial) {
    Problem p = random_problem(rng);
    p.seqlens.clear();
    p.B = 1 + static_cast<int64_t>(rng() % 3);
    p.T = 1 + static_cast<int64_t>(rng() % 3);
    p.make(rng());
    SCOPED_TRACE("seed " + std::to_string(seed) + ", trial " + std::to_string(trial));
    const int64_t P = p.B * p.T + 2;  // one slot per (sequence, token): no two sequences share one
    HostTensor pool(p.state_shape(P), p.state_dtype == CULA_BFLOAT16 ? CULA_BFLOAT16 : CULA_FLOAT32);
    pool.fill_normal(rng, 0.0, 0.5);
    const bool spec = p.T > 1 && rng() % 2;
    HostTensor idx = spec ? HostTensor({p.B, p.T}, CULA_INT32) : HostTensor({p.B}, CULA_INT32);
    for (int64_t i = 0; i < idx.numel(); ++i) idx.set(i, static_cast<double>(i + 1));
    HostTensor acc({p.B}, CULA_INT32);
    for (int64_t n = 0; n < p.B; ++n) acc.set(n, static_cast<double>(rng() % (p.T + 1)));
    HostTensor pool0 = pool, out({p.B, p.T, p.HV, p.V}, CULA_FLOAT32);
    out.poison();
    cula_decode_args a = p.decode_args(random_host_backend(rng, p), pool, &idx, spec ? &acc : nullptr, out);
    ASSERT_EQ(cula_decode(&a), CULA_OK) << cula_last_error();
    const HostTensor out_ref = out, pool_ref = pool;
    pool = pool0;
    a.state_pool = pool.ptr();
    out.poison();

    std::deque<StridedTensor> keep;
    std::vector<Slot> inputs = input_slots(
        a, {{"decay", &a.decay}, {"state_indices", &a.state_indices}, {"num_accepted_tokens", &a.num_accepted_tokens}});
    if (p.family == CULA_GDN) inputs.push_back({"dt_bias", &a.dt_bias});  // KDA's must be contiguous
    stride_inputs(inputs, keep, rng);
    ASSERT_EQ(cula_decode(&a), CULA_OK) << cula_last_error();
    EXPECT_TRUE(same_bits(out, out_ref)) << "out differs with strided inputs";
    EXPECT_TRUE(same_bits(pool, pool_ref)) << "state_pool differs with strided inputs";
  }
}

TEST(RandomCalls, StridedBackwardAndGateInputsGiveTheContiguousResult) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 30; ++trial) {
    Problem p = random_problem(rng, /*for_backward=*/true);
    SCOPED_TRACE("seed " + std::to_string(seed) + ", trial " + std::to_string(trial));
    HostTensor d_out({p.B, p.T, p.HV, p.V}, CULA_FLOAT32);
    d_out.fill_normal(rng);
    HostTensor dq = p.q, dk = p.k, dv = p.v, dg = p.g;
    for (HostTensor* t : {&dq, &dk, &dv, &dg}) t->poison();
    cula_chunk_bwd_args a = p.bwd_args(CULA_BACKEND_AUTO, d_out, &dq, &dk, &dv, &dg);
    ASSERT_EQ(cula_chunk_bwd(&a), CULA_OK) << cula_last_error();
    const HostTensor dq0 = dq, dk0 = dk, dv0 = dv, dg0 = dg;
    for (HostTensor* t : {&dq, &dk, &dv, &dg}) t->poison();
    std::deque<StridedTensor> keep;
    std::vector<Slot> inputs =
        input_slots(a, {{"cu_seqlens", &a.cu_seqlens}, {"initial_state", &a.initial_state}, {"d_out", &a.d_out}});
    if (p.family == CULA_GDN) inputs.push_back({"dt_bias", &a.dt_bias});  // KDA's must be contiguous
    stride_inputs(inputs, keep, rng);
    ASSERT_EQ(cula_chunk_bwd(&a), CULA_OK) << cula_last_error();
    EXPECT_TRUE(same_bits(dq, dq0) && same_bits(dk, dk0) && same_bits(dv, dv0) && same_bits(dg, dg0))
        << "gradients differ with strided inputs";

    // The KDA gate on a strided g.
    HostTensor g({p.B, p.T, p.HV, p.K}, p.dtype == CULA_FLOAT64 ? CULA_FLOAT64 : CULA_FLOAT32);
    g.fill_normal(rng);
    HostTensor A_log({p.HV}, CULA_FLOAT32), g_out({p.B, p.T, p.HV, p.K}, CULA_FLOAT32);
    A_log.fill_uniform(rng, -1.0, 0.5);
    g_out.poison();
    cula_kda_gate_args ga = kda_gate_args(g, &A_log, g_out, CULA_BACKEND_AUTO);
    ASSERT_EQ(cula_kda_gate(&ga), CULA_OK) << cula_last_error();
    const HostTensor g_out0 = g_out;
    g_out.poison();
    keep.push_back(strided_copy(g.t, rng));
    ga.g = &keep.back().t;
    ASSERT_EQ(cula_kda_gate(&ga), CULA_OK) << cula_last_error();
    EXPECT_TRUE(same_bits(g_out, g_out0)) << "kda_gate differs with a strided g";
  }
}

// The per-channel dt_bias as [HV*K] or as [HV, K], and a zero dt_bias or none, are the same
// function: forward (every host backend) and backward give the same bits.
TEST(RandomCalls, EquivalentDtBiasFormsGiveTheSameResult) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 40; ++trial) {
    Problem p = random_problem(rng, /*for_backward=*/true);
    p.family = rng() % 2 ? CULA_KDA : CULA_GDN;
    p.gate_in_kernel = true;
    p.use_dt_bias = true;
    p.safe_gate = false;
    p.make(rng());
    SCOPED_TRACE("seed " + std::to_string(seed) + ", trial " + std::to_string(trial));
    const int32_t backend = random_host_backend(rng, p);
    auto forward = [&](const cula_tensor* dt_bias) {
      auto a = p.fwd_args(backend);
      a.dt_bias = dt_bias;
      p.out.poison();
      EXPECT_EQ(cula_chunk_fwd(&a), CULA_OK) << cula_last_error();
      return p.out;
    };
    auto backward = [&](const cula_tensor* dt_bias) {
      HostTensor d_out({p.B, p.T, p.HV, p.V}, CULA_FLOAT32);
      d_out.fill(0.25);
      HostTensor dq = p.q, dk = p.k, dg = p.g, dA({p.HV}, CULA_FLOAT64);
      for (HostTensor* t : {&dq, &dk, &dg, &dA}) t->poison();
      cula_chunk_bwd_args a = p.bwd_args(CULA_BACKEND_AUTO, d_out, &dq, &dk, nullptr, &dg);
      a.dt_bias = dt_bias;
      if (p.use_A_log) a.dA_log = dA.ptr();
      EXPECT_EQ(cula_chunk_bwd(&a), CULA_OK) << cula_last_error();
      std::vector<unsigned char> all = dq.bytes;
      for (const HostTensor* t : {&dk, &dg, &dA}) all.insert(all.end(), t->bytes.begin(), t->bytes.end());
      return all;
    };
    if (p.family == CULA_KDA) {
      HostTensor other = p.dt_bias_2d ? HostTensor({p.HV * p.K}, p.dt_bias.t.dtype) : HostTensor({p.HV, p.K}, p.dt_bias.t.dtype);
      std::memcpy(other.bytes.data(), p.dt_bias.bytes.data(), p.dt_bias.bytes.size());
      EXPECT_TRUE(same_bits(forward(p.dt_bias.cptr()), forward(other.cptr()))) << "forward: dt_bias [HV*K] vs [HV, K]";
      EXPECT_TRUE(backward(p.dt_bias.cptr()) == backward(other.cptr())) << "backward: dt_bias [HV*K] vs [HV, K]";
    }
    p.dt_bias.fill(0.0);
    EXPECT_TRUE(same_bits(forward(p.dt_bias.cptr()), forward(nullptr))) << "forward: zero dt_bias vs none";
    EXPECT_TRUE(backward(p.dt_bias.cptr()) == backward(nullptr)) << "backward: zero dt_bias vs none";
  }
}

namespace {

// Breaks one random place of a valid call. Returns a description of what it did.
struct Breaker {
  std::mt19937_64& rng;
  std::deque<HostTensor>& keep;
  std::deque<StridedTensor>& keep_strided;
  int64_t T;

  int64_t pick(int64_t n) { return static_cast<int64_t>(rng() % static_cast<uint64_t>(n)); }

  const cula_tensor* fresh(std::vector<int64_t> shape, int32_t dtype) {
    for (auto& d : shape) d = std::max<int64_t>(d, 0);
    keep.emplace_back(shape, dtype);
    HostTensor& t = keep.back();
    if (dtype == CULA_INT32 || dtype == CULA_INT64) {
      for (int64_t i = 0; i < t.numel(); ++i) t.set(i, static_cast<double>(pick(T + 3)));
    } else if (dtype_bytes(dtype) > 0) {
      t.fill_normal(rng, 0.0, 0.5);
    }
    return t.cptr();
  }

  std::vector<int64_t> shape_of(const cula_tensor* t) {
    return std::vector<int64_t>(t->shape, t->shape + t->ndim);
  }

  std::string tensor(Slot& s) {
    const cula_tensor* t = *s.field;
    const std::string name = s.name;
    if (!t) {  // add a tensor that was not given
      *s.field = fresh({1 + pick(3)}, s.integer ? CULA_INT32 : CULA_FLOAT32);
      return "added " + name;
    }
    switch (pick(10)) {
      case 0: *s.field = nullptr; return "dropped " + name;
      case 1: {
        auto sh = shape_of(t);
        if (sh.empty()) sh.push_back(1);
        sh[pick(static_cast<int64_t>(sh.size()))] += pick(2) ? 1 : -1;
        *s.field = fresh(sh, t->dtype);
        return "resized " + name;
      }
      case 2: {
        auto sh = shape_of(t);
        if (!sh.empty() && (pick(2) || sh.size() == CULA_MAX_DIMS))
          sh.pop_back();
        else
          sh.push_back(1);
        *s.field = fresh(sh, t->dtype);
        return "changed the rank of " + name;
      }
      case 3: {
        const int32_t types[] = {CULA_INT32, CULA_INT64, CULA_FLOAT16, CULA_FLOAT32, CULA_FLOAT64, CULA_BFLOAT16};
        *s.field = fresh(shape_of(t), types[pick(6)]);
        return "retyped " + name;
      }
      case 4: {
        keep.emplace_back();
        keep.back().t = *t;
        // A CUDA tensor only where no GPU could run it: host pointers must never reach a kernel.
        keep.back().t.device_type = cula_cuda_device_count() == 0 && pick(2) ? CULA_CUDA : 7;
        keep.back().t.device_id = static_cast<int32_t>(pick(2));
        *s.field = &keep.back().t;
        return "moved " + name;
      }
      case 5:
        keep_strided.push_back(strided_copy(*t, rng));
        *s.field = &keep_strided.back().t;
        return "strided " + name;
      case 6: {
        keep.emplace_back();
        keep.back().t = *t;
        keep.back().t.data = nullptr;
        *s.field = &keep.back().t;
        return "took the data of " + name;
      }
      case 7: {
        keep.emplace_back();
        keep.back().t = *t;
        keep.back().t.ndim = pick(2) ? -1 : CULA_MAX_DIMS + 1;
        *s.field = &keep.back().t;
        return "gave " + name + " an impossible rank";
      }
      case 8: {
        if (t->ndim == 0) return "left " + name;
        keep.emplace_back();
        keep.back().t = *t;
        *s.field = &keep.back().t;
        if (pick(2)) {
          keep.back().t.shape[pick(t->ndim)] = -1 - pick(3);
          return "gave " + name + " a negative size";
        }
        // Sizes whose product wraps to 0 in 64 bits, with no data behind them.
        keep.back().t.shape[0] = int64_t(1) << 32;
        keep.back().t.shape[t->ndim - 1] = t->ndim > 1 ? int64_t(1) << 32 : int64_t(1) << 62;
        keep.back().t.data = nullptr;
        return "gave " + name + " sizes that overflow";
      }
      default: {  // a value out of range in an integer tensor; any value in a float one
        keep.emplace_back();
        HostTensor& c = keep.back();
        c = HostTensor(shape_of(t), t->dtype);
        if (dtype_bytes(t->dtype) == 0 || c.numel() == 0) return "left " + name;
        std::memcpy(c.bytes.data(), t->data, static_cast<size_t>(c.numel()) * dtype_bytes(t->dtype));
        const int64_t vals[] = {-5, -1, T, T + 1, int64_t(1) << 40};
        c.set(pick(c.numel()), s.integer ? static_cast<double>(vals[pick(5)]) : NAN);
        *s.field = c.cptr();
        return "changed a value of " + name;
      }
    }
  }

  std::string option(cula_recurrence_options& o, size_t* struct_size, int32_t* chunk_size) {
    switch (pick(12)) {
      case 0: o.family = static_cast<int32_t>(pick(2) ? -1 : 5 + pick(3)); return "family";
      case 1: o.state_layout = 2; return "state_layout";
      case 2: o.backend = static_cast<int32_t>(pick(2) ? -1 : 4); return "backend";
      case 3: o.scale = pick(2) ? INFINITY : -INFINITY; return "scale";
      case 4: o.has_lower_bound = 1; o.lower_bound = pick(2) ? 0.5 : NAN; return "lower_bound";
      case 5: o.safe_gate = 1; o.has_lower_bound = 1; o.lower_bound = -7.0; return "safe_gate";
      case 6: o.use_gate_in_kernel = !o.use_gate_in_kernel; return "use_gate_in_kernel";
      case 7: o.use_beta_sigmoid = !o.use_beta_sigmoid; return "use_beta_sigmoid";
      case 8: o.allow_neg_eigval = 1; return "allow_neg_eigval";
      case 9: o.family = static_cast<int32_t>(pick(5)); return "another family";
      case 10:
        if (struct_size) *struct_size -= 8 * (1 + pick(2));
        return "struct_size";
      default:
        if (chunk_size) *chunk_size = static_cast<int32_t>(pick(2) ? -pick(3) - 1 : 1 + pick(100));
        return "chunk_size";
    }
  }

  // One random break of a call: an option (one time in four) or one of its tensors.
  std::string any(std::vector<Slot>& slots, cula_recurrence_options& o, size_t* struct_size, int32_t* chunk_size) {
    return pick(4) == 0 ? "option " + option(o, struct_size, chunk_size)
                        : tensor(slots[pick(static_cast<int64_t>(slots.size()))]);
  }
};

// Runs one broken call and checks the refusal rules; `outputs` are poisoned (NaN) before it.
void expect_clean(cula_status st, const std::string& what, const std::vector<const HostTensor*>& outputs,
                  const HostTensor* pool, const HostTensor* pool_before) {
  EXPECT_TRUE(st == CULA_OK || st == CULA_ERROR_INVALID_ARGUMENT || st == CULA_ERROR_UNSUPPORTED ||
              (st == CULA_ERROR_CUDA && cula_cuda_device_count() == 0))
      << what << ": status " << st << ": " << cula_last_error();
  if (st == CULA_OK) {
    EXPECT_STREQ(cula_last_error(), "") << what;
    return;
  }
  const std::string msg = cula_last_error();
  EXPECT_FALSE(msg.empty()) << what;
  if (st == CULA_ERROR_INVALID_ARGUMENT) EXPECT_NE(msg.find("argument '"), std::string::npos) << what << ": " << msg;
  for (const HostTensor* o : outputs) EXPECT_TRUE(all_nan(*o)) << what << ": an output was written by a refused call (" << msg << ")";
  if (pool) EXPECT_TRUE(same_bits(*pool, *pool_before)) << what << ": the state pool changed in a refused call (" << msg << ")";
}

}  // namespace

TEST(RandomCalls, BrokenForwardCallsAreRefusedCleanly) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const int n = random_calls();
  for (int trial = 0; trial < n; ++trial) {
    Problem p = random_problem(rng);
    std::deque<HostTensor> keep;
    std::deque<StridedTensor> keep_strided;
    Breaker br{rng, keep, keep_strided, p.T};
    auto a = p.fwd_args(random_host_backend(rng, p));
    // Half of the calls write their final states to a pool instead.
    HostTensor pool, pool_before, idx;
    if (rng() % 2 && !p.initial_state && !p.final_state) {
      const int64_t P = p.N + 1;
      pool = HostTensor(p.state_shape(P), CULA_FLOAT32);
      pool.fill_normal(rng, 0.0, 0.5);
      pool_before = pool;
      idx = HostTensor({p.N}, CULA_INT32);
      for (int64_t i = 0; i < p.N; ++i) idx.set(i, static_cast<double>(P - 1 - i));
      a.state_pool = pool.ptr();
      a.state_indices = idx.cptr();
    }
    std::vector<Slot> slots = input_slots(a, {{"decay", &a.decay},
                                              {"dt_bias", &a.dt_bias},
                                              {"cu_seqlens", &a.cu_seqlens, true},
                                              {"initial_state", &a.initial_state},
                                              {"state_pool", out_field(&a.state_pool)},
                                              {"state_indices", &a.state_indices, true},
                                              {"out", out_field(&a.out)},
                                              {"final_state", out_field(&a.final_state)},
                                              {"intermediate_states", out_field(&a.intermediate_states)}});
    std::string what = br.any(slots, a.opt, &a.struct_size, &a.chunk_size);
    SCOPED_TRACE("seed " + std::to_string(seed) + ", trial " + std::to_string(trial) + ": " + what);
    // Outputs that a broken call may have swapped for another tensor are not the ones checked.
    std::vector<const HostTensor*> outputs = {&p.out};
    if (p.final_state) outputs.push_back(&p.ht);
    if (p.intermediate) outputs.push_back(&p.inter);
    const cula_status st = cula_chunk_fwd(&a);
    expect_clean(st, what, outputs, a.state_pool == pool.ptr() && pool.t.ndim ? &pool : nullptr, &pool_before);
  }
}

TEST(RandomCalls, BrokenDecodeCallsAreRefusedCleanly) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const int n = random_calls();
  for (int trial = 0; trial < n; ++trial) {
    Problem p = random_problem(rng);
    p.seqlens.clear();
    p.B = 1 + static_cast<int64_t>(rng() % 3);
    p.T = 1 + static_cast<int64_t>(rng() % 3);
    p.make(rng());
    std::deque<HostTensor> keep;
    std::deque<StridedTensor> keep_strided;
    const int64_t P = p.B * p.T + 2;
    Breaker br{rng, keep, keep_strided, P};
    HostTensor pool(p.state_shape(P), CULA_FLOAT32);
    pool.fill_normal(rng, 0.0, 0.5);
    const HostTensor pool_before = pool;
    const bool spec = p.T > 1 && rng() % 2;
    HostTensor idx = spec ? HostTensor({p.B, p.T}, CULA_INT32) : HostTensor({p.B}, CULA_INT32);
    for (int64_t i = 0; i < idx.numel(); ++i) idx.set(i, static_cast<double>(i + 1));
    HostTensor acc({p.B}, CULA_INT32);
    acc.fill(1);
    HostTensor out({p.B, p.T, p.HV, p.V}, CULA_FLOAT32);
    out.poison();
    cula_decode_args a = p.decode_args(random_host_backend(rng, p), pool, &idx, spec ? &acc : nullptr, out);
    std::vector<Slot> slots = input_slots(a, {{"decay", &a.decay},
                                              {"dt_bias", &a.dt_bias},
                                              {"state_pool", out_field(&a.state_pool)},
                                              {"state_indices", &a.state_indices, true},
                                              {"num_accepted_tokens", &a.num_accepted_tokens, true},
                                              {"out", out_field(&a.out)}});
    std::string what = br.any(slots, a.opt, &a.struct_size, nullptr);
    SCOPED_TRACE("seed " + std::to_string(seed) + ", trial " + std::to_string(trial) + ": " + what);
    const cula_status st = cula_decode(&a);
    expect_clean(st, what, {&out}, a.state_pool == pool.ptr() ? &pool : nullptr, &pool_before);
  }
}

TEST(RandomCalls, BrokenBackwardAndGateCallsAreRefusedCleanly) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const int n = random_calls();
  for (int trial = 0; trial < n; ++trial) {
    Problem p = random_problem(rng, /*for_backward=*/true);
    std::deque<HostTensor> keep;
    std::deque<StridedTensor> keep_strided;
    Breaker br{rng, keep, keep_strided, p.T};
    HostTensor d_out({p.B, p.T, p.HV, p.V}, CULA_FLOAT32);
    d_out.fill_normal(rng);
    HostTensor dq = p.q, dk = p.k, dv = p.v, dg = p.g;
    for (HostTensor* t : {&dq, &dk, &dv, &dg}) t->poison();
    cula_chunk_bwd_args a = p.bwd_args(CULA_BACKEND_AUTO, d_out, &dq, &dk, &dv, &dg);
    std::vector<Slot> slots = input_slots(a, {{"dt_bias", &a.dt_bias},
                                              {"cu_seqlens", &a.cu_seqlens, true},
                                              {"initial_state", &a.initial_state},
                                              {"d_out", &a.d_out},
                                              {"d_final_state", &a.d_final_state},
                                              {"dq", out_field(&a.dq)},
                                              {"dk", out_field(&a.dk)},
                                              {"dv", out_field(&a.dv)},
                                              {"dg", out_field(&a.dg)}});
    std::string what = br.any(slots, a.opt, &a.struct_size, nullptr);
    {
      SCOPED_TRACE("seed " + std::to_string(seed) + ", trial " + std::to_string(trial) + ": chunk_bwd " + what);
      expect_clean(cula_chunk_bwd(&a), what, {&dq, &dk, &dv, &dg}, nullptr, nullptr);
    }

    // The KDA gate.
    HostTensor g({p.B, p.T, p.HV, p.K}, CULA_FLOAT32), A_log({p.HV}, CULA_FLOAT32), dt_bias({p.HV * p.K}, CULA_FLOAT32);
    g.fill_normal(rng);
    A_log.fill_uniform(rng, -1.0, 0.5);
    dt_bias.fill_normal(rng, 0.0, 0.5);
    HostTensor g_out({p.B, p.T, p.HV, p.K}, rng() % 2 ? CULA_FLOAT32 : CULA_BFLOAT16);
    g_out.poison();
    cula_kda_gate_args ga = kda_gate_args(g, nullptr, g_out, random_host_backend(rng, p));
    ga.opt.has_lower_bound = rng() % 2;
    ga.opt.lower_bound = -3.0;
    if (!ga.opt.has_lower_bound || rng() % 2) ga.A_log = A_log.cptr();
    if (rng() % 2) ga.dt_bias = dt_bias.cptr();
    std::vector<Slot> gate_slots = {{"g", &ga.g},
                                    {"A_log", &ga.A_log},
                                    {"dt_bias", &ga.dt_bias},
                                    {"g_out", out_field(&ga.g_out)}};
    what = br.any(gate_slots, ga.opt, &ga.struct_size, nullptr);
    SCOPED_TRACE("seed " + std::to_string(seed) + ", trial " + std::to_string(trial) + ": kda_gate " + what);
    expect_clean(cula_kda_gate(&ga), what, {&g_out}, nullptr, nullptr);
  }
}

// Calls from several host threads at once (each with its own arrays) give the bits of the same
// calls made one after another: no state is shared between calls but the last error and kernel
// name, which are per thread.
TEST(RandomCalls, ConcurrentCallsGiveTheSequentialResult) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  constexpr int kThreads = 4;
  std::vector<Problem> problems;
  std::vector<int32_t> backends;
  for (int i = 0; i < kThreads; ++i) {
    problems.push_back(random_problem(rng));
    backends.push_back(random_host_backend(rng, problems.back()));
  }
  std::vector<HostTensor> expected;
  for (int i = 0; i < kThreads; ++i) {
    auto a = problems[i].fwd_args(backends[i]);
    ASSERT_EQ(cula_chunk_fwd(&a), CULA_OK) << cula_last_error();
    expected.push_back(problems[i].out);
    problems[i].out.poison();
  }
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back([&, i] {
      for (int rep = 0; rep < 3; ++rep) {
        auto a = problems[i].fwd_args(backends[i]);
        // A refused call on the same thread in between: its error must not leak into the next call.
        auto bad = a;
        bad.chunk_size = -1;
        if (cula_chunk_fwd(&bad) != CULA_ERROR_INVALID_ARGUMENT) errors[i] = "a bad chunk_size was not refused";
        if (cula_chunk_fwd(&a) != CULA_OK) errors[i] = cula_last_error();
        else if (std::string(cula_last_error()) != "") errors[i] = "last error not cleared by a success";
        if (!same_bits(problems[i].out, expected[i])) errors[i] = "out differs from the sequential call";
      }
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(errors[i], "") << "seed " << seed << ", thread " << i;
}
