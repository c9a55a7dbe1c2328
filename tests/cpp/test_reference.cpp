// Properties of the float64 reference that an independent argument pins down.
#include <gtest/gtest.h>

#include <cmath>

#include "helpers.h"

using namespace cula_test;

TEST(Reference, ScalarCaseMatchesHandComputation) {
  // K = V = 1 delta rule: S' = e^a S, S = S' + b k (v - S' k), o = scale q S.
  Problem p;
  p.family = CULA_KDA;
  p.B = 1;
  p.T = 6;
  p.H = p.HV = 1;
  p.K = p.V = 1;
  p.l2norm = false;
  p.make(fresh_seed());
  auto a = p.fwd_args(CULA_BACKEND_ORACLE);
  a.opt.scale = 0.7;
  ASSERT_EQ(cula_chunk_fwd(&a), CULA_OK) << cula_last_error();
  double S = p.h0.get(0);
  for (int t = 0; t < p.T; ++t) {
    const double sp = std::exp(p.g.get(t)) * S;
    S = sp + p.beta.get(t) * p.k.get(t) * (p.v.get(t) - sp * p.k.get(t));
    EXPECT_NEAR(p.out.get(t), 0.7 * p.q.get(t) * S, 1e-6 * std::fabs(S) + 1e-12);
  }
  EXPECT_NEAR(p.ht.get(0), S, 1e-6 * std::fabs(S));
}

TEST(Reference, VarlenEqualsSeparateSequences) {
  for (int fam : {CULA_KDA, CULA_GDN, CULA_GLA, CULA_SIMPLE_GLA, CULA_LIGHTNING}) {
    Problem p;
    p.family = fam;
    p.seqlens = {5, 0, 9, 3};
    p.K = 8;
    p.V = 4;
    p.make(fresh_seed());
    auto a = p.fwd_args(CULA_BACKEND_ORACLE);
    ASSERT_EQ(cula_chunk_fwd(&a), CULA_OK) << cula_last_error();
    int64_t start = 0;
    for (size_t n = 0; n < p.seqlens.size(); ++n) {
      const int64_t len = p.seqlens[n];
      Problem s = p;
      s.seqlens.clear();
      s.B = 1;
      s.T = len;
      auto slice = [&](const HostTensor& src, int64_t per_token, HostTensor& dst, std::vector<int64_t> shape) {
        dst = HostTensor(shape, src.t.dtype);
        for (int64_t i = 0; i < len * per_token; ++i) dst.set(i, src.get(start * per_token + i));
      };
      slice(p.q, p.H * p.K, s.q, {1, len, p.H, p.K});
      slice(p.k, p.H * p.K, s.k, {1, len, p.H, p.K});
      slice(p.v, p.HV * p.V, s.v, {1, len, p.HV, p.V});
      if (p.g.t.ndim == 4) slice(p.g, p.HV * p.K, s.g, {1, len, p.HV, p.K});
      if (p.g.t.ndim == 3) slice(p.g, p.HV, s.g, {1, len, p.HV});
      if (p.beta.t.ndim) slice(p.beta, p.HV, s.beta, {1, len, p.HV});
      const int64_t st = p.HV * p.K * p.V;
      s.h0 = HostTensor(s.state_shape(1), CULA_FLOAT32);
      for (int64_t i = 0; i < st; ++i) s.h0.set(i, p.h0.get(n * st + i));
      s.out = HostTensor({1, len, p.HV, p.V}, CULA_FLOAT32);
      s.ht = HostTensor(s.state_shape(1), CULA_FLOAT32);
      s.ht.poison();
      auto sa = s.fwd_args(CULA_BACKEND_ORACLE);
      ASSERT_EQ(cula_chunk_fwd(&sa), CULA_OK) << cula_last_error();
      for (int64_t i = 0; i < len * p.HV * p.V; ++i) ASSERT_DOUBLE_EQ(s.out.get(i), p.out.get(start * p.HV * p.V + i));
      for (int64_t i = 0; i < st; ++i) ASSERT_DOUBLE_EQ(s.ht.get(i), p.ht.get(n * st + i));
      start += len;
    }
  }
}

