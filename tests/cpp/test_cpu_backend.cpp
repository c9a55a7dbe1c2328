// The fast CPU path against the float64 reference over a randomized grid of options.
#include <gtest/gtest.h>

#include "helpers.h"

using namespace cula_test;

namespace {

struct Case {
  int32_t family;
  bool l2norm, gate_in_kernel, has_lb, beta_sigmoid, neg_eig, varlen, gva, bf16_state, k_first, intermediate;
  int32_t dtype;
};

std::string name_of(const Case& c) {
  static const char* fam[] = {"KDA", "GDN", "GLA", "SimpleGLA", "Lightning"};
  std::string s = fam[c.family];
  if (c.l2norm) s += "_l2";
  if (c.gate_in_kernel) s += c.has_lb ? "_gateLB" : "_gate";
  if (c.beta_sigmoid) s += c.neg_eig ? "_negeig" : "_betasig";
  if (c.varlen) s += "_varlen";
  if (c.gva) s += "_gva";
  if (c.bf16_state) s += "_bf16state";
  if (c.k_first) s += "_kfirst";
  if (c.intermediate) s += "_inter";
  if (c.dtype == CULA_BFLOAT16) s += "_bf16";
  return s;
}

void run_case(const Case& c, uint64_t seed) {
  Problem p;
  p.family = c.family;
  p.l2norm = c.l2norm;
  const bool delta = c.family == CULA_KDA || c.family == CULA_GDN;
  p.gate_in_kernel = c.gate_in_kernel;
  p.has_lb = c.has_lb;
  p.safe_gate = c.has_lb;
  p.lb = -5.0;
  p.beta_sigmoid = c.beta_sigmoid && delta;
  p.neg_eig = c.neg_eig && delta;
  if (c.varlen) p.seqlens = {13, 0, 40, 1, 17};
  p.B = 2;
  p.T = 45;
  p.H = 2;
  p.HV = c.gva ? 4 : 2;
  p.K = 32;
  p.V = 24;
  p.state_dtype = c.bf16_state ? CULA_BFLOAT16 : CULA_FLOAT32;
  p.layout = c.k_first ? CULA_STATE_K_FIRST : CULA_STATE_K_LAST;
  p.intermediate = c.intermediate;
  p.chunk = 16;
  p.dtype = c.dtype;
  p.make(seed);
  Problem ref = p;
  auto ra = ref.fwd_args(CULA_BACKEND_ORACLE);
  ASSERT_EQ(cula_chunk_fwd(&ra), CULA_OK) << cula_last_error();
  auto fa = p.fwd_args(CULA_BACKEND_CPU);
  ASSERT_EQ(cula_chunk_fwd(&fa), CULA_OK) << cula_last_error();
  ASSERT_TRUE(all_finite(p.out)) << "unwritten or non-finite output";
  const double tol = c.bf16_state ? 5e-3 : 1e-4;
  EXPECT_LT(rel_err(p.out, ref.out), tol) << "out, seed " << seed;
  ASSERT_TRUE(all_finite(p.ht));
  EXPECT_LT(rel_err(p.ht, ref.ht), tol) << "final state, seed " << seed;
  if (c.intermediate) {
    ASSERT_TRUE(all_finite(p.inter));
    EXPECT_LT(rel_err(p.inter, ref.inter), tol) << "intermediate states, seed " << seed;
  }
}

}  // namespace

TEST(CpuBackend, MatchesReferenceOverOptionGrid) {
  std::vector<Case> cases;
  for (int fam = CULA_KDA; fam <= CULA_LIGHTNING; ++fam) {
    const bool gated = fam == CULA_KDA || fam == CULA_GDN;
    for (int variant = 0; variant < 6; ++variant) {
      Case c{};
      c.family = fam;
      c.dtype = variant == 5 ? CULA_BFLOAT16 : CULA_FLOAT32;
      c.l2norm = variant != 1;
      c.gate_in_kernel = gated && (variant == 1 || variant == 2 || variant == 4);
      c.has_lb = gated && variant == 2;
      c.beta_sigmoid = variant >= 2;
      c.neg_eig = variant == 3;
      c.varlen = variant == 3 || variant == 4;
      c.gva = variant == 2 || variant == 4;
      c.bf16_state = variant == 4;
      c.k_first = variant == 1 || variant == 3;
      c.intermediate = variant != 0;
      cases.push_back(c);
    }
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(name_of(c));
    run_case(c, fresh_seed());
  }
}

