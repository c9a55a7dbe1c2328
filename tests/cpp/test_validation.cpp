// SPEC §4: every bad input is refused with a message naming the argument, what was expected
// and what was given, and no output is touched.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "helpers.h"

using namespace cula_test;

namespace {

Problem base(int32_t family = CULA_KDA) {
  Problem p;
  p.family = family;
  p.K = 8;
  p.V = 4;
  p.make(fresh_seed());
  return p;
}

// Calls chunk_fwd after `mutate`, expects `status` and every fragment in the message.
void expect_fwd_error(Problem& p, const std::function<void(cula_chunk_fwd_args&)>& mutate,
                      std::vector<std::string> fragments, cula_status status = CULA_ERROR_INVALID_ARGUMENT) {
  auto a = p.fwd_args(CULA_BACKEND_AUTO);
  mutate(a);
  EXPECT_EQ(cula_chunk_fwd(&a), status);
  const std::string msg = cula_last_error();
  for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "message: " << msg << "\nmissing: " << f;
  EXPECT_TRUE(all_nan(p.out)) << "out written on failure";
  EXPECT_TRUE(all_nan(p.ht)) << "final_state written on failure";
}

}  // namespace

TEST(Validation, SuccessClearsTheLastError) {
  Problem p = base();
  auto a = p.fwd_args(CULA_BACKEND_AUTO);
  ASSERT_EQ(cula_chunk_fwd(&a), CULA_OK);
  EXPECT_STREQ(cula_last_error(), "");
}

TEST(Validation, QMustBeFourDimensional) {
  Problem p = base();
  HostTensor bad({2, 3, 4}, CULA_FLOAT32);
  expect_fwd_error(p, [&](auto& a) { a.q = bad.cptr(); }, {"argument 'q'", "4-D", "[2, 3, 4]"});
}

TEST(Validation, KMustMatchQ) {
  Problem p = base();
  HostTensor bad({p.B, p.T, p.H, p.K + 1}, CULA_FLOAT32);
  expect_fwd_error(p, [&](auto& a) { a.k = bad.cptr(); }, {"argument 'k'", "expected shape", "got shape"});
}

TEST(Validation, QMustBeFloatingPoint) {
  Problem p = base();
  HostTensor bad({p.B, p.T, p.H, p.K}, CULA_INT32);
  expect_fwd_error(p, [&](auto& a) { a.q = bad.cptr(); }, {"argument 'q'", "floating-point", "int32"});
}

TEST(Validation, TensorsMustShareTheDeviceOfQ) {
  Problem p = base();
  HostTensor other = p.v;
  other.t.device_type = CULA_CUDA;
  expect_fwd_error(p, [&](auto& a) { a.v = other.cptr(); }, {"argument 'v'", "on cpu", "cuda:0"});
}

TEST(Validation, OutputMustBeContiguous) {
  Problem p = base();
  HostTensor strided = p.out;
  std::swap(strided.t.strides[2], strided.t.strides[3]);
  expect_fwd_error(p, [&](auto& a) { a.out = strided.ptr(); }, {"argument 'out'", "contiguous", "strides"});
}

TEST(Validation, HeadRatioMustDivide) {
  Problem p = base();
  p.H = 2;
  HostTensor v3({p.B, p.T, 3, p.V}, CULA_FLOAT32);
  expect_fwd_error(p, [&](auto& a) { a.v = v3.cptr(); }, {"argument 'v'", "divisible", "HV = 3"});
}

TEST(Validation, GateShapeFollowsTheFamily) {
  Problem p = base(CULA_GDN);
  HostTensor per_channel({p.B, p.T, p.HV, p.K}, CULA_FLOAT32);
  expect_fwd_error(p, [&](auto& a) { a.g = per_channel.cptr(); }, {"argument 'g'", "[B, T, HV]"});
}

TEST(Validation, DeltaFamiliesNeedBeta) {
  Problem p = base(CULA_KDA);
  expect_fwd_error(p, [&](auto& a) { a.beta = nullptr; }, {"argument 'beta'", "None"});
}

TEST(Validation, NonDeltaFamiliesRefuseBeta) {
  Problem p = base(CULA_GLA);
  HostTensor beta({p.B, p.T, p.HV}, CULA_FLOAT32);
  expect_fwd_error(p, [&](auto& a) { a.beta = beta.cptr(); }, {"argument 'beta'", "no delta rule"});
}

