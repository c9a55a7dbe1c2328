// Chunked forward for the families without the delta rule and with a scalar or constant decay
// (simple GLA, Lightning), sm_80 instruction set (mma.sync, ldmatrix, cp.async). Without the delta
// rule nothing of a chunk needs an inverse, so one kernel walks the chunks of a sequence and reads
// q, k, v straight from the inputs: no per-chunk workspace beyond a few row factors.
//
//  factors (one warp per chunk of 64 tokens and value head, all chunks in parallel): G, the
//    inclusive cumulative log-decay of each row from the chunk start (gate activation in kernel
//    when asked), the row factors qs = scale (/ |q| with l2norm) and ks = 1 (/ |k|), and what the
//    fused kernel needs of them per row (qs e^G, ks e^{G_last - G}, G - ln ks) plus e^{G_last}:
//    1.3 KB per chunk and head. Lightning (constant decay, no l2norm) needs no factor kernel:
//    the fused kernels' copying threads write the factors of each stage themselves
//    (constant_decay_factors), so a dense call in one pass has no workspace at all.
//  fused (one CTA per sequence, value head and VB columns of V, chunks in order, the state slice
//    S (K x VB, fp32) in registers), per chunk:
//      o_i = qs_i e^{G_i} (q_i S) + sum_{j<=i} qs_i ks_j e^{G_i - G_j} (q_i . k_j) v_j
//      S   = e^{G_last} S + sum_j k_j^T (ks_j e^{G_last - G_j} v_j)
//    Every exponent is of a difference G_i - G_j with j <= i, so no factor exceeds 1 and any decay
//    is exact (no bound needed, unlike the per-channel engine).
//
// Two fused kernels: the warp-specialized one (chunk_fused_ws_kernel below: output warps, state
// warps, mbarriers; ~210 KB at K = 128, VB = 64) where a block can hold its shared memory, else
// the 8-warp one (also the local pass of split sequences):
// 8-warp fused: warp w owns rows 16(w%4).. of o and channels (w%4)*K/4.. of the state, for half
// w/4 of the slice's columns. The warp's q rows are loaded once per chunk as A fragments and serve
// q S and its blocks of q k^T: the blocks Jb <= w%4 of its row block are split between the two
// warps of that row block by parity, each applied to all VB columns, the partner's half of the
// partial o passing through shared memory. q k^T is a chain in registers: its accumulator pairs
// are the A fragments of the product with v (bf16 hi + lo, as the per-channel engine keeps
// tril(A_qk)). Shared memory (K = 128, VB = 64: ~133 KB, one CTA per SM): two stages of (q, k,
// v slice, factors), S (bf16), the scaled v (Vd, bf16), the partial o (fp32).
// Barriers per chunk: B1 stage in and S written; B2 Vd and partial o written, S read; B3 stage,
// S, Vd and partial o free.
// Split sequences (few sequence x head chains, long sequences; plan_fused): each sequence is cut
// into nseg segments run by separate fused CTAs. A local pass (the same kernel, kLocal: k, v and
// factors only, ~65 KB, state updates only) first computes each part's own contribution from a
// zero state and its total decay; a segment's CTA starts from S0 and folds in the parts before it
// (S = D_j S + L_j, fp32, the same sums in another order).
// Where the time goes (docs/NOTES.md): latency chains and shared-memory traffic (~250 KB per chunk
// in the warp-specialized kernel, whose schedulers issue ~0.4 instructions per cycle); the
// warp-specialized kernel takes the state chain off the output warps' path (1.2-1.3x).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <type_traits>

#include "common/error.h"
#include "cuda/runtime/check.h"
#include "cuda/runtime/runtime.h"
#include "cuda/common/recurrence_math.cuh"
#include "cuda/kerutils/mbarrier.cuh"
#include "cuda/kerutils/mma.cuh"
#include "cuda/prefill/chunk_common.cuh"
#include "cuda/prefill/chunk_engines.h"
#include "cuda/common/fwd_params.cuh"
#include "cuda/prefill/state_slice.cuh"

