// The scan kernel of the chunk engine: one CTA per (sequence, value head, VB columns), the chunks
// in order, the state slice in registers, the prep's workspace blocks streamed in. Warps, buffers
// and barriers: DESIGN.md beside this file.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/common/fwd_params.cuh"
#include "cuda/common/recurrence_math.cuh"
#include "cuda/kerutils/mma.cuh"
#include "cuda/kerutils/wgmma.cuh"
#include "cuda/prefill/chunk_common.cuh"
#include "cuda/prefill/chunk_prep_scan/config.cuh"
#include "cuda/prefill/state_slice.cuh"

namespace cula {
namespace chunk_prep_scan {

// kBlockBarriersOnly: the debug instantiation for racecheck (DESIGN.md), launched only on request.
// kStatesOnly: the segments' summary scan (launch.cuh), which wants the states and not o: no Qg
// (or q) and AM tiles copied, no products of o, nothing stored but the states.
template <int K, int VB, class F, bool kBlockBarriersOnly = false, bool kStatesOnly = false>
__global__ void __launch_bounds__(32 * scan_warps(VB), scan_ctas_per_sm(K, VB, kStatesOnly))
    chunk_scan_kernel(const FwdParams p, const int32_t* __restrict__ chunk_base, const unsigned char* __restrict__ work) {
  using Ly = ScanLayoutOf<K, VB, F, kStatesOnly>;
  using Wk = Work<K, F>;
  constexpr int LDK = Ly::LDK, LDV = Ly::LDV, LDT = Ly::LDT;
  constexpr int KS = K / 16;
  constexpr int NW = scan_warps(VB), NTHR = 32 * NW, WH = NW / 4;  // WH: column groups
  constexpr int NTH = VB / (8 * WH);  // n-tiles per warp: warps 4j..4j+3 take column group j
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* s_s = reinterpret_cast<bf16*>(smem + Ly::oS);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int I = warp & 3, bI = 16 * I, hc0 = (warp >> 2) * (VB / WH);
  const chunk::SliceTask tk = chunk::slice_task<VB, true>(p, chunk_base);
  const int n = tk.n, hv = tk.hv, v0 = tk.v0, nchunks = tk.nchunks;
  const Seq sq = tk.sq;
  const int64_t cbase = tk.cbase;

  // sm_90a: the products with S as warpgroup products (DESIGN.md); with the delta rule the
  // state update too, which takes S in the warpgroup row layout and Y transposed (kYtOwn: in a
  // buffer of its own, else in the S^T buffer)
  constexpr bool kWg = CULA_WGMMA, kWgUpdate = kWg && F::kDelta, kYtOwn = kWg && Ly::kYtOwn;
  using Slice = StateSlice<K, VB, NW, kWgUpdate>;
  Slice S(warp, lane, v0);
  const int64_t slot = Slice::pool_slot(p, n);
  S.load(p, n, hv, slot);

  // One chunk's workspace slice (and v slice without the delta rule) into stage st (an empty
  // commit group past the end).
  constexpr int kMats = F::kDelta ? 3 : 2;  // (W,) Qg, Kd
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
      if constexpr (F::kDelta) {  // Kt^T [channel][token] from the workspace, in the 128-byte swizzle
#pragma unroll
        for (int j = 0; j < CopyKt::J; ++j)
          mma::cp_async16(dst + Ly::sKt + wg::sw128_offset(K, ckt.row(j), ckt.c8),
                          blk + Wk::oKt + (ckt.row(j) * kBT + ckt.c8) * 2);
      }
      if constexpr (F::kRawQK) {
        // Kt^T (above), q and k raw from the input (rows past the sequence zeros); row factors
#pragma unroll
        for (int j = 0; j < CopyK::J; ++j) {
          const int r = ck.row(j);
          unsigned char* dq = dst + Ly::sQ + left_at(r, ck.c8);
          unsigned char* dk = dst + Ly::sKd + left_at(r, ck.c8);
          if (r < Lc) {
            const int64_t tok = static_cast<int64_t>(c) * kBT + r;
            if (!kStatesOnly) mma::cp_async16(dq, q_in + tok * p.q_s[1]);
            mma::cp_async16(dk, k_in + tok * p.k_s[1]);
          } else {
            if (!kStatesOnly) *reinterpret_cast<uint4*>(dq) = make_uint4(0, 0, 0, 0);
            *reinterpret_cast<uint4*>(dk) = make_uint4(0, 0, 0, 0);
          }
        }
      } else {
#pragma unroll
        for (int m = 3 - kMats; m < (F::kDelta ? 2 : 3); ++m) {  // (Kt^T above)
          if (kStatesOnly && m == 1) continue;  // (Qg: o's only)
          const int so = m == 0 ? Ly::sW : m == 1 ? Ly::sQ : Ly::sKd, go = m == 0 ? Wk::oW : m == 1 ? Wk::oQ : Wk::oKd;
#pragma unroll
          for (int j = 0; j < CopyK::J; ++j)
            mma::cp_async16(dst + so + (m < 2 ? left_at(ck.row(j), ck.c8) : (ck.row(j) * LDK + ck.c8) * 2),
                            blk + go + (ck.row(j) * K + ck.c8) * 2);
        }
      }
#pragma unroll
      for (int j = 0; j < (kStatesOnly ? 0 : CopyA::J); ++j) {  // rows 64..127: the lo plane, its diagonal blocks only
        const int r = ca.row(j), rb = (r % kBT) / 16;  // blocks on or below the diagonal
        if (ca.c8 < 16 * (rb + 1) && (r < kBT || ca.c8 >= 16 * rb))
          mma::cp_async16(dst + Ly::sA + (r * LDT + ca.c8) * 2, blk + Wk::oA + (r * kBT + ca.c8) * 2);
      }
#pragma unroll
      for (int j = 0; j < CopyV::J; ++j) {
        const int r = cv.row(j);
        unsigned char* du = dst + Ly::sU + (r * LDV + cv.c8) * 2;
        // rows past the sequence are zeros (they meet zero k rows and A columns), as are columns past
        // v's (value_dim)
        if (r < Lc && v0 < p.v_cols)
          mma::cp_async16(du, v_in + (static_cast<int64_t>(c) * kBT + r) * p.v_s[1]);
        else
          *reinterpret_cast<uint4*>(du) = make_uint4(0, 0, 0, 0);
      }
      if (tid < K / 4) mma::cp_async16(dst + Ly::sDL + tid * 16, blk + Wk::oDL + tid * 16);
      if (tid < Wk::kRowFactors * kBT / 4) mma::cp_async16(dst + Ly::sRF + tid * 16, blk + Wk::oRF + tid * 16);
    }
    mma::cp_async_commit();
  };