TEST(CpuBackend, LongSequenceAtLowerBoundStaysFinite) {
  // Gates at the lower bound for thousands of tokens: the chunked form must not overflow.
  for (int fam : {CULA_KDA, CULA_GDN, CULA_GLA}) {
    Problem p;
    p.family = fam;
    p.B = 1;
    p.T = 3000;
    p.H = 1;
    p.HV = 1;
    p.K = 16;
    p.V = 16;
    p.chunk = 64;
    p.make(fresh_seed());
    for (int64_t i = 0; i < p.g.numel(); ++i) p.g.set(i, -5.0);
    Problem ref = p;
    auto ra = ref.fwd_args(CULA_BACKEND_ORACLE);
    ASSERT_EQ(cula_chunk_fwd(&ra), CULA_OK) << cula_last_error();
    auto fa = p.fwd_args(CULA_BACKEND_CPU);
    ASSERT_EQ(cula_chunk_fwd(&fa), CULA_OK) << cula_last_error();
    ASSERT_TRUE(all_finite(p.out));
    EXPECT_LT(rel_err(p.out, ref.out), 1e-4);
  }
}

TEST(CpuBackend, DecodeMatchesReferenceWithPaddingAndSpeculativeSlots) {
  for (int fam : {CULA_KDA, CULA_GDN, CULA_LIGHTNING}) {
    for (int spec = 0; spec < 2; ++spec) {
      const uint64_t seed = fresh_seed();
      SCOPED_TRACE("family " + std::to_string(fam) + " spec " + std::to_string(spec) + " seed " + std::to_string(seed));
      Problem p;
      p.family = fam;
      p.B = 5;  // sequences
      p.T = spec ? 3 : 1;
      p.H = 2;
      p.HV = 4;
      p.K = 16;
      p.V = 8;
      p.initial_state = false;
      p.final_state = false;
      p.make(seed);
      std::mt19937_64 rng(seed);
      const int64_t P = 24;
      HostTensor pool(p.state_shape(P), CULA_FLOAT32);
      pool.fill_normal(rng, 0.0, 0.5);
      // a random permutation of slots; sequence 2 is padding
      std::vector<int> perm(P);
      for (int i = 0; i < P; ++i) perm[i] = i;
      std::shuffle(perm.begin(), perm.end(), rng);
      HostTensor idx = spec ? HostTensor({p.B, p.T}, CULA_INT32) : HostTensor({p.B}, CULA_INT32);
      for (int64_t i = 0; i < idx.numel(); ++i) idx.set(i, perm[i]);
      if (spec)
        for (int64_t t = 0; t < p.T; ++t) idx.set(2 * p.T + t, -1);
      else
        idx.set(2, -1);
      HostTensor acc({p.B}, CULA_INT32);
      for (int64_t n = 0; n < p.B; ++n) acc.set(n, static_cast<double>(n % (p.T + 1)));  // includes 0
      auto args = [&](HostTensor& pl, HostTensor& out, int32_t backend) {
        return p.decode_args(backend, pl, &idx, spec ? &acc : nullptr, out);
      };
      HostTensor pool_ref = pool, pool_cpu = pool;
      HostTensor out_ref({p.B, p.T, p.HV, p.V}, CULA_FLOAT32), out_cpu = out_ref;
      out_ref.poison();
      out_cpu.poison();
      auto ar = args(pool_ref, out_ref, CULA_BACKEND_ORACLE);
      ASSERT_EQ(cula_decode(&ar), CULA_OK) << cula_last_error();
      auto ac = args(pool_cpu, out_cpu, CULA_BACKEND_CPU);
      ASSERT_EQ(cula_decode(&ac), CULA_OK) << cula_last_error();
      ASSERT_TRUE(all_finite(out_cpu));
      EXPECT_LT(rel_err(out_cpu, out_ref), 1e-5);
      EXPECT_LT(rel_err(pool_cpu, pool_ref), 1e-5);
      // Slots never named stay bit-identical; the padding sequence's outputs are zero.
      std::vector<bool> named(P, false);
      for (int64_t i = 0; i < idx.numel(); ++i)
        if (idx.get(i) >= 0) named[static_cast<int>(idx.get(i))] = true;
      const int64_t slot_elems = pool.numel() / P;
      for (int64_t s = 0; s < P; ++s)
        if (!named[s])
          for (int64_t e = 0; e < slot_elems; ++e)
            ASSERT_EQ(pool_cpu.get(s * slot_elems + e), pool.get(s * slot_elems + e)) << "slot " << s << " changed";
      for (int64_t t = 0; t < p.T; ++t)
        for (int64_t e = 0; e < p.HV * p.V; ++e) EXPECT_EQ(out_cpu.get((2 * p.T + t) * p.HV * p.V + e), 0.0);
    }
  }
}