namespace cula {
namespace {

using bf16 = __nv_bfloat16;
using mma::pack;
using mma::unpack;

constexpr int kBT = kChunk;
constexpr int kThreads = 256;
constexpr int kFactorWarps = 4;
// Per chunk and head, per row: G; qs; qs e^{G}; ks e^{G_last - G}; G - ln ks (the pair factor
// qs_i ks_j e^{G_i - G_j} is then qs_i e^{G_i - (G_j - ln ks_j)}: one exponential per pair, whose
// argument G_i - G_j + ln ks_j stays below ln 1e3 as G_i <= G_j); then e^{G_last}.
constexpr int kFG = 0, kFQS = kBT, kFO = 2 * kBT, kFV = 3 * kBT, kFP = 4 * kBT, kFL = 5 * kBT;
constexpr int kFactorFloats = 5 * kBT + 4;  // 16-byte multiple

// kLocal: the local pass of a split sequence (state updates only: no q, no bf16 S, no partial o).
template <int K, int VB, bool kLocal>
struct FusedLayout {
  static constexpr int LDK = K + 8, LDV = VB + 8;
  static constexpr int sQ = 0, sK = sQ + (kLocal ? 0 : kBT * LDK * 2), sV = sK + kBT * LDK * 2,
                       sF = sV + kBT * LDV * 2, stage = sF + kFactorFloats * 4;
  static constexpr int LDX = VB + 8;  // fp32 partial o of the partner warp (conflict-free float2 rows)
  static constexpr int oS = 2 * stage, oVD = oS + (kLocal ? 0 : K * LDV * 2), oX = oVD + kBT * LDV * 2,
                       bytes = oX + (kLocal ? 0 : kBT * LDX * 4);
};

// A sequence split into nseg segments of nsub parts each (nseg = 1: not split). Part j of a
// sequence with C chunks is chunks [j P, (j + 1) P) with P = ceil(C / (nseg nsub)), clipped to C;
// segment s is parts [s nsub, (s + 1) nsub). Workspace, for the parts before the last segment:
// loc, each part's own state contribution from a zero state, per (sequence, part, value head, V
// slice), K x VB floats in StateSlice::save order; dec, each part's total decay (the product of
// its chunks' e^{G_last}) per (sequence, part, value head); s0, the initial state per (sequence,
// value head, V slice), copied by the local pass so that the fused pass never reads a pool slot
// that its last segment writes.
struct SplitState {
  float *loc, *dec, *s0;
  int nseg, nsub;
};

__device__ __forceinline__ uint32_t& u32at(bf16* p) { return *reinterpret_cast<uint32_t*>(p); }

// The per-token log-decay of a constant-decay (Lightning) value head hv of query head h: -decay,
// one rate per query head or per value head.
__device__ __forceinline__ float constant_log_decay(const FwdParams& p, int hv, int h) {
  return -dev::ld(p.decay, p.decay_dt, p.decay_heads == p.HV ? hv : h);
}

// Row factors of every (chunk, value head): one warp each, lane holds rows lane and lane + 32.
__global__ void __launch_bounds__(32 * kFactorWarps)
    chunk_factor_kernel(const FwdParams p, const int32_t* __restrict__ chunk_base, float* __restrict__ fac, int pairs) {
  const int lane = threadIdx.x & 31;
  const int pair = static_cast<int>(blockIdx.x) * kFactorWarps + static_cast<int>(threadIdx.x >> 5);
  if (pair >= pairs) return;
  const int hv = pair % p.HV, cidx = pair / p.HV;
  int n, ci;
  if (!chunk::locate(p, chunk_base, cidx, n, ci)) return;
  const Seq sq = seq_of(p, n);
  const int64_t t0 = sq.bos + static_cast<int64_t>(ci) * kBT;
  const int Lc = static_cast<int>(min(int64_t{kBT}, sq.eos - t0));
  const int h = hv / (p.HV / p.H);
  const float eA = (p.gate_in_kernel && p.A_log) ? __expf(dev::ld(p.A_log, p.A_dt, hv)) : 1.0f;
  const float bias = (p.gate_in_kernel && p.dt_bias) ? dev::ld(p.dt_bias, p.bias_dt, hv) : 0.0f;
  const float decay = p.gate_kind == 2 ? constant_log_decay(p, hv, h) : 0.0f;
  float* f = fac + static_cast<int64_t>(pair) * kFactorFloats;
  float x[2], qsr[2], ksr[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = lane + 32 * hh;
    float a = 0.0f, qs = p.scale, ks = 1.0f;
    if (row < Lc) {
      const int64_t tok = t0 + row;
      if (p.gate_kind == 2) {
        a = decay;
      } else {
        a = dev::ld(p.g, p.g_dt, sq.b_row * p.g_s[0] + tok * p.g_s[1] + hv * p.g_s[2]);
        if (p.gate_in_kernel) a = dev::activate_gate(a + bias, eA, p.has_lb, p.lb);
      }
      a = dev::chunk_log_decay(a);
      if (p.l2norm) {
        const bf16* qr = static_cast<const bf16*>(p.q) + sq.b_row * p.q_s[0] + tok * p.q_s[1] + h * p.q_s[2];
        const bf16* kr = static_cast<const bf16*>(p.k) + sq.b_row * p.k_s[0] + tok * p.k_s[1] + h * p.k_s[2];
        float q2 = 0.0f, k2 = 0.0f;
        for (int c8 = 0; c8 < p.K; c8 += 8) {
          const uint4 qv = *reinterpret_cast<const uint4*>(qr + c8), kv = *reinterpret_cast<const uint4*>(kr + c8);
          const uint32_t *qw = reinterpret_cast<const uint32_t*>(&qv), *kw = reinterpret_cast<const uint32_t*>(&kv);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 u = unpack(qw[j]), w = unpack(kw[j]);
            q2 += u.x * u.x + u.y * u.y;
            k2 += w.x * w.x + w.y * w.y;
          }
        }
        qs *= rsqrtf(q2 + 1e-6f);
        ks = rsqrtf(k2 + 1e-6f);
      }
    }
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const float u = __shfl_up_sync(0xffffffffu, a, d);
      if (lane >= d) a += u;
    }
    x[hh] = a;
    qsr[hh] = qs, ksr[hh] = ks;
  }
  x[1] += __shfl_sync(0xffffffffu, x[0], 31);
  const float glast = __shfl_sync(0xffffffffu, x[1], 31);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = lane + 32 * hh;
    f[kFG + row] = x[hh];
    f[kFQS + row] = qsr[hh];
    f[kFO + row] = qsr[hh] * __expf(x[hh]);
    f[kFV + row] = ksr[hh] * __expf(glast - x[hh]);
    f[kFP + row] = x[hh] - __logf(ksr[hh]);
  }
  if (lane < 4) f[kFL + lane] = __expf(glast);
}

// A constant decay without l2norm (Lightning): every row factor of a chunk follows from the
// per-token log-decay a and the chunk length Lc (G_r = a (min(r, Lc - 1) + 1), qs = scale, ks = 1),
// so the fused kernels write them themselves (no factor kernel). Four consecutive floats of the
// factor block, from float e4 * 4 on.
__device__ __forceinline__ float4 constant_decay_factors(int e4, float a, float scale, int Lc) {
  // a float4 lies in one region of the block (regions of kBT floats, kFL = 80 float4 in)
  const int region = e4 / (kBT / 4), row0 = (e4 % (kBT / 4)) * 4;
  const float glast = a * static_cast<float>(Lc);
  float r[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float G = a * static_cast<float>(min(row0 + j, Lc - 1) + 1);
    // kFO = scale e^G, kFV = e^{G_last - G}, kFL = e^{G_last}: one exponential per float
    const float e = __expf(region == 2 ? G : region == 3 ? glast - G : glast);
    r[j] = region == 0 || region == 4 ? G : region == 1 ? scale : region == 2 ? scale * e : e;  // kFP: ln ks = 0
  }
  return make_float4(r[0], r[1], r[2], r[3]);
}