TEST(Validation, LightningNeedsDecayOfHeadLength) {
  Problem p = base(CULA_LIGHTNING);
  HostTensor bad({p.H + 5}, CULA_FLOAT32);
  expect_fwd_error(p, [&](auto& a) { a.decay = bad.cptr(); }, {"argument 'decay'", "[H]"});
}

TEST(Validation, CuSeqlensMustStartAtZero) {
  Problem p;
  p.seqlens = {3, 4};
  p.make(fresh_seed());
  p.cu.set(0, 1);
  expect_fwd_error(p, [](auto&) {}, {"argument 'cu_seqlens'", "cu_seqlens[0] == 0", "= 1"});
}

TEST(Validation, CuSeqlensMustBeMonotone) {
  Problem p;
  p.seqlens = {3, 4, 2};
  p.make(fresh_seed());
  p.cu.set(2, 1);
  expect_fwd_error(p, [](auto&) {}, {"argument 'cu_seqlens'", "non-decreasing"});
}

TEST(Validation, CuSeqlensMustEndAtT) {
  Problem p;
  p.seqlens = {3, 4};
  p.make(fresh_seed());
  p.cu.set(2, 6);
  expect_fwd_error(p, [](auto&) {}, {"argument 'cu_seqlens'", "== T = 7", "= 6"});
}

TEST(Validation, CuSeqlensNeedsBatchOne) {
  Problem p = base();  // B = 2
  HostTensor cu({3}, CULA_INT32);
  cu.set(0, 0);
  cu.set(1, 10);
  cu.set(2, p.T);
  expect_fwd_error(p, [&](auto& a) { a.cu_seqlens = cu.cptr(); }, {"argument 'q'", "batch size 1", "batch size 2"});
}

TEST(Validation, CuSeqlensMustBeIntegerOnTheRightDevice) {
  Problem p;
  p.seqlens = {3, 4};
  p.make(fresh_seed());
  HostTensor f({3}, CULA_FLOAT32);
  expect_fwd_error(p, [&](auto& a) { a.cu_seqlens = f.cptr(); }, {"argument 'cu_seqlens'", "int32 or int64", "float32"});
  HostTensor elsewhere = p.cu;
  elsewhere.t.device_type = 7;
  expect_fwd_error(p, [&](auto& a) { a.cu_seqlens = elsewhere.cptr(); }, {"argument 'cu_seqlens'", "host or on the device of q"});
}

TEST(Validation, StateShapeFollowsTheLayout) {
  Problem p = base();
  HostTensor kfirst({p.N, p.HV, p.K, p.V}, CULA_FLOAT32);
  expect_fwd_error(p, [&](auto& a) { a.initial_state = kfirst.cptr(); }, {"argument 'initial_state'", "K-last"});
}

TEST(Validation, StateDtypeIsFloat32OrBfloat16) {
  Problem p = base();
  HostTensor half(p.state_shape(p.N), CULA_FLOAT16);
  expect_fwd_error(p, [&](auto& a) { a.initial_state = half.cptr(); }, {"argument 'initial_state'", "float32 or bfloat16", "float16"});
}

TEST(Validation, PoolIndicesMustBeBelowPoolSize) {
  Problem p = base();
  p.initial_state = p.final_state = false;
  HostTensor pool(p.state_shape(3), CULA_FLOAT32), idx({p.N}, CULA_INT32);
  pool.fill(1.0);
  idx.set(0, 1);
  idx.set(1, 3);
  expect_fwd_error(p, [&](auto& a) {
    a.initial_state = nullptr;
    a.final_state = nullptr;
    a.state_pool = pool.ptr();
    a.state_indices = idx.cptr();
  }, {"argument 'state_indices'", "< pool size P = 3", "state_indices[1] = 3"});
  for (int64_t i = 0; i < pool.numel(); ++i) ASSERT_EQ(pool.get(i), 1.0);
}

