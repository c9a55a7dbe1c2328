// The reference backward against central finite differences of the reference forward.
#include <gtest/gtest.h>

#include <cstddef>
#include <functional>

#include "cuda/backward/lean_plan.h"
#include "cuda/backward/scan_width.h"
#include "helpers.h"

using namespace cula_test;

namespace {

struct GradCase {
  const char* name;
  int32_t family;
  bool l2norm, gate_in_kernel, has_lb, use_A_log, beta_sigmoid, neg_eig, varlen;
};

void check_case(const GradCase& c, uint64_t seed) {
  Problem p;
  p.family = c.family;
  p.dtype = CULA_FLOAT64;
  p.state_dtype = CULA_FLOAT64;
  p.B = c.varlen ? 1 : 2;
  p.T = 5;
  if (c.varlen) p.seqlens = {3, 0, 4};
  p.H = 1;
  p.HV = 2;
  p.K = 3;
  p.V = 2;
  p.l2norm = c.l2norm;
  p.gate_in_kernel = c.gate_in_kernel;
  p.has_lb = c.has_lb;
  p.lb = -3.0;
  p.use_A_log = c.use_A_log;
  p.beta_sigmoid = c.beta_sigmoid;
  p.neg_eig = c.neg_eig;
  p.gate_scale = 0.5;
  p.make(seed);
  p.out = HostTensor({p.B, p.T, p.HV, p.V}, CULA_FLOAT64);
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  HostTensor d_out = p.out, d_ht(p.state_shape(p.N), CULA_FLOAT64);
  d_out.fill_normal(rng);
  d_ht.fill_normal(rng);

  auto loss = [&]() {
    p.out.poison();
    p.ht.poison();
    auto a = p.fwd_args(CULA_BACKEND_ORACLE);
    EXPECT_EQ(cula_chunk_fwd(&a), CULA_OK) << cula_last_error();
    double l = 0;
    for (int64_t i = 0; i < p.out.numel(); ++i) l += p.out.get(i) * d_out.get(i);
    for (int64_t i = 0; i < p.ht.numel(); ++i) l += p.ht.get(i) * d_ht.get(i);
    return l;
  };

  // Analytic gradients.
  auto make_like = [](const HostTensor& x) { return HostTensor(std::vector<int64_t>(x.t.shape, x.t.shape + x.t.ndim), CULA_FLOAT64); };
  HostTensor dq = make_like(p.q), dk = make_like(p.k), dv = make_like(p.v), dh0 = make_like(p.h0);
  HostTensor dg = p.g.t.ndim ? make_like(p.g) : HostTensor();
  HostTensor dbeta = p.beta.t.ndim ? make_like(p.beta) : HostTensor();
  HostTensor dA = c.gate_in_kernel && c.use_A_log ? make_like(p.A_log) : HostTensor();
  HostTensor ddt = c.gate_in_kernel ? make_like(p.dt_bias) : HostTensor();
  cula_chunk_bwd_args b{};
  b.struct_size = sizeof(b);
  b.opt = p.options(CULA_BACKEND_ORACLE);
  b.q = p.q.cptr();
  b.k = p.k.cptr();
  b.v = p.v.cptr();
  if (p.g.t.ndim) b.g = p.g.cptr();
  if (p.decay.t.ndim) b.decay = p.decay.cptr();
  if (p.beta.t.ndim) b.beta = p.beta.cptr();
  if (c.gate_in_kernel && c.use_A_log) b.A_log = p.A_log.cptr();
  if (c.gate_in_kernel) b.dt_bias = p.dt_bias.cptr();
  if (c.varlen) b.cu_seqlens = p.cu.cptr();
  b.initial_state = p.h0.cptr();
  b.d_out = d_out.cptr();
  b.d_final_state = d_ht.cptr();
  b.dq = dq.ptr();
  b.dk = dk.ptr();
  b.dv = dv.ptr();
  if (p.g.t.ndim) b.dg = dg.ptr();
  if (p.beta.t.ndim) b.dbeta = dbeta.ptr();
  if (b.A_log) b.dA_log = dA.ptr();
  if (b.dt_bias) b.ddt_bias = ddt.ptr();
  b.d_initial_state = dh0.ptr();
  for (HostTensor* t : {&dq, &dk, &dv, &dg, &dbeta, &dA, &ddt, &dh0})
    if (t->t.ndim) t->poison();
  ASSERT_EQ(cula_chunk_bwd(&b), CULA_OK) << cula_last_error();

  auto fd_check = [&](HostTensor& x, const HostTensor& grad, const char* name) {
    if (!x.t.ndim || !grad.t.ndim) return;
    HostTensor fd = grad;
    const double h = 1e-6;
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double x0 = x.get(i);
      x.set(i, x0 + h);
      const double lp = loss();
      x.set(i, x0 - h);
      const double lm = loss();
      x.set(i, x0);
      fd.set(i, (lp - lm) / (2 * h));
    }
    ASSERT_TRUE(all_finite(grad)) << name << " not fully written";
    EXPECT_LT(rel_err(grad, fd), 1e-6) << c.name << ": d" << name << " vs finite differences, seed " << seed;
  };
  fd_check(p.q, dq, "q");
  fd_check(p.k, dk, "k");
  fd_check(p.v, dv, "v");
  fd_check(p.g, dg, "g");
  fd_check(p.beta, dbeta, "beta");
  if (b.A_log) fd_check(p.A_log, dA, "A_log");
  if (b.dt_bias) fd_check(p.dt_bias, ddt, "dt_bias");
  fd_check(p.h0, dh0, "initial_state");
}

}  // namespace