// kLocal: the local pass of a split sequence, one CTA per (sequence, value head, V slice, part
// before the last segment); otherwise one CTA per (sequence, value head, V slice, segment).
// kOwnFactors (fac == nullptr): the row factors are written here (constant_decay_factors).
template <int K, int VB, bool kLocal, bool kOwnFactors>
__global__ void __launch_bounds__(kThreads, kLocal ? 3 : 1)  // the local pass: ~65 KB, three CTAs per SM
    chunk_fused_kernel(const FwdParams p, const int32_t* __restrict__ chunk_base, const float* __restrict__ fac,
                       const SplitState sp) {
  using Ly = FusedLayout<K, VB, kLocal>;
  constexpr int LDK = Ly::LDK, LDV = Ly::LDV;
  constexpr int KS = K / 16;
  constexpr int NT = VB / 8;
  constexpr int NTH = NT / 2;  // n-tiles per warp: warps 4..7 take the second half of the columns
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* s_s = reinterpret_cast<bf16*>(smem + Ly::oS);
  bf16* vd_s = reinterpret_cast<bf16*>(smem + Ly::oVD);
  float* xo_s = reinterpret_cast<float*>(smem + Ly::oX);
  constexpr int LDX = Ly::LDX;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int I = warp & 3, bI = 16 * I, hc0 = (warp >> 2) * (VB / 2);
  const chunk::SliceTask tk = chunk::slice_task<VB>(p, chunk_base);
  const int n = tk.n, hv = tk.hv, v0 = tk.v0, nchunks = tk.nchunks;
  const Seq sq = tk.sq;
  const int64_t cbase = tk.cbase;
  const int h = hv / (p.HV / p.H);
  const uint4 zero4 = make_uint4(0, 0, 0, 0);

  // This CTA's chunks [c_begin, c_end) and the state at c_begin.
  const int nvb = p.V / VB, vs = v0 / VB;
  const int parts = sp.nseg * sp.nsub, part_len = (nchunks + parts - 1) / parts;
  const int y = static_cast<int>(blockIdx.y), first_part = kLocal ? y : y * sp.nsub;
  const int c_begin = min(first_part * part_len, nchunks);
  const int c_end = min(c_begin + (kLocal ? 1 : sp.nsub) * part_len, nchunks);
  const bool last_segment = !kLocal && y == sp.nseg - 1;
  const int64_t slice_floats = int64_t{K} * VB;
  const int64_t head_slice = static_cast<int64_t>(hv) * nvb + vs;
  const int local_parts = (sp.nseg - 1) * sp.nsub;  // parts with a local state
  StateSlice<K, VB> S(warp, lane, v0);
  const int64_t slot = StateSlice<K, VB>::pool_slot(p, n);
  if (kLocal) {
    if (y == 0) {
      S.load(p, n, hv, slot);
      S.save(sp.s0 + (static_cast<int64_t>(n) * p.HV * nvb + head_slice) * slice_floats, tid);
    }
    S.zero();
  } else if (sp.nseg == 1) {
    S.load(p, n, hv, slot);
  } else {
    if (c_begin == c_end && !last_segment) return;
    S.load_saved(sp.s0 + (static_cast<int64_t>(n) * p.HV * nvb + head_slice) * slice_floats, tid);
    for (int j = 0; j < first_part; ++j) {
      const int64_t nj = static_cast<int64_t>(n) * local_parts + j;
      S.scale_add(sp.loc + (nj * p.HV * nvb + head_slice) * slice_floats, tid, sp.dec[nj * p.HV + hv]);
    }
  }

  // One chunk's q, k, v slice and factors into stage st (rows past the sequence are zeros; an
  // empty commit group past the end).
  using CopyK = chunk::TileCopy<kBT, K, kThreads>;  // q, k
  using CopyV = chunk::TileCopy<kBT, VB, kThreads>;  // v slice
  const CopyK ck(tid);
  const CopyV cv(tid);
  const bf16* q_in = static_cast<const bf16*>(p.q) + sq.b_row * p.q_s[0] + sq.bos * p.q_s[1] + h * p.q_s[2] + ck.c8;
  const bf16* k_in = static_cast<const bf16*>(p.k) + sq.b_row * p.k_s[0] + sq.bos * p.k_s[1] + h * p.k_s[2] + ck.c8;
  const bf16* v_in = static_cast<const bf16*>(p.v) + sq.b_row * p.v_s[0] + sq.bos * p.v_s[1] + hv * p.v_s[2] + v0 + cv.c8;
  const float own_a = kOwnFactors ? dev::chunk_log_decay(constant_log_decay(p, hv, h)) : 0.0f;
  auto stage_in = [&](int c, int st) {
    if (c < c_end) {
      unsigned char* dst = smem + st * Ly::stage;
      const int64_t t0 = static_cast<int64_t>(c) * kBT;  // from the sequence start
      const int Lc = static_cast<int>(min(int64_t{kBT}, sq.eos - sq.bos - t0));
#pragma unroll
      for (int j = 0; j < CopyK::J; ++j) {
        const int r = ck.row(j);
        bf16* dq = reinterpret_cast<bf16*>(dst + Ly::sQ) + r * LDK + ck.c8;
        bf16* dk = reinterpret_cast<bf16*>(dst + Ly::sK) + r * LDK + ck.c8;
        if (r < Lc) {
          if (!kLocal) mma::cp_async16(dq, q_in + (t0 + r) * p.q_s[1]);
          mma::cp_async16(dk, k_in + (t0 + r) * p.k_s[1]);
        } else {
          if (!kLocal) *reinterpret_cast<uint4*>(dq) = zero4;
          *reinterpret_cast<uint4*>(dk) = zero4;
        }
      }
#pragma unroll
      for (int j = 0; j < CopyV::J; ++j) {
        const int r = cv.row(j);
        bf16* d = reinterpret_cast<bf16*>(dst + Ly::sV) + r * LDV + cv.c8;
        if (r < Lc)
          mma::cp_async16(d, v_in + (t0 + r) * p.v_s[1]);
        else
          *reinterpret_cast<uint4*>(d) = zero4;
      }
      if constexpr (kOwnFactors) {  // plain stores, ordered for the readers by the chunk's first barrier
        if (tid < kFactorFloats / 4)
          reinterpret_cast<float4*>(dst + Ly::sF)[tid] = constant_decay_factors(tid, own_a, p.scale, Lc);
      } else {
        const float* f = fac + ((cbase + c) * p.HV + hv) * kFactorFloats;
        if (tid < kFactorFloats / 4) mma::cp_async16(dst + Ly::sF + tid * 16, f + tid * 4);
      }
    }
    mma::cp_async_commit();
  };

  stage_in(c_begin, 0);
  stage_in(c_begin + 1, 1);
  bf16* og = static_cast<bf16*>(p.out);
  float decay_product = 1.0f;  // kLocal: the part's total decay
  for (int c = c_begin; c < c_end; ++c) {
    const int st = (c - c_begin) & 1;
    const unsigned char* base = smem + st * Ly::stage;
    const bf16* q_s = reinterpret_cast<const bf16*>(base + Ly::sQ);
    const bf16* k_s = reinterpret_cast<const bf16*>(base + Ly::sK);
    const bf16* v_s = reinterpret_cast<const bf16*>(base + Ly::sV);
    const float* F = reinterpret_cast<const float*>(base + Ly::sF);
    const int64_t t0 = sq.bos + static_cast<int64_t>(c) * kBT;
    const int Lc = static_cast<int>(min(int64_t{kBT}, sq.eos - t0));

    // S (bf16) for the products; intermediate state (chunk start)
    if (!kLocal) {
      S.to_smem(s_s, LDV);
      if (p.inter) S.store(p, p.inter, p.inter_dt, cbase + c, hv);
    }
    mma::cp_async_wait_pending(1);
    __syncthreads();  // B1: this chunk's stage landed; S visible

    // Vd = ks_j e^{G_last - G_j} v_j for this warp's rows and columns
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = bI + g + 8 * hh;
      const float f = F[kFV + row];
#pragma unroll
      for (int nt = 0; nt < NTH; ++nt) {
        const int col = hc0 + nt * 8 + 2 * t;
        const float2 x = unpack(*reinterpret_cast<const uint32_t*>(v_s + row * LDV + col));
        u32at(vd_s + row * LDV + col) = pack(x.x * f, x.y * f);
      }
    }

    if constexpr (kLocal) {
      __syncthreads();  // B2: Vd complete
    } else {
      // This warp's q rows as A fragments, once for q S and every block of q k^T
      uint32_t qf[KS][4];
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) mma::ldsm_x4(qf[kk], q_s + (bI + mma::a_row(lane)) * LDK + 16 * kk + mma::a_col(lane));

      // o = qs_i e^{G_i} (q_i S)
      float o[NTH][4] = {};
#pragma unroll
      for (int kk = 0; kk < KS; ++kk)
#pragma unroll
        for (int np = 0; np < NTH / 2; ++np) {
          uint32_t b[4];
          mma::ldsm_x4_t(b, s_s + (16 * kk + mma::bk_row(lane)) * LDV + hc0 + 16 * np + mma::bk_col(lane));
          mma::mma16816(o[2 * np], qf[kk], b[0], b[1]);
          mma::mma16816(o[2 * np + 1], qf[kk], b[2], b[3]);
        }
      float gi[2], qi[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = bI + g + 8 * hh;
        gi[hh] = F[kFG + row], qi[hh] = F[kFQS + row];
        const float f = F[kFO + row];
#pragma unroll
        for (int nt = 0; nt < NTH; ++nt) o[nt][2 * hh] *= f, o[nt][2 * hh + 1] *= f;
      }

      // o += A v block by block: A = (q k^T) scaled per pair, lower triangle only, kept in
      // registers as bf16 hi + lo A fragments. The blocks Jb <= I are split between the two warps of
      // row block I by parity and each is applied to all VB columns (the longest row block costs
      // two blocks, not four); the partial for the partner's half goes through xo_s behind B2.
      // Unrolled (two accumulator chains over the k-steps) so the blocks of a warp overlap.
      const int hw = warp >> 2;
      float ox[NT][4] = {};
#pragma unroll
      for (int Jb = 0; Jb < 4; ++Jb) {
        if (Jb > I || (Jb & 1) != hw) continue;
        float a[2][4] = {}, a2[2][4] = {};
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
          uint32_t b[4];
          mma::ldsm_x4(b, k_s + (16 * Jb + mma::bn_row(lane)) * LDK + 16 * kk + mma::bn_col(lane));
          mma::mma16816((kk & 1) ? a2[0] : a[0], qf[kk], b[0], b[1]);
          mma::mma16816((kk & 1) ? a2[1] : a[1], qf[kk], b[2], b[3]);
        }
        uint32_t ahi[4], alo[4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int j = 16 * Jb + nt * 8 + 2 * t;
          const float2 pj = *reinterpret_cast<const float2*>(F + kFP + j);
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int i = bI + g + 8 * hh;
            const float x0 = dev::masked_exp_scale(j <= i, (a[nt][2 * hh] + a2[nt][2 * hh]) * qi[hh], gi[hh] - pj.x);
            const float x1 = dev::masked_exp_scale(j + 1 <= i, (a[nt][2 * hh + 1] + a2[nt][2 * hh + 1]) * qi[hh], gi[hh] - pj.y);
            const uint32_t hi = pack(x0, x1);
            const float2 h2 = unpack(hi);
            ahi[2 * nt + hh] = hi;  // fragment a0..a3 = (row g, k lo), (row g+8, k lo), (row g, k hi), (row g+8, k hi)
            alo[2 * nt + hh] = pack(x0 - h2.x, x1 - h2.y);
          }
        }
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t b[4];
          mma::ldsm_x4_t(b, v_s + (16 * Jb + mma::bk_row(lane)) * LDV + 16 * np + mma::bk_col(lane));
          mma::mma16816(ox[2 * np], ahi, b[0], b[1]);
          mma::mma16816(ox[2 * np + 1], ahi, b[2], b[3]);
          mma::mma16816(ox[2 * np], alo, b[0], b[1]);
          mma::mma16816(ox[2 * np + 1], alo, b[2], b[3]);
        }
      }
      // own half into o, the partner's half to shared memory (n-tile indices stay compile-time)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (nt / NTH == hw) {
