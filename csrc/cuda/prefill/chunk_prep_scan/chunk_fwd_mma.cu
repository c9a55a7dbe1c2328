// Chunked forward (WY/UT form) on tensor cores, sm_80 instruction set (mma.sync, ldmatrix,
// cp.async); runs on Ampere, Hopper and Blackwell. Three families share this engine, switched by
// template parameters: KDA (per-channel gate, bounded, delta rule), GDN (scalar gate: the pair
// products take e^{G_i - G_j} per element, exact for any decay; delta rule) and GLA (per-channel
// gate, any decay, no delta rule). Simple GLA and Lightning go to chunk_fwd_fused.cu (no inverse and
// a per-pair scalar factor, so no workspace).
//
// Two kernels and a workspace (plus a prefix sum of chunk counts for varlen):
//  prep (one CTA per chunk of 64 tokens and value head, all chunks in parallel): everything of a
//    chunk that does not depend on the state. With G the inclusive cumulative log-decay and
//    block I = tokens 16I..16I+15 (b_I its first token, e_I its last):
//      el_i = e^{G_i - G_bI} (<= 1);  Kr_j = k_j e^{G_bJ - G_j} (>= 1, bounded by the decay inside
//      one 16-token block);  A[i,j] = sum_c (k_i el_i E_IJ)[c] Kr_j[c], E_IJ = e^{G_bI - G_bJ}:
//      every exponent splits through the first token of i's block, so no factor overflows.
//      M = I + diag(beta) strict_lower(A_kk); Minv by 16x16 blocks (diagonal blocks by substitution
//      in fp32, the rest by products: the 32-row halves' inverses, then the quarter below them).
//    Vnew = U + W S with U = Minv (beta v), W = -Minv (beta k e^G) is Minv Y, Y = beta v + W' S,
//    W' = -beta k e^G; so the prep never forms U or W (nor reads v): o's intra-chunk part
//    tril(A_qk) Vnew = AM Y with AM = tril(A_qk) Minv, and the update Kd^T Vnew = Kt^T Y with
//    Kt = Minv^T Kd. It writes per chunk: W', Qg = q e^G, Kt^T (Kd = k e^{G_last - G}; stored
//    [channel][token], the update's left operand K-major), AM in bf16 (the product from fp32
//    tril(A_qk); its diagonal blocks, which carry q_i.k_i, as hi + lo for ~16 bits), beta and
//    e^{G_last} (fp32): 55.5 KB written for K = 128 (the zero blocks above the diagonal are not).
//    GDN (scalar gate): no W', Qg (their factors are per row): the scan reads q and k from the
//    input and applies the row factors qs e^{G_i} (to q S) and -beta ks e^{G_i} (to k S); Kt =
//    Minv^T diag(ks e^{G_last - G}) k in the W slot, AM as KDA's (diagonal blocks hi + lo), 24 KB written.
//    GLA (no delta rule, no bound): only A_qk (one plane), Qg, Kd and e^{G_last} (40.5 KB). Off the diagonal
//    the right operand goes through the end of its own block, Kt_j = k_j e^{G_eJ - G_j}, and the
//    left through E'_IJ = e^{G_bI - G_eJ}: all three factors <= 1 for any decay. Diagonal blocks
//    take the same Kt against Ql e^{G_bI - G_eI} (a per-channel factor >= 1); where some channel
//    decays by more than 64 inside the block (that factor could overflow) the block's products
//    are recomputed per element in fp32 (exact_diagonal: raw q, k and gate re-read, one k-step at
//    a time through a per-warp scratch in the Minv buffer). No Kr tile: 56 KB, four CTAs per SM.
//  scan (one CTA per sequence, value head and VB columns of V, chunks in order, the state slice
//    S (K x VB, fp32) in registers; 8 warps, the second four on the other half of the columns, or
//    16 warps on four quarters of VB = 128):
//    Y = beta v + W' S (v read from the input);  o = Qg S + AM Y;  S = e^{G_last} S + Kt^T Y.
//    The next chunk's workspace streams in by cp.async (2 stages). GDN: Qg S = diag(qs e^G) (q S)
//    and W' S = diag(-beta ks e^G) (k S) scale rows of the accumulators.
//    Without the delta rule Vnew = v (the stage's v slice): o = Qg S + tril(A_qk) v, S += Kd^T v.
// The in-block exponent bound (<= 15 |lower_bound|) is why the dispatch table sends only bounded
// KDA gates (lower_bound >= -5) here; unbounded KDA gates take the recurrent kernel.
//
// prep, GDN and GLA: 4 warps; warp w owns chunk rows 16w..16w+15 for the element-wise work (norms,
// gate, el, Kt, Kd); the ten lower 16x16 block pairs of A (and of AM) are dealt round-robin to the
// warps and Kt is split by column tiles, so the triangle costs every warp the same. GLA's gate pass
// takes a channel pair per thread down the 16 rows of the warp's block (the block total first, for
// Kt's factors through the block's end); the block sums meet in shared memory.
// prep, KDA: 8 warps (three CTAs of 80 registers per SM: six warps per scheduler to hide the MUFU
// and shared-memory latencies of the gate work). Row norms with 4 lanes per row. The gate pass takes
// a channel pair per thread down the 16 rows of block w % 4 (warps w and w + 4 the two halves of the
// channels), so the running sum of the log-decays needs no shuffles; the gate comes from a bf16
// tile copied into TB and TAB with q and k, or from global memory four rows ahead. Pair products:
// the six off-diagonal pairs one per warp, the diagonal ones (no E factor) two each to warps 6 and
// 7; M written by the owner of the pair; Minv by the first four warps while the last four write
// W' and Kd of their row blocks (they would wait at the barriers otherwise); then tril(A_qk) in
// fp32 by the pair owners and Kt by 16-column tiles; the AM pairs dealt by cost. The code is kept
// small on purpose (rolled loops): a fully unrolled body thrashed the instruction cache
// (docs/NOTES.md).
// Shared buffers (KDA at K = 128: 75 KB, three CTAs per SM; GDN 43 KB, five): R1 q tile -> q el
// -> M (fp32) (GDN: -> tril(A_qk) in fp32 once Minv is out);
// KRAW k tile -> k el (or Kt) -> Kd; KR Kr -> tril(A_qk) in fp32 (absent for GLA); TB + TAB
// KDA's bf16 gate tile until the block sums are out; TB Minv (or the exact path's scratch, row
// factors and steep flags); TAB per-channel exponent rows; BT block sums and
// dt_bias; per-row beta, scalar gate and fp32 q.k; KDA's row scales qs, ks.
// Tile loads: on sm_90+ one bulk copy per row of q, k (and KDA's gate tile), completing on an
// mbarrier (no per-thread 16-byte copies and their address arithmetic); cp.async on sm_80.
// Barriers: B_a0 tiles in; B_a1 row scales (KDA); B_b block sums; B_c Kr and table; B_c2 pair
// products done (GLA stops after writing A_qk); B_e M; B_f diagonal inverses (KDA: barrier 1, warps
// 4-7 only arrive); B_f2 Minv's blocks (1,0) and (3,2) (KDA: barrier 2, warps 0-3); B_g Minv (KDA:
// also W', Kd out and Kr free); B_h tril(A_qk) in fp32 (KDA: in the
// Kr buffer; GDN: in R1).
// scan: 8 warps (16 at VB = 128); warp w owns rows 16(w%4).. of the token-side products and
// channels (w%4)*K/4.. of the state, for column group w/4 of the slice (halves; quarters of 32
// columns at VB = 128). Two stages of (W', Qg, Kt, AM hi and lo, v slice (Y in its place),
// e^{G_last}, row factors) and S (bf16): 180 KB for K = 128, VB = 64, one CTA per SM (163 KB at
// VB = 32, which an A100 block holds; 212 KB at VB = 128; GLA: no W'; GDN: Kt, raw q, k in the W',
// Qg, Kd slots).
// Barriers per chunk: B1 stage in and S written; B2 Y written (delta rule; the column group's
// four warps only, named barrier 1 + group); B3 stage free.
// sm_90a: the products with S (Y's W' S and o's Qg S; GDN's k S and q S) are warpgroup products
// (wgmma m64n32k16 / m64n16k16, warps 4j..4j+3 = column group j, the accumulators in the same
// registers as the mma.sync path's): S is kept in shared memory transposed, S^T, and it and the two
// left operands of the stage sit in the 128-byte swizzle (wgmma.cuh), so each group reads S once
// instead of each warp reading it (a quarter of the S traffic). Each thread fences its stage and S
// writes to the async proxy before B1, and the group waits for its products before Y is written.
// With the delta rule the state update is one too: S sits in the registers of the warpgroup row
// layout (StateSlice kWgRows: warp w holds channels 64 mt + 16 (w%4)..), Y goes transposed into
// the S^T buffer (S^T is consumed by then; B2 orders it), the update S = e^{G_last} S + Kt^T Y runs
// asynchronously behind o's AM Y products (which read Y^T by ldmatrix), and S^T is written back
// after B3. The Kt^T slot of the stage is swizzled on every path (the sm_80 update reads it with
// ldmatrix at swizzled addresses).
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <initializer_list>
#include <mutex>
#include <string>
#include <type_traits>

#include "common/error.h"
#include "cuda/runtime/check.h"
#include "cuda/runtime/runtime.h"
#include "cuda/common/recurrence_math.cuh"
#include "cuda/kerutils/mbarrier.cuh"
#include "cuda/kerutils/mma.cuh"
#include "cuda/kerutils/wgmma.cuh"
#include "cuda/prefill/chunk_engines.h"
#include "cuda/prefill/chunk_common.cuh"
#include "cuda/common/fwd_params.cuh"
#include "cuda/prefill/state_slice.cuh"