TEST(Backward, ReferenceGradientsMatchFiniteDifferences) {
  const GradCase cases[] = {
      {"KDA", CULA_KDA, false, false, false, true, false, false, false},
      {"KDA_l2_gate_betasig", CULA_KDA, true, true, false, true, true, false, false},
      {"KDA_gate_lowerbound", CULA_KDA, true, true, true, true, true, true, false},
      {"KDA_lowerbound_noAlog_varlen", CULA_KDA, false, true, true, false, false, false, true},
      {"GDN", CULA_GDN, true, false, false, true, false, false, false},
      {"GDN_gate_betasig_varlen", CULA_GDN, true, true, false, true, true, false, true},
      {"GLA", CULA_GLA, true, false, false, true, false, false, false},
      {"SimpleGLA", CULA_SIMPLE_GLA, false, false, false, true, false, false, true},
      {"Lightning_l2_varlen", CULA_LIGHTNING, true, false, false, true, false, false, true},
  };
  for (const GradCase& c : cases) {
    SCOPED_TRACE(c.name);
    check_case(c, fresh_seed());
  }
}

TEST(Backward, ArgumentStructOfCallersBuiltBeforeDecayIsAccepted) {
  // The struct as it was before `decay` was appended (struct_size ends at d_initial_state).
  Problem p;
  p.family = CULA_GDN;
  p.dtype = CULA_FLOAT64;
  p.state_dtype = CULA_FLOAT64;
  p.B = 1, p.T = 4, p.H = 1, p.HV = 1, p.K = 3, p.V = 2;
  p.make(fresh_seed());
  HostTensor d_out({p.B, p.T, p.HV, p.V}, CULA_FLOAT64), dq = p.q;
  std::mt19937_64 rng(7);
  d_out.fill_normal(rng);
  dq.poison();
  cula_chunk_bwd_args b{};
  b.opt = p.options(CULA_BACKEND_ORACLE);
  b.q = p.q.cptr(), b.k = p.k.cptr(), b.v = p.v.cptr(), b.g = p.g.cptr(), b.beta = p.beta.cptr();
  b.d_out = d_out.cptr();
  b.dq = dq.ptr();
  b.struct_size = offsetof(cula_chunk_bwd_args, decay);
  ASSERT_EQ(cula_chunk_bwd(&b), CULA_OK) << cula_last_error();
  EXPECT_TRUE(all_finite(dq));
  b.struct_size = offsetof(cula_chunk_bwd_args, decay) - sizeof(void*);  // older than any release: refused
  EXPECT_EQ(cula_chunk_bwd(&b), CULA_ERROR_INVALID_ARGUMENT);
}