#pragma unroll
          for (int r = 0; r < 4; ++r) o[nt % NTH][r] += ox[nt][r];
        } else {
#pragma unroll
          for (int hh = 0; hh < 2; ++hh)
            *reinterpret_cast<float2*>(xo_s + (bI + g + 8 * hh) * LDX + nt * 8 + 2 * t) =
                make_float2(ox[nt][2 * hh], ox[nt][2 * hh + 1]);
        }
      }
      __syncthreads();  // B2: Vd and the partial o complete; every warp done reading S
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = bI + g + 8 * hh;
        bf16* dst = og + sq.b_row * p.out_s[0] + (t0 + row) * p.out_s[1] + hv * p.out_s[2] + v0 + hc0 + 2 * t;
#pragma unroll
        for (int nt = 0; nt < NTH; ++nt) {
          const float2 x = *reinterpret_cast<const float2*>(xo_s + row * LDX + hc0 + nt * 8 + 2 * t);
          if (row < Lc) u32at(dst + nt * 8) = pack(o[nt][2 * hh] + x.x, o[nt][2 * hh + 1] + x.y);
        }
      }
    }

    // S = e^{G_last} S + k^T Vd
    const float dl = F[kFL];
    S.update(k_s, LDK, vd_s, LDV, [&](int) { return dl; }, lane);
    decay_product *= dl;
    __syncthreads();  // B3: stage st, S, Vd and the partial o no longer read
    stage_in(c + 2, st);
  }

  if (kLocal) {
    const int64_t nj = static_cast<int64_t>(n) * local_parts + y;
    S.save(sp.loc + (nj * p.HV * nvb + head_slice) * slice_floats, tid);
    if (vs == 0 && tid == 0) sp.dec[nj * p.HV + hv] = decay_product;
  } else if (last_segment) {
    if (p.ht) S.store(p, p.ht, p.ht_dt, n, hv);
    if (slot >= 0) S.store(p, p.pool, p.pool_dt, slot, hv);
  }
}