TEST(Validation, PoolIndicesMustBeInt32) {
  Problem p = base();
  HostTensor pool(p.state_shape(3), CULA_FLOAT32), idx({p.N}, CULA_INT64);
  expect_fwd_error(p, [&](auto& a) {
    a.initial_state = nullptr;
    a.final_state = nullptr;
    a.state_pool = pool.ptr();
    a.state_indices = idx.cptr();
  }, {"argument 'state_indices'", "int32", "int64"});
}

TEST(Validation, LowerBoundRangeWithSafeGate) {
  Problem p;
  p.gate_in_kernel = true;
  p.has_lb = true;
  p.safe_gate = true;
  p.lb = -6.0;
  p.make(fresh_seed());
  expect_fwd_error(p, [](auto&) {}, {"argument 'lower_bound'", "[-5, 0)", "-6"});
  expect_fwd_error(p, [](auto& a) { a.opt.lower_bound = 0.5; }, {"argument 'lower_bound'", "0.5"});
  expect_fwd_error(p, [](auto& a) { a.opt.has_lower_bound = 0; }, {"argument 'lower_bound'", "None"});
}

TEST(Validation, GateInKernelNeedsALogWithoutLowerBound) {
  Problem p;
  p.gate_in_kernel = true;
  p.use_A_log = false;
  p.make(fresh_seed());
  expect_fwd_error(p, [](auto&) {}, {"argument 'A_log'", "lower_bound is None"});
}

TEST(Validation, DtBiasShape) {
  Problem p;
  p.gate_in_kernel = true;
  p.make(fresh_seed());
  HostTensor bad({p.HV * p.K + 1}, CULA_FLOAT32);
  expect_fwd_error(p, [&](auto& a) { a.dt_bias = bad.cptr(); }, {"argument 'dt_bias'", "[HV*K]"});
}

TEST(Validation, NegativeEigenvaluesNeedTheSigmoid) {
  Problem p = base();
  expect_fwd_error(p, [](auto& a) { a.opt.allow_neg_eigval = 1; }, {"argument 'allow_neg_eigval'"});
}

TEST(Validation, GateInKernelOnlyForKdaAndGdn) {
  Problem p = base(CULA_GLA);
  expect_fwd_error(p, [](auto& a) { a.opt.use_gate_in_kernel = 1; }, {"argument 'use_gate_in_kernel'", "GLA"});
}

TEST(Validation, IntermediateStatesShape) {
  Problem p = base();
  HostTensor bad({p.B, 1, p.HV, p.V, p.K}, CULA_FLOAT32);
  expect_fwd_error(p, [&](auto& a) { a.intermediate_states = bad.ptr(); }, {"argument 'intermediate_states'", "NT"});
}