TEST(Reference, LayoutsAgreeUpToTranspose) {
  Problem p;
  p.family = CULA_KDA;
  p.K = 8;
  p.V = 4;
  p.make(fresh_seed());
  Problem f = p;
  f.layout = CULA_STATE_K_FIRST;
  f.h0 = HostTensor(f.state_shape(p.N), CULA_FLOAT32);
  f.ht = HostTensor(f.state_shape(p.N), CULA_FLOAT32);
  for (int64_t nh = 0; nh < p.N * p.HV; ++nh)
    for (int64_t i = 0; i < p.K; ++i)
      for (int64_t j = 0; j < p.V; ++j) f.h0.set((nh * p.K + i) * p.V + j, p.h0.get((nh * p.V + j) * p.K + i));
  auto a = p.fwd_args(CULA_BACKEND_ORACLE);
  auto b = f.fwd_args(CULA_BACKEND_ORACLE);
  ASSERT_EQ(cula_chunk_fwd(&a), CULA_OK);
  ASSERT_EQ(cula_chunk_fwd(&b), CULA_OK);
  EXPECT_EQ(rel_err(f.out, p.out), 0.0);
  for (int64_t nh = 0; nh < p.N * p.HV; ++nh)
    for (int64_t i = 0; i < p.K; ++i)
      for (int64_t j = 0; j < p.V; ++j) ASSERT_EQ(f.ht.get((nh * p.K + i) * p.V + j), p.ht.get((nh * p.V + j) * p.K + i));
}

TEST(Reference, DecodeEqualsChunkForward) {
  for (int fam : {CULA_KDA, CULA_GDN, CULA_LIGHTNING}) {
    Problem p;
    p.family = fam;
    p.B = 3;
    p.T = 4;
    p.HV = 4;
    p.K = 8;
    p.V = 4;
    p.make(fresh_seed());
    auto a = p.fwd_args(CULA_BACKEND_ORACLE);
    ASSERT_EQ(cula_chunk_fwd(&a), CULA_OK) << cula_last_error();
    HostTensor pool = p.h0, out({p.B, p.T, p.HV, p.V}, CULA_FLOAT32);
    out.poison();
    cula_decode_args d = p.decode_args(CULA_BACKEND_ORACLE, pool, nullptr, nullptr, out);
    ASSERT_EQ(cula_decode(&d), CULA_OK) << cula_last_error();
    EXPECT_LT(rel_err(out, p.out), 1e-14);
    EXPECT_LT(rel_err(pool, p.ht), 1e-14);
  }
}

TEST(Reference, StatePoolEqualsInitialState) {
  Problem p;
  p.family = CULA_GDN;
  p.K = 8;
  p.V = 4;
  p.make(fresh_seed());
  auto a = p.fwd_args(CULA_BACKEND_ORACLE);
  ASSERT_EQ(cula_chunk_fwd(&a), CULA_OK);
  // pool of 5 slots: sequence 0 -> slot 3, sequence 1 -> slot 1
  const int64_t st = p.HV * p.K * p.V;
  HostTensor pool(p.state_shape(5), CULA_FLOAT32), idx({2}, CULA_INT32);
  pool.fill(7.0);
  idx.set(0, 3);
  idx.set(1, 1);
  for (int64_t i = 0; i < st; ++i) {
    pool.set(3 * st + i, p.h0.get(i));
    pool.set(1 * st + i, p.h0.get(st + i));
  }
  Problem q = p;
  q.initial_state = q.final_state = false;
  q.out.poison();
  auto b = q.fwd_args(CULA_BACKEND_ORACLE);
  b.state_pool = pool.ptr();
  b.state_indices = idx.cptr();
  ASSERT_EQ(cula_chunk_fwd(&b), CULA_OK) << cula_last_error();
  EXPECT_EQ(rel_err(q.out, p.out), 0.0);
  for (int64_t i = 0; i < st; ++i) {
    ASSERT_EQ(pool.get(3 * st + i), p.ht.get(i));
    ASSERT_EQ(pool.get(1 * st + i), p.ht.get(st + i));
    ASSERT_EQ(pool.get(0 * st + i), 7.0);
  }
}
