// Configuration of the prep + scan chunk engine (design: DESIGN.md beside this file): the families
// as named traits, the chunk, the warp counts, and the byte layouts of the workspace block and of
// both kernels' shared memory with their budgets. A new head size starts here.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/kerutils/mma.cuh"
#include "cuda/prefill/chunk_common.cuh"
#include "cuda/prefill/half_inputs.cuh"

namespace cula {
namespace chunk_prep_scan {

using bf16 = __nv_bfloat16;
using mma::pack;
using mma::unpack;

// The three families of this engine. kRawQK: the scan reads q and k from the input and applies
// per-row factors (a scalar gate comes with the delta rule here: GDN), instead of reading the
// prep's gated tiles Qg and W'.
struct Kda {
  static constexpr bool kDelta = true, kScalarGate = false, kRawQK = false;
};
struct Gdn {
  static constexpr bool kDelta = true, kScalarGate = true, kRawQK = true;
};
struct Gla {
  static constexpr bool kDelta = false, kScalarGate = false, kRawQK = false;
};

// The prep's triangle is four 16-row blocks (pair_of, the exponent table's rows, the warp split):
// the chunk length is not a free parameter of this engine.
static_assert(kChunk == 64, "the prep cuts a chunk into four 16-row blocks");
constexpr int kBT = kChunk;
// Prep warps: KDA runs 8 (three CTAs per SM: twice the warps per scheduler to hide the MUFU and
// shared-memory latencies of its gate work; DESIGN.md says how the work is cut for them); GDN
// (five CTAs per SM) and GLA (four) run 4.
template <class F>
constexpr int prep_warps() { return F::kDelta && !F::kScalarGate ? 8 : 4; }
// CTAs of the prep per SM (its __launch_bounds__): KDA 3, GDN 5, GLA 4.
template <class F>
constexpr int prep_ctas_per_sm() { return F::kDelta && !F::kScalarGate ? 3 : F::kScalarGate ? 5 : 4; }
// Scan warps: four row blocks times VB / 32 column groups of 32 columns (VB = 32: two groups of
// 16). The 128-column scan (16 warps, one stage read per chunk for all of a head's columns; KDA
// and GLA) is for calls with more sequence-heads than 64-column slices fit in one wave.
constexpr int scan_warps(int vb) { return vb == 128 ? 16 : 8; }

constexpr int cmax(int a, int b) { return a > b ? a : b; }

// Workspace block of one (chunk, value head), in bytes; without the delta rule there is no W'
// (the scan reads v from the input, as it does with the delta rule). F::kRawQK (scalar gate with the
// delta rule: GDN): no W', Qg tiles; their factors are per row, so the scan reads q, k from the
// input and applies the row factors. The A slot holds tril(A_qk) (no delta rule) or AM =
// tril(A_qk) Minv (delta rule: KDA, GDN), as bf16 hi + lo planes, and tril(A_qk) (GLA) as one
// bf16 plane (as FLA keeps A); lower triangular in 16 x 16 blocks, whose six zero blocks the prep
// does not write and the scan does not copy (6 of KDA's 64.5 KB per chunk and head). The lo plane
// is written and read on the four diagonal blocks only: those carry q_i.k_i, most of o for short
// sequences, whose digits bf16 alone loses for nearly orthogonal rows (GDN with one plane came to
// 5.2e-3 at T = 1, over the 5e-3 tolerance); the blocks below the diagonal are one bf16 plane as A
// is in FLA (3 KB less written and read per chunk and head).
template <class F>
constexpr int a_planes() { return F::kDelta ? 2 : 1; }
// per-row factors: KDA beta_i; GDN qs e^{G_i}, beta_i and -beta_i ks e^{G_i}
template <class F>
constexpr int row_factors() { return F::kRawQK ? 3 : F::kDelta ? 1 : 0; }

template <int K, class F>
struct Work {
  static constexpr int QK = F::kRawQK ? 0 : kBT * K * 2;
  static constexpr int kAPlanes = a_planes<F>();
  static constexpr int kRowFactors = row_factors<F>();
  // Delta rule: the A slot holds tril(A_qk) Minv and Kt^T = (Minv^T Kd)^T ([K][64]) the Kd slot
  // (KDA) or the W slot (GDN, whose W slot is otherwise unused); KDA's W slot holds W' = -beta k
  // e^G (no Minv)
  static constexpr int oW = 0, oQ = oW + (F::kDelta ? kBT * K * 2 : 0), oKd = oQ + QK, oA = oKd + QK,
                       oDL = oA + kAPlanes * kBT * kBT * 2, oRF = oDL + K * 4, bytes = oRF + kRowFactors * kBT * 4;
  static constexpr int oKt = F::kRawQK ? oW : oKd;
  static_assert(bytes % 16 == 0, "16-byte aligned blocks");
};

// F::kScalarGate (GDN): no Kr, no exponent table, no per-channel block sums (tril(A_qk) goes to R1 once
// Minv is out, the per-row values live in TB until then): 43 KB at K = 128, five CTAs per SM.
template <int K, class F>
struct PrepLayout {
  static constexpr int LDK = K + 8, LDT = kBT + 8, MS = kBT + 4;
  static constexpr int oR1 = 0;
  static constexpr int oKRAW = oR1 + cmax(kBT * LDK * 2, kBT * MS * 4);
  static constexpr int oKR = oKRAW + kBT * LDK * 2;
  // Kr, then tril(A_qk) in fp32 (KDA); nothing without the delta rule or for scalar gates
  static constexpr int oTB = oKR + (F::kDelta && !F::kScalarGate ? cmax(kBT * LDK * 2, kBT * MS * 4) : 0);
  static constexpr int oTAB = oTB + kBT * LDT * 2;
  // per block: gate sum and first gate, per channel; dt_bias. Scalar gates: G, qs, ks per row,
  // and with the other per-row values inside TB (all dead once M is complete, before Minv)
  static constexpr int oBT = F::kScalarGate ? oTB : oTAB + 15 * K * 4;
  static constexpr int oBETA = oBT + (F::kScalarGate ? 3 * kBT * 4 : 9 * K * 4);
  static constexpr int oGS = oBETA + kBT * 4;
  static constexpr int oQK = oGS + kBT * 4;  // q.k of each row, fp32 (the diagonal of A_qk)
  // KDA: the row scales qs, ks of the gate pass
  static constexpr int oNRM = oQK + kBT * 4;
  // the mbarrier on which the tiles' bulk copies complete (sm_90+), then the steep blocks' bits
  // (per-channel gates: bit I set where block I has a steep channel)
  static constexpr int oMBAR = F::kScalarGate ? oTAB : oNRM + (F::kDelta ? 2 * kBT * 4 : 0);
  static constexpr int oSTEEP = oMBAR + 8;
  static constexpr int bytes = oMBAR + 16;
  static_assert(!F::kScalarGate || oQK + kBT * 4 <= oTAB, "per-row values fit TB");
  static_assert(oMBAR % 16 == 0, "aligned mbarrier slot");
  // TB holds the exact path of steep diagonal blocks while the pair products run (KDA: between the
  // gate tile and Minv): per warp that takes diagonal pairs (GLA: all four; KDA: warps 6, 7) the
  // local gate (16 x 16 fp32) and raw q, k (16 x 16 bf16) of one k-step; then GLA's row factors of
  // q and k (KDA's are in NRM).
  static constexpr int oXS = oTB, oRQ = oXS + 4 * 2048, oRK = oRQ + kBT * 4;
  static_assert(oRK + kBT * 4 <= oTAB, "exact-path scratch fits the Minv buffer");
};

// A diagonal block (no delta rule) is steep when some channel decays by more than this inside it:
// its left factor e^{G_bI - G_eI} could overflow there, so its pair products are taken per element
// instead (exact for any decay).
constexpr float kSteepSpan = 64.0f;
// KDA keeps Kr = k ks e^{G_bI - G_i} (>= 1) for its diagonal pair products: a channel is steep in a
// block where it decays by more than this inside it (Kr would approach fp32's limit e^88); a
// bounded gate (lower_bound >= -5: at most 75 in a block) never is. first, sum: the block's first
// log-decay and its total, as the gate pass stores them (the table decides from the same floats).
constexpr float kKdaSteepSpan = 80.0f;
// The KDA gate that never makes a block steep: in the kernel with lower_bound >= -5 (the
// prep's kAnyDecay = false instantiation).
inline bool kda_bounded_gate(const Recurrence& r) { return r.gate_in_kernel && r.has_lb && r.lb >= -5.0; }
__device__ __forceinline__ bool kda_steep(float first, float sum) { return first - sum > kKdaSteepSpan; }

// sU holds the v slice read from the input, replaced in place by Y with the delta rule (sm_80; on
// sm_90a Y^T takes a buffer of its own, oYT, for KDA at VB >= 64, so that Qg S, which reads S^T,
// can still run while Y^T is written; else the S^T buffer). F::kRawQK: sW holds Kt^T, sQ and sKd the
// raw q and k. kCompact (the segments' summary scan at up to 64 columns and K <= 128,
// compact_summary): no Qg / q and no A slots, and Y^T in the S^T buffer (there is no Qg S to
// overlap), so that two CTAs share an SM.
template <int K, int VB, class F, bool kCompact = false>
struct ScanLayout {
  static constexpr int LDK = K + 8, LDV = VB + 8, LDT = kBT + 8;
  static constexpr int sW = 0, sQ = sW + (F::kDelta ? kBT * LDK * 2 : 0), sKd = sQ + (kCompact ? 0 : kBT * LDK * 2),
                       sA = sKd + kBT * LDK * 2, sU = sA + (kCompact ? 0 : a_planes<F>() * kBT * LDT * 2),
                       sDL = sU + kBT * LDV * 2, sRF = sDL + K * 4,
                       stage = (sRF + row_factors<F>() * kBT * 4 + 1023) / 1024 * 1024;
  // (stages on 1024-byte boundaries: sm_90a keeps the products' left operands and S^T there in the
  // 128-byte swizzle, wgmma.cuh)
  // (VB = 32 keeps Y^T in S^T: its A100 KDA scan at K = 128 has no 4 KB to spare)
  static constexpr bool kYtOwn = F::kDelta && !F::kRawQK && VB >= 64 && !kCompact;
  // stages streamed: two (one chunk ahead) up to K = 128; one at K = 256 (a stage is ~124 KB)
  static constexpr int kStages = K <= 128 ? 2 : 1;
  static constexpr int oS = kStages * stage, oYT = oS + K * LDV * 2, bytes = oYT + (kYtOwn ? VB * kBT * 2 : 0);
  static_assert(oYT % 1024 == 0, "Y^T on a 1024-byte boundary (128-byte swizzle)");
  static constexpr int sKt = F::kRawQK ? sW : sKd;  // Kt^T [K][64] (delta rule), in the 128-byte swizzle
  static_assert(sKt % 1024 == 0 && K * kBT * 2 <= kBT * LDK * 2, "Kt^T fits its slot");
  static_assert(sQ % 1024 == 0 && sKd % 1024 == 0 && VB * K * 2 <= K * LDV * 2, "swizzled tiles fit their slots");
};

// The states-only scan's compact layout and two CTAs an SM (its shared memory fits twice, its
// registers held to 128): up to 64 columns at K <= 128. GDN's summary scan at 1x131072 H2/HV4 in 16
// segments (H200): 349 -> 296 us. KDA's at 128 columns keeps the full layout, one CTA an SM: the
// compact one was 3% slower there, and two CTAs of 64 columns no faster (274 against 269 us).
constexpr bool compact_summary(int K, int vb, bool states_only) { return states_only && vb <= 64 && K <= 128; }
constexpr int scan_ctas_per_sm(int K, int vb, bool states_only) { return compact_summary(K, vb, states_only) ? 2 : 1; }
// The layout of the scan kernel with these template arguments (the kernel and its launch agree on it).
template <int K, int VB, class F, bool kStatesOnly>
using ScanLayoutOf = ScanLayout<K, VB, F, compact_summary(K, VB, kStatesOnly)>;

// Key head sizes with kernels (the instantiations/ folder holds one translation unit per family and
// K). The value head size is no template parameter: the scan slices V into VB-column CTAs, so any
// multiple of 64 runs (FLA's default GatedDeltaNet has V = 2K; chunk::tensor_core_declines).
constexpr bool head_size_supported(int64_t n) { return n == 64 || n == 128 || n == 256; }

__device__ __forceinline__ uint32_t& u32at(bf16* p) { return *reinterpret_cast<uint32_t*>(p); }
__device__ __forceinline__ float2 bf2(const bf16* p) { return unpack(*reinterpret_cast<const uint32_t*>(p)); }

using chunk::half8_to_bf16;
using chunk::half8_to_bf16_at;
using chunk::ld2;
using chunk::pack_out;
using chunk::store_out2;

}  // namespace chunk_prep_scan
}  // namespace cula