// Warp-specialized fused kernel (the non-local pass; same instruction set): the state chain and
// the outputs of a chunk run on different warps, handing buffers over through mbarriers instead
// of stopping the block three times per chunk.
//  warps 0-7  (output): warp w owns rows 16(w%4).. of o and half w/4 of the VB columns; per
//             chunk: the blocks of q k^T of its row block with parity w/4 (A in one bf16 plane,
//             as FLA keeps it; the 8-warp kernel's hi + lo planes cost twice the A v products),
//             handed to the partner warp of the row block as register fragments through shared
//             memory (16 bytes per lane and block, double-buffered, one pair barrier per chunk),
//             then A v over all blocks of the row block for its own half of the columns, q S_c
//             from the state ring, o stored. Exchanging A (10 KB per chunk) instead of the fp32
//             partial o (32 KB) freed the shared memory for a fourth input stage.
//  warps 8-11 (state): warp w owns channels (w-8)*K/4.. and all VB columns of the fp32 state in
//             registers; per chunk c: S = e^{G_last} S + (ks e^{G_last - G} k)^T v, the key
//             rows scaled in registers, then S_{c+1} as bf16 into ring slot (c+1)%2 (and the
//             intermediate state) as soon as q S of chunk c - 1 has freed the slot. Only then do
//             they issue copies: once every warp is done with chunk c - 1, q, k, the v slice and
//             the row factors of chunk c - 1 + kStages go into its stage by cp.async (rows past
//             the sequence as zero-fill copies), the stage's full barrier completing when the
//             copies land. Publishing S first keeps the copy issue (~900 cycles) off the chain
//             S_c -> q S_c. (A 13th warp for the copies would cap every thread at 128 registers.)
// Shared memory (K = 128, VB = 64): four stages of (q, k, v slice, row factors) 4 x 44 KB, the
// S ring 36 KB, the A exchange 10 KB: 228.5 KB, one CTA per SM.
// mbarriers: full[stage] (128 copying threads), empty[stage] (8 output + 4 state warps),
// sready[slot] (4 state warps), sfree[slot] (8 output warps). The output warps need S_c only after
// their q k^T and A v. Timeline and what bounds the chunk period: docs/NOTES.md.
constexpr int kWsOutWarps = 8, kWsStateWarps = 4, kWsThreads = 32 * (kWsOutWarps + kWsStateWarps);

template <int K, int VB>
struct WsLayout {
  static constexpr int kStages = 4;
  static constexpr int kABlocks = 10;  // the 16 x 16 blocks Jb <= I of the causal triangle
  static constexpr int LDK = K + 8, LDV = VB + 8;
  static constexpr int sQ = 0, sK = kBT * LDK * 2, sV = 2 * kBT * LDK * 2, sF = sV + kBT * LDV * 2,
                       stage = sF + kFactorFloats * 4;
  // oA: the A blocks exchanged by the two warps of a row block, bf16 in fragment order (16 bytes
  // per lane and block), double-buffered by chunk parity
  static constexpr int oS = kStages * stage, oA = oS + 2 * K * LDV * 2, oBar = oA + 2 * kABlocks * 32 * 16,
                       bytes = oBar + 8 * (2 * kStages + 4);
  static_assert(stage % 16 == 0 && oA % 16 == 0 && oBar % 8 == 0, "aligned buffers");
  static_assert(K * VB * 4 <= 2 * K * LDV * 2, "a state slice fits the ring (the fold of a split sequence)");
};

