// The warp-specialized fused kernel: output warps and state warps handing buffers over through
// mbarriers. Warps, buffers and barriers: DESIGN.md beside this file.
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

// kOwnFactors (fac == nullptr): the row factors are written here (constant_decay_factors), not
// copied from the factor kernel's output. E: the element type of q, k, v (bf16 or fp16) and of the
// 16-bit operands formed from them (the S ring, A).
template <class E, int K, int VB, bool kOwnFactors>
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
  auto ring_at = [&](int i) { return reinterpret_cast<E*>(smem + Ly::oS) + (i & 1) * K * LDV; };

  if (warp >= kWsOutWarps) {
    // state chain and copies
    const int ts = tid - 32 * kWsOutWarps;
    using CopyK = chunk::TileCopy<kBT, K, 32 * kWsStateWarps>;
    using CopyV = chunk::TileCopy<kBT, VB, 32 * kWsStateWarps>;
    const CopyK ck(ts);
    const CopyV cv(ts);
    const E* q_in = static_cast<const E*>(p.q) + sq.b_row * p.q_s[0] + sq.bos * p.q_s[1] + h * p.q_s[2] + ck.c8;
    const E* k_in = static_cast<const E*>(p.k) + sq.b_row * p.k_s[0] + sq.bos * p.k_s[1] + h * p.k_s[2] + ck.c8;
    const E* v_in =
        static_cast<const E*>(p.v) + sq.b_row * p.v_s[0] + sq.bos * p.v_s[1] + hv * p.v_s[2] + v0 + cv.c8;
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
      S.update_token_scaled(reinterpret_cast<const E*>(base + Ly::sK), LDK, reinterpret_cast<const E*>(base + Ly::sV),
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
    const bool out_f32 = p.out_dt == CULA_FLOAT32, out_half = p.out_dt == CULA_FLOAT16;  // else bf16
    for (int i = 0; i < nloc; ++i) {
      const int c = c_begin + i;
      const int64_t t0 = sq.bos + static_cast<int64_t>(c) * kBT;
      const int Lc = static_cast<int>(min(int64_t{kBT}, sq.eos - t0));
      mbar::wait(&full[i % D], (i / D) & 1);
      const unsigned char* base = stage_at(i);
      const E* q_s = reinterpret_cast<const E*>(base + Ly::sQ);
      const E* k_s = reinterpret_cast<const E*>(base + Ly::sK);
      const E* v_s = reinterpret_cast<const E*>(base + Ly::sV);
      const float* F = reinterpret_cast<const float*>(base + Ly::sF);

      uint32_t qf[KS][4];
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) mma::ldsm_x4(qf[kk], q_s + (bI + mma::a_row(lane)) * LDK + 16 * kk + mma::a_col(lane));
      float gi[2], qi[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) gi[hh] = F[kFG + bI + g + 8 * hh], qi[hh] = F[kFQS + bI + g + 8 * hh];

      // The blocks Jb <= I of q k^T with parity hw, as E (16-bit) A fragments (one plane, as FLA's
      // chunk_simple_gla keeps A); each also goes to the partner warp of row block I.
      uint32_t af[4][4];
      uint4* ax = reinterpret_cast<uint4*>(smem + Ly::oA) + (i & 1) * Ly::kABlocks * 32;
      const int tri = I * (I + 1) / 2;  // first block of row block I in the exchange
#pragma unroll
      for (int Jb = 0; Jb < 4; ++Jb) {
        if (Jb > I || (Jb & 1) != hw) continue;
        float x[2][2][2];
        masked_qk_block<KS, LDK, E>(qf, k_s, Jb, bI, lane, F, gi, qi, x);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) af[Jb][2 * nt + hh] = pack<E>(x[nt][hh][0], x[nt][hh][1]);
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
          mma::mma16816<E>(ox[2 * np], a4, b[0], b[1]);
          mma::mma16816<E>(ox[2 * np + 1], a4, b[2], b[3]);
        }
      }

      // o = qs_i e^{G_i} (q_i S_c)
      mbar::wait(&sready[i & 1], (i >> 1) & 1);
      const E* s_s = ring_at(i);
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
      float fo[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) fo[hh] = F[kFO + bI + g + 8 * hh];
      __syncwarp();
      if (lane == 0) mbar::arrive(&sfree[i & 1]), mbar::arrive(&empty[i % D]);

#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = bI + g + 8 * hh;
        const int64_t dst = sq.b_row * p.out_s[0] + (t0 + row) * p.out_s[1] + hv * p.out_s[2] + v0 + hc0 + 2 * t;
#pragma unroll
        for (int nt = 0; nt < NTH; ++nt)
          if (row < Lc)
            chunk::store_out2(p.out, out_f32, out_half, dst + nt * 8, o[nt][2 * hh] * fo[hh] + ox[nt][2 * hh],
                              o[nt][2 * hh + 1] * fo[hh] + ox[nt][2 * hh + 1]);
      }
    }
  }
}

}  // namespace chunk_fused
}  // namespace cula