// Device offsets with intermediate states: their count comes from cu_seqlens_host (the same
// offsets on the host), checked like cu_seqlens; without it the call is refused naming it.
TEST(Validation, DeviceOffsetsTakeTheIntermediateCountFromTheirHostCopy) {
  Problem p;
  p.K = 8;
  p.V = 4;
  p.B = 1;
  p.seqlens = {5, 0, 20, 12};
  p.T = 37;
  p.intermediate = true;
  p.make(fresh_seed());
  HostTensor short_copy({2}, CULA_INT32), wrong_copy = p.cu;
  short_copy.set(0, 0);
  short_copy.set(1, 37);
  wrong_copy.set(1, 7);  // 0, 7, 5, ...: not non-decreasing
  // host tensors: a host copy is checked too, and a matching one changes nothing
  expect_fwd_error(p, [&](auto& a) { a.cu_seqlens_host = short_copy.cptr(); }, {"argument 'cu_seqlens_host'", "[N+1] = [5]"});
  expect_fwd_error(p, [&](auto& a) { a.cu_seqlens_host = wrong_copy.cptr(); }, {"argument 'cu_seqlens_host'", "non-decreasing"});
  cula_chunk_fwd_args ok = p.fwd_args(CULA_BACKEND_AUTO);
  ok.cu_seqlens_host = p.cu.cptr();
  EXPECT_EQ(cula_chunk_fwd(&ok), CULA_OK) << cula_last_error();
  // (fake) device tensors: refused without the copy; with it, validation passes and the CUDA rows
  // decline K = 8 before any pointer is read
  HostTensor cq = p.q, ck = p.k, cv = p.v, cg = p.g, cb = p.beta, co = p.out, ch0 = p.h0, cht = p.ht, ccu = p.cu,
             ci = p.inter;
  for (HostTensor* t : {&cq, &ck, &cv, &cg, &cb, &co, &ch0, &cht, &ccu, &ci}) t->t.device_type = CULA_CUDA;
  cula_chunk_fwd_args a = p.fwd_args(CULA_BACKEND_AUTO);
  a.q = cq.cptr(); a.k = ck.cptr(); a.v = cv.cptr(); a.g = cg.cptr(); a.beta = cb.cptr(); a.out = co.ptr();
  a.initial_state = ch0.cptr(); a.final_state = cht.ptr(); a.cu_seqlens = ccu.cptr(); a.intermediate_states = ci.ptr();
  EXPECT_EQ(cula_chunk_fwd(&a), CULA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(cula_last_error()).find("argument 'cu_seqlens_host'"), std::string::npos) << cula_last_error();
  a.cu_seqlens_host = p.cu.cptr();
  EXPECT_EQ(cula_chunk_fwd(&a), CULA_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(cula_last_error()).find("K in {64, 128, 256}"), std::string::npos) << cula_last_error();
  // a caller built before the field (a smaller struct) is still served: no host copy read
  cula_chunk_fwd_args old = p.fwd_args(CULA_BACKEND_AUTO);
  old.struct_size = offsetof(cula_chunk_fwd_args, cu_seqlens_host);
  old.cu_seqlens_host = short_copy.cptr();  // beyond the struct the caller knows: ignored
  EXPECT_EQ(cula_chunk_fwd(&old), CULA_OK) << cula_last_error();
  // and one built before value_dim: its cu_seqlens_host read, a value_dim past its struct ignored
  cula_chunk_fwd_args before_value_dim = p.fwd_args(CULA_BACKEND_AUTO);
  before_value_dim.struct_size = offsetof(cula_chunk_fwd_args, value_dim);
  before_value_dim.cu_seqlens_host = p.cu.cptr();
  before_value_dim.value_dim = 3 * p.V;
  EXPECT_EQ(cula_chunk_fwd(&before_value_dim), CULA_OK) << cula_last_error();
}

// value_dim smaller than v's V is refused naming it.
TEST(Validation, ValueDimBelowTheValuesIsRefused) {
  Problem p = base();
  expect_fwd_error(p, [&](auto& a) { a.value_dim = p.V - 1; }, {"argument 'value_dim'", "at least v's V"});
}

// segment_len: 0 or a positive multiple of 64, dense calls only (refused naming it); rows that do not
// run segments compute the call uncut; a caller built before the field passes none.
TEST(Validation, SegmentLenIsAMultipleOf64OnDenseCallsOnly) {
  Problem p = base();
  expect_fwd_error(p, [](auto& a) { a.segment_len = 100; }, {"argument 'segment_len'", "positive multiple of 64", "100"});
  expect_fwd_error(p, [](auto& a) { a.segment_len = -64; }, {"argument 'segment_len'", "-64"});
  HostTensor wide({p.B, p.T, p.HV, 2 * p.V}, CULA_FLOAT32);
  wide.poison();
  expect_fwd_error(p, [&](auto& a) { a.segment_len = 64, a.value_dim = 2 * p.V, a.out = wide.ptr(), a.initial_state = nullptr,
                                     a.final_state = nullptr; }, {"argument 'segment_len'", "value_dim"});
  Problem inter = base();
  inter.intermediate = true;
  inter.make(fresh_seed());
  expect_fwd_error(inter, [](auto& a) { a.segment_len = 64; }, {"argument 'segment_len'", "intermediate_states"});
  Problem varlen;
  varlen.K = 8, varlen.V = 4, varlen.B = 1, varlen.seqlens = {70, 60}, varlen.T = 130;
  varlen.make(fresh_seed());
  expect_fwd_error(varlen, [](auto& a) { a.segment_len = 64; }, {"argument 'segment_len'", "cu_seqlens"});
  // the host rows compute the call uncut: the same bits as without segment_len
  Problem q = base();
  q.B = 2, q.T = 150;
  q.make(fresh_seed());
  cula_chunk_fwd_args whole = q.fwd_args(CULA_BACKEND_CPU);
  ASSERT_EQ(cula_chunk_fwd(&whole), CULA_OK) << cula_last_error();
  const HostTensor out_whole = q.out, ht_whole = q.ht;
  q.out.poison();
  q.ht.poison();
  cula_chunk_fwd_args cut = q.fwd_args(CULA_BACKEND_CPU);
  cut.segment_len = 64;
  ASSERT_EQ(cula_chunk_fwd(&cut), CULA_OK) << cula_last_error();
  EXPECT_EQ(rel_err(q.out, out_whole), 0.0);
  EXPECT_EQ(rel_err(q.ht, ht_whole), 0.0);
  // a caller built before segment_len: a value past its struct is not read
  cula_chunk_fwd_args before = q.fwd_args(CULA_BACKEND_CPU);
  before.struct_size = offsetof(cula_chunk_fwd_args, segment_len);
  before.segment_len = 100;
  EXPECT_EQ(cula_chunk_fwd(&before), CULA_OK) << cula_last_error();
}

