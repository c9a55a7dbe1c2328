// The prep kernel of the chunk engine: everything of a chunk that does not depend on the state,
// written to the workspace block (config.cuh: Work) for the scan. Warps, buffers and barriers:
// DESIGN.md beside this file.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/common/fwd_params.cuh"
#include "cuda/common/recurrence_math.cuh"
#include "cuda/kerutils/mbarrier.cuh"
#include "cuda/kerutils/mma.cuh"
#include "cuda/prefill/chunk_common.cuh"
#include "cuda/prefill/chunk_prep_scan/config.cuh"
#include "cuda/prefill/chunk_prep_scan/prep_common.cuh"
#include "cuda/prefill/chunk_prep_scan/prep_kt_am.cuh"
#include "cuda/prefill/chunk_prep_scan/prep_minv.cuh"
#include "cuda/prefill/chunk_prep_scan/prep_norms.cuh"
#include "cuda/prefill/chunk_prep_scan/prep_table.cuh"

namespace cula {
namespace chunk_prep_scan {

// kAnyDecay (KDA): any gate form and decay, with the steep-block machinery; without it (the bounded
// in-kernel gate, lower_bound >= -5: kda_bounded_gate) the pass and the pair products carry none
// of it (it cost the bounded path 3-5% where compiled in). GLA always has its steep path; GDN needs
// none. kBlockBarriersOnly: the debug instantiation for racecheck (DESIGN.md), launched only on
// request.
template <int K, class F, bool kAnyDecay, bool kBlockBarriersOnly = false>
__global__ void __launch_bounds__(32 * prep_warps<F>(), prep_ctas_per_sm<F>())
    chunk_prep_kernel(const FwdParams p, const int32_t* __restrict__ chunk_base, unsigned char* __restrict__ work) {
  static_assert(F::kDelta || !F::kScalarGate, "scalar gates without the delta rule take chunk_fwd_fused");
  static_assert(!kAnyDecay || (F::kDelta && !F::kScalarGate), "kAnyDecay: KDA");
  constexpr bool kSteep = !F::kDelta || kAnyDecay;  // steep diagonal blocks taken per element
  using Ly = PrepLayout<K, F>;
  using Wk = Work<K, F>;
  constexpr int LDK = Ly::LDK, MS = Ly::MS;
  constexpr int KS = K / 16;
  constexpr int NW = prep_warps<F>(), NT = 32 * NW, KH = NW / 4;  // KH: warps per row block
  static_assert(KH == 1 || (F::kDelta && !F::kScalarGate), "8 prep warps: KDA");
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
  // per-channel gates: bit I set where diagonal block I has a steep channel (exact_diagonal)
  unsigned* steep_bits = reinterpret_cast<unsigned*>(smem + Ly::oSTEEP);

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

  if (kSteep && tid == 0) *steep_bits = 0u;  // (set by the gate pass, after B_a0)
  float eA = 1.0f;  // e^{A_log}, taken once the tiles are in (see below)
  const float head_bias = (p.gate_in_kernel && p.dt_bias && !p.dt_bias_per_channel) ? dev::ld(p.dt_bias, p.dt_bias_dt, hv) : 0.0f;
  const float const_decay =
      p.gate_kind == GateKind::Constant ? -dev::ld(p.decay, p.decay_dt, p.decay_heads == p.HV ? hv : (hv / (p.HV / p.H))) : 0.0f;
  const uint4 zero4 = make_uint4(0, 0, 0, 0);
  // KDA with a bf16 gate: the chunk's gate tile streams into shared memory with q and k (TB and TAB
  // are free until Minv and the exponent table), so the rolled k-step loop reads it without a
  // global-memory latency per step (the register prefetch one step ahead converted bf16 to fp32
  // right after the load, so it waited at once: ~20% of the prep's warp time). Unpadded rows (the
  // gate pass reads a row's consecutive channel pairs across the lanes: no bank conflicts).
  constexpr bool kGateTileFits = F::kDelta && !F::kScalarGate && Ly::oBT - Ly::oTB >= kBT * K * 2;
  const bool gate_tile = kGateTileFits && p.g_dt == CULA_BFLOAT16;
  bf16* gt_s = reinterpret_cast<bf16*>(smem + Ly::oTB);
  auto gate_at = [&](int row, int col) { return gt_s + row * K + col; };
  // log-decay of one element from its raw gate
  auto activate = [&](float x) {
    if (p.gate_in_kernel && p.gate_kind != GateKind::Constant) x = dev::activate_gate(x, eA, p.has_lb, p.lb);
    return dev::chunk_log_decay(x);
  };

  // ---- q, k (and per-channel gate) tiles; rows past the sequence are zeros. The small loads (A_log,
  // beta, the scalar gate, a per-channel dt_bias) go out first as raw bits and are converted once
  // the tiles are in: a conversion right behind its load held every warp there (~3% of the prep's
  // stall samples), and issued after the copies the loads added their latency to the tiles'.
  const int64_t row_at = t0 + min(tid, kBT - 1);  // (tid >= kBT reads nothing per row)
  const bool row_loads = tid < kBT && tid < Lc;
  const uint32_t alog_bits = p.gate_in_kernel && p.A_log ? dev::ld_bits(p.A_log, p.A_log_dt, hv) : 0u;
  const uint32_t beta_bits =
      F::kDelta && row_loads ? dev::ld_bits(p.beta, p.beta_dt, b_row * p.beta_s[0] + row_at * p.beta_s[1] + hv * p.beta_s[2]) : 0u;
  const uint32_t gs_bits =
      F::kScalarGate && p.gate_kind == GateKind::Scalar && row_loads ? dev::ld_bits(p.g, p.g_dt, b_row * p.g_s[0] + row_at * p.g_s[1] + hv * p.g_s[2]) : 0u;
  const bool bias_per_channel = !F::kScalarGate && p.gate_in_kernel && p.dt_bias && p.dt_bias_per_channel;
  constexpr int kChannelsPerThread = (K + NT - 1) / NT;
  uint32_t bias_bits[kChannelsPerThread];  // channel tid + j NT
#pragma unroll
  for (int j = 0; j < kChannelsPerThread; ++j)
    bias_bits[j] = bias_per_channel && tid + j * NT < K ? dev::ld_bits(p.dt_bias, p.dt_bias_dt, hv * K + tid + j * NT) : 0u;
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
    if (!F::kScalarGate && row < Lc) {
      const int64_t off = b_row * p.g_s[0] + (t0 + row) * p.g_s[1] + hv * p.g_s[2] + col;
      v = p.g_dt == CULA_FLOAT32 ? *reinterpret_cast<const float2*>(static_cast<const float*>(p.g) + off)
                                 : ld2(static_cast<const bf16*>(p.g) + off, p.g_dt == CULA_FLOAT16);
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
  const bool half_in = p.q_dt == CULA_FLOAT16;  // fp16 q, k (and v): bf16 tiles from here on
#if CULA_BULK_COPY
  mbar::wait(tiles_in, 0);
  if (half_in)  // every thread sees the landed tiles
    for (int idx = tid; idx < 2 * kBT * (K / 8); idx += NT) {
      const int r = (idx / (K / 8)) % kBT, c8 = (idx % (K / 8)) * 8;
      if (r < Lc) half8_to_bf16_at((idx < kBT * (K / 8) ? q_s : k_s) + r * LDK + c8);
    }
#else
  mma::cp_async_wait_all();
  if (half_in) {  // this thread's own copies
    using CopyK = chunk::TileCopy<kBT, K, NT>;
    const CopyK ck(tid);
#pragma unroll
    for (int j = 0; j < CopyK::J; ++j)
      if (ck.row(j) < Lc) {
        half8_to_bf16_at(q_s + ck.row(j) * LDK + ck.c8);
        half8_to_bf16_at(k_s + ck.row(j) * LDK + ck.c8);
      }
  }
#endif
  if (p.gate_in_kernel && p.A_log) eA = __expf(dev::from_bits(alog_bits, p.A_log_dt));
  if (tid < kBT) {
    float b = 0.0f;
    if (F::kDelta && row_loads) {
      b = dev::from_bits(beta_bits, p.beta_dt);
      if (p.beta_sigmoid) b = dev::beta_sigmoid(b, p.beta_mult);
    }
    beta_s[tid] = b;
    gs_s[tid] = F::kScalarGate && p.gate_kind == GateKind::Scalar && row_loads ? dev::from_bits(gs_bits, p.g_dt) : 0.0f;
  }
  if constexpr (!F::kScalarGate)
    for_strided<K, NT>(tid, [&](int c) { bias_s[c] = bias_per_channel ? dev::from_bits(bias_bits[(c - tid) / NT], p.dt_bias_dt) : head_bias; });
  __syncthreads();  // B_a0: tiles landed

  if constexpr (F::kDelta && !F::kScalarGate) {
    // ---- KDA. Row norms (prep_norms.cuh); the row scales go to shared memory for the gate pass
    float* rs_s = reinterpret_cast<float*>(smem + Ly::oNRM);  // qs per row, then ks per row
    kda_row_norms<K, Ly>(p, q_s, k_s, rs_s, qk_s, warp, lane);
    __syncthreads();  // B_a1: row scales visible

    // ---- KDA gate pass, a channel pair per thread down the 16 rows of block I (warps w and w + 4
    // the two halves of the channels; 64 pairs per block, so at K = 64 the second half has none):
    // log-decay, its running sum d_i = G_i - G_bI (<= 0) with no shuffles; Kr = k ks e^{-d} (KR)
    // and in place Kl = k ks e^d, Ql = q qs e^d; the block's first gate and total per channel.
    // Rows go four at a time (a rolled loop keeps the code small), their raw gates loaded a step
    // ahead. The pass is compiled once per gate source (from_tile) and gate form (form: std::
    // integral_constant): with the source chosen per load, the tile reads carried the global
    // path's 64-bit offsets and dtype branches (~2.8 K of a chunk's ~32 K warp instructions).
    // The pass works in log2 units (every exponential an ex2 of its argument as it is): the
    // bounded form lb sigmoid(eA (x + dt_bias)) is an ex2 of one FMA of the raw gate (eA log2 e
    // and its product with dt_bias per channel, once) and a divide; the softplus form
    // -eA softplus(x + dt_bias) is -eA lg2(1 + ex2(.)); a precomputed log-decay is scaled only.
    // The sums go back to natural units once per channel at the end.
    // Steep channels (decay past kKdaSteepSpan inside the block; a bounded gate never is) would
    // take Kr out of fp32's range: for them a second pass over the block, which re-reads their k,
    // takes Kr through the block's last row instead (Kt = k ks e^{G_eI - G_i} <= 1), the table
    // takes their factors through e_I, and the block's diagonal pair products are taken per
    // element (exact_diagonal).
    auto gate_pass = [&](auto from_tile, auto form) {
      constexpr int kForm = decltype(form)::value;
      constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
      constexpr float kFloor2 = kMinChunkLogDecay * kLog2e, kLinear2 = 20.0f * kLog2e;
      const float neg_ea2 = -eA * kLog2e, lb2 = p.lb * kLog2e;
      // the bounded form's exponent -eA log2(e) (x + dt_bias) = neg_ea2 x + nb; softplus's argument
      // log2(e) (x + dt_bias) = log2(e) x + nb
      const float bias_mult = kForm == kBoundedGate ? neg_ea2 : kLog2e;
      // log2-unit log-decays of raw gates in two halves: the exponential before the next rows'
      // loads go out, the rest after them (u: softplus's argument)
      auto decay_begin = [&](float xn, float nb, float& u) {
        u = kForm == kBoundedGate ? 0.0f : fmaf(kLog2e, xn, nb);
        if constexpr (kForm == kBoundedGate) return dev::ex2_ftz(fmaf(neg_ea2, xn, nb));
        else if constexpr (kForm == kSoftplusGate) return dev::ex2_ftz(u > kLinear2 ? kLinear2 : u);
        else return u;
      };
      auto decay_end = [&](float y, float u) {
        float x;
        if constexpr (kForm == kBoundedGate) x = __fdividef(lb2, 1.0f + y);
        else if constexpr (kForm == kSoftplusGate) x = -eA * (u > kLinear2 ? u : dev::lg2_ftz(1.0f + y));
        else x = y;
        // chunk_log_decay's floor (not fmaxf: a NaN stays NaN); a bounded gate needs none (finite)
        return kForm == kBoundedGate || !(x < kFloor2) ? x : kFloor2;
      };
      auto load_row = [&](int row, int c0) {
        if constexpr (decltype(from_tile)::value) return row < Lc ? bf2(gate_at(row, c0)) : make_float2(0.0f, 0.0f);
        else return raw_gate(row, c0);
      };
      bool steep = false;
      for (int cp = 32 * kh + lane; cp < K / 2; cp += 64) {
        const int c0 = 2 * cp;
        auto load_rows = [&](int i0, float (&x)[8]) {
#pragma unroll
          for (int ii = 0; ii < 4; ++ii) {
            const float2 v = load_row(bI + i0 + ii, c0);
            x[2 * ii] = v.x, x[2 * ii + 1] = v.y;
          }
        };
        const float nb0 = bias_mult * bias_s[c0], nb1 = bias_mult * bias_s[c0 + 1];
        float run0 = 0.0f, run1 = 0.0f, first0 = 0.0f, first1 = 0.0f, xn[8];
        load_rows(0, xn);
#pragma unroll 1
        for (int i0 = 0; i0 < 16; i0 += 4) {
          float x[8], u[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) x[e] = decay_begin(xn[e], (e & 1) ? nb1 : nb0, u[e]);
          if (i0 + 4 < 16) load_rows(i0 + 4, xn);
#pragma unroll
          for (int e = 0; e < 8; ++e) x[e] = bI + i0 + (e >> 1) < Lc ? decay_end(x[e], u[e]) : 0.0f;
          if (i0 == 0) first0 = x[0], first1 = x[1];
#pragma unroll
          for (int ii = 0; ii < 4; ++ii) {
            const int row = bI + i0 + ii;
            run0 += x[2 * ii], run1 += x[2 * ii + 1];
            // |d| <= 15 |lower_bound| log2 e <= 109 for a bounded gate: every factor a normal float.
            // (A steep channel's Kr may overflow here: the pass below writes all of its rows again.)
            const float e0 = dev::ex2_ftz(run0 - first0), e1 = dev::ex2_ftz(run1 - first1);
            const float r0 = dev::ex2_ftz(first0 - run0), r1 = dev::ex2_ftz(first1 - run1);
            const float qsr = rs_s[row], ksr = rs_s[kBT + row];
            const float2 kv = bf2(k_s + row * LDK + c0), qv = bf2(q_s + row * LDK + c0);
            u32at(kr_s + row * LDK + c0) = pack(kv.x * ksr * r0, kv.y * ksr * r1);
            u32at(k_s + row * LDK + c0) = pack(kv.x * ksr * e0, kv.y * ksr * e1);
            u32at(q_s + row * LDK + c0) = pack(qv.x * qsr * e0, qv.y * qsr * e1);
          }
        }
        const float sum0 = run0 * kLn2, sum1 = run1 * kLn2, f0 = first0 * kLn2, f1 = first1 * kLn2;
        bsum_s[I * K + c0] = sum0, bsum_s[I * K + c0 + 1] = sum1;
        bfirst_s[I * K + c0] = f0, bfirst_s[I * K + c0 + 1] = f1;
        const bool steep0 = kAnyDecay && kda_steep(f0, sum0), steep1 = kAnyDecay && kda_steep(f1, sum1);
        if (steep0 || steep1) {
          // Kr of this pair again, the steep channel(s) through the block's last row: k ks
          // e^{G_eI - G_i} (<= 1), the raw k re-read (Kl is in its place)
          steep = true;
          float r[2] = {0.0f, 0.0f};
#pragma unroll 1
          for (int i = 0; i < 16; ++i) {
            const int row = bI + i;
            float2 kv = make_float2(0.0f, 0.0f);
            if (row < Lc) {
              const float2 v = load_row(row, c0);
              float u0, u1;
              const float y0 = decay_begin(v.x, nb0, u0), y1 = decay_begin(v.y, nb1, u1);
              r[0] += decay_end(y0, u0), r[1] += decay_end(y1, u1);
              kv = ld2(static_cast<const bf16*>(p.k) + b_row * p.k_s[0] + (t0 + row) * p.k_s[1] + h * p.k_s[2] + c0, half_in);
            }
            const float x0 = steep0 ? run0 - r[0] : first0 - r[0], x1 = steep1 ? run1 - r[1] : first1 - r[1];
            const float ksr = rs_s[kBT + row];
            u32at(kr_s + row * LDK + c0) = pack(kv.x * ksr * dev::ex2_ftz(x0), kv.y * ksr * dev::ex2_ftz(x1));
          }
        }
      }
      if constexpr (kAnyDecay) {
        steep = __any_sync(0xffffffffu, steep);
        if (steep && lane == 0) atomicOr(steep_bits, 1u << I);
      }
    };
    auto gate_forms = [&](auto from_tile) {
      if constexpr (!kAnyDecay) {
        gate_pass(from_tile, std::integral_constant<int, kBoundedGate>{});
      } else {
        if (!p.gate_in_kernel) gate_pass(from_tile, std::integral_constant<int, kLogDecay>{});
        else if (p.has_lb) gate_pass(from_tile, std::integral_constant<int, kBoundedGate>{});
        else gate_pass(from_tile, std::integral_constant<int, kSoftplusGate>{});
      }
    };
    if (gate_tile) gate_forms(std::true_type{});
    else gate_forms(std::false_type{});
    __syncthreads();  // B_b: block sums visible
  } else {
    // ---- row norms of this warp's rows, before the tiles are scaled in place (prep_norms.cuh)
    block_row_norms<K, F, Ly>(p, q_s, k_s, qk_s, qsc_s, ksc_s, rowq_s, rowk_s, bI, g, t);

    if constexpr (F::kScalarGate) {
      // One log-decay per row: warp 0 scans the 64 rows (lane holds rows lane and lane + 32); rows
      // past the sequence add nothing, so row 63 holds G_last.
      if (warp == 0) {
        float x[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int row = lane + 32 * hh;
          x[hh] = row < Lc ? activate(p.gate_kind == GateKind::Scalar ? gs_s[row] + head_bias : const_decay) : 0.0f;
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
                                       : ld2(static_cast<const bf16*>(p.g) + off, p.g_dt == CULA_FLOAT16);
          }
          x[2 * i] = v.x + bias_s[c0], x[2 * i + 1] = v.y + bias_s[c0 + 1];
        }
        if (p.gate_in_kernel && p.gate_kind != GateKind::Constant) dev::activate_gates(x, eA, p.has_lb, p.lb);
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
      if (steep && lane == 0) atomicOr(steep_bits, 1u << I);
      __syncthreads();  // B_b: block sums visible
    }
  }
  if constexpr (!F::kScalarGate) {
    // ---- per-channel exponent table (prep_table.cuh)
    exponent_table<K, F, kAnyDecay, KH, NT>(tid, bfirst_s, bsum_s, tab);
    __syncthreads();  // B_c: Kr and the table visible
  }

  // Exact A_qk of a steep diagonal block Ib into acc (the mma C-fragment layout) and, with the
  // delta rule, its A_kk straight into M (m_s: this warp wrote the block's entries just before, so
  // KDA calls it once its A_kk accumulators are spent): sum_c q_i k_j e^{G_i - G_j} (k_i k_j ...)
  // per element (j < i), the local gate recomputed from the raw one and raw q, k re-read, one
  // k-step at a time through this warp's scratch (slot: the warps that take diagonal pairs). Row
  // scales: GLA's in RQ, RK; KDA's in NRM.
  const float* rowq = F::kDelta ? reinterpret_cast<const float*>(smem + Ly::oNRM) : rowq_s;
  const float* rowk = F::kDelta ? reinterpret_cast<const float*>(smem + Ly::oNRM) + kBT : rowk_s;
  auto exact_diagonal = [&](int Ib, float (&acc)[2][4]) {
    const int slot = NW == 8 ? warp - 6 : warp;
    float* xs = reinterpret_cast<float*>(smem + Ly::oXS + slot * 2048);
    bf16* qr = reinterpret_cast<bf16*>(smem + Ly::oXS + slot * 2048 + 1024);
    bf16* kr = qr + 256;
    const int r0 = 16 * Ib;
    float acck[8];  // element r as acc's
#pragma unroll
    for (int r = 0; r < 8; ++r) acck[r] = 0.0f;
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
        *reinterpret_cast<uint4*>(qr + row * 16 + c8) = half_in ? half8_to_bf16(qv) : qv;
        *reinterpret_cast<uint4*>(kr + row * 16 + c8) = half_in ? half8_to_bf16(kv) : kv;
      }
      __syncwarp();
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const int i = g + 8 * (r >> 2), j = 8 * ((r >> 1) & 1) + 2 * t + (r & 1);
        if (j >= i) continue;
        float sum = 0.0f, sumk = 0.0f;
#pragma unroll 4
        for (int c = 0; c < 16; ++c) {
          const float e = __expf(xs[i * 16 + c] - xs[j * 16 + c]), kj = __bfloat162float(kr[j * 16 + c]);
          sum += __bfloat162float(qr[i * 16 + c]) * kj * e;
          if (F::kDelta) sumk += __bfloat162float(kr[i * 16 + c]) * kj * e;
        }
        acc[(r >> 1) & 1][(r & 1) + 2 * (r >> 2)] += sum;
        if (F::kDelta) acck[r] += sumk;
      }
      __syncwarp();
    }
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const int i = g + 8 * (r >> 2), j = 8 * ((r >> 1) & 1) + 2 * t + (r & 1);
      acc[(r >> 1) & 1][(r & 1) + 2 * (r >> 2)] *= rowq[r0 + i] * rowk[r0 + j];
      if (F::kDelta && j < i) m_s[(r0 + i) * MS + r0 + j] = beta_s[r0 + i] * (acck[r] * (rowk[r0 + i] * rowk[r0 + j]));
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
  const bf16* right_s = F::kScalarGate || !F::kDelta ? k_s : kr_s;  // Kt without the delta rule
  constexpr int kPairUnroll = F::kDelta && !F::kScalarGate ? 2 : 1;
#pragma unroll kPairUnroll
  for (int kk = 0; kk < KS; ++kk) {
    if (!F::kScalarGate && (kk & (KH - 1)) == kh) {
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
      if (F::kDelta) mma::ldsm_x4(ak, k_s + (16 * Ib + mma::a_row(lane)) * LDK + 16 * kk + mma::a_col(lane));
      mma::ldsm_x4(aq, q_s + (16 * Ib + mma::a_row(lane)) * LDK + 16 * kk + mma::a_col(lane));
      mma::ldsm_x4(b, right_s + (16 * Jb + mma::bn_row(lane)) * LDK + 16 * kk + mma::bn_col(lane));
      if (F::kDelta && !F::kScalarGate && Jb < Ib) {
        // KDA: E_{Ib,Jb} on the right operand, one fragment for both products (Kr e^{G_bI - G_bJ} =
        // k ks e^{G_bI - G_j} <= |k ks|); b[0], b[2] hold channels 2t, 2t + 1, b[1], b[3] 2t + 8, 2t + 9
#pragma unroll
        for (int h8 = 0; h8 < 2; ++h8) {
          const float2 e = *reinterpret_cast<const float2*>(tab + tab_pair(Ib, Jb) * K + 16 * kk + 2 * t + 8 * h8);
          const float2 x = unpack(b[h8]), y = unpack(b[h8 + 2]);
          b[h8] = pack(x.x * e.x, x.y * e.y);
          b[h8 + 2] = pack(y.x * e.x, y.y * e.y);
        }
      } else if (!F::kDelta && Jb < Ib) {
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
          const float2 e = *reinterpret_cast<const float2*>(tab + tab_pair(Ib, Jb) * K + 16 * kk + 2 * t + 8 * (rr >> 1));
          const float2 qv = unpack(aq[rr]);
          aq[rr] = pack(qv.x * e.x, qv.y * e.y);
        }
      } else if (!F::kDelta) {
        // Diagonal block without the delta rule: Ql e^{G_bI - G_eI} (per channel, <= e^64 unless
        // the block is steep and recomputed anyway) against Kt
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
          const int col = Ib * K + 16 * kk + 2 * t + 8 * (rr >> 1);
          const float2 qv = unpack(aq[rr]);
          aq[rr] = pack(qv.x * dev::exp_ftz(bfirst_s[col] - bsum_s[col]), qv.y * dev::exp_ftz(bfirst_s[col + 1] - bsum_s[col + 1]));
        }
      }
      if (F::kDelta) {
        mma::mma16816(akk[q][0], ak, b[0], b[1]);
        mma::mma16816(akk[q][1], ak, b[2], b[3]);
      }
      mma::mma16816(aqk[q][0], aq, b[0], b[1]);
      mma::mma16816(aqk[q][1], aq, b[2], b[3]);
    }
  }
  // Steep diagonal blocks: a factor of their products may have left fp32's range (GLA's left
  // e^{G_bI - G_eI}, KDA's Kr), so they are replaced by sums taken per element, each pair with its
  // own exponent (KDA: once M is written, below).
  auto exact_steep_diagonals = [&] {
#pragma unroll
    for (int q = 0; q < QP; ++q)
      if (pi[q] >= 0 && pi[q] == pj[q] && ((*steep_bits >> pi[q]) & 1u)) exact_diagonal(pi[q], aqk[q]);
  };
  if constexpr (!F::kDelta) exact_steep_diagonals();
  __syncthreads();  // B_c2: every warp done with the k el tile (it becomes Kd next)
  if constexpr (F::kScalarGate) {
    // This warp's rows, 16 bytes at a time: F = diag(ks e^{G_last - G_i}) k in place (Kt's right
    // operand); e^{G_last} for every channel; the scan's row factors (Work::F::kRawQK): qs e^{G_i} for
    // o = q S, beta_i and -beta_i ks e^{G_i} for Y = beta v - beta ks e^G (k S).
    const float glast = grow_s[kBT - 1];
    if (lane < 16) {
      const int row = bI + lane;
      float* rf = reinterpret_cast<float*>(blk + Wk::oRF);
      rf[row] = qsc_s[row] * dev::exp_ftz(grow_s[row]);
      rf[kBT + row] = beta_s[row];
      rf[2 * kBT + row] = -beta_s[row] * ksc_s[row] * dev::exp_ftz(grow_s[row]);
    }
    // fp16 inputs: F from the fp16 k (re-read, the tile holds it as bf16) as two bf16 planes, the
    // rounded remainder (lo) transposed into the workspace's Kt slot, where kt_product reads it
    // before writing Kt over it: k's bf16 rounding in Kt was the rest of the fp16 error
    // (tools/analysis/gdn_fp16_rounding.py)
    // Lanes 0-15 and 16-31 take the warp's 16 rows at two 8-channel columns per step, so that each
    // of the lo plane's transposed 2-byte stores is 32 contiguous bytes per half-warp (16 rows of one
    // channel; row-major lanes made it 16 sectors per store, 2.7x the bf16 prep's time at K = 128).
    bf16* kd_lo = reinterpret_cast<bf16*>(blk + Wk::oKt);
    const int row = bI + lane % 16;
    const float fw = ksc_s[row] * dev::exp_ftz(glast - grow_s[row]);
    for (int idx = lane; idx < 16 * (K / 8); idx += 32) {
      const int c8 = (idx / 16) * 8;
      const bool exact16 = half_in && row < Lc;
      const uint4 kv = exact16 ? *reinterpret_cast<const uint4*>(static_cast<const bf16*>(p.k) + b_row * p.k_s[0] +
                                                                 (t0 + row) * p.k_s[1] + h * p.k_s[2] + c8)
                               : *reinterpret_cast<const uint4*>(k_s + row * LDK + c8);
      uint4 ow;
      const uint32_t* kw = reinterpret_cast<const uint32_t*>(&kv);
      uint32_t* oww = reinterpret_cast<uint32_t*>(&ow);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 y = exact16 ? chunk::unpack16<true>(kw[j]) : unpack(kw[j]);
        oww[j] = pack(y.x * fw, y.y * fw);
        if (half_in) {
          const float2 hi = unpack(oww[j]);
          const uint32_t lo = exact16 ? pack(y.x * fw - hi.x, y.y * fw - hi.y) : 0u;
          kd_lo[(c8 + 2 * j) * kBT + row] = reinterpret_cast<const bf16*>(&lo)[0];
          kd_lo[(c8 + 2 * j + 1) * kBT + row] = reinterpret_cast<const bf16*>(&lo)[1];
        }
      }
      *reinterpret_cast<uint4*>(ck_s + row * LDK + c8) = ow;
    }
    for_strided<K, NT>(tid, [&](int c) { reinterpret_cast<float*>(blk + Wk::oDL)[c] = __expf(glast); });
  } else if constexpr (F::kDelta) {
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
    for_strided<K, NT>(tid, [&](int c) { reinterpret_cast<float*>(blk + Wk::oDL)[c] = tab[kTabLast * K + c]; });
  }
  // ---- M = I + diag(beta) strict_lower(A_kk) for this warp's pairs into R1 (the q el tile, free
  // since B_c2); tril(A_qk) out (its blocks above the diagonal are not written).
  // Delta rule: tril(A_qk) in fp32 for the product tril(A_qk) Minv instead, into the Kr buffer once
  // B_d frees it (GDN: kept in registers until M is consumed, then into R1).
  float* af_s = reinterpret_cast<float*>(smem + (F::kScalarGate ? Ly::oR1 : Ly::oKR));
  static_assert(!F::kDelta || F::kScalarGate || Ly::oTB - Ly::oKR >= kBT * MS * 4, "fp32 A_qk fits the Kr buffer");
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
  if constexpr (F::kScalarGate)  // e^{G_i - G_j} <= 1 for j <= i, with the row factors of q_i, k_i, k_j
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
  if constexpr (F::kDelta && !F::kScalarGate) {
    each_pair([&](int q, int nt, int hh, int gi, int gj) {
      const float b = beta_s[gi];
      m_s[gi * MS + gj] = gj < gi ? b * akk[q][nt][2 * hh] : (gj == gi ? 1.0f : 0.0f);
      m_s[gi * MS + gj + 1] = gj + 1 < gi ? b * akk[q][nt][2 * hh + 1] : (gj + 1 == gi ? 1.0f : 0.0f);
    });
    if constexpr (kAnyDecay) exact_steep_diagonals();
  } else if constexpr (!F::kDelta) {
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
    for_strided<K, 128>(tid - 128, [&](int c) { reinterpret_cast<float*>(blk + Wk::oDL)[c] = tab[kTabLast * K + c]; });
  };
  // In the block-barriers-only instantiation (for racecheck, which misreads the block barriers after
  // a barrier that some warps only arrive at) B_f is a block barrier and warps 4-7 start after it.
  constexpr bool overlap_w_kd = F::kDelta && !F::kScalarGate && !kBlockBarriersOnly;
  if constexpr (F::kDelta && !F::kScalarGate) {
    if (overlap_w_kd && kh == 1) {
      mbar::named_arrive(1, 32 * NW);  // B_f
      w_kd_pass();
    }
  }
  // Diagonal blocks of Minv (prep_minv.cuh)
  if (kh == 0 && lane < 16) invert_diagonal_block<Ly>(m_s, t_s, bI, lane);
  if (overlap_w_kd) {
    if (kh == 0) mbar::named_sync(1, 32 * NW);  // B_f: diagonal inverses visible (warps 4-7 arrived)
  } else {
    __syncthreads();  // B_f: diagonal inverses visible
    if constexpr (F::kDelta && !F::kScalarGate)
      if (kh == 1) w_kd_pass();
  }
  // Off-diagonal blocks of Minv by halves (prep_minv.cuh)
  invert_off_diagonal<Ly, NT, overlap_w_kd>(m_s, t_s, half_in, I, kh, lane, g, t);
  __syncthreads();  // B_g: Minv complete (KDA: W', Kd written, Kr no longer read)
  if constexpr (!F::kScalarGate) {  // KDA: tril(A_qk) in fp32 into the Kr buffer
    each_pair([&](int q, int nt, int hh, int gi, int gj) {
      *reinterpret_cast<float2*>(af_s + gi * MS + gj) =
          make_float2(masked_a(gi, gj, aqk[q][nt][2 * hh]), masked_a(gi, gj + 1, aqk[q][nt][2 * hh + 1]));
    });
  } else {  // tril(A_qk) from registers into R1 (M is consumed)
    each_pair([&](int q, int nt, int hh, int gi, int gj) {
      *reinterpret_cast<float2*>(af_s + gi * MS + gj) = make_float2(aqk[q][nt][2 * hh], aqk[q][nt][2 * hh + 1]);
    });
  }
  // Kt = Minv^T Kd, written transposed (prep_kt_am.cuh). KDA: before B_h, since it reads neither
  // tril(A_qk) nor anything written after B_g (-1..-1.5%); GDN measured 2% slower in that order,
  // so it stays after AM.
  auto kt_pass = [&] {
    kt_product<K, NW, Ly>(t_s, ck_s, reinterpret_cast<bf16*>(blk + Wk::oKt), F::kScalarGate && half_in, warp, lane, g, t);
  };
  if constexpr (!F::kScalarGate) kt_pass();
  __syncthreads();  // B_h: tril(A_qk) visible

  // AM = tril(A_qk) Minv (prep_kt_am.cuh)
  am_product<KH, QP, Ly, Wk>(pi, pj, af_s, t_s, reinterpret_cast<bf16*>(blk + Wk::oA), warp, lane, g, t);
  if constexpr (F::kScalarGate) kt_pass();
}

}  // namespace chunk_prep_scan
}  // namespace cula