namespace cula {
namespace {

using bf16 = __nv_bfloat16;
using mma::pack;
using mma::unpack;

constexpr int kBT = kChunk;
// Prep warps: KDA runs 8 (three CTAs per SM: twice the warps per scheduler to hide the MUFU and
// shared-memory latencies of its gate work; the design note above says how the work is cut for
// them); GDN (five CTAs per SM) and GLA (four) run 4.
constexpr int prep_warps(bool delta, bool scalar) { return delta && !scalar ? 8 : 4; }
// Scan warps: four row blocks times VB / 32 column groups of 32 columns (VB = 32: two groups of
// 16). The 128-column scan (16 warps, one stage read per chunk for all of a head's columns; KDA
// and GLA) is for calls with more sequence-heads than 64-column slices fit in one wave.
constexpr int scan_warps(int vb) { return vb == 128 ? 16 : 8; }

constexpr int cmax(int a, int b) { return a > b ? a : b; }

// Workspace block of one (chunk, value head), in bytes; without the delta rule there is no W'
// (the scan reads v from the input, as it does with the delta rule). RAWQK (scalar gate with the
// delta rule: GDN): no W', Qg tiles; their factors are per row, so the scan reads q, k from the
// input and applies the row factors. The A slot holds tril(A_qk) (no delta rule) or AM =
// tril(A_qk) Minv (delta rule: KDA, GDN), as bf16 hi + lo planes, and tril(A_qk) (GLA) as one
// bf16 plane (as FLA keeps A); lower triangular in 16 x 16 blocks, whose six zero blocks the prep
// does not write and the scan does not copy (6 of KDA's 64.5 KB per chunk and head). The lo plane
// is written and read on the four diagonal blocks only: those carry q_i.k_i, most of o for short
// sequences, whose digits bf16 alone loses for nearly orthogonal rows (GDN with one plane came to
// 5.2e-3 at T = 1, over the 5e-3 tolerance); the blocks below the diagonal are one bf16 plane as A
// is in FLA (3 KB less written and read per chunk and head).
constexpr int a_planes(bool delta) { return delta ? 2 : 1; }
// per-row factors: KDA beta_i; GDN qs e^{G_i}, beta_i and -beta_i ks e^{G_i}
constexpr int row_factors(bool delta, bool rawqk) { return rawqk ? 3 : delta ? 1 : 0; }

template <int K, int V, bool DELTA, bool RAWQK>
struct Work {
  static constexpr int QK = RAWQK ? 0 : kBT * K * 2;
  static constexpr int kAPlanes = a_planes(DELTA);
  static constexpr int kRowFactors = row_factors(DELTA, RAWQK);
  // Delta rule: the A slot holds tril(A_qk) Minv and Kt^T = (Minv^T Kd)^T ([K][64]) the Kd slot
  // (KDA) or the W slot (GDN, whose W slot is otherwise unused); KDA's W slot holds W' = -beta k
  // e^G (no Minv)
  static constexpr int oW = 0, oQ = oW + (DELTA ? kBT * K * 2 : 0), oKd = oQ + QK, oA = oKd + QK,
                       oDL = oA + kAPlanes * kBT * kBT * 2, oRF = oDL + K * 4, bytes = oRF + kRowFactors * kBT * 4;
  static constexpr int oKt = RAWQK ? oW : oKd;
  static_assert(bytes % 16 == 0, "16-byte aligned blocks");
};

// SCALAR (GDN): no Kr, no exponent table, no per-channel block sums (tril(A_qk) goes to R1 once
// Minv is out, the per-row values live in TB until then): 43 KB at K = 128, five CTAs per SM.
template <int K, bool DELTA, bool SCALAR>
struct PrepLayout {
  static constexpr int LDK = K + 8, LDT = kBT + 8, MS = kBT + 4;
  static constexpr int oR1 = 0;
  static constexpr int oKRAW = oR1 + cmax(kBT * LDK * 2, kBT * MS * 4);
  static constexpr int oKR = oKRAW + kBT * LDK * 2;
  // Kr, then tril(A_qk) in fp32 (KDA); nothing without the delta rule or for scalar gates
  static constexpr int oTB = oKR + (DELTA && !SCALAR ? cmax(kBT * LDK * 2, kBT * MS * 4) : 0);
  static constexpr int oTAB = oTB + kBT * LDT * 2;
  // per block: gate sum and first gate, per channel; dt_bias. Scalar gates: G, qs, ks per row,
  // and with the other per-row values inside TB (all dead once M is complete, before Minv)
  static constexpr int oBT = SCALAR ? oTB : oTAB + 15 * K * 4;
  static constexpr int oBETA = oBT + (SCALAR ? 3 * kBT * 4 : 9 * K * 4);
  static constexpr int oGS = oBETA + kBT * 4;
  static constexpr int oQK = oGS + kBT * 4;  // q.k of each row, fp32 (the diagonal of A_qk)
  // KDA: the row scales qs, ks of the gate pass
  static constexpr int oNRM = oQK + kBT * 4;
  // the mbarrier on which the tiles' bulk copies complete (sm_90+)
  static constexpr int oMBAR = SCALAR ? oTAB : oNRM + (DELTA ? 2 * kBT * 4 : 0);
  static constexpr int bytes = oMBAR + 16;
  static_assert(!SCALAR || oQK + kBT * 4 <= oTAB, "per-row values fit TB");
  static_assert(oMBAR % 16 == 0, "aligned mbarrier slot");
  // Without the delta rule TB (no Minv) holds the exact path of steep diagonal blocks: per warp the
  // local gate (16 x 16 fp32) and raw q, k (16 x 16 bf16) of one k-step; then the row factors of
  // q and k and a steep flag per block.
  static constexpr int oXS = oTB, oRQ = oXS + 4 * 2048, oRK = oRQ + kBT * 4, oSTEEP = oRK + kBT * 4;
  static_assert(oSTEEP + 16 <= oTAB, "exact-path scratch fits the Minv buffer");
};

// A diagonal block (no delta rule) is steep when some channel decays by more than this inside it:
// its left factor e^{G_bI - G_eI} could overflow there, so its pair products are taken per element
// instead (exact for any decay).
constexpr float kSteepSpan = 64.0f;

// sU holds the v slice read from the input, replaced in place by Y with the delta rule (sm_80; on
// sm_90a Y^T takes a buffer of its own, oYT, for KDA at VB >= 64, so that Qg S, which reads S^T,
// can still run while Y^T is written; else the S^T buffer). RAWQK: sW holds Kt^T, sQ and sKd the
// raw q and k.
template <int K, int VB, bool DELTA, bool RAWQK>
struct ScanLayout {
  static constexpr int LDK = K + 8, LDV = VB + 8, LDT = kBT + 8;
  static constexpr int sW = 0, sQ = sW + (DELTA ? kBT * LDK * 2 : 0), sKd = sQ + kBT * LDK * 2, sA = sKd + kBT * LDK * 2,
                       sU = sA + a_planes(DELTA) * kBT * LDT * 2, sDL = sU + kBT * LDV * 2, sRF = sDL + K * 4,
                       stage = (sRF + row_factors(DELTA, RAWQK) * kBT * 4 + 1023) / 1024 * 1024;
  // (stages on 1024-byte boundaries: sm_90a keeps the products' left operands and S^T there in the
  // 128-byte swizzle, wgmma.cuh)
  // (VB = 32 keeps Y^T in S^T: its A100 KDA scan at K = 128 has no 4 KB to spare)
  static constexpr bool kYtOwn = DELTA && !RAWQK && VB >= 64;
  static constexpr int oS = 2 * stage, oYT = oS + K * LDV * 2, bytes = oYT + (kYtOwn ? VB * kBT * 2 : 0);
  static_assert(oYT % 1024 == 0, "Y^T on a 1024-byte boundary (128-byte swizzle)");
  static constexpr int sKt = RAWQK ? sW : sKd;  // Kt^T [K][64] (delta rule), in the 128-byte swizzle
  static_assert(sKt % 1024 == 0 && K * kBT * 2 <= kBT * LDK * 2, "Kt^T fits its slot");
  static_assert(sQ % 1024 == 0 && sKd % 1024 == 0 && VB * K * 2 <= K * LDV * 2, "swizzled tiles fit their slots");
};

// Rows of the per-channel exponent table.
__device__ __forceinline__ int tab_pair(int I, int J) { return I * (I - 1) / 2 + J; }  // e^{G_bI - G_bJ}, J < I
constexpr int kTabEb = 6;     // + I: e^{G_bI}
constexpr int kTabEd = 10;    // + J: e^{G_last - G_bJ}
constexpr int kTabLast = 14;  // e^{G_last}

// Block pair number m >= 0 of the lower triangle, (0,0) (1,0) (1,1) (2,0) ... (3,3) for m = 0..9, as
// (I, J); I = J = -1 for m >= 10.
__device__ __forceinline__ void pair_of(int m, int& I, int& J) {
  I = m < 1 ? 0 : m < 3 ? 1 : m < 6 ? 2 : m < 10 ? 3 : -1;
  J = I < 0 ? -1 : m - I * (I + 1) / 2;
}

__device__ __forceinline__ uint32_t& u32at(bf16* p) { return *reinterpret_cast<uint32_t*>(p); }
__device__ __forceinline__ float2 bf2(const bf16* p) { return unpack(*reinterpret_cast<const uint32_t*>(p)); }
// Eight consecutive per-channel factors (two 16-byte loads from shared memory).
__device__ __forceinline__ void load8(const float* p, float (&f)[8]) {
  *reinterpret_cast<float4*>(f) = *reinterpret_cast<const float4*>(p);
  *reinterpret_cast<float4*>(f + 4) = *reinterpret_cast<const float4*>(p + 4);
}
// Eight bf16 values (16 bytes) times their channels' factors, each rounded once.
__device__ __forceinline__ uint4 scale8(uint4 v, const float (&f)[8]) {
  uint32_t* w = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 x = unpack(w[j]);
    w[j] = pack(x.x * f[2 * j], x.y * f[2 * j + 1]);
  }
  return v;
}

template <int K, int V, bool SCALAR, bool DELTA>
__global__ void __launch_bounds__(32 * prep_warps(DELTA, SCALAR), DELTA && !SCALAR ? 3 : SCALAR ? 5 : 4)
    chunk_prep_kernel(const FwdParams p, const int32_t* __restrict__ chunk_base, unsigned char* __restrict__ work) {
  static_assert(DELTA || !SCALAR, "scalar gates without the delta rule take chunk_fwd_fused");
  using Ly = PrepLayout<K, DELTA, SCALAR>;
  using Wk = Work<K, V, DELTA, SCALAR>;  // scalar gates come with the delta rule here
  constexpr int LDK = Ly::LDK, LDT = Ly::LDT, MS = Ly::MS;
  constexpr int KS = K / 16;
  constexpr int NW = prep_warps(DELTA, SCALAR), NT = 32 * NW, KH = NW / 4;  // KH: warps per row block
  static_assert(KH == 1 || (DELTA && !SCALAR), "8 prep warps: KDA");
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* q_s = reinterpret_cast<bf16*>(smem + Ly::oR1);
  float* m_s = reinterpret_cast<float*>(smem + Ly::oR1);
  bf16* k_s = reinterpret_cast<bf16*>(smem + Ly::oKRAW);
  bf16* ck_s = reinterpret_cast<bf16*>(smem + Ly::oKRAW);
  float* bsum_s = reinterpret_cast<float*>(smem + Ly::oBT);           // [4][K] gate sum of block I
  float* bfirst_s = reinterpret_cast<float*>(smem + Ly::oBT) + 4 * K;  // [4][K] first gate of block I
  float* bias_s = reinterpret_cast<float*>(smem + Ly::oBT) + 8 * K;    // [K] dt_bias
  bf16* kr_s = reinterpret_cast<bf16*>(smem + Ly::oKR);
  bf16* t_s = reinterpret_cast<bf16*>(smem + Ly::oTB);
  float* tab = reinterpret_cast<float*>(smem + Ly::oTAB);
  float* beta_s = reinterpret_cast<float*>(smem + Ly::oBETA);
  float* gs_s = reinterpret_cast<float*>(smem + Ly::oGS);
  float* qk_s = reinterpret_cast<float*>(smem + Ly::oQK);
  // scalar gates: cumulative gate, q and k row factors (the per-channel block-sum area is free)
  float* grow_s = bsum_s;
  float* qsc_s = bsum_s + kBT;
  float* ksc_s = bsum_s + 2 * kBT;
  // no delta rule: the exact path of steep diagonal blocks (TB is free: no Minv)
  float* rowq_s = reinterpret_cast<float*>(smem + Ly::oRQ);
  float* rowk_s = reinterpret_cast<float*>(smem + Ly::oRK);
  int* steep_s = reinterpret_cast<int*>(smem + Ly::oSTEEP);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  // row block I of this warp; with 8 warps kh is which of the row block's two warps it is (the
  // channel half of the gate pass, the k-step parity of Qg)
  const int I = KH == 1 ? warp : warp & 3, bI = 16 * I, kh = KH == 1 ? 0 : warp >> 2;
  // Chunks from the last to the first: the scan starts on the first ones, so the prep writes them
  // last and they are still in L2 then.
  const unsigned task = gridDim.x - 1 - blockIdx.x;
  const int hv = static_cast<int>(task % p.HV);
  const int cidx = static_cast<int>(task / p.HV);  // global chunk index
  int n, ci;
  if (!chunk::locate(p, chunk_base, cidx, n, ci)) return;
  const Seq sq = seq_of(p, n);
  const int64_t t0 = sq.bos + static_cast<int64_t>(ci) * kBT;
  const int Lc = static_cast<int>(min(int64_t{kBT}, sq.eos - t0));
  const int b_row = sq.b_row;
  const int h = hv / (p.HV / p.H);
  unsigned char* blk = work + (static_cast<int64_t>(cidx) * p.HV + hv) * Wk::bytes;

  float eA = 1.0f;  // e^{A_log}, taken once the tiles are in (see below)
  const float head_bias = (p.gate_in_kernel && p.dt_bias && !p.dt_bias_per_channel) ? dev::ld(p.dt_bias, p.bias_dt, hv) : 0.0f;
  const float const_decay =
      p.gate_kind == 2 ? -dev::ld(p.decay, p.decay_dt, p.decay_heads == p.HV ? hv : (hv / (p.HV / p.H))) : 0.0f;
  const uint4 zero4 = make_uint4(0, 0, 0, 0);
  // KDA with a bf16 gate: the chunk's gate tile streams into shared memory with q and k (TB and TAB
  // are free until Minv and the exponent table), so the rolled k-step loop reads it without a
  // global-memory latency per step (the register prefetch one step ahead converted bf16 to fp32
  // right after the load, so it waited at once: ~20% of the prep's warp time). Unpadded rows (the
  // gate pass reads a row's consecutive channel pairs across the lanes: no bank conflicts).
  constexpr bool kGateTileFits = DELTA && !SCALAR && Ly::oBT - Ly::oTB >= kBT * K * 2;
  const bool gate_tile = kGateTileFits && p.g_dt == CULA_BFLOAT16;
  bf16* gt_s = reinterpret_cast<bf16*>(smem + Ly::oTB);
  auto gate_at = [&](int row, int col) { return gt_s + row * K + col; };
  // log-decay of one element from its raw gate
  auto activate = [&](float x) {
    if (p.gate_in_kernel && p.gate_kind != 2) x = dev::activate_gate(x, eA, p.has_lb, p.lb);
    return dev::chunk_log_decay(x);
  };

  // ---- q, k (and per-channel gate) tiles; rows past the sequence are zeros. The small loads (A_log,
  // beta, the scalar gate, a per-channel dt_bias) go out first as raw bits and are converted once
  // the tiles are in: a conversion right behind its load held every warp there (~3% of the prep's
  // stall samples), and issued after the copies the loads added their latency to the tiles'.
  const int64_t row_at = t0 + min(tid, kBT - 1);  // (tid >= kBT reads nothing per row)
  const bool row_loads = tid < kBT && tid < Lc;
  const uint32_t alog_bits = p.gate_in_kernel && p.A_log ? dev::ld_bits(p.A_log, p.A_dt, hv) : 0u;
  const uint32_t beta_bits =
      DELTA && row_loads ? dev::ld_bits(p.beta, p.beta_dt, b_row * p.beta_s[0] + row_at * p.beta_s[1] + hv * p.beta_s[2]) : 0u;
  const uint32_t gs_bits =
      SCALAR && p.gate_kind == 1 && row_loads ? dev::ld_bits(p.g, p.g_dt, b_row * p.g_s[0] + row_at * p.g_s[1] + hv * p.g_s[2]) : 0u;
  const bool bias_per_channel = !SCALAR && tid < K && p.gate_in_kernel && p.dt_bias && p.dt_bias_per_channel;
  const uint32_t bias_bits = bias_per_channel ? dev::ld_bits(p.dt_bias, p.bias_dt, hv * K + tid) : 0u;
#if CULA_BULK_COPY
  // sm_90+: one bulk copy per tile row (thread tid: row tid % 64 of q, k or the gate tile), all
  // completing on one mbarrier; thread 0 arrives with the bytes to expect. Rows past the sequence
  // are zeros (q, k) or never read (the gate).
  uint64_t* tiles_in = reinterpret_cast<uint64_t*>(smem + Ly::oMBAR);
  if (tid == 0) {
    mbar::init(tiles_in, 1);
    mbar::fence_init();
  }
  __syncthreads();  // the mbarrier initialised
  {
    static_assert(2 * kBT <= NT && (!kGateTileFits || 3 * kBT <= NT), "a thread per tile row");
    const int tiles = gate_tile ? 3 : 2, r = tid % kBT, which = tid / kBT;
    if (which < tiles) {
      const int64_t tok = t0 + r;
      const bf16* src = which == 0   ? static_cast<const bf16*>(p.q) + b_row * p.q_s[0] + tok * p.q_s[1] + h * p.q_s[2]
                        : which == 1 ? static_cast<const bf16*>(p.k) + b_row * p.k_s[0] + tok * p.k_s[1] + h * p.k_s[2]
                                     : static_cast<const bf16*>(p.g) + b_row * p.g_s[0] + tok * p.g_s[1] + hv * p.g_s[2];
      bf16* dst = which == 0 ? q_s + r * LDK : which == 1 ? k_s + r * LDK : gt_s + r * K;
      if (r < Lc) {
        mma::bulk_copy(dst, src, K * 2, tiles_in);
      } else if (which < 2) {
#pragma unroll
        for (int c8 = 0; c8 < K; c8 += 8) *reinterpret_cast<uint4*>(dst + c8) = zero4;
      }
    }
    if (tid == 0) mbar::arrive_expect_tx(tiles_in, static_cast<uint32_t>(tiles * Lc * K * 2));
  }
#else
  {
    using CopyK = chunk::TileCopy<kBT, K, NT>;
    const CopyK ck(tid);
    const bf16* q_in = static_cast<const bf16*>(p.q) + b_row * p.q_s[0] + t0 * p.q_s[1] + h * p.q_s[2] + ck.c8;
    const bf16* k_in = static_cast<const bf16*>(p.k) + b_row * p.k_s[0] + t0 * p.k_s[1] + h * p.k_s[2] + ck.c8;
#pragma unroll
    for (int j = 0; j < CopyK::J; ++j) {
      const int r = ck.row(j);
      bf16 *dq = q_s + r * LDK + ck.c8, *dk = k_s + r * LDK + ck.c8;
      if (r < Lc) {
        mma::cp_async16(dq, q_in + r * p.q_s[1]);
        mma::cp_async16(dk, k_in + r * p.k_s[1]);
      } else {
        *reinterpret_cast<uint4*>(dq) = zero4;
        *reinterpret_cast<uint4*>(dk) = zero4;
      }
    }
    if (gate_tile) {  // rows past the sequence are never read (the gate pass)
      const bf16* g_in = static_cast<const bf16*>(p.g) + b_row * p.g_s[0] + t0 * p.g_s[1] + hv * p.g_s[2] + ck.c8;
#pragma unroll
      for (int j = 0; j < CopyK::J; ++j) {
        const int r = ck.row(j);
        if (r < Lc) mma::cp_async16(gate_at(r, ck.c8), g_in + r * p.g_s[1]);
      }
    }
    mma::cp_async_commit();
  }
#endif
  // Raw per-channel gate of channels col, col + 1 at chunk row `row` from global memory (KDA's gate
  // tile is read by the gate pass itself); zeros past the sequence
  auto raw_gate = [&](int row, int col) {
    float2 v = make_float2(0.0f, 0.0f);
    if (!SCALAR && row < Lc) {
      const int64_t off = b_row * p.g_s[0] + (t0 + row) * p.g_s[1] + hv * p.g_s[2] + col;
      v = p.g_dt == CULA_FLOAT32 ? *reinterpret_cast<const float2*>(static_cast<const float*>(p.g) + off)
                                 : bf2(static_cast<const bf16*>(p.g) + off);
    }
    return v;
  };
  // Raw gate of one k-step of the A-fragment elements of the block from row r0: element 2rr + h is
  // row r0 + g + 8(rr&1), channel 16kk + 2t + 8(rr>>1) + h.
  auto load_gate = [&](int r0, int kk, float (&x)[8]) {
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) {
      const float2 v = raw_gate(r0 + g + 8 * (rr & 1), 16 * kk + 2 * t + 8 * (rr >> 1));
      x[2 * rr] = v.x, x[2 * rr + 1] = v.y;
    }
  };
  // The local cumulative log-decay of those elements: gate activation; inclusive sum down the
  // block by shuffles (rows g and g + 8 of a channel live in the lanes with this t); minus the
  // block's first row, so a[e] = G_i - G_b (<= 0). first and total of element 4cs + hc's channel:
  // its gate at the first row and its sum over the block.
  // (GLA's exact path of steep diagonal blocks)
  auto block_scan = [&](int r0, int kk, float (&a)[8], float (&first)[2][2], float (&total)[2][2]) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int row = r0 + g + 8 * ((e >> 1) & 1), col = 16 * kk + 2 * t + 8 * (e >> 2) + (e & 1);
      a[e] = row < Lc ? activate(a[e] + bias_s[col]) : 0.0f;
    }