// kOwnFactors (fac == nullptr): the row factors are written here (constant_decay_factors), not
// copied from the factor kernel's output.
template <int K, int VB, bool kOwnFactors>
__global__ void __launch_bounds__(kWsThreads, 1)
    chunk_fused_ws_kernel(const FwdParams p, const int32_t* __restrict__ chunk_base, const float* __restrict__ fac,
                          const SplitState sp) {
  using Ly = WsLayout<K, VB>;
  constexpr int D = Ly::kStages, LDK = Ly::LDK, LDV = Ly::LDV;
  constexpr int KS = K / 16, NT = VB / 8, NTH = NT / 2;
  extern __shared__ __align__(16) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Ly::oBar);
  uint64_t *empty = full + D, *sready = full + 2 * D, *sfree = sready + 2;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const chunk::SliceTask tk = chunk::slice_task<VB>(p, chunk_base);
  const int n = tk.n, hv = tk.hv, v0 = tk.v0, nchunks = tk.nchunks;
  const Seq sq = tk.sq;
  const int64_t cbase = tk.cbase;
  const int h = hv / (p.HV / p.H);
  const int nvb = p.V / VB, vs = v0 / VB;
  const int parts = sp.nseg * sp.nsub, part_len = (nchunks + parts - 1) / parts;
  const int y = static_cast<int>(blockIdx.y), first_part = y * sp.nsub;
  const int c_begin = min(first_part * part_len, nchunks), c_end = min(c_begin + sp.nsub * part_len, nchunks);
  const bool last_segment = y == sp.nseg - 1;
  if (sp.nseg > 1 && c_begin == c_end && !last_segment) return;
  const int nloc = c_end - c_begin;
  if (tid == 0) {
    // kOwnFactors: each copying thread also arrives on full[] after its factor stores (a release),
    // besides its arrival on its copies
    for (int s = 0; s < D; ++s)
      mbar::init(&full[s], 32 * kWsStateWarps * (kOwnFactors ? 2 : 1)), mbar::init(&empty[s], kWsOutWarps + kWsStateWarps);
    for (int s = 0; s < 2; ++s) mbar::init(&sready[s], kWsStateWarps), mbar::init(&sfree[s], kWsOutWarps);
  }
  __syncthreads();
  auto stage_at = [&](int i) { return smem + (i % D) * Ly::stage; };
  auto ring_at = [&](int i) { return reinterpret_cast<bf16*>(smem + Ly::oS) + (i & 1) * K * LDV; };

  if (warp >= kWsOutWarps) {
    // state chain and copies
    const int ts = tid - 32 * kWsOutWarps;
    using CopyK = chunk::TileCopy<kBT, K, 32 * kWsStateWarps>;
    using CopyV = chunk::TileCopy<kBT, VB, 32 * kWsStateWarps>;
    const CopyK ck(ts);
    const CopyV cv(ts);
    const bf16* q_in = static_cast<const bf16*>(p.q) + sq.b_row * p.q_s[0] + sq.bos * p.q_s[1] + h * p.q_s[2] + ck.c8;
    const bf16* k_in = static_cast<const bf16*>(p.k) + sq.b_row * p.k_s[0] + sq.bos * p.k_s[1] + h * p.k_s[2] + ck.c8;
    const bf16* v_in =
        static_cast<const bf16*>(p.v) + sq.b_row * p.v_s[0] + sq.bos * p.v_s[1] + hv * p.v_s[2] + v0 + cv.c8;
    const float own_a = kOwnFactors ? dev::chunk_log_decay(constant_log_decay(p, hv, h)) : 0.0f;
    // Chunk c_begin + i into stage i % D; the stage's full barrier completes when the copies land.
    auto produce = [&](int i) {
      const int c = c_begin + i;
      const int64_t t0 = static_cast<int64_t>(c) * kBT;  // from the sequence start
      const int Lc = static_cast<int>(min(int64_t{kBT}, sq.eos - sq.bos - t0));
      const uint32_t dst = mma::smem_addr(stage_at(i));
#pragma unroll
      for (int j = 0; j < CopyK::J; ++j) {
        const int r = ck.row(j);
        const bool in = r < Lc;
        const int64_t row = t0 + (in ? r : 0);
        const uint32_t off = (r * LDK + ck.c8) * 2;
        mma::cp_async16_or_zero(dst + Ly::sQ + off, q_in + row * p.q_s[1], in);
        mma::cp_async16_or_zero(dst + Ly::sK + off, k_in + row * p.k_s[1], in);
      }
#pragma unroll
      for (int j = 0; j < CopyV::J; ++j) {
        const int r = cv.row(j);
        const bool in = r < Lc;
        mma::cp_async16_or_zero(dst + Ly::sV + (r * LDV + cv.c8) * 2, v_in + (t0 + (in ? r : 0)) * p.v_s[1], in);
      }
      if constexpr (kOwnFactors) {
        if (ts < kFactorFloats / 4)
          reinterpret_cast<float4*>(stage_at(i) + Ly::sF)[ts] = constant_decay_factors(ts, own_a, p.scale, Lc);
        mbar::arrive_on_copies(&full[i % D]);
        mbar::arrive(&full[i % D]);
      } else {
        const float* f = fac + ((cbase + c) * p.HV + hv) * kFactorFloats;
        if (ts < kFactorFloats / 4) mma::cp_async16(dst + Ly::sF + ts * 16, f + ts * 4);
        mbar::arrive_on_copies(&full[i % D]);
      }
    };
    for (int i = 0; i < min(D, nloc); ++i) produce(i);

    StateSlice<K, VB, kWsStateWarps> S(warp - kWsOutWarps, lane, v0);
    const int64_t slot = StateSlice<K, VB>::pool_slot(p, n);
    const int64_t slice_floats = int64_t{K} * VB, head_slice = static_cast<int64_t>(hv) * nvb + vs;
    if (sp.nseg == 1) {
      S.load(p, n, hv, slot);
    } else {
      const int local_parts = (sp.nseg - 1) * sp.nsub;
      // S0 and the parts before this segment, folded in their saved order (the local pass's 8-warp
      // register order) into the S ring, not yet in use
      float4* fold = reinterpret_cast<float4*>(smem + Ly::oS);
      const float4* s0 =
          reinterpret_cast<const float4*>(sp.s0 + (static_cast<int64_t>(n) * p.HV * nvb + head_slice) * slice_floats);
      for (int e = ts; e < K * VB / 4; e += 32 * kWsStateWarps) {
        float4 x = s0[e];
        for (int j = 0; j < first_part; ++j) {
          const int64_t nj = static_cast<int64_t>(n) * local_parts + j;
          const float d = sp.dec[nj * p.HV + hv];
          const float4 l = reinterpret_cast<const float4*>(sp.loc + (nj * p.HV * nvb + head_slice) * slice_floats)[e];
          x = make_float4(d * x.x + l.x, d * x.y + l.y, d * x.z + l.z, d * x.w + l.w);
        }
        fold[e] = x;
      }
      mbar::named_sync(5, 32 * kWsStateWarps);
      S.template load_saved_from<8>(reinterpret_cast<const float*>(fold));
      mbar::named_sync(5, 32 * kWsStateWarps);  // the fold read before S goes into the ring
    }
    // S of chunk c_begin + i into ring slot i % 2 once q S of chunk i - 2 has freed it
    auto publish = [&](int i) {
      if (i >= 2) mbar::wait(&sfree[i & 1], ((i >> 1) - 1) & 1);
      S.to_smem(ring_at(i), LDV);
      if (p.inter) S.store(p, p.inter, p.inter_dt, cbase + c_begin + i, hv);
      __syncwarp();
      if (lane == 0) mbar::arrive(&sready[i & 1]);
    };
    if (nloc > 0) publish(0);
    for (int i = 0; i < nloc; ++i) {
      mbar::wait(&full[i % D], (i / D) & 1);
      const unsigned char* base = stage_at(i);
      const float* F = reinterpret_cast<const float*>(base + Ly::sF);
      S.update_token_scaled(reinterpret_cast<const bf16*>(base + Ly::sK), LDK, reinterpret_cast<const bf16*>(base + Ly::sV),
                            LDV, F[kFL], F + kFV, lane);
      __syncwarp();
      if (lane == 0) mbar::arrive(&empty[i % D]);
      // The next S goes out before the copies: the output warps' q S waits on it, the copies
      // are for two chunks later.
      if (i + 1 < nloc) publish(i + 1);
      if (i >= 1 && i - 1 + D < nloc) {
        mbar::wait(&empty[(i - 1) % D], ((i - 1) / D) & 1);  // every warp done with chunk i - 1
        produce(i - 1 + D);
      }
    }
    if (last_segment) {
      if (p.ht) S.store(p, p.ht, p.ht_dt, n, hv);
      if (slot >= 0) S.store(p, p.pool, p.pool_dt, slot, hv);
    }
  } else {
    // outputs
    const int I = warp & 3, bI = 16 * I, hw = warp >> 2, hc0 = hw * (VB / 2);
    bf16* og = static_cast<bf16*>(p.out);
    for (int i = 0; i < nloc; ++i) {
      const int c = c_begin + i;
      const int64_t t0 = sq.bos + static_cast<int64_t>(c) * kBT;
      const int Lc = static_cast<int>(min(int64_t{kBT}, sq.eos - t0));
      mbar::wait(&full[i % D], (i / D) & 1);
      const unsigned char* base = stage_at(i);
      const bf16* q_s = reinterpret_cast<const bf16*>(base + Ly::sQ);
      const bf16* k_s = reinterpret_cast<const bf16*>(base + Ly::sK);
      const bf16* v_s = reinterpret_cast<const bf16*>(base + Ly::sV);
      const float* F = reinterpret_cast<const float*>(base + Ly::sF);

      uint32_t qf[KS][4];
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) mma::ldsm_x4(qf[kk], q_s + (bI + mma::a_row(lane)) * LDK + 16 * kk + mma::a_col(lane));
      float gi[2], qi[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) gi[hh] = F[kFG + bI + g + 8 * hh], qi[hh] = F[kFQS + bI + g + 8 * hh];

      // The blocks Jb <= I of q k^T with parity hw, as bf16 A fragments (one plane, as FLA's
      // chunk_simple_gla keeps A); each also goes to the partner warp of row block I.
      uint32_t af[4][4];
      uint4* ax = reinterpret_cast<uint4*>(smem + Ly::oA) + (i & 1) * Ly::kABlocks * 32;
      const int tri = I * (I + 1) / 2;  // first block of row block I in the exchange
#pragma unroll
      for (int Jb = 0; Jb < 4; ++Jb) {
        if (Jb > I || (Jb & 1) != hw) continue;
        float a[2][4] = {}, a2[2][4] = {};
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
          uint32_t b[4];
          mma::ldsm_x4(b, k_s + (16 * Jb + mma::bn_row(lane)) * LDK + 16 * kk + mma::bn_col(lane));
          mma::mma16816((kk & 1) ? a2[0] : a[0], qf[kk], b[0], b[1]);
          mma::mma16816((kk & 1) ? a2[1] : a[1], qf[kk], b[2], b[3]);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int j = 16 * Jb + nt * 8 + 2 * t;
          const float2 pj = *reinterpret_cast<const float2*>(F + kFP + j);
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int i_row = bI + g + 8 * hh;
            const float x0 = dev::masked_exp_scale(j <= i_row, (a[nt][2 * hh] + a2[nt][2 * hh]) * qi[hh], gi[hh] - pj.x);
            const float x1 =
                dev::masked_exp_scale(j + 1 <= i_row, (a[nt][2 * hh + 1] + a2[nt][2 * hh + 1]) * qi[hh], gi[hh] - pj.y);
            af[Jb][2 * nt + hh] = pack(x0, x1);
          }
        }
        ax[(tri + Jb) * 32 + lane] = make_uint4(af[Jb][0], af[Jb][1], af[Jb][2], af[Jb][3]);
      }
      mbar::named_sync(1 + I, 64);  // warps I and I + 4: the partner's blocks written

      // A v over all blocks Jb <= I for this warp's half of the columns
      float ox[NTH][4] = {};
