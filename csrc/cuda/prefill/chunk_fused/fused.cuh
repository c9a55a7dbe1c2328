// The 8-warp fused kernel (also the local pass of split sequences). Warps, buffers and barriers:
// DESIGN.md beside this file.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/common/fwd_params.cuh"
#include "cuda/common/recurrence_math.cuh"
#include "cuda/kerutils/mbarrier.cuh"
#include "cuda/kerutils/mma.cuh"
#include "cuda/prefill/chunk_common.cuh"
#include "cuda/prefill/chunk_fused/config.cuh"
#include "cuda/prefill/chunk_fused/factors.cuh"
#include "cuda/prefill/chunk_fused/qk_block.cuh"
#include "cuda/prefill/state_slice.cuh"

namespace cula {
namespace chunk_fused {

// kLocal: the local pass of a split sequence, one CTA per (sequence, value head, V slice, part
// before the last segment); otherwise one CTA per (sequence, value head, V slice, segment).
// kOwnFactors (fac == nullptr): the row factors are written here (constant_decay_factors). E: the
// element type of q, k, v (bf16 or fp16) and of every 16-bit operand formed from them (S, Vd, A).
template <class E, int K, int VB, bool kLocal, bool kOwnFactors>
__global__ void __launch_bounds__(kThreads, kLocal ? (K > 128 ? 2 : 3) : 1)  // the local pass: ~65 KB at K = 128, three CTAs per SM
    chunk_fused_kernel(const FwdParams p, const int32_t* __restrict__ chunk_base, const float* __restrict__ fac,
                       const SplitState sp) {
  using Ly = FusedLayout<K, VB, kLocal>;
  constexpr int LDK = Ly::LDK, LDV = Ly::LDV;
  constexpr int KS = K / 16;
  constexpr int NT = VB / 8;
  constexpr int NTH = NT / 2;  // n-tiles per warp: warps 4..7 take the second half of the columns
  extern __shared__ __align__(16) unsigned char smem[];
  E* s_s = reinterpret_cast<E*>(smem + Ly::oS);
  E* vd_s = reinterpret_cast<E*>(smem + Ly::oVD);
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
  const E* q_in = static_cast<const E*>(p.q) + sq.b_row * p.q_s[0] + sq.bos * p.q_s[1] + h * p.q_s[2] + ck.c8;
  const E* k_in = static_cast<const E*>(p.k) + sq.b_row * p.k_s[0] + sq.bos * p.k_s[1] + h * p.k_s[2] + ck.c8;
  const E* v_in = static_cast<const E*>(p.v) + sq.b_row * p.v_s[0] + sq.bos * p.v_s[1] + hv * p.v_s[2] + v0 + cv.c8;
  const float own_a = kOwnFactors ? dev::chunk_log_decay(constant_log_decay(p, hv, h)) : 0.0f;
  auto stage_in = [&](int c, int st) {
    if (c < c_end) {
      unsigned char* dst = smem + st * Ly::stage;
      const int64_t t0 = static_cast<int64_t>(c) * kBT;  // from the sequence start
      const int Lc = static_cast<int>(min(int64_t{kBT}, sq.eos - sq.bos - t0));
#pragma unroll
      for (int j = 0; j < CopyK::J; ++j) {
        const int r = ck.row(j);
        E* dq = reinterpret_cast<E*>(dst + Ly::sQ) + r * LDK + ck.c8;
        E* dk = reinterpret_cast<E*>(dst + Ly::sK) + r * LDK + ck.c8;
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
        E* d = reinterpret_cast<E*>(dst + Ly::sV) + r * LDV + cv.c8;
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
  const bool out_f32 = p.out_dt == CULA_FLOAT32, out_half = p.out_dt == CULA_FLOAT16;  // else bf16
  float decay_product = 1.0f;  // kLocal: the part's total decay
  for (int c = c_begin; c < c_end; ++c) {
    const int st = (c - c_begin) & 1;
    const unsigned char* base = smem + st * Ly::stage;
    const E* q_s = reinterpret_cast<const E*>(base + Ly::sQ);
    const E* k_s = reinterpret_cast<const E*>(base + Ly::sK);
    const E* v_s = reinterpret_cast<const E*>(base + Ly::sV);
    const float* F = reinterpret_cast<const float*>(base + Ly::sF);
    const int64_t t0 = sq.bos + static_cast<int64_t>(c) * kBT;
    const int Lc = static_cast<int>(min(int64_t{kBT}, sq.eos - t0));

    // S (16-bit, E) for the products; intermediate state (chunk start)
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
        const float2 x = unpack<E>(*reinterpret_cast<const uint32_t*>(v_s + row * LDV + col));
        u32at(vd_s + row * LDV + col) = pack<E>(x.x * f, x.y * f);
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
          mma::mma16816<E>(o[2 * np], qf[kk], b[0], b[1]);
          mma::mma16816<E>(o[2 * np + 1], qf[kk], b[2], b[3]);
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
      // registers as E (bf16 or fp16) hi + lo A fragments. The blocks Jb <= I are split between
      // the two warps of row block I by parity and each is applied to all VB columns (the longest
      // row block costs two blocks, not four); the partial for the partner's half goes through xo_s
      // behind B2.
      // Unrolled (two accumulator chains over the k-steps) so the blocks of a warp overlap.
      const int hw = warp >> 2;
      float ox[NT][4] = {};
#pragma unroll
      for (int Jb = 0; Jb < 4; ++Jb) {
        if (Jb > I || (Jb & 1) != hw) continue;
        float x[2][2][2];
        masked_qk_block<KS, LDK, E>(qf, k_s, Jb, bI, lane, F, gi, qi, x);
        uint32_t ahi[4], alo[4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const float x0 = x[nt][hh][0], x1 = x[nt][hh][1];
            const uint32_t hi = pack<E>(x0, x1);
            const float2 h2 = unpack<E>(hi);
            ahi[2 * nt + hh] = hi;  // fragment a0..a3 = (row g, k lo), (row g+8, k lo), (row g, k hi), (row g+8, k hi)
            alo[2 * nt + hh] = pack<E>(x0 - h2.x, x1 - h2.y);
          }
        }
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t b[4];
          mma::ldsm_x4_t(b, v_s + (16 * Jb + mma::bk_row(lane)) * LDV + 16 * np + mma::bk_col(lane));
          mma::mma16816<E>(ox[2 * np], ahi, b[0], b[1]);
          mma::mma16816<E>(ox[2 * np + 1], ahi, b[2], b[3]);
          mma::mma16816<E>(ox[2 * np], alo, b[0], b[1]);
          mma::mma16816<E>(ox[2 * np + 1], alo, b[2], b[3]);
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
        const int64_t dst = sq.b_row * p.out_s[0] + (t0 + row) * p.out_s[1] + hv * p.out_s[2] + v0 + hc0 + 2 * t;
#pragma unroll
        for (int nt = 0; nt < NTH; ++nt) {
          const float2 x = *reinterpret_cast<const float2*>(xo_s + row * LDX + hc0 + nt * 8 + 2 * t);
          if (row < Lc) chunk::store_out2(p.out, out_f32, out_half, dst + nt * 8, o[nt][2 * hh] + x.x, o[nt][2 * hh + 1] + x.y);
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

}  // namespace chunk_fused
}  // namespace cula