#pragma unroll
    for (int cs = 0; cs < 2; ++cs)
#pragma unroll
      for (int hc = 0; hc < 2; ++hc) {
        float& x = a[4 * cs + hc];      // row g
        float& y = a[4 * cs + 2 + hc];  // row g + 8
#pragma unroll
        for (int d = 1; d < 8; d <<= 1) {
          const float xu = __shfl_up_sync(0xffffffffu, x, 4 * d), yu = __shfl_up_sync(0xffffffffu, y, 4 * d);
          if (g >= d) x += xu, y += yu;
        }
        y += __shfl_sync(0xffffffffu, x, 28 + t);
        first[cs][hc] = __shfl_sync(0xffffffffu, x, t), total[cs][hc] = __shfl_sync(0xffffffffu, y, 28 + t);
        x -= first[cs][hc], y -= first[cs][hc];
      }
  };
#if CULA_BULK_COPY
  mbar::wait(tiles_in, 0);
#else
  mma::cp_async_wait_all();
#endif
  if (p.gate_in_kernel && p.A_log) eA = __expf(dev::from_bits(alog_bits, p.A_dt));
  if (tid < kBT) {
    float b = 0.0f;
    if (DELTA && row_loads) {
      b = dev::from_bits(beta_bits, p.beta_dt);
      if (p.beta_sigmoid) b = __fdividef(p.beta_mult, 1.0f + __expf(-b));
    }
    beta_s[tid] = b;
    gs_s[tid] = SCALAR && p.gate_kind == 1 && row_loads ? dev::from_bits(gs_bits, p.g_dt) : 0.0f;
  }
  if (!SCALAR && tid < K) bias_s[tid] = bias_per_channel ? dev::from_bits(bias_bits, p.bias_dt) : head_bias;
  __syncthreads();  // B_a0: tiles landed

  if constexpr (DELTA && !SCALAR) {
    // ---- KDA. Row norms: 4 lanes per row (warp w rows 8w..8w+7), each lane K / 4 channels in
    // 16-byte pieces 16c + 8(p & 1) + 64(p >> 1), so the two rows of a quarter warp hit disjoint
    // banks; the row scales go to shared memory for the gate pass.
    float* rs_s = reinterpret_cast<float*>(smem + Ly::oNRM);  // qs per row, then ks per row
    {
      const int row = 8 * warp + (lane >> 2), c = lane & 3;
      float q2 = 0.0f, k2 = 0.0f, qk = 0.0f;
#pragma unroll
      for (int pc = 0; pc < K / 32; ++pc) {
        const int col = 16 * c + 8 * (pc & 1) + 64 * (pc >> 1);
        const uint4 qv = *reinterpret_cast<const uint4*>(q_s + row * LDK + col);
        const uint4 kv = *reinterpret_cast<const uint4*>(k_s + row * LDK + col);
        const uint32_t* qw = reinterpret_cast<const uint32_t*>(&qv);
        const uint32_t* kw = reinterpret_cast<const uint32_t*>(&kv);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 a = unpack(qw[j]), b = unpack(kw[j]);
          q2 += a.x * a.x + a.y * a.y;
          k2 += b.x * b.x + b.y * b.y;
          qk += a.x * b.x + a.y * b.y;
        }
      }
#pragma unroll
      for (int o = 1; o < 4; o <<= 1) {
        q2 += __shfl_xor_sync(0xffffffffu, q2, o);
        k2 += __shfl_xor_sync(0xffffffffu, k2, o);
        qk += __shfl_xor_sync(0xffffffffu, qk, o);
      }
      if (c == 0) {
        const float qsr = p.l2norm ? p.scale * rsqrtf(q2 + 1e-6f) : p.scale;
        const float ksr = p.l2norm ? rsqrtf(k2 + 1e-6f) : 1.0f;
        rs_s[row] = qsr, rs_s[kBT + row] = ksr;
        // The diagonal of A_qk in fp32 from the unrounded rows: for short sequences it is most of
        // o, and q.k of two nearly orthogonal rows loses its digits to bf16 rounding of q el and Kr.
        qk_s[row] = qsr * ksr * qk;
      }
    }
    __syncthreads();  // B_a1: row scales visible

    // ---- KDA gate pass, a channel pair per thread down the 16 rows of block I (warps w and w + 4
    // the two halves of the channels; 64 pairs per block, so at K = 64 the second half has none):
    // log-decay, its running sum d_i = G_i - G_bI (<= 0) with no shuffles; Kr = k ks e^{-d} (KR)
    // and in place Kl = k ks e^d, Ql = q qs e^d; the block's first gate and total per channel.
    // Rows go four at a time (a rolled loop keeps the code small), their raw gates loaded a step
    // ahead. The pass is compiled once per gate source (from_tile: std::bool_constant): with the
    // source chosen per load, the tile reads carried the global path's 64-bit offsets and dtype
    // branches (~2.8 K of a chunk's ~32 K warp instructions).
    // The dispatch takes KDA here only with the gate in the kernel and a lower bound lb >= -5
    // (chunk_fwd_mma_accepts), so the log-decay is lb sigmoid(eA (x + dt_bias)), in [lb, 0]: the
    // chunk_log_decay clamp at -64 never acts and is left out. The pass works in log2 units (every
    // exponential an ex2 of its argument as it is): the sigmoid's exponent is one FMA of the raw
    // gate (eA log2 e and its product with dt_bias per channel, once), and the sums go back to
    // natural units once per channel at the end.
    auto gate_pass = [&](auto from_tile) {
      constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
      const float neg_ea2 = -eA * kLog2e, lb2 = p.lb * kLog2e;
      for (int cp = 32 * kh + lane; cp < K / 2; cp += 64) {
        const int c0 = 2 * cp;
        auto load_rows = [&](int i0, float (&x)[8]) {
#pragma unroll
          for (int ii = 0; ii < 4; ++ii) {
            const int row = bI + i0 + ii;
            float2 v;
            if constexpr (decltype(from_tile)::value) v = row < Lc ? bf2(gate_at(row, c0)) : make_float2(0.0f, 0.0f);
            else v = raw_gate(row, c0);
            x[2 * ii] = v.x, x[2 * ii + 1] = v.y;
          }
        };
        // -eA log2(e) (x + dt_bias) = neg_ea2 x + nb
        const float nb0 = neg_ea2 * bias_s[c0], nb1 = neg_ea2 * bias_s[c0 + 1];
        float run0 = 0.0f, run1 = 0.0f, first0 = 0.0f, first1 = 0.0f, xn[8];
        load_rows(0, xn);
#pragma unroll 1
        for (int i0 = 0; i0 < 16; i0 += 4) {
          float x[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) x[e] = dev::ex2_ftz(fmaf(neg_ea2, xn[e], (e & 1) ? nb1 : nb0));
          if (i0 + 4 < 16) load_rows(i0 + 4, xn);
#pragma unroll
          for (int e = 0; e < 8; ++e) x[e] = bI + i0 + (e >> 1) < Lc ? __fdividef(lb2, 1.0f + x[e]) : 0.0f;
          if (i0 == 0) first0 = x[0], first1 = x[1];
#pragma unroll
          for (int ii = 0; ii < 4; ++ii) {
            const int row = bI + i0 + ii;
            run0 += x[2 * ii], run1 += x[2 * ii + 1];
            // |d| <= 15 |lower_bound| log2 e <= 109: every factor a normal float
            const float e0 = dev::ex2_ftz(run0 - first0), e1 = dev::ex2_ftz(run1 - first1);
            const float r0 = dev::ex2_ftz(first0 - run0), r1 = dev::ex2_ftz(first1 - run1);
            const float qsr = rs_s[row], ksr = rs_s[kBT + row];
            const float2 kv = bf2(k_s + row * LDK + c0), qv = bf2(q_s + row * LDK + c0);
            u32at(kr_s + row * LDK + c0) = pack(kv.x * ksr * r0, kv.y * ksr * r1);
            u32at(k_s + row * LDK + c0) = pack(kv.x * ksr * e0, kv.y * ksr * e1);
            u32at(q_s + row * LDK + c0) = pack(qv.x * qsr * e0, qv.y * qsr * e1);
          }
        }
        bsum_s[I * K + c0] = run0 * kLn2, bsum_s[I * K + c0 + 1] = run1 * kLn2;
        bfirst_s[I * K + c0] = first0 * kLn2, bfirst_s[I * K + c0 + 1] = first1 * kLn2;
      }
    };
    if (gate_tile) gate_pass(std::true_type{});
    else gate_pass(std::false_type{});
    __syncthreads();  // B_b: block sums visible
  } else {
    // ---- row norms of this warp's rows (before the tiles are scaled in place)
    float qs[2], ks[2];
    {
      float q2[2] = {0.0f, 0.0f}, k2[2] = {0.0f, 0.0f}, qk[2] = {0.0f, 0.0f};
#pragma unroll 1
      for (int kk = 0; kk < KS; ++kk)
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
          const int row = bI + g + 8 * (rr & 1), col = 16 * kk + 2 * t + 8 * (rr >> 1);
          const float2 qv = bf2(q_s + row * LDK + col), kv = bf2(k_s + row * LDK + col);
          q2[rr & 1] += qv.x * qv.x + qv.y * qv.y;
          k2[rr & 1] += kv.x * kv.x + kv.y * kv.y;
          qk[rr & 1] += qv.x * kv.x + qv.y * kv.y;
        }
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        q2[x] += __shfl_xor_sync(0xffffffffu, q2[x], 1);
        q2[x] += __shfl_xor_sync(0xffffffffu, q2[x], 2);
        k2[x] += __shfl_xor_sync(0xffffffffu, k2[x], 1);
        k2[x] += __shfl_xor_sync(0xffffffffu, k2[x], 2);
        qk[x] += __shfl_xor_sync(0xffffffffu, qk[x], 1);
        qk[x] += __shfl_xor_sync(0xffffffffu, qk[x], 2);
      }
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        qs[x] = p.l2norm ? p.scale * rsqrtf(q2[x] + 1e-6f) : p.scale;
        ks[x] = p.l2norm ? rsqrtf(k2[x] + 1e-6f) : 1.0f;
        // The diagonal of A_qk in fp32 from the unrounded rows: for short sequences it is most of o,
        // and q.k of two nearly orthogonal rows loses its digits to bf16 rounding of q el and Kr.
        if (t == 0) {
          qk_s[bI + g + 8 * x] = qs[x] * ks[x] * qk[x];
          if (SCALAR) qsc_s[bI + g + 8 * x] = qs[x], ksc_s[bI + g + 8 * x] = ks[x];
          if (!DELTA) rowq_s[bI + g + 8 * x] = qs[x], rowk_s[bI + g + 8 * x] = ks[x];
        }
      }
    }

    if constexpr (SCALAR) {
      // One log-decay per row: warp 0 scans the 64 rows (lane holds rows lane and lane + 32); rows
      // past the sequence add nothing, so row 63 holds G_last.
      if (warp == 0) {
        float x[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int row = lane + 32 * hh;
          x[hh] = row < Lc ? activate(p.gate_kind == 1 ? gs_s[row] + head_bias : const_decay) : 0.0f;
#pragma unroll
          for (int d = 1; d < 32; d <<= 1) {
            const float u = __shfl_up_sync(0xffffffffu, x[hh], d);
            if (lane >= d) x[hh] += u;
          }
        }
        x[1] += __shfl_sync(0xffffffffu, x[0], 31);
        grow_s[lane] = x[0], grow_s[lane + 32] = x[1];
      }
      __syncthreads();  // B_b: row gates and row factors visible
    } else {

      // ---- GLA gate pass, a channel pair per thread down the 16 rows of this warp's block (two
      // pairs per lane; the row scales come from this warp's norms): the 16 rows' log-decays into
      // registers (their loads in flight together), the block's first gate and total; then in place
      // Kt = k ks e^{G_eI - G_i} (<= 1, through the block's last row e_I) and Ql = q qs e^{G_i - G_bI}.
      __syncwarp();
      bool steep = false;
#pragma unroll 1
      for (int cp = lane; cp < K / 2; cp += 32) {
        const int c0 = 2 * cp;
        float x[32];  // row i, channel c0 + h at 2i + h
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          // (raw_gate's form, written out: through the lambda this loop measured 3-4% slower)
          float2 v = make_float2(0.0f, 0.0f);
          if (bI + i < Lc) {
            const int64_t off = b_row * p.g_s[0] + (t0 + bI + i) * p.g_s[1] + hv * p.g_s[2] + c0;
            v = p.g_dt == CULA_FLOAT32 ? *reinterpret_cast<const float2*>(static_cast<const float*>(p.g) + off)
                                       : bf2(static_cast<const bf16*>(p.g) + off);
          }
          x[2 * i] = v.x + bias_s[c0], x[2 * i + 1] = v.y + bias_s[c0 + 1];
        }
        if (p.gate_in_kernel && p.gate_kind != 2) dev::activate_gates(x, eA, p.has_lb, p.lb);
        float run[2] = {0.0f, 0.0f};
#pragma unroll
        for (int e = 0; e < 32; ++e) {
          x[e] = bI + (e >> 1) < Lc ? dev::chunk_log_decay(x[e]) : 0.0f;
          run[e & 1] += x[e];  // the block's total, summed down the rows
        }
        const float first[2] = {x[0], x[1]}, total[2] = {run[0], run[1]};
        steep |= first[0] - total[0] > kSteepSpan || first[1] - total[1] > kSteepSpan;
        run[0] = run[1] = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const int row = bI + i;
          run[0] += x[2 * i], run[1] += x[2 * i + 1];
          const float d0 = run[0] - first[0], d1 = run[1] - first[1];
          const float e0 = dev::exp_ftz(d0), e1 = dev::exp_ftz(d1);
          const float t0 = dev::exp_ftz(total[0] - first[0] - d0), t1 = dev::exp_ftz(total[1] - first[1] - d1);
          const float qsr = rowq_s[row], ksr = rowk_s[row];
          const float2 kv = bf2(k_s + row * LDK + c0), qv = bf2(q_s + row * LDK + c0);
          u32at(k_s + row * LDK + c0) = pack(kv.x * ksr * t0, kv.y * ksr * t1);
          u32at(q_s + row * LDK + c0) = pack(qv.x * qsr * e0, qv.y * qsr * e1);
        }
        bsum_s[I * K + c0] = total[0], bsum_s[I * K + c0 + 1] = total[1];
        bfirst_s[I * K + c0] = first[0], bfirst_s[I * K + c0 + 1] = first[1];
      }
      steep = __any_sync(0xffffffffu, steep);
      if (lane == 0) steep_s[I] = steep;
      __syncthreads();  // B_b: block sums visible
    }
  }
  if constexpr (!SCALAR) {
    // ---- per-channel exponent table; without the delta rule the right operands (Kt) are taken
    // through the last row of their block, so the pair and Kd factors are too (all <= 1)
    // (8 warps: the pair rows by the first K threads, the others by the next K)
    if (tid < KH * K) {
      const int c = tid % K;
      float gb[4], ge[4], gl = 0.0f;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        gb[b] = gl + bfirst_s[b * K + c];
        gl += bsum_s[b * K + c];
        ge[b] = DELTA ? gb[b] : gl;
      }
      if (KH == 1 || tid < K)
#pragma unroll
        for (int b = 1; b < 4; ++b)
#pragma unroll
          for (int a = 0; a < b; ++a) tab[tab_pair(b, a) * K + c] = dev::exp_ftz(gb[b] - ge[a]);
      if (KH == 1 || tid >= K) {
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          tab[(kTabEb + b) * K + c] = dev::exp_ftz(gb[b]);
          tab[(kTabEd + b) * K + c] = dev::exp_ftz(gl - ge[b]);
        }
        tab[kTabLast * K + c] = dev::exp_ftz(gl);
      }
    }
    __syncthreads();  // B_c: Kr and the table visible
  }

  // Exact A_qk of diagonal block Ib (no delta rule): sum_c q_i k_j e^{G_i - G_j} per element
  // (j < i), the local gate recomputed from the raw one and raw q, k re-read, one k-step at a time
  // through this warp's scratch; acc in the mma C-fragment layout.
  auto exact_diagonal = [&](int Ib, float (&acc)[2][4]) {
    float* xs = reinterpret_cast<float*>(smem + Ly::oXS + warp * 2048);
    bf16* qr = reinterpret_cast<bf16*>(smem + Ly::oXS + warp * 2048 + 1024);
    bf16* kr = qr + 256;
    const int r0 = 16 * Ib;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[nt][r] = 0.0f;
#pragma unroll 1
    for (int kk = 0; kk < KS; ++kk) {
      float a[8], first[2][2], total[2][2];
      load_gate(r0, kk, a);
      block_scan(r0, kk, a, first, total);
#pragma unroll
      for (int e = 0; e < 8; ++e) xs[(g + 8 * ((e >> 1) & 1)) * 16 + 2 * t + 8 * (e >> 2) + (e & 1)] = a[e];
      {
        const int row = lane >> 1, c8 = (lane & 1) * 8;
        uint4 qv = zero4, kv = zero4;
        if (r0 + row < Lc) {
          const int64_t tok = t0 + r0 + row;
          qv = *reinterpret_cast<const uint4*>(static_cast<const bf16*>(p.q) + b_row * p.q_s[0] + tok * p.q_s[1] + h * p.q_s[2] + 16 * kk + c8);
          kv = *reinterpret_cast<const uint4*>(static_cast<const bf16*>(p.k) + b_row * p.k_s[0] + tok * p.k_s[1] + h * p.k_s[2] + 16 * kk + c8);
        }
        *reinterpret_cast<uint4*>(qr + row * 16 + c8) = qv;
        *reinterpret_cast<uint4*>(kr + row * 16 + c8) = kv;
      }
      __syncwarp();
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const int i = g + 8 * (r >> 2), j = 8 * ((r >> 1) & 1) + 2 * t + (r & 1);
        if (j >= i) continue;
        float sum = 0.0f;
#pragma unroll 4
        for (int c = 0; c < 16; ++c)
          sum += __bfloat162float(qr[i * 16 + c]) * __bfloat162float(kr[j * 16 + c]) * __expf(xs[i * 16 + c] - xs[j * 16 + c]);
        acc[(r >> 1) & 1][(r & 1) + 2 * (r >> 2)] += sum;
      }
      __syncwarp();
    }
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const int i = g + 8 * (r >> 2), j = 8 * ((r >> 1) & 1) + 2 * t + (r & 1);
      acc[(r >> 1) & 1][(r & 1) + 2 * (r >> 2)] *= rowq_s[r0 + i] * rowk_s[r0 + j];
    }
  };

  // ---- pair products A_kk, A_qk over the ten lower block pairs (Ib, Jb), dealt to the warps
  // round-robin (three or two each, so the triangle costs every warp about the same); the operands
  // come from shared memory, off the diagonal scaled by E_{Ib,Jb} (KDA: the right one, Kr of rows
  // Jb; GLA: the left one, q el of rows Ib). Qg = q el e^{G_bI} of this warp's rows goes straight out. Scalar gates multiply the
  // plain products by e^{G_i - G_j} per pair afterwards (exact for any decay), so the operands
  // are the raw q, k tiles.
  // (0,0) (1,0) (1,1) (2,0) (2,1) (2,2) (3,0) (3,1) (3,2) (3,3), pair q of warp w is number w + 4q
  // (8 warps: the six off-diagonal pairs one each, the cheaper diagonal ones (no E factor) two each
  // to the last two warps, as pair numbers in two nibble tables; Qg of row block I by the warp of its
  // k-step's parity)
  constexpr int QP = (10 + NW - 1) / NW;  // pairs per warp
  int pi[QP], pj[QP];