#pragma unroll
      for (int Jb = 0; Jb < 4; ++Jb) {
        if (Jb > I) continue;
        uint32_t a4[4];
        if ((Jb & 1) == hw) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a4[e] = af[Jb][e];
        } else {
          const uint4 x = ax[(tri + Jb) * 32 + lane];
          a4[0] = x.x, a4[1] = x.y, a4[2] = x.z, a4[3] = x.w;
        }
#pragma unroll
        for (int np = 0; np < NTH / 2; ++np) {
          uint32_t b[4];
          mma::ldsm_x4_t(b, v_s + (16 * Jb + mma::bk_row(lane)) * LDV + hc0 + 16 * np + mma::bk_col(lane));
          mma::mma16816(ox[2 * np], a4, b[0], b[1]);
          mma::mma16816(ox[2 * np + 1], a4, b[2], b[3]);
        }
      }

      // o = qs_i e^{G_i} (q_i S_c)
      mbar::wait(&sready[i & 1], (i >> 1) & 1);
      const bf16* s_s = ring_at(i);
      float o[NTH][4] = {};
#pragma unroll
      for (int kk = 0; kk < KS; ++kk)
#pragma unroll
        for (int np = 0; np < NTH / 2; ++np) {
          uint32_t b[4];
          mma::ldsm_x4_t(b, s_s + (16 * kk + mma::bk_row(lane)) * LDV + hc0 + 16 * np + mma::bk_col(lane));
          mma::mma16816(o[2 * np], qf[kk], b[0], b[1]);
          mma::mma16816(o[2 * np + 1], qf[kk], b[2], b[3]);
        }
      float fo[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) fo[hh] = F[kFO + bI + g + 8 * hh];
      __syncwarp();
      if (lane == 0) mbar::arrive(&sfree[i & 1]), mbar::arrive(&empty[i % D]);

#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = bI + g + 8 * hh;
        bf16* dst = og + sq.b_row * p.out_s[0] + (t0 + row) * p.out_s[1] + hv * p.out_s[2] + v0 + hc0 + 2 * t;
#pragma unroll
        for (int nt = 0; nt < NTH; ++nt)
          if (row < Lc)
            u32at(dst + nt * 8) = pack(o[nt][2 * hh] * fo[hh] + ox[nt][2 * hh], o[nt][2 * hh + 1] * fo[hh] + ox[nt][2 * hh + 1]);
      }
    }
  }
}

