// The state slice that each warp of the chunk-walking kernels (chunk_scan_kernel in
// chunk_prep_scan/scan.cuh, chunk_fused_kernel in chunk_fused/fused.cuh) keeps in registers for a
// whole sequence. Warp w owns channels (w%4)*K/4.. and column group w/4 of the kWarps / 4 groups of
// VB columns: kWarps = 8 (the scan and the sm_80 fused kernel) two halves, 16 (the 128-column
// scan) four quarters, 4 (the state warps of the warp-specialized fused kernel) all VB. Element
// (mt, nt, r) is channel cw + mt*16 + g + 8(r>>1), column v0 + hc0 + nt*8 + 2t + (r&1): the
// C-fragment layout of the state update's mma, so the slice never leaves registers between chunks.
// With kWgRows (the sm_90a scan with the delta rule) warp w owns channels 64 mt + 16 (w%4).. instead
// (channel tile mt is then 64 channels apart, cbase): the rows a warpgroup's m64 product gives it.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/common/recurrence_math.cuh"
#include "cuda/kerutils/mma.cuh"
#include "cuda/kerutils/wgmma.cuh"
#include "cuda/common/fwd_params.cuh"

namespace cula {

// kWgRows (the sm_90a scan of the delta-rule families): channel tile mt of warp w is channels
// 64 mt + 16 (w % 4).., the rows a warpgroup product m64 gives warp w of the group, so the state
// update can be one (update_wg).
template <int K, int VB, int kWarps = 8, bool kWgRows = false>
struct StateSlice {
  static_assert(kWarps == 4 || kWarps == 8 || kWarps == 16, "4 warps over the channels, times 1, 2 or 4 column groups");
  static constexpr int WH = kWarps / 4;       // column groups
  static constexpr int MT = K / 64;           // 16-channel tiles per warp
  static constexpr int NTH = VB / (8 * WH);   // 8-column tiles per warp
  static constexpr int kTileStride = kWgRows ? 64 : 16;  // channels from tile mt to mt + 1
  float s[MT][NTH][4];
  int cw, hc0, v0, g, t;

  __device__ StateSlice(int warp, int lane, int v0_)
      : cw((warp & 3) * (kWgRows ? 16 : K / 4)), hc0((warp >> 2) * (VB / WH)), v0(v0_), g(lane >> 2), t(lane & 3) {}

  __device__ int cbase(int mt) const { return cw + mt * kTileStride; }
  __device__ int channel(int mt, int r) const { return cbase(mt) + g + 8 * (r >> 1); }
  __device__ int column(int nt, int r) const { return v0 + hc0 + nt * 8 + 2 * t + (r & 1); }

  // The pool slot of sequence n, or -1 (no pool, a padding index, or one past the pool).
  static __device__ int64_t pool_slot(const FwdParams& p, int n) {
    int64_t slot = -1;
    if (p.pool) slot = p.pool_idx ? p.pool_idx[n] : n;
    return slot >= p.P ? -1 : slot;
  }