#pragma unroll
  for (int q = 0; q < QP; ++q) {
    int m = warp + NW * q;
    if (NW == 8) m = ((q == 0 ? 0x20876431u : 0x95FFFFFFu) >> (4 * warp)) & 15;
    pair_of(m, pi[q], pj[q]);
  }
  float akk[QP][2][4], aqk[QP][2][4];
#pragma unroll
  for (int q = 0; q < QP; ++q)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) akk[q][nt][r] = 0.0f, aqk[q][nt][r] = 0.0f;
  bf16* qgo = reinterpret_cast<bf16*>(blk + Wk::oQ);
  const bf16* right_s = SCALAR || !DELTA ? k_s : kr_s;  // Kt without the delta rule
  constexpr int kPairUnroll = DELTA && !SCALAR ? 2 : 1;
#pragma unroll kPairUnroll
  for (int kk = 0; kk < KS; ++kk) {
    if (!SCALAR && (kk & (KH - 1)) == kh) {
      // Qg of the k-step's 16 channels, 16 bytes per lane: row lane % 16, channels 8 (lane / 16)..
      // (the quarter warps' shared-memory reads hit distinct banks; each row's 32 bytes go out
      // whole from one instruction)
      const int row = bI + (lane & 15), col = 16 * kk + 8 * (lane >> 4);
      float e[8];
      load8(tab + (kTabEb + I) * K + col, e);
      *reinterpret_cast<uint4*>(qgo + row * K + col) = scale8(*reinterpret_cast<const uint4*>(q_s + row * LDK + col), e);
    }
#pragma unroll
    for (int q = 0; q < QP; ++q) {
      if (pi[q] < 0) continue;
      const int Ib = pi[q], Jb = pj[q];
      uint32_t ak[4], aq[4], b[4];
      if (DELTA) mma::ldsm_x4(ak, k_s + (16 * Ib + mma::a_row(lane)) * LDK + 16 * kk + mma::a_col(lane));
      mma::ldsm_x4(aq, q_s + (16 * Ib + mma::a_row(lane)) * LDK + 16 * kk + mma::a_col(lane));
      mma::ldsm_x4(b, right_s + (16 * Jb + mma::bn_row(lane)) * LDK + 16 * kk + mma::bn_col(lane));
      if (DELTA && !SCALAR && Jb < Ib) {
        // KDA: E_{Ib,Jb} on the right operand, one fragment for both products (Kr e^{G_bI - G_bJ} =
        // k ks e^{G_bI - G_j} <= |k ks|); b[0], b[2] hold channels 2t, 2t + 1, b[1], b[3] 2t + 8, 2t + 9
#pragma unroll
        for (int h8 = 0; h8 < 2; ++h8) {
          const float2 e = *reinterpret_cast<const float2*>(tab + tab_pair(Ib, Jb) * K + 16 * kk + 2 * t + 8 * h8);
          const float2 x = unpack(b[h8]), y = unpack(b[h8 + 2]);
          b[h8] = pack(x.x * e.x, x.y * e.y);
          b[h8 + 2] = pack(y.x * e.x, y.y * e.y);
        }
      } else if (!DELTA && Jb < Ib) {
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
          const float2 e = *reinterpret_cast<const float2*>(tab + tab_pair(Ib, Jb) * K + 16 * kk + 2 * t + 8 * (rr >> 1));
          const float2 qv = unpack(aq[rr]);
          aq[rr] = pack(qv.x * e.x, qv.y * e.y);
        }
      } else if (!DELTA) {
        // Diagonal block without the delta rule: Ql e^{G_bI - G_eI} (per channel, <= e^64 unless
        // the block is steep and recomputed anyway) against Kt
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
          const int col = Ib * K + 16 * kk + 2 * t + 8 * (rr >> 1);
          const float2 qv = unpack(aq[rr]);
          aq[rr] = pack(qv.x * dev::exp_ftz(bfirst_s[col] - bsum_s[col]), qv.y * dev::exp_ftz(bfirst_s[col + 1] - bsum_s[col + 1]));
        }
      }
      if (DELTA) {
        mma::mma16816(akk[q][0], ak, b[0], b[1]);
        mma::mma16816(akk[q][1], ak, b[2], b[3]);
      }
      mma::mma16816(aqk[q][0], aq, b[0], b[1]);
      mma::mma16816(aqk[q][1], aq, b[2], b[3]);
    }
  }
  if constexpr (!DELTA) {
    // Steep diagonal blocks: the left factor e^{G_bI - G_eI} may have overflowed there, so their
    // products are replaced by sums taken per element, each pair with its own exponent.
#pragma unroll
    for (int q = 0; q < QP; ++q)
      if (pi[q] >= 0 && pi[q] == pj[q] && steep_s[pi[q]]) exact_diagonal(pi[q], aqk[q]);
  }
  __syncthreads();  // B_c2: every warp done with the k el tile (it becomes Kd next)
  if constexpr (SCALAR) {
    // This warp's rows, 16 bytes at a time: F = diag(ks e^{G_last - G_i}) k in place (Kt's right
    // operand); e^{G_last} for every channel; the scan's row factors (Work::RAWQK): qs e^{G_i} for
    // o = q S, beta_i and -beta_i ks e^{G_i} for Y = beta v - beta ks e^G (k S).
    const float glast = grow_s[kBT - 1];
    if (lane < 16) {
      const int row = bI + lane;
      float* rf = reinterpret_cast<float*>(blk + Wk::oRF);
      rf[row] = qsc_s[row] * dev::exp_ftz(grow_s[row]);
      rf[kBT + row] = beta_s[row];
      rf[2 * kBT + row] = -beta_s[row] * ksc_s[row] * dev::exp_ftz(grow_s[row]);
    }
    for (int idx = lane; idx < 16 * (K / 8); idx += 32) {
      const int row = bI + idx / (K / 8), c8 = (idx % (K / 8)) * 8;
      const float fw = ksc_s[row] * dev::exp_ftz(glast - grow_s[row]);
      const uint4 kv = *reinterpret_cast<const uint4*>(k_s + row * LDK + c8);
      uint4 ow;
      const uint32_t* kw = reinterpret_cast<const uint32_t*>(&kv);
      uint32_t* oww = reinterpret_cast<uint32_t*>(&ow);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 y = unpack(kw[j]);
        oww[j] = pack(y.x * fw, y.y * fw);
      }
      *reinterpret_cast<uint4*>(ck_s + row * LDK + c8) = ow;
    }
    if (tid < K) reinterpret_cast<float*>(blk + Wk::oDL)[tid] = __expf(glast);
  } else if constexpr (DELTA) {
    // KDA: W' and Kd are written by warps 4-7 while warps 0-3 invert M (below)
  } else {
    // Kd = Kt e^{G_last - G_eI} for this warp's rows, to the workspace (no delta rule)
    bf16* kdo = reinterpret_cast<bf16*>(blk + Wk::oKd);
    const int c8 = lane % (K / 8) * 8;  // the same channels in every row (as for KDA above)
    float ed[8];
    load8(tab + (kTabEd + I) * K + c8, ed);
    for (int idx = lane; idx < 16 * (K / 8); idx += 32) {
      const int row = bI + idx / (K / 8);
      *reinterpret_cast<uint4*>(kdo + row * K + c8) = scale8(*reinterpret_cast<const uint4*>(k_s + row * LDK + c8), ed);
    }
    if (tid < K) reinterpret_cast<float*>(blk + Wk::oDL)[tid] = tab[kTabLast * K + tid];
  }
  // ---- M = I + diag(beta) strict_lower(A_kk) for this warp's pairs into R1 (the q el tile, free
  // since B_c2); tril(A_qk) out (its blocks above the diagonal are not written).
  // Delta rule: tril(A_qk) in fp32 for the product tril(A_qk) Minv instead, into the Kr buffer once
  // B_d frees it (GDN: kept in registers until M is consumed, then into R1).
  float* af_s = reinterpret_cast<float*>(smem + (SCALAR ? Ly::oR1 : Ly::oKR));
  static_assert(!DELTA || SCALAR || Ly::oTB - Ly::oKR >= kBT * MS * 4, "fp32 A_qk fits the Kr buffer");
  // f(q, nt, hh, gi, gj) for the element pairs (gi, gj), (gi, gj + 1) of this warp's pair fragments
  auto each_pair = [&](auto&& f) {
#pragma unroll
    for (int q = 0; q < QP; ++q) {
      if (pi[q] < 0) continue;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) f(q, nt, hh, 16 * pi[q] + g + 8 * hh, 16 * pj[q] + nt * 8 + 2 * t);
    }
  };
  // tril(A_qk) with its fp32 diagonal
  auto masked_a = [&](int gi, int gj, float a) { return gj > gi ? 0.0f : gj == gi ? qk_s[gi] : a; };
  if constexpr (SCALAR)  // e^{G_i - G_j} <= 1 for j <= i, with the row factors of q_i, k_i, k_j
    each_pair([&](int q, int nt, int hh, int gi, int gj) {
      const float gri = grow_s[gi];
      const float e0 = dev::masked_exp_scale(gj <= gi, ksc_s[gj], gri - grow_s[gj]);
      const float e1 = dev::masked_exp_scale(gj + 1 <= gi, ksc_s[gj + 1], gri - grow_s[gj + 1]);
      aqk[q][nt][2 * hh] = masked_a(gi, gj, aqk[q][nt][2 * hh] * (qsc_s[gi] * e0));
      aqk[q][nt][2 * hh + 1] = masked_a(gi, gj + 1, aqk[q][nt][2 * hh + 1] * (qsc_s[gi] * e1));
      const float b = beta_s[gi];
      m_s[gi * MS + gj] = gj < gi ? b * (akk[q][nt][2 * hh] * (ksc_s[gi] * e0)) : (gj == gi ? 1.0f : 0.0f);
      m_s[gi * MS + gj + 1] = gj + 1 < gi ? b * (akk[q][nt][2 * hh + 1] * (ksc_s[gi] * e1)) : (gj + 1 == gi ? 1.0f : 0.0f);
    });
  if constexpr (DELTA && !SCALAR) {
    each_pair([&](int q, int nt, int hh, int gi, int gj) {
      const float b = beta_s[gi];
      m_s[gi * MS + gj] = gj < gi ? b * akk[q][nt][2 * hh] : (gj == gi ? 1.0f : 0.0f);
      m_s[gi * MS + gj + 1] = gj + 1 < gi ? b * akk[q][nt][2 * hh + 1] : (gj + 1 == gi ? 1.0f : 0.0f);
    });
  } else if constexpr (!DELTA) {
    bf16* aqo = reinterpret_cast<bf16*>(blk + Wk::oA);
    each_pair([&](int q, int nt, int hh, int gi, int gj) {
      u32at(aqo + gi * kBT + gj) = pack(masked_a(gi, gj, aqk[q][nt][2 * hh]), masked_a(gi, gj + 1, aqk[q][nt][2 * hh + 1]));
    });
    // (the blocks above the diagonal are neither written nor read: the scan copies the lower ones)
    return;  // no delta rule: no M, Minv, AM, Kt (the scan reads v itself)
  }
  __syncthreads();  // B_e: M complete
  // KDA, warps 4-7 while warps 0-3 invert M (they arrive at B_f at once: nothing they do needs it):
  // rows of block I: W' = -beta k e^G = -beta Kl e^{G_bI} to the workspace; Kd = Kr e^{G_last -
  // G_bI} in place of Kl (Kt's right operand); beta and e^{G_last} to the workspace. A lane takes
  // the same 8 channels in every row (the stride 32 is a multiple of K / 8), so their factors are
  // read once (read per row they were the prep's largest shared-memory traffic).
  auto w_kd_pass = [&] {
    bf16* wo = reinterpret_cast<bf16*>(blk + Wk::oW);
    const int c8 = lane % (K / 8) * 8;
    float eb[8], ed[8];
    load8(tab + (kTabEb + I) * K + c8, eb);
    load8(tab + (kTabEd + I) * K + c8, ed);
    static_assert(32 % (K / 8) == 0, "a lane's channels are the same in every row");
    for (int idx = lane; idx < 16 * (K / 8); idx += 32) {
      const int row = bI + idx / (K / 8);
      uint4 kv = *reinterpret_cast<const uint4*>(k_s + row * LDK + c8);
      const float b = -beta_s[row];
      uint32_t* w = reinterpret_cast<uint32_t*>(&kv);
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // (x e^{G_bI}) (-beta): not scale8, whose factor would round e^{G_bI} (-beta) first
        const float2 x = unpack(w[j]);
        w[j] = pack(x.x * eb[2 * j] * b, x.y * eb[2 * j + 1] * b);
      }
      *reinterpret_cast<uint4*>(wo + row * K + c8) = kv;
      *reinterpret_cast<uint4*>(ck_s + row * LDK + c8) = scale8(*reinterpret_cast<const uint4*>(kr_s + row * LDK + c8), ed);
    }
    if (lane < 16) reinterpret_cast<float*>(blk + Wk::oRF)[bI + lane] = beta_s[bI + lane];
    if (tid - 128 < K) reinterpret_cast<float*>(blk + Wk::oDL)[tid - 128] = tab[kTabLast * K + tid - 128];
  };
  // With p.block_barriers_only (for racecheck, which misreads the block barriers after a barrier
  // that some warps only arrive at) B_f is a block barrier and warps 4-7 start after it.
  const bool overlap_w_kd = DELTA && !SCALAR && !p.block_barriers_only;
  if constexpr (DELTA && !SCALAR) {
    if (overlap_w_kd && kh == 1) {
      mbar::named_arrive(1, 32 * NW);  // B_f
      w_kd_pass();
    }
  }
  // Diagonal blocks of Minv: lane c < 16 solves column c by substitution, in fp32.
  if (kh == 0 && lane < 16) {
    float xcol[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      float acc = i == lane ? 1.0f : 0.0f;
#pragma unroll
      for (int l = 0; l < i; ++l) acc -= m_s[(bI + i) * MS + bI + l] * xcol[l];
      xcol[i] = acc;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) t_s[(bI + i) * LDT + bI + lane] = __float2bfloat16_rn(xcol[i]);
  }
  if (overlap_w_kd) {
    if (kh == 0) mbar::named_sync(1, 32 * NW);  // B_f: diagonal inverses visible (warps 4-7 arrived)
  } else {
    __syncthreads();  // B_f: diagonal inverses visible
    if constexpr (DELTA && !SCALAR)
      if (kh == 1) w_kd_pass();
  }
  // Off-diagonal blocks by halves (the first four warps): Minv = [[Ainv, 0], [-Dinv C Ainv, Dinv]]
  // for M = [[A, 0], [C, D]] split at row 32. Blocks (1,0) and (3,2) (the halves' inverses: Minv_10
  // = -Minv_11 M_10 Minv_00) by warps 0 and 1; then the bottom-left quarter, block (r,c) = -sum_P Z_rP
  // Minv_Pc with Z_rP = sum_{L=2..r} Minv_rL M_LP, one block per warp. The products with a diagonal
  // inverse only go before the halves' barrier, so the chain is four products deep (it was nine, in
  // warp 0, behind three shared-memory round trips) and every warp has a share.
  // Z stays in registers: an accumulator is the A fragment of the next product.
  {
    auto m_frag_b = [&](int Lb, int Pb, uint32_t (&b)[4]) {  // M block (Lb, Pb) as the B operand [k][n], bf16
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // n-tile r / 2, k rows 2t (+ 8 for odd r)
        const float* col = m_s + (16 * Lb + 2 * t + 8 * (r & 1)) * MS + 16 * Pb + 8 * (r >> 1) + g;
        b[r] = pack(col[0], col[MS]);
      }
    };
    auto t_frag_a = [&](int Ib, int Lb, uint32_t (&a)[4]) {
      mma::ldsm_x4(a, t_s + (16 * Ib + mma::a_row(lane)) * LDT + 16 * Lb + mma::a_col(lane));
    };
    auto t_frag_b = [&](int Lb, int Pb, uint32_t (&b)[4]) {
      mma::ldsm_x4_t(b, t_s + (16 * Lb + mma::bk_row(lane)) * LDT + 16 * Pb + mma::bk_col(lane));
    };
    auto mma2 = [](float (&x)[2][4], const uint32_t (&a)[4], const uint32_t (&b)[4]) {
      mma::mma16816(x[0], a, b[0], b[1]);
      mma::mma16816(x[1], a, b[2], b[3]);
    };
    auto as_a = [](const float (&x)[2][4], uint32_t (&a)[4]) {  // accumulator -> A fragment
      a[0] = pack(x[0][0], x[0][1]), a[1] = pack(x[0][2], x[0][3]);
      a[2] = pack(x[1][0], x[1][1]), a[3] = pack(x[1][2], x[1][3]);
    };
    auto store_neg = [&](int Ib, int Jb, const float (&x)[2][4]) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          u32at(t_s + (16 * Ib + g + 8 * hh) * LDT + 16 * Jb + nt * 8 + 2 * t) = pack(-x[nt][2 * hh], -x[nt][2 * hh + 1]);
    };
    if (kh == 0) {
      uint32_t a[4], b[4];
      if (I < 2) {  // the halves: (1,0) by warp 0, (3,2) by warp 1
        const int Ib = 2 * I + 1, Jb = 2 * I;
        float z[2][4] = {}, x[2][4] = {};
        t_frag_a(Ib, Ib, a);
        m_frag_b(Ib, Jb, b);
        mma2(z, a, b);
        as_a(z, a);
        t_frag_b(Jb, Jb, b);
        mma2(x, a, b);
        store_neg(Ib, Jb, x);
      }
      // bottom-left quarter: warp 0 (3,1), warp 1 (2,1), warp 2 (2,0), warp 3 (3,0)
      const int r = I == 1 || I == 2 ? 2 : 3, c = I >= 2 ? 0 : 1;
      float z[2][2][4] = {};  // Z_rP, P = c..1 (unrolled: register arrays)
      t_frag_a(r, r, a);
#pragma unroll
      for (int P = 0; P < 2; ++P)  // Z_rP = Minv_rr M_rP (+ Minv_32 M_2P after the barrier, r = 3)
        if (P >= c) {
          m_frag_b(r, P, b);
          mma2(z[P], a, b);
        }
      // B_f2: (1,0) and (3,2) visible to the first four warps (all warps take part in the
      // block-barriers-only mode, where warps 4-7 are not busy elsewhere)
      mbar::named_sync(2, overlap_w_kd ? 128 : NT);
      if (r == 3) {
        t_frag_a(3, 2, a);
#pragma unroll
        for (int P = 0; P < 2; ++P)
          if (P >= c) {
            m_frag_b(2, P, b);
            mma2(z[P], a, b);
          }
      }
      float x[2][4] = {};
#pragma unroll
      for (int P = 0; P < 2; ++P)
        if (P >= c) {
          as_a(z[P], a);
          t_frag_b(P, c, b);
          mma2(x, a, b);
        }
      store_neg(r, c, x);
    } else if (!overlap_w_kd) {
      mbar::named_sync(2, NT);
    }
  }
  __syncthreads();  // B_g: Minv complete (KDA: W', Kd written, Kr no longer read)
  if constexpr (!SCALAR) {  // KDA: tril(A_qk) in fp32 into the Kr buffer
    each_pair([&](int q, int nt, int hh, int gi, int gj) {
      *reinterpret_cast<float2*>(af_s + gi * MS + gj) =
          make_float2(masked_a(gi, gj, aqk[q][nt][2 * hh]), masked_a(gi, gj + 1, aqk[q][nt][2 * hh + 1]));
    });
  } else {  // tril(A_qk) from registers into R1 (M is consumed)
    each_pair([&](int q, int nt, int hh, int gi, int gj) {
      *reinterpret_cast<float2*>(af_s + gi * MS + gj) = make_float2(aqk[q][nt][2 * hh], aqk[q][nt][2 * hh + 1]);
    });
  }
  // Kt = Minv^T Kd (Kd in the k tile), written transposed: Kt^T = Kd^T Minv, [channel][token], the
  // A operand of the scan's state update as it reads it (K-major). Each warp its 16-channel tiles:
  // token block Jb of Kt^T = sum_{Ib >= Jb} (Kd_Ib)^T Minv_{Ib,Jb}, Kd^T as A fragments (ldmatrix
  // .trans of the k tile), the ten Minv blocks as B fragments loaded once.
  // (KDA: before B_h, since it reads neither tril(A_qk) nor anything written after B_g, so the warps
  // reach B_h with this work done instead of waiting there for the tril(A_qk) writes: -1..-1.5%;
  // GDN's 4-warp prep measured 2% slower in that order, so it stays after AM)
  auto kt_pass = [&] {
    if (16 * NW <= K || 16 * warp < K) {  // (8 warps at K = 64: four idle)
      constexpr int KT = cmax(1, K / (16 * NW));  // 16-channel tiles per warp
      uint32_t mb[4][4][4];  // Minv block (Ib, Jb), Jb <= Ib, as the B operand [token i][token j]
#pragma unroll
      for (int Ib = 0; Ib < 4; ++Ib)
#pragma unroll
        for (int Jb = 0; Jb <= Ib; ++Jb)
          mma::ldsm_x4_t(mb[Ib][Jb], t_s + (16 * Ib + mma::bk_row(lane)) * LDT + 16 * Jb + mma::bk_col(lane));
      bf16* kto = reinterpret_cast<bf16*>(blk + Wk::oKt);
#pragma unroll 1
      for (int c0 = 16 * KT * warp, c1 = c0 + 16 * KT; c0 < c1; c0 += 16) {
        float acc[4][2][4] = {};
#pragma unroll
        for (int Ib = 0; Ib < 4; ++Ib) {
          uint32_t a[4];
          mma::ldsm_x4_t(a, ck_s + (16 * Ib + mma::at_row(lane)) * LDK + c0 + mma::at_col(lane));
#pragma unroll
          for (int Jb = 0; Jb <= Ib; ++Jb) {
            mma::mma16816(acc[Jb][0], a, mb[Ib][Jb][0], mb[Ib][Jb][1]);
            mma::mma16816(acc[Jb][1], a, mb[Ib][Jb][2], mb[Ib][Jb][3]);
          }
        }
#pragma unroll
        for (int Jb = 0; Jb < 4; ++Jb)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
              u32at(kto + (c0 + g + 8 * hh) * kBT + 16 * Jb + 8 * nt + 2 * t) = pack(acc[Jb][nt][2 * hh], acc[Jb][nt][2 * hh + 1]);
      }
    }
  };
  if constexpr (!SCALAR) kt_pass();
  __syncthreads();  // B_h: tril(A_qk) visible

  // Vnew = U + W S = Minv Y with Y = beta v + W' S, W' = -beta k e^G (the scan forms Y from v read
  // from the input), so the intra-chunk part of o is A Vnew = (tril(A_qk) Minv) Y and the state
  // update Kd^T Vnew = Kt^T Y with Kt = Minv^T Kd (GDN: Kd = diag(ks e^{G_last - G}) k): no U, W
  // products here and no v tile.
  // AM = tril(A_qk) Minv, block (Ib, Cb) = sum_{Jb=Cb..Ib} A_{Ib,Jb} Minv_{Jb,Cb}; the ten lower
  // block pairs dealt as for the pair products (4-6 k-steps per warp); A from fp32 as bf16 hi + lo
  // for the diagonal blocks, which come out as hi + lo, and as bf16 for those below the diagonal,
  // which come out as one bf16 plane.
  // (8 warps: the pairs dealt by cost, Ib - Cb + 1 steps: (3,0); (2,0); (3,1); (1,0); (2,1) and
  // (1,1); (3,2) and (2,2); (3,3); (0,0), as pair numbers in two nibble tables)
  bf16* amo = reinterpret_cast<bf16*>(blk + Wk::oA);