template <int K, int VB>
void run(const Recurrence& r, const FwdParams& p, int nseg, int nsub, int device, cudaStream_t stream) {
  const int64_t max_chunks = chunk::max_chunks(p), base_bytes = chunk::base_bytes(p);
  const int64_t pairs = max_chunks * r.HV;
  const int64_t fused_blocks = r.N * r.HV * (r.V / VB);
  const int64_t local_parts = static_cast<int64_t>(nseg - 1) * nsub;
  const int64_t slice_floats = int64_t{K} * VB, slices = fused_blocks;  // one per (sequence, head, V slice)
  // CULA_FUSED_8WARP set: the 8-warp kernel on any device (tests of the path small devices take)
  const bool ws = WsLayout<K, VB>::bytes <= cuda_smem_per_block(device) && !std::getenv("CULA_FUSED_8WARP");
  // Lightning without l2norm: the fused kernels write their row factors themselves, which saves
  // the factor kernel and, for one pass over dense inputs, the whole workspace (an allocation, a
  // launch and a release: ~25 us of host time per call when the host's caches are cold)
  const bool own_factors = p.gate_kind == 2 && !p.l2norm;
  const int64_t fac_bytes = own_factors ? 0 : pairs * kFactorFloats * 4;
  const int64_t loc_floats = local_parts * slices * slice_floats, dec_floats = (local_parts * r.N * r.HV + 3) / 4 * 4;
  const int64_t s0_floats = nseg > 1 ? slices * slice_floats : 0;
  const int64_t bytes = base_bytes + fac_bytes + (loc_floats + dec_floats + s0_floats) * 4;
  if (pairs >= (int64_t{1} << 31) || fused_blocks >= (int64_t{1} << 31))
    throw_unsupported("chunk_fwd", "too many chunks x heads for one launch");
  if (max_chunks == 0) return;
  void* work = nullptr;
  if (bytes > 0)
    chunk::check(cudaMallocFromPoolAsync(&work, static_cast<size_t>(bytes), chunk_workspace_pool(device), stream),
                 "workspace allocation");
  int32_t* chunk_base = p.cu ? static_cast<int32_t*>(work) : nullptr;
  float* const after_base = reinterpret_cast<float*>(static_cast<unsigned char*>(work) + base_bytes);
  float* fac = own_factors ? nullptr : after_base;
  SplitState sp{};
  sp.nseg = nseg, sp.nsub = nsub;
  sp.loc = after_base + fac_bytes / 4;
  sp.dec = sp.loc + loc_floats;
  sp.s0 = sp.dec + dec_floats;
  if (p.cu) chunk::launch_chunk_base(p, chunk_base, stream);
  if (!own_factors)
    chunk_factor_kernel<<<static_cast<unsigned>((pairs + kFactorWarps - 1) / kFactorWarps), 32 * kFactorWarps, 0,
                          stream>>>(p, chunk_base, fac, static_cast<int>(pairs));
  const dim3 grid(static_cast<unsigned>(fused_blocks), static_cast<unsigned>(nseg));
  auto launch = [&](auto own) {  // the kernels of one factor source (own: std::bool_constant)
    constexpr bool kOwn = decltype(own)::value;
    if constexpr (VB == 64) {  // segments only with 64-column slices (plan_fused)
      if (nseg > 1) {
        chunk::allow_smem(chunk_fused_kernel<K, VB, true, kOwn>, FusedLayout<K, VB, true>::bytes);
        chunk_fused_kernel<K, VB, true, kOwn>
            <<<dim3(static_cast<unsigned>(fused_blocks), static_cast<unsigned>(local_parts)), kThreads,
               FusedLayout<K, VB, true>::bytes, stream>>>(p, chunk_base, fac, sp);
      }
    }
    if (ws) {
      chunk::allow_smem(chunk_fused_ws_kernel<K, VB, kOwn>, WsLayout<K, VB>::bytes);
      chunk_fused_ws_kernel<K, VB, kOwn><<<grid, kWsThreads, WsLayout<K, VB>::bytes, stream>>>(p, chunk_base, fac, sp);
    } else {  // e.g. K = 128, VB = 64 on sm_80 (164 KB): the 8-warp kernel
      chunk::allow_smem(chunk_fused_kernel<K, VB, false, kOwn>, FusedLayout<K, VB, false>::bytes);
      chunk_fused_kernel<K, VB, false, kOwn>
          <<<grid, kThreads, FusedLayout<K, VB, false>::bytes, stream>>>(p, chunk_base, fac, sp);
    }
  };
  if (own_factors)
    launch(std::true_type{});
  else
    launch(std::false_type{});
  const cudaError_t launched = cudaGetLastError();
  if (work) chunk::check(cudaFreeAsync(work, stream), "workspace release");
  chunk::check(launched, "kernel launch");
}

// How a call is spread over the GPU (one fused CTA per SM, ~133 KB of shared memory at VB = 64).
// Slices of 64 columns cost ~1.25x a 32-column slice per chunk (the q k^T work is per slice),
// so 64 is the default; when the (sequence, head, 64-column slice) chains fill at most half the
// SMs, sequences are split into 2-16 segments (the chain per CTA shortens by that factor; a local
// pass costing ~1/4 of a fused chunk provides each segment's initial state); otherwise slices of
// 32 columns when those still fit in one wave.
struct FusedPlan {
  int VB, nseg, nsub;
};
FusedPlan plan_fused(const Recurrence& r, bool varlen, int sms) {
  const int64_t chains = r.N * r.HV * (r.V / 64);
  // varlen: the lengths are on the device; their mean decides (each sequence is split evenly)
  const int64_t chunks_per_seq = varlen ? r.T / kBT / std::max<int64_t>(r.N, 1) : (r.T + kBT - 1) / kBT;
  // Up to 16 segments of >= 32 chunks (few heads per GPU, e.g. heads split by tensor parallelism).
  int nseg = 1;
  while (nseg < 16 && chains * nseg * 2 <= sms && chunks_per_seq / (nseg * 2) >= 32) nseg *= 2;
  if (nseg > 1) {
    // Enough local-pass CTAs to cover the SMs (it fits three per SM), parts of >= 16 chunks.
    int nsub = 1;
    while (nsub < 8 && chains * (nseg - 1) * nsub < sms && chunks_per_seq / (nseg * nsub * 2) >= 16) nsub *= 2;
    return {64, nseg, nsub};
  }
  return {r.N * r.HV * (r.V / 32) <= sms ? 32 : 64, 1, 1};
}

}  // namespace

bool chunk_fwd_fused_accepts(const Recurrence& r, const cula_chunk_fwd_args& a) {
  if (r.tr.delta || r.tr.gate == GateKind::PerChannel) return false;
  if (r.K != 64 && r.K != 128) return false;
  if (r.V != 64 && r.V != 128) return false;
  if (a.chunk_size != 0 && a.chunk_size != kBT) return false;  // intermediate states are per 64 tokens
  for (const cula_tensor* t : std::initializer_list<const cula_tensor*>{a.q, a.k, a.v, a.out})
    if (t->dtype != CULA_BFLOAT16 || !chunk::aligned16(t)) return false;
  if (first_unreadable_input(a).name) return false;
  return cuda_device_arch(a.q->device_id) >= 80;  // mma.sync bf16, ldmatrix, cp.async
}

void cuda_chunk_fwd_fused(const Recurrence& r, const cula_chunk_fwd_args& a) {
  const FwdParams p = make_fwd_params(r, a);
  if (r.N == 0) return;
  const int dev = a.q->device_id;
  chunk::check(cudaSetDevice(dev), "cudaSetDevice");
  const cudaStream_t stream = static_cast<cudaStream_t>(a.opt.stream);
  const int sms = cuda_sm_count(dev);
  const FusedPlan plan = plan_fused(r, a.cu_seqlens != nullptr, sms);
  if (plan.VB == 32)
    r.K == 64 ? run<64, 32>(r, p, 1, 1, dev, stream) : run<128, 32>(r, p, 1, 1, dev, stream);
  else
    r.K == 64 ? run<64, 64>(r, p, plan.nseg, plan.nsub, dev, stream)
              : run<128, 64>(r, p, plan.nseg, plan.nsub, dev, stream);
}

}  // namespace cula