  // Initial state of sequence n: initial_state[n], else the pool slot, else zeros.
  __device__ void load(const FwdParams& p, int n, int hv, int64_t slot) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTH; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int c = channel(mt, r), j = column(nt, r);
          float x = 0.0f;
          if (p.h0) x = dev::ld(p.h0, p.h0_dt, state_elem(p, n, hv, j, c));
          else if (slot >= 0) x = dev::ld(p.pool, p.pool_dt, state_elem(p, slot, hv, j, c));
          s[mt][nt][r] = x;
        }
  }

  // The slice in its register order, as float4s laid out thread-major (coalesced) for the
  // kThreads threads that hold it: K x VB floats at base (partial states of a split sequence).
  static constexpr int kThreads = 32 * kWarps;
  __device__ void save(float* base, int tid) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTH; ++nt)
        reinterpret_cast<float4*>(base)[(mt * NTH + nt) * kThreads + tid] =
            make_float4(s[mt][nt][0], s[mt][nt][1], s[mt][nt][2], s[mt][nt][3]);
  }
  __device__ void load_saved(const float* base, int tid) {
    zero();
    scale_add(base, tid, 1.0f);
  }
  // S = d S + (the slice saved at base).
  __device__ void scale_add(const float* base, int tid, float d) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTH; ++nt) {
        const float4 x = reinterpret_cast<const float4*>(base)[(mt * NTH + nt) * kThreads + tid];
        s[mt][nt][0] = d * s[mt][nt][0] + x.x, s[mt][nt][1] = d * s[mt][nt][1] + x.y;
        s[mt][nt][2] = d * s[mt][nt][2] + x.z, s[mt][nt][3] = d * s[mt][nt][3] + x.w;
      }
  }
  // Where a slice saved by StateSlice<K, VB, W> keeps channel c, column v0 + j (a float index).
  template <int W>
  static __device__ int saved_pos(int c, int j) {
    static_assert(!kWgRows, "split states are saved in the mma.sync layout");
    using From = StateSlice<K, VB, W>;
    const int w = c / (K / 4) + 4 * (j / (VB / From::WH)), cc = c % (K / 4), jj = j % (VB / From::WH);
    const int lane = 4 * (cc % 8) + (jj % 8) / 2, r = 2 * ((cc % 16) / 8) + (jj % 2);
    return (((cc / 16) * From::NTH + jj / 8) * From::kThreads + 32 * w + lane) * 4 + r;
  }
  // S = the slice that StateSlice<K, VB, W> saved, read from a copy of it in shared memory.
  template <int W>
  __device__ void load_saved_from(const float* saved) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTH; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) s[mt][nt][r] = saved[saved_pos<W>(channel(mt, r), column(nt, r) - v0)];
  }

  __device__ void zero() {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTH; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) s[mt][nt][r] = 0.0f;
  }

  // Writes the slice as state row `row` of dst (intermediate, final or pool states).
  __device__ void store(const FwdParams& p, void* dst, int dt, int64_t row, int hv) const {
    const int64_t base = state_elem(p, row, hv, 0, 0);
    int sj = p.k_last ? p.K : 1, sc = p.k_last ? 1 : p.V;  // strides of a column and a channel
    // Opaque per call: inside a chunk loop the compiler would otherwise keep every element's offset
    // live across the loop (registers the warp-specialized state warps do not have).
    asm volatile("" : "+r"(sj), "+r"(sc));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTH; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) dev::st(dst, dt, base + channel(mt, r) * sc + column(nt, r) * sj, s[mt][nt][r]);
  }

  // 16-bit copy (E: bf16 or fp16, the type of the products that read it) for the products of the
  // chunk: s_s[channel][column - v0], leading dimension ld.
  template <class E>
  __device__ void to_smem(E* s_s, int ld) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTH; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          *reinterpret_cast<uint32_t*>(s_s + (cbase(mt) + g + 8 * hh) * ld + hc0 + nt * 8 + 2 * t) =
              mma::pack<E>(s[mt][nt][2 * hh], s[mt][nt][2 * hh + 1]);
  }

  // sm_90a: the bf16 copy transposed, S^T[column - v0][channel] as a K-major 128-byte-swizzled tile
  // of VB rows at shared address s_addr (the B operand of a warpgroup product), by stmatrix.trans.
  __device__ void to_smem_t_sw128(uint32_t s_addr, int lane) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) wg::store_t_sw128<NTH>(s_addr, VB, cbase(mt), hc0, s[mt], lane);
  }

  // S = d S + (diag(f) A)^T B over the 64 tokens of a chunk, A stored [token][channel] (lda), B
  // stored [token][column - v0] (ldb): token j's row of A scaled by f[j] in registers (no scaled
  // copy in shared memory); each B fragment loaded once for all of the warp's channel tiles. E: the
  // tiles' element type (bf16 or fp16).
  template <class E>
  __device__ void update_token_scaled(const E* a_s, int lda, const E* b_s, int ldb, float d, const float* f, int lane) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTH; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) s[mt][nt][r] *= d;
#pragma unroll
    for (int kj = 0; kj < 4; ++kj) {
      // a0, a1 hold tokens 16kj + 2t, +1; a2, a3 tokens 16kj + 2t + 8, +9
      const float2 f0 = *reinterpret_cast<const float2*>(f + 16 * kj + 2 * t);
      const float2 f8 = *reinterpret_cast<const float2*>(f + 16 * kj + 2 * t + 8);
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma::ldsm_x4_t(a[mt], a_s + (16 * kj + mma::at_row(lane)) * lda + cbase(mt) + mma::at_col(lane));
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float2 x = mma::unpack<E>(a[mt][r]);
          const float2 s2 = r < 2 ? f0 : f8;
          a[mt][r] = mma::pack<E>(x.x * s2.x, x.y * s2.y);
        }
      }