#pragma unroll
  for (int q = 0; q < (KH == 2 ? 2 : 3); ++q) {
    int Ib = pi[q], Cb = pj[q];
    if (KH == 2) pair_of(((q == 0 ? 0x09841736u : 0xFF52FFFFu) >> (4 * warp)) & 15, Ib, Cb);
    if (Ib < 0) continue;
    float acc[2][4] = {};
    // A's lo part only where the output keeps a lo plane (the diagonal blocks, one k-step): a block
    // written as one bf16 plane is rounded to bf16 anyway
    const bool a_lo = Wk::kAPlanes == 2 && Ib == Cb;
    for (int Jb = Cb; Jb <= Ib; ++Jb) {
      uint32_t ah[4], al[4], b[4];
#pragma unroll
      for (int rr = 0; rr < 4; ++rr) {
        const float2 x = *reinterpret_cast<const float2*>(af_s + (16 * Ib + g + 8 * (rr & 1)) * MS + 16 * Jb + 2 * t + 8 * (rr >> 1));
        ah[rr] = pack(x.x, x.y);
        const float2 h2 = unpack(ah[rr]);
        al[rr] = pack(x.x - h2.x, x.y - h2.y);
      }
      mma::ldsm_x4_t(b, t_s + (16 * Jb + mma::bk_row(lane)) * LDT + 16 * Cb + mma::bk_col(lane));
      mma::mma16816(acc[0], ah, b[0], b[1]);
      mma::mma16816(acc[1], ah, b[2], b[3]);
      if (a_lo) {
        mma::mma16816(acc[0], al, b[0], b[1]);
        mma::mma16816(acc[1], al, b[2], b[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int at = (16 * Ib + g + 8 * hh) * kBT + 16 * Cb + nt * 8 + 2 * t;
        const uint32_t hi = pack(acc[nt][2 * hh], acc[nt][2 * hh + 1]);
        u32at(amo + at) = hi;
        if (a_lo) {  // the lo plane (a diagonal block)
          const float2 h2 = unpack(hi);
          u32at(amo + kBT * kBT + at) = pack(acc[nt][2 * hh] - h2.x, acc[nt][2 * hh + 1] - h2.y);
        }
      }
  }
  if constexpr (SCALAR) kt_pass();
}

template <int K, int V, int VB, bool DELTA, bool RAWQK>
__global__ void __launch_bounds__(32 * scan_warps(VB), 1)
    chunk_scan_kernel(const FwdParams p, const int32_t* __restrict__ chunk_base, const unsigned char* __restrict__ work) {
  using Ly = ScanLayout<K, VB, DELTA, RAWQK>;
  using Wk = Work<K, V, DELTA, RAWQK>;
  constexpr int LDK = Ly::LDK, LDV = Ly::LDV, LDT = Ly::LDT;
  constexpr int KS = K / 16;
  constexpr int NW = scan_warps(VB), NTHR = 32 * NW, WH = NW / 4;  // WH: column groups
  constexpr int NTH = VB / (8 * WH);  // n-tiles per warp: warps 4j..4j+3 take column group j
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* s_s = reinterpret_cast<bf16*>(smem + Ly::oS);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int I = warp & 3, bI = 16 * I, hc0 = (warp >> 2) * (VB / WH);
  const chunk::SliceTask tk = chunk::slice_task<VB>(p, chunk_base);
  const int n = tk.n, hv = tk.hv, v0 = tk.v0, nchunks = tk.nchunks;
  const Seq sq = tk.sq;
  const int64_t cbase = tk.cbase;

  // sm_90a: the products with S as warpgroup products (design note above); with the delta rule the
  // state update too, which takes S in the warpgroup row layout and Y transposed (kYtOwn: in a
  // buffer of its own, else in the S^T buffer)
  constexpr bool kWg = CULA_WGMMA, kWgUpdate = kWg && DELTA, kYtOwn = kWg && Ly::kYtOwn;
  using Slice = StateSlice<K, VB, NW, kWgUpdate>;
  Slice S(warp, lane, v0);
  const int64_t slot = Slice::pool_slot(p, n);
  S.load(p, n, hv, slot);

  // One chunk's workspace slice (and v slice without the delta rule) into stage st (an empty
  // commit group past the end).
  constexpr int kMats = DELTA ? 3 : 2;  // (W,) Qg, Kd
  using CopyK = chunk::TileCopy<kBT, K, NTHR>;                   // W, Qg, Kd
  using CopyA = chunk::TileCopy<Wk::kAPlanes * kBT, kBT, NTHR>;  // A_qk (hi and lo planes)
  using CopyV = chunk::TileCopy<kBT, VB, NTHR>;                  // U or v slice
  using CopyKt = chunk::TileCopy<K, kBT, NTHR>;                  // Kt^T (delta rule)
  const CopyKt ckt(tid);
  const CopyK ck(tid);
  const CopyA ca(tid);
  const CopyV cv(tid);
  const bf16* v_in = static_cast<const bf16*>(p.v) + sq.b_row * p.v_s[0] + sq.bos * p.v_s[1] + hv * p.v_s[2] + v0 + cv.c8;
  const int h = hv / (p.HV / p.H);
  const bf16* q_in = static_cast<const bf16*>(p.q) + sq.b_row * p.q_s[0] + sq.bos * p.q_s[1] + h * p.q_s[2] + ck.c8;
  const bf16* k_in = static_cast<const bf16*>(p.k) + sq.b_row * p.k_s[0] + sq.bos * p.k_s[1] + h * p.k_s[2] + ck.c8;
  // The left operands of the products with S (W' or raw k, and Qg or raw q): on sm_90a in the
  // 128-byte swizzle for the warpgroup products, else padded rows for ldmatrix.
  auto left_at = [&](int r, int c8) { return kWg ? wg::sw128_offset(kBT, r, c8) : (r * LDK + c8) * 2; };
  auto state_to_smem = [&] {
    if constexpr (kWg) S.to_smem_t_sw128(mma::smem_addr(s_s), lane);
    else S.to_smem(s_s, LDV);
  };
  auto stage_in = [&](int c, int st) {
    if (c < nchunks) {
      const unsigned char* blk = work + ((cbase + c) * p.HV + hv) * Wk::bytes;
      unsigned char* dst = smem + st * Ly::stage;
      const int Lc = static_cast<int>(min(int64_t{kBT}, sq.eos - sq.bos - static_cast<int64_t>(c) * kBT));
      if constexpr (DELTA) {  // Kt^T [channel][token] from the workspace, in the 128-byte swizzle
#pragma unroll
        for (int j = 0; j < CopyKt::J; ++j)
          mma::cp_async16(dst + Ly::sKt + wg::sw128_offset(K, ckt.row(j), ckt.c8),
                          blk + Wk::oKt + (ckt.row(j) * kBT + ckt.c8) * 2);
      }
      if constexpr (RAWQK) {
        // Kt^T (above), q and k raw from the input (rows past the sequence zeros); row factors
#pragma unroll
        for (int j = 0; j < CopyK::J; ++j) {
          const int r = ck.row(j);
          unsigned char* dq = dst + Ly::sQ + left_at(r, ck.c8);
          unsigned char* dk = dst + Ly::sKd + left_at(r, ck.c8);
          if (r < Lc) {
            const int64_t tok = static_cast<int64_t>(c) * kBT + r;
            mma::cp_async16(dq, q_in + tok * p.q_s[1]);
            mma::cp_async16(dk, k_in + tok * p.k_s[1]);
          } else {
            *reinterpret_cast<uint4*>(dq) = make_uint4(0, 0, 0, 0);
            *reinterpret_cast<uint4*>(dk) = make_uint4(0, 0, 0, 0);
          }
        }
      } else {
#pragma unroll
        for (int m = 3 - kMats; m < (DELTA ? 2 : 3); ++m) {  // (Kt^T above)
          const int so = m == 0 ? Ly::sW : m == 1 ? Ly::sQ : Ly::sKd, go = m == 0 ? Wk::oW : m == 1 ? Wk::oQ : Wk::oKd;
#pragma unroll
          for (int j = 0; j < CopyK::J; ++j)
            mma::cp_async16(dst + so + (m < 2 ? left_at(ck.row(j), ck.c8) : (ck.row(j) * LDK + ck.c8) * 2),
                            blk + go + (ck.row(j) * K + ck.c8) * 2);
        }
      }
#pragma unroll
      for (int j = 0; j < CopyA::J; ++j) {  // rows 64..127: the lo plane, its diagonal blocks only
        const int r = ca.row(j), rb = (r % kBT) / 16;  // blocks on or below the diagonal
        if (ca.c8 < 16 * (rb + 1) && (r < kBT || ca.c8 >= 16 * rb))
          mma::cp_async16(dst + Ly::sA + (r * LDT + ca.c8) * 2, blk + Wk::oA + (r * kBT + ca.c8) * 2);
      }
#pragma unroll
      for (int j = 0; j < CopyV::J; ++j) {
        const int r = cv.row(j);
        unsigned char* du = dst + Ly::sU + (r * LDV + cv.c8) * 2;
        if (r < Lc)  // rows past the sequence are zeros (they meet zero k rows and A columns)
          mma::cp_async16(du, v_in + (static_cast<int64_t>(c) * kBT + r) * p.v_s[1]);
        else
          *reinterpret_cast<uint4*>(du) = make_uint4(0, 0, 0, 0);
      }
      if (tid < K / 4) mma::cp_async16(dst + Ly::sDL + tid * 16, blk + Wk::oDL + tid * 16);
      if (tid < Wk::kRowFactors * kBT / 4) mma::cp_async16(dst + Ly::sRF + tid * 16, blk + Wk::oRF + tid * 16);
    }
    mma::cp_async_commit();
  };

  if (kWg && tid == 0 && (mma::smem_addr(smem) & 1023)) __trap();  // the swizzle needs 1024-byte panels
  stage_in(0, 0);
  stage_in(1, 1);
  if (DELTA) state_to_smem();
  bf16* og = static_cast<bf16*>(p.out);
  for (int c = 0; c < nchunks; ++c) {
    const int st = c & 1;
    const unsigned char* base = smem + st * Ly::stage;
    const bf16* w_s = reinterpret_cast<const bf16*>(base + Ly::sW);
    const bf16* qg_s = reinterpret_cast<const bf16*>(base + Ly::sQ);
    const bf16* kd_s = reinterpret_cast<const bf16*>(base + Ly::sKd);
    const bf16* a_s = reinterpret_cast<const bf16*>(base + Ly::sA);
    // the v slice; with the delta rule Y replaces it in place (each thread reads exactly the v
    // elements it later writes Y to)
    bf16* vin_s = reinterpret_cast<bf16*>(smem + st * Ly::stage + Ly::sU);
    const float* dl_s = reinterpret_cast<const float*>(base + Ly::sDL);
    const int64_t t0 = sq.bos + static_cast<int64_t>(c) * kBT;
    const int Lc = static_cast<int>(min(int64_t{kBT}, sq.eos - t0));

    // S (bf16) for the products (with the delta rule written at the end of the chunk before);
    // intermediate state (chunk start)
    if (!DELTA) state_to_smem();
    if (p.inter) S.store(p, p.inter, p.inter_dt, cbase + c, hv);
    mma::cp_async_wait_pending(1);
    if constexpr (kWg) wg::fence_proxy_async();  // the stage and S, written by this thread, to wgmma
    __syncthreads();  // B1: this chunk's stage landed; S visible

    // Delta rule: Y = beta v + W' S (Vnew = Minv Y; without the delta rule Vnew = v, the stage's v
    // slice) and o = Qg S, sharing the S fragments. RAWQK: X = k S in place of W' S, then
    // Y = beta v - beta ks e^G X
    float vn[NTH][4], o[NTH][4];
    const float* rf = reinterpret_cast<const float*>(base + Ly::sRF);
#pragma unroll
    for (int nt = 0; nt < NTH; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        if (DELTA) {
          const int row = bI + g + 8 * hh;
          const float2 v2 = RAWQK ? make_float2(0.0f, 0.0f) : bf2(vin_s + row * LDV + hc0 + nt * 8 + 2 * t);
          const float b = RAWQK ? 0.0f : rf[row];
          vn[nt][2 * hh] = b * v2.x, vn[nt][2 * hh + 1] = b * v2.y;
        }
        o[nt][2 * hh] = 0.0f, o[nt][2 * hh + 1] = 0.0f;
      }
    if constexpr (kWg) {
      // one warpgroup per column group: W' S (or k S) and Qg S (or q S) for all 64 rows, S^T (its
      // rows hc0..) read once per group
      const uint32_t aw0 = mma::smem_addr(RAWQK ? kd_s : w_s), aq0 = mma::smem_addr(qg_s), bs0 = mma::smem_addr(s_s);
      wg::fence_operand(vn);
      wg::fence_operand(o);
      wg::fence();
      if constexpr (kYtOwn) {
        // W' S and Qg S as two groups: Y waits for the first only; Qg S runs on through Y^T's
        // store, B2 and the update's issue, and is waited for before AM Y adds to o
#pragma unroll
        for (int kk = 0; kk < KS; ++kk)
          wg::mma_bf16<NTH>(vn, wg::desc_kstep(aw0, kBT, 0, kk), wg::desc_kstep(bs0, VB, hc0, kk));
        wg::commit();
#pragma unroll
        for (int kk = 0; kk < KS; ++kk)
          wg::mma_bf16<NTH>(o, wg::desc_kstep(aq0, kBT, 0, kk), wg::desc_kstep(bs0, VB, hc0, kk));
        wg::commit();
        wg::wait_pending<1>();
        wg::fence_operand(vn);
      } else {
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
          const uint64_t db = wg::desc_kstep(bs0, VB, hc0, kk);
          if (DELTA) wg::mma_bf16<NTH>(vn, wg::desc_kstep(aw0, kBT, 0, kk), db);
          wg::mma_bf16<NTH>(o, wg::desc_kstep(aq0, kBT, 0, kk), db);
        }
        wg::commit();
        wg::wait_all();
        wg::fence_operand(vn);
        wg::fence_operand(o);
      }
    } else {
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      uint32_t aw[4], aq[4];
      if (DELTA) mma::ldsm_x4(aw, (RAWQK ? kd_s : w_s) + (bI + mma::a_row(lane)) * LDK + 16 * kk + mma::a_col(lane));
      mma::ldsm_x4(aq, qg_s + (bI + mma::a_row(lane)) * LDK + 16 * kk + mma::a_col(lane));
#pragma unroll
      for (int np = 0; np < NTH / 2; ++np) {
        uint32_t b[4];
        mma::ldsm_x4_t(b, s_s + (16 * kk + mma::bk_row(lane)) * LDV + hc0 + 16 * np + mma::bk_col(lane));
        if (DELTA) {
          mma::mma16816(vn[2 * np], aw, b[0], b[1]);
          mma::mma16816(vn[2 * np + 1], aw, b[2], b[3]);
        }
        mma::mma16816(o[2 * np], aq, b[0], b[1]);
        mma::mma16816(o[2 * np + 1], aq, b[2], b[3]);
      }
    }
    }
    if constexpr (RAWQK) {  // o = qs e^{G_i} (q S); Y = beta_i v_i - beta_i ks e^{G_i} X_i
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = bI + g + 8 * hh;
        const float fq = rf[row], fv = rf[kBT + row], fx = rf[2 * kBT + row];
#pragma unroll
        for (int nt = 0; nt < NTH; ++nt) {
          o[nt][2 * hh] *= fq, o[nt][2 * hh + 1] *= fq;
          const float2 v2 = bf2(vin_s + row * LDV + hc0 + nt * 8 + 2 * t);
          vn[nt][2 * hh] = fv * v2.x + fx * vn[nt][2 * hh];
          vn[nt][2 * hh + 1] = fv * v2.y + fx * vn[nt][2 * hh + 1];
        }
      }
    }
    // sm_90a: Y transposed, the B operand of the warpgroup update, into its own buffer (KDA at
    // VB >= 64) or else into the S^T buffer (S^T is read by then, the products waited for), which
    // goes back to S^T after B3
    const uint32_t yt = mma::smem_addr(kYtOwn ? smem + Ly::oYT : smem + Ly::oS);
    if constexpr (kWgUpdate) {
      wg::store_t_sw128<NTH>(yt, VB, bI, hc0, vn, lane);
      wg::fence_proxy_async();
    }
    if (DELTA) {
      if constexpr (!kWgUpdate)
#pragma unroll
        for (int nt = 0; nt < NTH; ++nt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh)
            u32at(vin_s + (bI + g + 8 * hh) * LDV + hc0 + nt * 8 + 2 * t) = pack(vn[nt][2 * hh], vn[nt][2 * hh + 1]);
      // B2: Y visible to the warps of this column group, its only readers (the update and AM Y take
      // the group's own columns), so the two groups need not wait for each other here
      if (p.block_barriers_only) __syncthreads();
      else mbar::named_sync(1 + warp / 4, 128);
    }

    // S = e^{G_last} S + Kt^T Y (delta rule: Kt in the Kd slot, GDN's in the W slot; without it
    // Kd^T v), issued first so that its mma latency hides behind o's products; with the delta rule
    // its bf16 copy for the next chunk goes out after them (every warp read this chunk's copy
    // before B2)
    // (Kt^T from the swizzled slot; sm_90a: as warpgroup products, waited for after o's)
    auto decay = [&](int ch) { return dl_s[ch]; };
    if constexpr (kWgUpdate) S.update_wg(mma::smem_addr(base + Ly::sKt), yt, decay);
    else if constexpr (DELTA) S.update_kt_sw128(mma::smem_addr(base + Ly::sKt), vin_s, LDV, decay, lane);
    else S.update(kd_s, LDK, vin_s, LDV, decay, lane);
    if constexpr (kYtOwn) {  // Qg S done (the update, committed last, may still run)
      wg::wait_pending<1>();
      wg::fence_operand(o);
    }

    // o += AM Y (delta rule; without it tril(A_qk) v); store. Blocks below the diagonal first, then
    // the diagonal block, which adds the lo plane (delta rule) (compiled apart: a per-block flag cost the
    // 16-warp scan a register spill).
    auto am_block = [&](int Jb, auto with_lo) {
      uint32_t a[4], alo[4];
      mma::ldsm_x4(a, a_s + (bI + mma::a_row(lane)) * LDT + 16 * Jb + mma::a_col(lane));
      if constexpr (decltype(with_lo)::value)
        mma::ldsm_x4(alo, a_s + (kBT + bI + mma::a_row(lane)) * LDT + 16 * Jb + mma::a_col(lane));
#pragma unroll
      for (int np = 0; np < NTH / 2; ++np) {
        uint32_t b[4];
        if constexpr (kWgUpdate)  // Y^T [column][token]: B stored [n][k]
          mma::ldsm_x4(b, yt + wg::sw128_offset(VB, hc0 + 16 * np + mma::bn_row(lane), 16 * Jb + mma::bn_col(lane)));
        else
          mma::ldsm_x4_t(b, vin_s + (16 * Jb + mma::bk_row(lane)) * LDV + hc0 + 16 * np + mma::bk_col(lane));
        mma::mma16816(o[2 * np], a, b[0], b[1]);
        mma::mma16816(o[2 * np + 1], a, b[2], b[3]);
        if constexpr (decltype(with_lo)::value) {
          mma::mma16816(o[2 * np], alo, b[0], b[1]);
          mma::mma16816(o[2 * np + 1], alo, b[2], b[3]);
        }
      }
    };
#pragma unroll
    for (int Jb = 0; Jb < 3; ++Jb)
      if (Jb < I) am_block(Jb, std::false_type{});
    am_block(I, std::bool_constant<Wk::kAPlanes == 2>{});
    if constexpr (kWgUpdate) S.wait_wg();
    else if (DELTA) state_to_smem();
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = bI + g + 8 * hh;
      if (row >= Lc) continue;
      bf16* dst = og + sq.b_row * p.out_s[0] + (t0 + row) * p.out_s[1] + hv * p.out_s[2] + v0 + hc0 + 2 * t;
#pragma unroll
      for (int nt = 0; nt < NTH; ++nt) u32at(dst + nt * 8) = pack(o[nt][2 * hh], o[nt][2 * hh + 1]);
    }
    __syncthreads();  // B3: stage st (and S without the delta rule, Y^T on sm_90a) no longer read
    stage_in(c + 2, st);
    if constexpr (kWgUpdate) state_to_smem();
  }

  if (p.ht) S.store(p, p.ht, p.ht_dt, n, hv);
  if (slot >= 0) S.store(p, p.pool, p.pool_dt, slot, hv);
}