TEST(Validation, UnknownFamilyAndLayout) {
  Problem p = base();
  expect_fwd_error(p, [](auto& a) { a.opt.family = 9; }, {"argument 'family'", "9"});
  expect_fwd_error(p, [](auto& a) { a.opt.state_layout = 5; }, {"argument 'state_layout'", "5"});
}

TEST(Validation, HeadDimsAreCheckedAgainstTheChosenKernel) {
  // The CUDA kernels take K in {64, 128, 256}: other sizes are refused before any launch.
  Problem p = base();  // K = 8
  HostTensor cq = p.q, ck = p.k, cv = p.v, cg = p.g, cb = p.beta, co = p.out, ch0 = p.h0, cht = p.ht;
  for (HostTensor* t : {&cq, &ck, &cv, &cg, &cb, &co, &ch0, &cht}) t->t.device_type = CULA_CUDA;
  cula_chunk_fwd_args a = p.fwd_args(CULA_BACKEND_AUTO);
  a.q = cq.cptr(); a.k = ck.cptr(); a.v = cv.cptr(); a.g = cg.cptr(); a.beta = cb.cptr();
  a.out = co.ptr(); a.initial_state = ch0.cptr(); a.final_state = cht.ptr();
  EXPECT_EQ(cula_chunk_fwd(&a), CULA_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(cula_last_error()).find("K in {64, 128, 256}, got K = 8"), std::string::npos) << cula_last_error();
}

TEST(Validation, BackendMustRunOnTheTensorsDevice) {
  Problem p = base();
  cula_chunk_fwd_args a = p.fwd_args(CULA_BACKEND_CUDA);  // host tensors, CUDA asked for
  EXPECT_EQ(cula_chunk_fwd(&a), CULA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(cula_last_error()).find("argument 'backend'"), std::string::npos) << cula_last_error();
  EXPECT_TRUE(all_nan(p.out));
}