  // fp16 inputs: this thread's own copies of stage st (Lc rows of the chunk) to bf16 in place
  // (GDN reads v once, as fp16, into Y's fp32 sum: its bf16 rounding was most of the fp16 error,
  // tools/analysis/gdn_fp16_rounding.py)
  // kHalfAhead: GDN's raw q and k (a whole K-wide tile each, where the other families convert a
  // v slice) are converted a chunk ahead: they were on the critical path before B1 (+29% scan time
  // at 1x8192 H16/HV32); KDA's 128-column scans spill with the ahead path compiled in.
  constexpr bool kHalfAhead = F::kRawQK && Ly::kStages == 2;
  auto half_stage_to_bf16 = [&](int st, int Lc) {
    unsigned char* base = smem + st * Ly::stage;
    if constexpr (!F::kRawQK)
#pragma unroll
      for (int j = 0; j < CopyV::J; ++j)
        if (cv.row(j) < Lc) half8_to_bf16_at(base + Ly::sU + (cv.row(j) * LDV + cv.c8) * 2);
    if constexpr (F::kRawQK) {
#pragma unroll
      for (int j = 0; j < CopyK::J; ++j)
        if (ck.row(j) < Lc) {
          if (!kStatesOnly) half8_to_bf16_at(base + Ly::sQ + left_at(ck.row(j), ck.c8));
          half8_to_bf16_at(base + Ly::sKd + left_at(ck.row(j), ck.c8));
        }
    }
  };
  if (kWg && tid == 0 && (mma::smem_addr(smem) & 1023)) __trap();  // the swizzle needs 1024-byte panels
  // Two stages, one chunk ahead; at K = 256 one stage fits (ScanLayout::kStages): the next chunk's
  // copies go out once this one's stage is free
  constexpr int kStages = Ly::kStages;
  stage_in(0, 0);
  if (kStages == 2) stage_in(1, 1);
  if (F::kDelta) state_to_smem();
  const bool out_f32 = p.out_dt == CULA_FLOAT32;  // else the inputs' 16-bit type (store_out2)
  const bool half_in = p.v_dt == CULA_FLOAT16;
  for (int c = 0; c < nchunks; ++c) {
    const int st = kStages == 2 ? c & 1 : 0;
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
    if (!F::kDelta) state_to_smem();
    if (p.inter) S.store(p, p.inter, p.inter_dt, cbase + c, hv);
    mma::cp_async_wait_pending(kStages - 1);
    // fp16 inputs: this chunk's copies here, or (kHalfAhead) the first chunk's only, the others'
    // converted at the end of the chunk before, under its state update
    if (half_in && (!kHalfAhead || c == 0)) half_stage_to_bf16(st, Lc);
    if constexpr (kWg) wg::fence_proxy_async();  // the stage and S, written by this thread, to wgmma
    __syncthreads();  // B1: this chunk's stage landed; S visible

    // Delta rule: Y = beta v + W' S (Vnew = Minv Y; without the delta rule Vnew = v, the stage's v
    // slice) and o = Qg S, sharing the S fragments. F::kRawQK: X = k S in place of W' S, then
    // Y = beta v - beta ks e^G X
    float vn[NTH][4], o[NTH][4];
    const float* rf = reinterpret_cast<const float*>(base + Ly::sRF);
#pragma unroll
    for (int nt = 0; nt < NTH; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        if (F::kDelta) {
          const int row = bI + g + 8 * hh;
          const float2 v2 = F::kRawQK ? make_float2(0.0f, 0.0f) : bf2(vin_s + row * LDV + hc0 + nt * 8 + 2 * t);
          const float b = F::kRawQK ? 0.0f : rf[row];
          vn[nt][2 * hh] = b * v2.x, vn[nt][2 * hh + 1] = b * v2.y;
        }
        o[nt][2 * hh] = 0.0f, o[nt][2 * hh + 1] = 0.0f;
      }
    if constexpr (kWg) {
      // one warpgroup per column group: W' S (or k S) and Qg S (or q S) for all 64 rows, S^T (its
      // rows hc0..) read once per group
      const uint32_t aw0 = mma::smem_addr(F::kRawQK ? kd_s : w_s), aq0 = mma::smem_addr(qg_s), bs0 = mma::smem_addr(s_s);
      wg::fence_operand(vn);
      if constexpr (!kStatesOnly) wg::fence_operand(o);
      wg::fence();
      if constexpr (kStatesOnly) {  // Y's product only (none without the delta rule)
        if constexpr (F::kDelta) {
#pragma unroll
          for (int kk = 0; kk < KS; ++kk)
            wg::mma_bf16<NTH>(vn, wg::desc_kstep(aw0, kBT, 0, kk), wg::desc_kstep(bs0, VB, hc0, kk));
          wg::commit();
          wg::wait_all();
          wg::fence_operand(vn);
        }
      } else if constexpr (kYtOwn) {
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
          if (F::kDelta) wg::mma_bf16<NTH>(vn, wg::desc_kstep(aw0, kBT, 0, kk), db);
          wg::mma_bf16<NTH>(o, wg::desc_kstep(aq0, kBT, 0, kk), db);
        }
        wg::commit();
        wg::wait_all();
        wg::fence_operand(vn);
        wg::fence_operand(o);
      }
    } else if constexpr (F::kDelta || !kStatesOnly) {
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      uint32_t aw[4], aq[4];
      if (F::kDelta) mma::ldsm_x4(aw, (F::kRawQK ? kd_s : w_s) + (bI + mma::a_row(lane)) * LDK + 16 * kk + mma::a_col(lane));
      if (!kStatesOnly) mma::ldsm_x4(aq, qg_s + (bI + mma::a_row(lane)) * LDK + 16 * kk + mma::a_col(lane));
#pragma unroll
      for (int np = 0; np < NTH / 2; ++np) {
        uint32_t b[4];
        mma::ldsm_x4_t(b, s_s + (16 * kk + mma::bk_row(lane)) * LDV + hc0 + 16 * np + mma::bk_col(lane));
        if (F::kDelta) {
          mma::mma16816(vn[2 * np], aw, b[0], b[1]);
          mma::mma16816(vn[2 * np + 1], aw, b[2], b[3]);
        }
        if (!kStatesOnly) {
          mma::mma16816(o[2 * np], aq, b[0], b[1]);
          mma::mma16816(o[2 * np + 1], aq, b[2], b[3]);
        }
      }
    }
    }
    if constexpr (F::kRawQK) {  // o = qs e^{G_i} (q S); Y = beta_i v_i - beta_i ks e^{G_i} X_i
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = bI + g + 8 * hh;
        const float fq = rf[row], fv = rf[kBT + row], fx = rf[2 * kBT + row];
#pragma unroll
        for (int nt = 0; nt < NTH; ++nt) {
          o[nt][2 * hh] *= fq, o[nt][2 * hh + 1] *= fq;
          const float2 v2 = ld2(vin_s + row * LDV + hc0 + nt * 8 + 2 * t, half_in);
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
    if (F::kDelta) {
      if constexpr (!kWgUpdate)
#pragma unroll
        for (int nt = 0; nt < NTH; ++nt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh)
            u32at(vin_s + (bI + g + 8 * hh) * LDV + hc0 + nt * 8 + 2 * t) = pack(vn[nt][2 * hh], vn[nt][2 * hh + 1]);
      // B2: Y visible to the warps of this column group, its only readers (the update and AM Y take
      // the group's own columns), so the two groups need not wait for each other here
      if constexpr (kBlockBarriersOnly) __syncthreads();
      else mbar::named_sync(1 + warp / 4, 128);
    }

    // S = e^{G_last} S + Kt^T Y (delta rule: Kt in the Kd slot, GDN's in the W slot; without it
    // Kd^T v), issued first so that its mma latency hides behind o's products; with the delta rule
    // its bf16 copy for the next chunk goes out after them (every warp read this chunk's copy
    // before B2)
    // (Kt^T from the swizzled slot; sm_90a: as warpgroup products, waited for after o's)
    auto decay = [&](int ch) { return dl_s[ch]; };
    if constexpr (kWgUpdate) S.update_wg(mma::smem_addr(base + Ly::sKt), yt, decay);
    else if constexpr (F::kDelta) S.update_kt_sw128(mma::smem_addr(base + Ly::sKt), vin_s, LDV, decay, lane);
    else S.update(kd_s, LDK, vin_s, LDV, decay, lane);
    if constexpr (kYtOwn && !kStatesOnly) {  // Qg S done (the update, committed last, may still run)
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
    if constexpr (!kStatesOnly) {
#pragma unroll
      for (int Jb = 0; Jb < 3; ++Jb)
        if (Jb < I) am_block(Jb, std::false_type{});
      am_block(I, std::bool_constant<Wk::kAPlanes == 2>{});
    }
    if (kHalfAhead && half_in && c + 1 < nchunks) {  // the next chunk's copies (landed by now), while
      mma::cp_async_wait_pending(0);                  // the update's products run
      half_stage_to_bf16(st ^ 1, static_cast<int>(min(int64_t{kBT}, sq.eos - t0 - kBT)));
    }
    if constexpr (kWgUpdate) S.wait_wg();
    else if (F::kDelta) state_to_smem();
#pragma unroll
    for (int hh = 0; hh < (kStatesOnly ? 0 : 2); ++hh) {
      const int row = bI + g + 8 * hh;
      if (row >= Lc) continue;
      const int64_t dst = sq.b_row * p.out_s[0] + (t0 + row) * p.out_s[1] + hv * p.out_s[2] + v0 + hc0 + 2 * t;
#pragma unroll
      for (int nt = 0; nt < NTH; ++nt) store_out2(p.out, out_f32, half_in, dst + nt * 8, o[nt][2 * hh], o[nt][2 * hh + 1]);
    }
    __syncthreads();  // B3: stage st (and S without the delta rule, Y^T on sm_90a) no longer read
    stage_in(c + kStages, st);
    if constexpr (kWgUpdate) state_to_smem();
  }

  if (p.ht) S.store(p, p.ht, p.ht_dt, n, hv);
  if (slot >= 0) S.store(p, p.pool, p.pool_dt, slot, hv);
}

}  // namespace chunk_prep_scan
}  // namespace cula