template <int K, int V, int VB, bool SCALAR, bool DELTA>
void run(const Recurrence& r, const FwdParams& p, int device, cudaStream_t stream) {
  const int64_t max_chunks = chunk::max_chunks(p), base_bytes = chunk::base_bytes(p);
  constexpr bool RAWQK = SCALAR;  // scalar gates come with the delta rule here (GDN)
  const int64_t bytes = base_bytes + max_chunks * r.HV * Work<K, V, DELTA, RAWQK>::bytes;
  const int64_t prep_blocks = max_chunks * r.HV, scan_blocks = r.N * r.HV * (V / VB);
  if (prep_blocks >= (int64_t{1} << 31) || scan_blocks >= (int64_t{1} << 31))
    throw_unsupported("chunk_fwd", "too many chunks x heads for one launch");
  if (max_chunks == 0) return;
  void* ws = nullptr;
  chunk::check(cudaMallocFromPoolAsync(&ws, static_cast<size_t>(bytes), chunk_workspace_pool(device), stream),
        "workspace allocation");
  int32_t* chunk_base = p.cu ? static_cast<int32_t*>(ws) : nullptr;
  unsigned char* work = static_cast<unsigned char*>(ws) + base_bytes;
  if (p.cu) chunk::launch_chunk_base(p, chunk_base, stream);
  using Scan = ScanLayout<K, VB, DELTA, RAWQK>;
  using Prep = PrepLayout<K, DELTA, SCALAR>;
  chunk::allow_smem(chunk_prep_kernel<K, V, SCALAR, DELTA>, Prep::bytes);
  chunk_prep_kernel<K, V, SCALAR, DELTA>
      <<<static_cast<unsigned>(prep_blocks), 32 * prep_warps(DELTA, SCALAR), Prep::bytes, stream>>>(p, chunk_base, work);
  chunk::allow_smem(chunk_scan_kernel<K, V, VB, DELTA, RAWQK>, Scan::bytes);
  chunk_scan_kernel<K, V, VB, DELTA, RAWQK>
      <<<static_cast<unsigned>(scan_blocks), 32 * scan_warps(VB), Scan::bytes, stream>>>(p, chunk_base, work);
  const cudaError_t launched = cudaGetLastError();
  chunk::check(cudaFreeAsync(ws, stream), "workspace release");
  chunk::check(launched, "kernel launch");
}

}  // namespace