// The CUDA kernels have no float64 loads: float64 device tensors are refused before any kernel
// (the descriptions below point at host memory, which no kernel may see).
TEST(Validation, Float64IsRefusedOnCudaDevices) {
  for (int32_t family : {CULA_KDA, CULA_GDN, CULA_GLA, CULA_LIGHTNING}) {
    Problem p;
    p.family = family;
    p.K = 8;
    p.V = 4;
    p.dtype = CULA_FLOAT64;
    p.initial_state = p.final_state = false;
    p.make(fresh_seed());
    HostTensor out64({p.B, p.T, p.HV, p.V}, CULA_FLOAT64);
    out64.poison();
    for (HostTensor* t : {&p.q, &p.k, &p.v, &p.g, &p.beta, &p.decay, &out64}) t->t.device_type = CULA_CUDA;
    cula_chunk_fwd_args a = p.fwd_args(CULA_BACKEND_AUTO);
    a.out = out64.ptr();
    EXPECT_EQ(cula_chunk_fwd(&a), CULA_ERROR_INVALID_ARGUMENT);
    const std::string msg = cula_last_error();
    EXPECT_NE(msg.find("argument 'q'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("float64 runs on host tensors"), std::string::npos) << msg;
    EXPECT_TRUE(all_nan(out64));

    // One float64 tensor among float32 ones is named too.
    Problem f = base(family);
    HostTensor v64({f.B, f.T, f.HV, f.V}, CULA_FLOAT64);
    v64.fill(0.5);
    for (HostTensor* t : {&f.q, &f.k, &v64, &f.g, &f.beta, &f.decay, &f.out}) t->t.device_type = CULA_CUDA;
    cula_chunk_fwd_args b = f.fwd_args(CULA_BACKEND_AUTO);
    b.v = v64.cptr();
    b.initial_state = nullptr;
    b.final_state = nullptr;
    EXPECT_EQ(cula_chunk_fwd(&b), CULA_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(cula_last_error()).find("argument 'v'"), std::string::npos) << cula_last_error();
  }
}

TEST(Validation, CudaBackwardRefusesKeyHeadSizesItHasNoKernelFor) {
  // Refused before anything touches the (fake) device pointers: the message names the head size.
  Problem p = base();
  HostTensor cq = p.q, ck = p.k, cv = p.v, cg = p.g, cb = p.beta, d = p.out;
  for (HostTensor* t : {&cq, &ck, &cv, &cg, &cb, &d}) t->t.device_type = CULA_CUDA;
  cula_chunk_bwd_args b{};
  b.struct_size = sizeof(b);
  b.opt = p.options(CULA_BACKEND_AUTO);
  b.q = cq.cptr(); b.k = ck.cptr(); b.v = cv.cptr(); b.g = cg.cptr(); b.beta = cb.cptr(); b.d_out = d.cptr();
  ASSERT_NE(p.K, 64);
  EXPECT_EQ(cula_chunk_bwd(&b), CULA_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(cula_last_error()).find("K in {64, 128, 256}, got K = " + std::to_string(p.K)), std::string::npos)
      << cula_last_error();
}

TEST(Validation, DecodeSpeculativeIndicesNeedTwoDimensions) {
  Problem p = base();
  HostTensor pool(p.state_shape(4), CULA_FLOAT32), idx({p.B}, CULA_INT32), acc({p.B}, CULA_INT32);
  for (int64_t n = 0; n < p.B; ++n) idx.set(n, static_cast<double>(n));
  cula_decode_args d = p.decode_args(CULA_BACKEND_AUTO, pool, &idx, &acc, p.out);
  EXPECT_EQ(cula_decode(&d), CULA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(cula_last_error()).find("argument 'num_accepted_tokens'"), std::string::npos) << cula_last_error();
}

TEST(Validation, SequencesNamingOneSlotAreRefused) {
  // Every read sees the pool as it was before the call: two sequences on one slot would race. Host
  // indices are checked (padding, -1, may repeat); the message names both sequences.
  Problem p = base();
  ASSERT_GE(p.B, 2);
  HostTensor pool(p.state_shape(4), CULA_FLOAT32), idx({p.B}, CULA_INT32);
  pool.fill(0.0);
  for (int64_t n = 0; n < p.B; ++n) idx.set(n, -1.0);
  cula_decode_args ok = p.decode_args(CULA_BACKEND_AUTO, pool, &idx, nullptr, p.out);
  EXPECT_EQ(cula_decode(&ok), CULA_OK) << cula_last_error();
  idx.set(0, 2.0);
  idx.set(1, 2.0);
  cula_decode_args d = p.decode_args(CULA_BACKEND_AUTO, pool, &idx, nullptr, p.out);
  EXPECT_EQ(cula_decode(&d), CULA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(cula_last_error()).find("slot 2 named by sequences 0 and 1"), std::string::npos) << cula_last_error();
}

TEST(Validation, KdaGateChecksItsArguments) {
  HostTensor g({1, 4, 2, 8}, CULA_FLOAT32), out({1, 4, 2, 8}, CULA_FLOAT32), A({3}, CULA_FLOAT32);
  cula_kda_gate_args a = kda_gate_args(g, &A, out, CULA_BACKEND_AUTO);
  EXPECT_EQ(cula_kda_gate(&a), CULA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(cula_last_error()).find("argument 'A_log'"), std::string::npos) << cula_last_error();
}

TEST(Validation, NullArgsPointer) {
  EXPECT_EQ(cula_chunk_fwd(nullptr), CULA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(cula_decode(nullptr), CULA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(cula_chunk_bwd(nullptr), CULA_ERROR_INVALID_ARGUMENT);
}