#pragma unroll
      for (int np = 0; np < NTH / 2; ++np) {
        uint32_t b[4];
        mma::ldsm_x4_t(b, b_s + (16 * kj + mma::bk_row(lane)) * ldb + hc0 + 16 * np + mma::bk_col(lane));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma::mma16816<E>(s[mt][2 * np], a[mt], b[0], b[1]);
          mma::mma16816<E>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }

  // Channel tile mt's rows times their decay.
  template <typename Decay>
  __device__ void decay_rows(int mt, Decay decay) {
    const int cb = cbase(mt);
    const float d0 = decay(cb + g), d1 = decay(cb + g + 8);
#pragma unroll
    for (int nt = 0; nt < NTH; ++nt) {
      s[mt][nt][0] *= d0, s[mt][nt][1] *= d0;
      s[mt][nt][2] *= d1, s[mt][nt][3] *= d1;
    }
  }
  // S = diag(decay) S + A^T B with load_a(cb, kj, a) giving the A fragment of channels cb.. (tile
  // mt) and tokens 16 kj.. (A^T: channels x tokens), B stored [token][column - v0] (ldb); E the
  // element type of both.
  template <typename LoadA, class E, typename Decay>
  __device__ void update_from(LoadA load_a, const E* b_s, int ldb, Decay decay, int lane) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int cb = cbase(mt);
      decay_rows(mt, decay);
#pragma unroll
      for (int kj = 0; kj < 4; ++kj) {
        uint32_t a[4];
        load_a(cb, kj, a);
#pragma unroll
        for (int np = 0; np < NTH / 2; ++np) {
          uint32_t b[4];
          mma::ldsm_x4_t(b, b_s + (16 * kj + mma::bk_row(lane)) * ldb + hc0 + 16 * np + mma::bk_col(lane));
          mma::mma16816<E>(s[mt][2 * np], a, b[0], b[1]);
          mma::mma16816<E>(s[mt][2 * np + 1], a, b[2], b[3]);
        }
      }
    }
  }

  // S = diag(decay) S + A^T B over the 64 tokens of a chunk: A stored [token][channel] (k side,
  // leading dimension lda), B stored [token][column - v0] (v side, ldb); decay(c) is channel c's
  // factor.
  template <class E, typename Decay>
  __device__ void update(const E* a_s, int lda, const E* b_s, int ldb, Decay decay, int lane) {
    update_from(
        [&](int cb, int kj, uint32_t (&a)[4]) {
          mma::ldsm_x4_t(a, a_s + (16 * kj + mma::at_row(lane)) * lda + cb + mma::at_col(lane));
        },
        b_s, ldb, decay, lane);
  }

  // The same with A = Kt^T stored [channel][token] as a K-major 128-byte-swizzled tile of K rows at
  // shared address kt (the prep writes Kt transposed): S = diag(decay) S + (Kt^T) Y.
  template <typename Decay>
  __device__ void update_kt_sw128(uint32_t kt, const __nv_bfloat16* b_s, int ldb, Decay decay, int lane) {
    update_from(
        [&](int cb, int kj, uint32_t (&a)[4]) {
          mma::ldsm_x4(a, kt + wg::sw128_offset(K, cb + mma::a_row(lane), 16 * kj + mma::a_col(lane)));
        },
        b_s, ldb, decay, lane);
  }

  // sm_90a (kWgRows): the same update as warpgroup products, issued and committed but not waited
  // for (wait_wg): A = Kt^T as above, B = Y^T [column - v0][token] as a K-major 128-byte-swizzled
  // tile of VB rows at shared address yt; this warp's group takes columns hc0.. of it.
  template <typename Decay>
  __device__ void update_wg(uint32_t kt, uint32_t yt, Decay decay) {
    static_assert(kWgRows, "the warpgroup update needs the warpgroup row layout");
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      decay_rows(mt, decay);
      wg::fence_operand(s[mt]);
    }
    wg::fence();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int kj = 0; kj < 4; ++kj)
        wg::mma_bf16<NTH>(s[mt], wg::desc_kstep(kt, K, 64 * mt, kj), wg::desc_kstep(yt, VB, hc0, kj));
    wg::commit();
  }
  __device__ void wait_wg() {
    wg::wait_all();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) wg::fence_operand(s[mt]);
  }
};

}  // namespace cula