namespace chunk {
namespace {
// One CTA of 1024 threads: a block scan over the sequences' chunk counts.
__global__ void __launch_bounds__(1024) chunk_base_kernel(const FwdParams p, int32_t* chunk_base) {
  using Scan = cub::BlockScan<int32_t, 1024>;
  __shared__ typename Scan::TempStorage tmp;
  int32_t carry = 0;
  for (int base = 0; base < p.N; base += 1024) {
    const int n = base + static_cast<int>(threadIdx.x);
    int32_t c = 0;
    if (n < p.N) {
      const Seq s = seq_of(p, n);
      c = static_cast<int32_t>((s.eos - s.bos + kChunk - 1) / kChunk);
    }
    int32_t excl, total;
    Scan(tmp).ExclusiveSum(c, excl, total);
    if (n < p.N) chunk_base[n] = carry + excl;
    carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) chunk_base[p.N] = carry;
}

}  // namespace

void launch_chunk_base(const FwdParams& p, int32_t* chunk_base, cudaStream_t stream) {
  chunk_base_kernel<<<1, 1024, 0, stream>>>(p, chunk_base);
}
}  // namespace chunk

cudaMemPool_t chunk_workspace_pool(int device) {
  static cudaMemPool_t pools[64] = {};
  static std::once_flag once[64];
  if (device < 0 || device >= 64) throw_unsupported("chunk_fwd", "device index >= 64");
  std::call_once(once[device], [&] {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    chunk::check(cudaMemPoolCreate(&pools[device], &props), "workspace pool");
    uint64_t keep = UINT64_MAX;
    chunk::check(cudaMemPoolSetAttribute(pools[device], cudaMemPoolAttrReleaseThreshold, &keep), "workspace pool");
  });
  return pools[device];
}