// The chunk backward's scan width (columns per CTA) from the waves each width takes, on 132 SMs.
TEST(ChunkBackwardPlan, ScanWidthFollowsTheWaves) {
  using cula::bwd::scan_width;
  // sm_90a, the delta rule, K <= 128: 32 or 64 columns, one CTA per SM
  EXPECT_EQ(scan_width(true, 128, 1, 16, 128, 132, true), 32);  // 128 CTAs at 32: one wave either way
  EXPECT_EQ(scan_width(true, 128, 1, 32, 128, 132, true), 64);  // 256 at 32 (two waves), 128 at 64 (one)
  EXPECT_EQ(scan_width(true, 128, 2, 32, 128, 132, true), 64);  // four waves against two
  EXPECT_EQ(scan_width(true, 64, 2, 16, 64, 132, true), 32);    // K = V = 64: 64 CTAs at 64 columns
  EXPECT_EQ(scan_width(true, 128, 1, 33, 64, 132, true), 32);   // 66 CTAs at 64: one wave at 32 too
  EXPECT_EQ(scan_width(true, 128, 1, 34, 64, 132, true), 64);   // 68 at 64, 136 (two waves) at 32
  // K = 256, or no warpgroup products: mma.sync at 16 columns
  EXPECT_EQ(scan_width(true, 256, 1, 32, 512, 132, true), 16);
  EXPECT_EQ(scan_width(true, 128, 1, 32, 128, 132, false), 16);
  // without the delta rule: 32 columns where that grid keeps 1.5 CTAs per SM, else 16
  EXPECT_EQ(scan_width(false, 128, 1, 32, 128, 132, true), 32);  // 256 CTAs at 32
  EXPECT_EQ(scan_width(false, 128, 1, 8, 128, 132, false), 16);  // 64 CTAs at 32
  EXPECT_EQ(scan_width(false, 128, 1, 25, 128, 132, false), 32);  // 200 at 32: 1.52 per SM
  EXPECT_EQ(scan_width(false, 128, 1, 24, 128, 132, false), 16);  // 192: 1.45 per SM
  EXPECT_EQ(scan_width(false, 256, 1, 32, 128, 132, false), 16);
}

// The lean backward's path (simple GLA, Lightning): precise for anything not bf16 or with the gate in
// the kernel, direct where nothing needs the prepare or chain kernels, bf16 otherwise.
TEST(ChunkBackwardPlan, LeanPathFollowsTheCall) {
  using cula::bwd::LeanCall;
  using cula::bwd::LeanPath;
  using cula::bwd::lean_path;
  constexpr int bf = CULA_BFLOAT16, f32 = CULA_FLOAT32, f16 = CULA_FLOAT16;
  const LeanCall plain{false, false, false, false, true, bf, bf, bf, bf};
  EXPECT_EQ(lean_path(plain), LeanPath::Direct);
  auto with = [&](auto change) {
    LeanCall c = plain;
    change(c);
    return lean_path(c);
  };
  EXPECT_EQ(with([](LeanCall& c) { c.gate_in_kernel = true; }), LeanPath::Precise);
  EXPECT_EQ(with([&](LeanCall& c) { c.q_dt = f32; }), LeanPath::Precise);
  EXPECT_EQ(with([&](LeanCall& c) { c.k_dt = f16; }), LeanPath::Precise);
  EXPECT_EQ(with([&](LeanCall& c) { c.v_dt = f32; }), LeanPath::Precise);
  EXPECT_EQ(with([](LeanCall& c) { c.l2norm = true; }), LeanPath::Bf16);
  EXPECT_EQ(with([](LeanCall& c) { c.grouped = true; }), LeanPath::Bf16);
  EXPECT_EQ(with([](LeanCall& c) { c.param_grads = true; }), LeanPath::Bf16);
  EXPECT_EQ(with([](LeanCall& c) { c.qk_rows16 = false; }), LeanPath::Bf16);
  EXPECT_EQ(with([&](LeanCall& c) { c.d_out_dt = f32; }), LeanPath::Bf16);  // d_out converted on the way in
}