// Shared memory of the scan for a family at head size K and slice width VB (the prep needs less).
template <int K>
int scan_bytes(const Recurrence& r, int vb) {
  if (!r.tr.delta) return vb == 32 ? ScanLayout<K, 32, false, false>::bytes : ScanLayout<K, 64, false, false>::bytes;
  if (r.tr.gate != GateKind::PerChannel)
    return vb == 32 ? ScanLayout<K, 32, true, true>::bytes : ScanLayout<K, 64, true, true>::bytes;
  return vb == 32 ? ScanLayout<K, 32, true, false>::bytes : ScanLayout<K, 64, true, false>::bytes;
}
int scan_bytes(const Recurrence& r, int vb) { return r.K == 64 ? scan_bytes<64>(r, vb) : scan_bytes<128>(r, vb); }

bool chunk_fwd_mma_accepts(const Recurrence& r, const cula_chunk_fwd_args& a) {
  if (!r.tr.delta && r.tr.gate != GateKind::PerChannel) return false;  // simple GLA, Lightning: chunk_fwd_fused
  if (r.tr.gate == GateKind::PerChannel) {
    // KDA: the in-block exponent bound |G_i - G_j| <= 15 * |lower_bound| inside a 16-token block.
    // GLA needs none (every factor <= 1, steep diagonal blocks taken per element).
    if (r.tr.delta && !(r.gate_in_kernel && r.has_lb && r.lb >= -5.0)) return false;
    if ((a.g->dtype != CULA_BFLOAT16 && a.g->dtype != CULA_FLOAT32) || !chunk::aligned16(a.g)) return false;
  }
  // Scalar and constant gates: the exponent is taken per pair (any decay); g is read per element.
  if (r.K != 64 && r.K != 128) return false;
  if (r.V != 64 && r.V != 128) return false;
  if (a.chunk_size != 0 && a.chunk_size != kBT) return false;  // intermediate states are per 64 tokens
  for (const cula_tensor* t : std::initializer_list<const cula_tensor*>{a.q, a.k, a.v, a.out})
    if (t->dtype != CULA_BFLOAT16 || !chunk::aligned16(t)) return false;
  if (first_unreadable_input(a).name) return false;
  if (cuda_device_arch(a.q->device_id) < 80) return false;  // mma.sync bf16, ldmatrix, cp.async
  // The scan's two stages must fit (at K = 128 the 32-column scans do on an A100, 163 KB per block)
  return scan_bytes(r, 32) <= cuda_smem_per_block(a.q->device_id);
}

template <int K, int V, bool SCALAR, bool DELTA>
void run_vb(const Recurrence& r, const FwdParams& p, int device, cudaStream_t stream) {
  // The scan has one CTA per (sequence, head, V slice), one CTA per SM. Slices of 32 columns when
  // those still fit in one wave (or when 64 columns do not fit the device's shared memory). KDA and
  // GLA on equal-length sequences take all 128 columns in one CTA of 16 warps (the stage read once
  // for the whole head) when 64-column slices would need more than one wave: a loaded SM moves a
  // head through about as fast either way, so what it saves is the partial last wave (docs/NOTES.md;
  // GDN's 16-warp scan was slower, and varlen calls, whose lengths the host does not know, lost
  // where one long sequence started late). Else 64.
  // CULA_SCAN_VB=32|64|128 (read once per process) forces a width where it fits, for benchmarks.
  static const int forced = [] {
    const char* e = std::getenv("CULA_SCAN_VB");
    return e ? std::atoi(e) : 0;
  }();
  const int sms = cuda_sm_count(device), smem = cuda_smem_per_block(device);
  const int64_t heads = static_cast<int64_t>(r.N) * r.HV;
  const bool fit64 = ScanLayout<K, 64, DELTA, SCALAR>::bytes <= smem;
  if constexpr (V == 128 && !SCALAR) {
    const bool wide = forced ? forced == 128 : !p.cu && heads * (V / 64) > sms;
    if (wide && ScanLayout<K, 128, DELTA, SCALAR>::bytes <= smem) return run<K, V, 128, SCALAR, DELTA>(r, p, device, stream);
  }
  if (forced ? forced == 32 || !fit64 : heads * (V / 32) <= sms || !fit64)
    run<K, V, 32, SCALAR, DELTA>(r, p, device, stream);
  else
    run<K, V, 64, SCALAR, DELTA>(r, p, device, stream);
}

// Three engines: per-channel gate with the delta rule (KDA), scalar gate with it (GDN), per-channel
// gate without it (GLA).
template <int K, int V>
void run_family(const Recurrence& r, const FwdParams& p, int device, cudaStream_t stream) {
  if (!r.tr.delta) run_vb<K, V, false, false>(r, p, device, stream);
  else if (r.tr.gate != GateKind::PerChannel) run_vb<K, V, true, true>(r, p, device, stream);
  else run_vb<K, V, false, true>(r, p, device, stream);
}

void cuda_chunk_fwd_mma(const Recurrence& r, const cula_chunk_fwd_args& a) {
  // CULA_BLOCK_BARRIERS_ONLY=1 (read once per process): see FwdParams::block_barriers_only
  static const int block_barriers_only = [] {
    const char* e = std::getenv("CULA_BLOCK_BARRIERS_ONLY");
    return e && *e && *e != '0' ? 1 : 0;
  }();
  FwdParams p = make_fwd_params(r, a);
  p.block_barriers_only = block_barriers_only;
  if (r.N == 0) return;
  const int dev = a.q->device_id;
  chunk::check(cudaSetDevice(dev), "cudaSetDevice");
  const cudaStream_t stream = static_cast<cudaStream_t>(a.opt.stream);
  if (r.K == 64 && r.V == 64) run_family<64, 64>(r, p, dev, stream);
  else if (r.K == 64) run_family<64, 128>(r, p, dev, stream);
  else if (r.V == 64) run_family<128, 64>(r, p, dev, stream);
  else run_family<128, 128>(r, p, dev, stream);
}

}  // namespace cula
