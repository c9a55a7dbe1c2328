// Recurrent decode on CUDA for every family: a few tokens per sequence against a state pool,
// updated in place.
//
// Design. The work is memory-bound (each step reads and writes the K x V state), so the kernel
// is built to keep many state bytes in flight without holding them in registers:
//  - grid: one CTA per (sequence n, value head hv, tile of R state rows along V), R chosen so a
//    tile is 16 KB (K-first: at least 64 columns at K <= 128; thinner, down to 16 rows, while the
//    grid has fewer than two CTAs per SM);
//    block: 4 warps. On sm_90+ the launch is a programmatic dependent one: the CTAs wait
//    (griddepcontrol.wait) for the previous kernel before their first read, so a decode step's
//    launch overlaps the end of the kernel before it.
//  - phase 1: each warp starts the copy of the rows it will update into shared memory with
//    cp.async, one group per batch of 4 rows (K-last: 16-byte pieces, a row per warp
//    instruction). Nothing waits on it yet.
//  - phase 2, overlapping the copy: warp w preprocesses tokens w, w+4, ... (q/k L2 norm by warp
//    reductions, scale, gate activation, exp of the log-decay, beta) into shared memory; one
//    __syncthreads publishes them. v of the first token does not pass through it (K <= 128): each
//    warp loads v for its own rows up front and hands it to the rows by a shuffle; later draft
//    tokens' v is staged in shared memory. In a one-wave launch at T = 1 (N = 1: hundreds of CTAs
//    per sequence) every warp prepares the token itself, in registers, and skips that barrier.
//  - phase 3: warp w runs its batches of rows (w, w+4, ..., then w+16, ...) as their groups land
//    (cp.async.wait_group + __syncwarp: no block barrier on the tile), so a CTA's first stores
//    overlap its last reads; lane l holds elements [l*EPL, (l+1)*EPL) of the row (EPL = K/32; K = 256:
//    [4l, 4l+4) and [128+4l, 128+4l+4), so that each warp access is contiguous) in registers through
//    the T tokens (16-byte loads and stores; K = 256: 2 rows a step, not 4, within the registers of
//    8 CTAs per SM): S' = S*exp(a), the delta rule's S'^T k and the output
//    S^T q are warp reductions, the 4 rows' sums together by reduce-scatter (6 shuffles instead
//    of 20); the row goes straight back to the pool from registers (16-byte stores for fp32,
//    K = 128); its output waits in shared memory.
//  - phase 4: after one block barrier, the tile's outputs leave in one coalesced store per token.
//  - the path from launch to the first load is kept short for small batches, which are bound by
//    latency: block index decomposed by multiply-high divisions by launch constants (FastDiv),
//    no integer division before the slot and tile loads.
//  - the slot index: read by every warp, or, in a one-wave launch where hundreds of CTAs share one
//    sequence (N = 1), by one thread per CTA and passed on through shared memory behind one block
//    barrier.
//  - speculative decoding: after token t the row also goes to slot idx[n, t].
//  - padding (slot < 0, or >= P for device-side indices, which cannot be range-checked on the
//    host without a synchronisation): outputs are zeros, the pool is not touched.
// With ~16 KB of shared memory and few registers per CTA, about a dozen CTAs share an SM.
//  - K-first pools ([K][V] per head, FLA's layout): the tile [K][R] lands by cp.async in 16-byte
//    pieces of its V rows (pitch R + 16 bytes) and stays there: thread (part, c) updates column c
//    over a 1/parts share of the channels in place (a warp reads one channel row's consecutive
//    columns: no bank conflict), the channel sums of the parts meet in shared memory (two block
//    barriers per token), and after the block barrier of phase 4 the tile leaves in 16-byte
//    coalesced stores (a lane's strided stores to K rows wrote one 32-byte sector per 4 bytes).
//    Speculative decoding's per-token slots: each thread stores its own elements after each token.
//  - final_state_out: the states are read from the pool and written to out[n] instead (FLA's
//    fused_recurrent without in-place update), the pool untouched.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <string>

#include "common/error.h"
#include "common/fast_div.h"
#include "cuda/runtime/check.h"
#include "cuda/runtime/runtime.h"
#include "cuda/common/recurrence_math.cuh"
#include "cuda/kerutils/mma.cuh"
#include "cuda/decode/decode.h"

namespace cula {
namespace {

constexpr int kWarps = 4;

struct DecodeParams {
  const void* q;
  const void* k;
  const void* v;
  const void* g;
  const void* beta;
  const float* decay;
  const float* A_log;
  const float* dt_bias;
  void* pool;
  void* pool_out;               // final_state_out [N, ...]: written at row n instead of the pool, or null
  const int32_t* pool_idx;      // [N] or [N, T] slots, may be null
  const int32_t* num_accepted;  // [N], may be null
  void* out;
  int q_dt, v_dt, g_dt, beta_dt, out_dt;  // DLPack dtype codes, as FwdParams
  int N, T, H, HV, K, V, P;
  int per_token_slots;  // pool_idx is [N, T]
  GateKind gate_kind;
  int delta, l2norm, gate_in_kernel, has_lb, beta_sigmoid, decay_heads, dt_bias_per_channel;
  float lb, beta_mult, scale;
  FastDiv value_heads_per_head;  // HV / H
  FastDiv value_heads;           // HV
  FastDiv tiles;                 // tiles per head (set at launch)
};

using dev::ld;
using dev::st;

// EPL consecutive state elements starting at p (K-last) as floats.
template <int EPL, typename S>
__device__ __forceinline__ void load_row(const S* p, float* x) {
  if constexpr (sizeof(S) == 4 && EPL == 4) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
  } else if constexpr (sizeof(S) == 2 && EPL == 4) {
    const uint2 a = *reinterpret_cast<const uint2*>(p);
    const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&a.x);
    const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&a.y);
    x[0] = __low2float(lo), x[1] = __high2float(lo), x[2] = __low2float(hi), x[3] = __high2float(hi);
  } else {
#pragma unroll
    for (int e = 0; e < EPL; ++e) x[e] = static_cast<float>(p[e]);
  }
}

template <int EPL, typename S>
__device__ __forceinline__ void store_row(S* p, const float* x) {
  if constexpr (sizeof(S) == 4 && EPL == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
  } else if constexpr (sizeof(S) == 2 && EPL == 4) {
    uint2 a;
    *reinterpret_cast<__nv_bfloat162*>(&a.x) = __floats2bfloat162_rn(x[0], x[1]);
    *reinterpret_cast<__nv_bfloat162*>(&a.y) = __floats2bfloat162_rn(x[2], x[3]);
    *reinterpret_cast<uint2*>(p) = a;
  } else {
#pragma unroll
    for (int e = 0; e < EPL; ++e) p[e] = static_cast<S>(x[e]);
  }
}

// The key channels lane `lane` holds, element e of EPL: EPL consecutive ones from lane * EPL (K <= 128),
// or at K = 256 two runs of 4, [4 lane, 4 lane + 4) and [128 + 4 lane, 128 + 4 lane + 4), so that a
// warp's access to a state row is one contiguous 512-byte (fp32) piece per instruction, not 32-byte
// pieces 32 bytes apart.
template <int EPL>
__device__ __forceinline__ int lane_channel(int lane, int e) {
  return EPL == 8 ? (e >> 2) * 128 + lane * 4 + (e & 3) : lane * EPL + e;
}

// A lane's EPL elements of the K-last state row at `row` as floats (lane_channel's order), and back.
template <int EPL, typename S>
__device__ __forceinline__ void load_lane(const S* row, int lane, float* x) {
  if constexpr (EPL == 8) {
    load_row<4, S>(row + 4 * lane, x);
    load_row<4, S>(row + 128 + 4 * lane, x + 4);
  } else {
    load_row<EPL, S>(row + lane * EPL, x);
  }
}

template <int EPL, typename S>
__device__ __forceinline__ void store_lane(S* row, int lane, const float* x) {
  if constexpr (EPL == 8) {
    store_row<4, S>(row + 4 * lane, x);
    store_row<4, S>(row + 128 + 4 * lane, x + 4);
  } else {
    store_row<EPL, S>(row + lane * EPL, x);
  }
}

__device__ __forceinline__ int read_slot(const DecodeParams& p, int n) {
  if (!p.pool_idx) return n;
  if (!p.per_token_slots) return p.pool_idx[n];
  int a = p.num_accepted ? p.num_accepted[n] : 1;
  a = min(max(a, 1), max(p.T, 1));
  return p.pool_idx[static_cast<int64_t>(n) * p.T + a - 1];
}

// Shared memory: the CTA's state tile (K-last [R][K]; K-first [K][kfirst_pitch(R)]) padded to 16 bytes,
// then per token the preprocessed q, k and exp(a) (K each), beta, the tile's R values of v and
// its R outputs.
// K-first tile row: R values, and 16 bytes more where a warp spans several shares of the channels
// (R < 32). From 32 columns a warp reads 32 consecutive columns of one channel row, which no
// padding helps, and the tile without it leaves room for one more CTA per SM at K = 256.
template <typename S>
__host__ __device__ constexpr int kfirst_pitch(int R) {
  return R >= 32 ? R : R + 16 / static_cast<int>(sizeof(S));
}

template <typename S>
__host__ __device__ inline size_t tile_bytes(int R, int K, bool k_last) {
  const size_t tile = k_last ? static_cast<size_t>(R) * K * sizeof(S) : static_cast<size_t>(K) * kfirst_pitch<S>(R) * sizeof(S);
  return ((tile + 15) / 16) * 16;
}

template <typename S>
__host__ __device__ inline size_t smem_bytes(int R, int K, int T, bool k_last) {
  return tile_bytes<S>(R, K, k_last) + static_cast<size_t>(T) * (3 * K + 1 + 2 * R) * sizeof(float);
}

// kServing: the serving engines' dtypes (q, k, v, out bf16; g, beta fp32) with the loads and
// stores resolved at compile time, which shortens every warp's instruction stream (the small-batch
// case is bound by it); any other dtype mix takes the generic instantiation.
// kOneToken (K-last serving kernels of a one-wave launch with one slot read per CTA, T = 1): every
// warp loads and prepares the token itself, in registers, so no block barrier for the token stands
// between a warp and its first rows (several waves lost with it: each warp asks for the same
// token inputs).
template <int EPL, typename S, bool KLAST, bool kServing, bool kKdaServing, bool kSlotPerCta, bool kOneToken = false>
__global__ void __launch_bounds__(kWarps * 32, 8) decode_kernel(const DecodeParams p, const int R) {
  // kKdaServing fixes the options of KDA serving (per-channel gate computed in kernel with a lower
  // bound, q/k L2 norm, beta sigmoid) at compile time; otherwise they are read from p.
  const GateKind gate_kind = kKdaServing ? GateKind::PerChannel : p.gate_kind;
  const bool delta = kKdaServing ? true : p.delta;
  const bool l2norm = kKdaServing ? true : p.l2norm;
  const bool gate_in_kernel = kKdaServing ? true : p.gate_in_kernel;
  const bool has_lb = kKdaServing ? true : p.has_lb;
  const bool beta_sigmoid = kKdaServing ? true : p.beta_sigmoid;
  auto ldx = [&](const void* ptr, int dt, int64_t i) -> float {  // q, k, v
    if constexpr (kServing) return __bfloat162float(static_cast<const __nv_bfloat16*>(ptr)[i]);
    else return ld(ptr, dt, i);
  };
  auto ldf = [&](const void* ptr, int dt, int64_t i) -> float {  // g, beta
    if constexpr (kServing) return static_cast<const float*>(ptr)[i];
    else return ld(ptr, dt, i);
  };
  auto sto = [&](int64_t i, float x) {
    if constexpr (kServing) static_cast<__nv_bfloat16*>(p.out)[i] = __float2bfloat16_rn(x);
    else st(p.out, p.out_dt, i, x);
  };
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int K = EPL * 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tid = threadIdx.x;
  // CTA = (n, hv, tile), tiles fastest: consecutive CTAs read one slot's rows (DRAM locality).
  // Divisions by launch constants (FastDiv): the path to the first load is latency at small N.
  const uint32_t head_tile = p.tiles.div(blockIdx.x);
  const int tile_id = static_cast<int>(blockIdx.x - head_tile * p.tiles.divisor);
  const int n = static_cast<int>(p.value_heads.div(head_tile));
  const int hv = static_cast<int>(head_tile - static_cast<uint32_t>(n) * p.value_heads.divisor);
  const int h = static_cast<int>(p.value_heads_per_head.div(static_cast<uint32_t>(hv)));
  const int j0 = tile_id * R;
  const int rows = min(R, p.V - j0);
  const int k0 = lane * EPL;  // (the vector loads of K <= 128; lane_channel in general)
  auto ch = [&](int e) { return lane_channel<EPL>(lane, e); };
  S* pool = static_cast<S*>(p.pool);
  const int64_t slot_elems = static_cast<int64_t>(p.HV) * p.V * K;
  const int64_t head_off = static_cast<int64_t>(hv) * p.V * K;

  // Everything read below may come from the previous kernel (inputs, the pool of the previous
  // step); only the index arithmetic above overlaps its tail.
  dev::grid_dependency_wait();
  dev::allow_dependents_launch();

  // 0. Issue every load that does not depend on the slot first, so that the slot index, the
  //    token inputs and v all arrive within one memory latency. Warp w loads token w (the
  //    common case T <= 4 needs no more); lane 0 also loads beta.
  // In a one-wave launch where hundreds of CTAs share one sequence (N = 1), one thread per CTA
  // reads the slot and shares it: every warp of those CTAs would ask for the same 4 bytes at once.
  // Otherwise each warp reads it (a block barrier there costs more than the repeated request).
  __shared__ int shared_slot;
  int rs = 0;
  if (!kSlotPerCta) rs = read_slot(p, n);
  else if (tid == 0) shared_slot = read_slot(p, n);
  const int my_t = kOneToken ? 0 : warp;
  const bool has_tok = my_t < p.T;
  float rq[EPL], rk[EPL], rg[EPL], rbias[EPL], rbeta = 1.0f, eA = 1.0f;
  // Only the warps that preprocess a token read the gate's constants: every CTA reads the same
  // few lines of A_log and dt_bias, so fewer requests to them at the start of a wave.
  if (gate_in_kernel && p.A_log && has_tok) eA = p.A_log[hv];
#pragma unroll
  for (int e = 0; e < EPL; ++e) rbias[e] = 0.0f;
  if (gate_in_kernel && p.dt_bias && has_tok) {
    if (kServing && p.dt_bias_per_channel) {
      load_row<EPL, float>(p.dt_bias + hv * K + k0, rbias);
    } else {
#pragma unroll
      for (int e = 0; e < EPL; ++e) rbias[e] = p.dt_bias_per_channel ? p.dt_bias[hv * K + ch(e)] : p.dt_bias[hv];
    }
  }
  // kServing: one vector load per input and lane (the launch checked the alignment) instead of
  // EPL scalar ones: fewer load instructions ahead of the tile's at the start of every CTA.
  auto load_token = [&](int t) {
    const int64_t f = static_cast<int64_t>(n) * p.T + t;
    const int64_t qk_off = (f * p.H + h) * K;
    if constexpr (kServing) {
      load_row<EPL, __nv_bfloat16>(static_cast<const __nv_bfloat16*>(p.q) + qk_off + k0, rq);
      load_row<EPL, __nv_bfloat16>(static_cast<const __nv_bfloat16*>(p.k) + qk_off + k0, rk);
    } else {
#pragma unroll
      for (int e = 0; e < EPL; ++e) rq[e] = ldx(p.q, p.q_dt, qk_off + ch(e)), rk[e] = ldx(p.k, p.q_dt, qk_off + ch(e));
    }
    if (kServing && gate_kind == GateKind::PerChannel) {
      load_row<EPL, float>(static_cast<const float*>(p.g) + (f * p.HV + hv) * K + k0, rg);
    } else {
#pragma unroll
      for (int e = 0; e < EPL; ++e)
        rg[e] = gate_kind == GateKind::PerChannel ? ldf(p.g, p.g_dt, (f * p.HV + hv) * K + ch(e))
                : gate_kind == GateKind::Scalar ? ldf(p.g, p.g_dt, f * p.HV + hv)
                                   : -p.decay[p.decay_heads == p.HV ? hv : h];
    }
    if (delta && (kOneToken || lane == 0)) rbeta = ldf(p.beta, p.beta_dt, f * p.HV + hv);
  };
  if (has_tok) load_token(my_t);
  // rows <= R <= the CTA's threads (launch_tile): thread j stores the outputs of row j0 + j (and
  // stages v[.., j0 + j] of the tokens that do not come by shuffle)
  const bool has_v = tid < rows;
  auto v_index = [&](int t) { return ((static_cast<int64_t>(n) * p.T + t) * p.HV + hv) * p.V + j0 + tid; };
  // K-last, K <= 128: v of the first token for this warp's rows (w, w + 4, ...): lane m holds that of row
  // w + 4m and the rows take it by a shuffle, so the block barrier does not wait for v. (K = 256
  // stages it in shared memory with the later tokens': the extra register spills there.)
  constexpr bool kVInRegs = KLAST && EPL <= 4;
  const int my_vrow = kVInRegs ? warp + kWarps * lane : tid;
  const float rv = my_vrow < rows ? ldx(p.v, p.v_dt, v_index(0) - tid + my_vrow) : 0.0f;
  if constexpr (kSlotPerCta) {
    __syncthreads();
    rs = shared_slot;
  }

  if (rs < 0 || rs >= p.P) {  // padding: zeros out, pool untouched
    if (has_v)
      for (int t = 0; t < p.T; ++t) sto(v_index(t), 0.0f);
    return;
  }

  S* tile = reinterpret_cast<S*>(smem);
  const int TP = kfirst_pitch<S>(R);                          // K-first tile pitch
  constexpr int kPer = 16 / static_cast<int>(sizeof(S));       // K-first: values per 16-byte piece
  // K-first 16-byte pieces: V rows of whole pieces (the pool's alignment is checked at launch; R is
  // a power of two of at least 8 values or V itself, so rows is whole pieces when V is)
  const bool kfirst_vec = !KLAST && (p.V * static_cast<int>(sizeof(S))) % 16 == 0;
  float* tok = reinterpret_cast<float*>(smem + tile_bytes<S>(R, K, KLAST));  // [T][3][K], then [T] beta
  float* tok_beta = tok + static_cast<size_t>(p.T) * 3 * K;
  float* tok_v = tok_beta + p.T;  // [T][R]: this tile's v values, off the rows' critical path
  float* tok_o = tok_v + static_cast<size_t>(p.T) * R;  // [T][R]: its outputs, stored together at the end

  // 1. Start the state tile on its way. K-last: each warp copies the rows it will update, one
  //    cp.async group per batch of rows, so that it can start on its first batch (and its stores)
  //    while the later batches are still arriving: a CTA's reads and writes overlap.
  // rows per warp per step (8 for bf16 measured slower: registers); K = 256 takes 2, whose state
  // rows fit the registers that 8 CTAs per SM leave (4 rows spilled)
  constexpr int kBatch = EPL > 4 ? 2 : 4;
  constexpr int kRowsPerStep = kWarps * kBatch;
  const S* src = pool + static_cast<int64_t>(rs) * slot_elems + head_off;
  const int my_steps = warp < rows ? (rows - warp + kRowsPerStep - 1) / kRowsPerStep : 0;
  if constexpr (KLAST) {
    constexpr int kPiecesPerRow = K * static_cast<int>(sizeof(S)) / 16;  // 16-byte pieces
    constexpr int kPiecesPerLane = kBatch * kPiecesPerRow / 32;
    static_assert(kBatch * kPiecesPerRow % 32 == 0, "a batch of rows is whole pieces per lane");
    const char* gsrc = reinterpret_cast<const char*>(src + static_cast<int64_t>(j0) * K);
    const uint32_t sdst = mma::smem_addr(tile);
    for (int step = 0; step < my_steps; ++step) {
#pragma unroll
      for (int i = 0; i < kPiecesPerLane; ++i) {
        const int c = lane + 32 * i;
        const int r = step * kRowsPerStep + warp + (c / kPiecesPerRow) * kWarps;
        const int off = (r * kPiecesPerRow + c % kPiecesPerRow) * 16;
        if (r < rows) mma::cp_async16(sdst + off, gsrc + off);
      }
      mma::cp_async_commit();
    }
  } else if (kfirst_vec) {
    // K-first: the K rows' R values (16-byte pieces) by cp.async, waited for before the barrier
    const int pieces = rows / kPer;
    for (int i = tid; i < K * pieces; i += blockDim.x) {
      const int kk = i / pieces, j = (i % pieces) * kPer;
      mma::cp_async16(tile + kk * TP + j, src + static_cast<int64_t>(kk) * p.V + j0 + j);
    }
    mma::cp_async_commit();
  } else {
    for (int i = tid; i < K * rows; i += blockDim.x) {
      const int kk = i / rows, j = i % rows;
      tile[kk * TP + j] = src[static_cast<int64_t>(kk) * p.V + j0 + j];
    }
  }

  // 2. Meanwhile, preprocess the tokens into shared memory (q/k L2 norm by warp reductions,
  //    scale, gate activation, exp of the log-decay, beta) and stage v.
  if (has_v) {
    if (!kVInRegs) tok_v[tid] = rv;
    for (int t = 1; t < p.T; ++t) tok_v[t * R + tid] = ldx(p.v, p.v_dt, v_index(t));
  }
  if (gate_in_kernel && p.A_log) eA = __expf(eA);
  // The token in rq, rk, rg, rbeta prepared: put(e, q, k, exp of the log-decay) per element e of
  // this lane (q, k scaled: L2 norm); returns beta.
  auto prepare = [&](auto&& put) {
    float qq = 0, kk = 0;
#pragma unroll
    for (int e = 0; e < EPL; ++e) qq += rq[e] * rq[e], kk += rk[e] * rk[e];
    float qs = p.scale, ks = 1.0f;
    if (l2norm) {  // both sums in one reduce-scatter: lanes 0-15 end with |q|^2, 16-31 with |k|^2
      float sq[2] = {qq, kk};
      const float mine = dev::warp_sum_scatter<2>(sq, lane);
      qs *= rsqrtf(__shfl_sync(0xffffffffu, mine, 0) + 1e-6f);
      ks = rsqrtf(__shfl_sync(0xffffffffu, mine, 16) + 1e-6f);
    }
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      float a = rg[e];
      if (gate_in_kernel) a = dev::activate_gate(a + rbias[e], eA, has_lb, p.lb);
      put(e, rq[e] * qs, rk[e] * ks, __expf(a));
    }
    return (delta && beta_sigmoid) ? dev::beta_sigmoid(rbeta, p.beta_mult) : rbeta;
  };
  float one_q[EPL], one_k[EPL], one_a[EPL], one_beta = 0.0f;  // kOneToken: the token, in every warp
  if constexpr (kOneToken) {
    static_assert(KLAST && kVInRegs, "per-warp tokens: K-last rows with v by shuffle");
    one_beta = prepare([&](int e, float xq, float xk, float xa) { one_q[e] = xq, one_k[e] = xk, one_a[e] = xa; });
  } else {
    for (int t = my_t; t < p.T; t += kWarps) {
      if (t != my_t) load_token(t);
      float* tq = tok + static_cast<size_t>(t) * 3 * K;
      const float xb = prepare([&](int e, float xq, float xk, float xa) {
        tq[ch(e)] = xq, tq[K + ch(e)] = xk, tq[2 * K + ch(e)] = xa;
      });
      if (lane == 0) tok_beta[t] = xb;
    }
    if (!KLAST && kfirst_vec) mma::cp_async_wait_all();
    __syncthreads();  // the token inputs (K-first: also the tile)
  }

  // where the final state goes: the slot read, or row n of final_state_out
  S* const final_dst = (p.pool_out ? static_cast<S*>(p.pool_out) + static_cast<int64_t>(n) * slot_elems
                                   : pool + static_cast<int64_t>(rs) * slot_elems) + head_off;
  // 3, K-first. Thread (part, c) = (tid / R, tid % R) owns column c of the tile over the channels
  //    [part * KW, (part + 1) * KW): a warp reads consecutive columns of one channel row (no bank
  //    conflict; lanes holding a column's channels read one word in 4 and wait on 16-way bank
  //    conflicts), the state stays in the tile, and the parts' sums meet in shared memory. The
  //    columns go back into the tile, which leaves coalesced after phase 4's barrier. A bf16
  //    tile rounds between the tokens of one call (the K-last rows keep fp32 through them).
  if constexpr (!KLAST) {
    __shared__ float part_sums[2][kWarps * 32];
    int parts = 1;  // a power of two: KW a multiple of 4 (R >= 8, launch_tile), the token's values read as float4
    while (2 * parts * R <= kWarps * 32) parts *= 2;  // R <= the CTA's threads (launch_tile)
    const int part = tid / R, c = tid % R;
    const int KW = K / parts;
    const int kb = part * KW, ke = part < parts ? kb + KW : kb;  // idle threads: an empty range
    const bool col = c < rows;
    auto column_sum = [&](float x, int buf) {  // every thread calls it: a block barrier
      part_sums[buf][tid] = x;
      __syncthreads();
      float sum = 0;
      for (int i = 0; i < parts; ++i) sum += part_sums[buf][i * R + c];
      return sum;
    };
    // A warp's lanes share kk: the token's q, k, exp(a) are broadcast reads, 4 channels per read.
    auto four = [](const float* x) { return *reinterpret_cast<const float4*>(x); };
    for (int t = 0; t < p.T; ++t) {
      const float* tq = tok + static_cast<size_t>(t) * 3 * K;
      float u = col ? tok_v[t * R + c] : 0.0f;
      if (delta) {
        float dot = 0;
        if (col) {
          for (int kk = kb; kk < ke; kk += 4) {
            const float4 k4 = four(tq + K + kk), a4 = four(tq + 2 * K + kk);
            const S* x = tile + kk * TP + c;
            dot += static_cast<float>(x[0]) * a4.x * k4.x + static_cast<float>(x[TP]) * a4.y * k4.y +
                   static_cast<float>(x[2 * TP]) * a4.z * k4.z + static_cast<float>(x[3 * TP]) * a4.w * k4.w;
          }
        }
        u = (u - column_sum(dot, 0)) * tok_beta[t];
      }
      float o = 0;
      if (col) {
        for (int kk = kb; kk < ke; kk += 4) {
          const float4 q4 = four(tq + kk), k4 = four(tq + K + kk), a4 = four(tq + 2 * K + kk);
          const float qe[4] = {q4.x, q4.y, q4.z, q4.w}, ke4[4] = {k4.x, k4.y, k4.z, k4.w}, ae[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            S* x = tile + (kk + e) * TP + c;
            const float y = static_cast<float>(*x) * ae[e] + ke4[e] * u;
            *x = static_cast<S>(y);
            o += y * qe[e];
          }
        }
      }
      // delta: the two sums of a token alternate buffers; without it consecutive tokens do
      o = column_sum(o, delta ? 1 : t & 1);
      if (part == 0 && col) tok_o[t * R + c] = o;
      if (p.per_token_slots) {  // after token t the column also goes to slot idx[n, t]: this thread's own elements
        const int ws = p.pool_idx[static_cast<int64_t>(n) * p.T + t];
        if (ws >= 0 && ws < p.P && col) {
          S* dst = pool + static_cast<int64_t>(ws) * slot_elems + head_off + j0 + c;
          for (int kk = kb; kk < ke; ++kk) dst[static_cast<int64_t>(kk) * p.V] = tile[kk * TP + c];
        }
      }
    }
  }
  // 3, K-last. Rows: warp w takes rows w, w + 4, ..., kBatch of them at a time so that their warp
  //    reductions interleave instead of running back to back.
  for (int step = 0; KLAST && step < my_steps; ++step) {
    const int r0 = step * kRowsPerStep + warp;
    mma::cp_async_wait_pending(my_steps - 1 - step);  // this warp's batches up to this one have landed
    __syncwarp();
    float s[kBatch][EPL];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int r = r0 + b * kWarps < rows ? r0 + b * kWarps : r0;  // past the tile: computed, never stored
      load_lane<EPL, S>(tile + r * K, lane, s[b]);
    }
    auto store_to = [&](S* dst) {  // the head's state in a slot (or in final_state_out)
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int r = r0 + b * kWarps;
        if (r < rows) store_lane<EPL, S>(dst + static_cast<int64_t>(j0 + r) * K, lane, s[b]);
      }
    };
    for (int t = 0; t < p.T; ++t) {
      const int64_t f = static_cast<int64_t>(n) * p.T + t;
      const float* tq = tok + static_cast<size_t>(t) * 3 * K;
      float qv[EPL], kv[EPL], av[EPL];
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        if constexpr (kOneToken) qv[e] = one_q[e], kv[e] = one_k[e], av[e] = one_a[e];
        else qv[e] = tq[ch(e)], kv[e] = tq[K + ch(e)], av[e] = tq[2 * K + ch(e)];
      }
      float u[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        u[b] = kVInRegs && t == 0 ? __shfl_sync(0xffffffffu, rv, step * kBatch + b)
                                  : tok_v[t * R + (r0 + b * kWarps < rows ? r0 + b * kWarps : r0)];
      const float o = dev::update_rows<EPL, kBatch>(s, qv, kv, av, u, kOneToken ? one_beta : tok_beta[t], delta, lane);
      const int ob = dev::scatter_index<kBatch>(lane), o_row = r0 + ob * kWarps;  // the row whose output o is
      if (dev::scatter_leader<kBatch>(lane) && o_row < rows) tok_o[t * R + o_row] = o;
      if (p.per_token_slots) {
        const int ws = p.pool_idx[f];
        if (ws >= 0 && ws < p.P) store_to(pool + static_cast<int64_t>(ws) * slot_elems + head_off);
      }
    }
    if (!p.per_token_slots) store_to(final_dst);
  }
  // 4. The outputs leave in one coalesced store per token (thread j: row j0 + j) instead of the
  //    rows' scattered 2-byte stores, which wrote parts of the same sectors from four warps.
  __syncthreads();
  if (has_v)
    for (int t = 0; t < p.T; ++t) sto(v_index(t), tok_o[t * R + tid]);
  if constexpr (!KLAST) {  // the K-first tile's updated columns, coalesced
    if (!p.per_token_slots) {
      if (kfirst_vec) {
        const int pieces = rows / kPer;
        for (int i = tid; i < K * pieces; i += blockDim.x) {
          const int kk = i / pieces, j = (i % pieces) * kPer;
          *reinterpret_cast<uint4*>(final_dst + static_cast<int64_t>(kk) * p.V + j0 + j) =
              *reinterpret_cast<const uint4*>(tile + kk * TP + j);
        }
      } else {
        for (int i = tid; i < K * rows; i += blockDim.x) {
          const int kk = i / rows, j = i % rows;
          final_dst[static_cast<int64_t>(kk) * p.V + j0 + j] = tile[kk * TP + j];
        }
      }
    }
  }
}

void check(cudaError_t e, const char* what) { cuda_check(e, "decode", what); }

// Tile rows: 16 KB of state per CTA, so that a dozen CTAs per SM keep ~200 KB of loads in flight.
// A small batch (fewer than two CTAs per SM) is bound by one CTA's latency, not by bandwidth:
// thinner tiles, down to one batch of rows per warp (16 rows), spread it over more SMs.
template <int EPL, typename S, bool KLAST, bool kServing, bool kKdaServing = false>
void launch_tile(DecodeParams p, bool pdl, int sms, cudaStream_t stream) {
  constexpr int K = EPL * 32;
  int R = static_cast<int>(16384 / (K * sizeof(S)));
  // K-first: at least 64 columns (256-byte pieces of each channel row; 32 columns, 128-byte pieces,
  // moved 7% fewer bytes a second on an H200: fp32 K = 128, N = 64 and 256), except at K = 256,
  // where the 32 KB tile of 32 columns already holds a sixth of the shared memory
  if (!KLAST) R = std::max(R, K <= 128 ? 64 : 32);
  // (K-first at least 8 columns, past V if need be: at most 16 shares of the channels, 4 or more each)
  R = std::max(KLAST ? 4 : 8, std::min(R, p.V));
  auto blocks_of = [&](int rows) { return static_cast<int64_t>(p.N) * p.HV * ((p.V + rows - 1) / rows); };
  while (R > 16 && blocks_of(R) < 2 * int64_t{sms}) R /= 2;
  R = std::min(R, kWarps * 32);  // one thread per tile row stages v
  const int64_t blocks = blocks_of(R);
  if (blocks >= (int64_t{1} << 31)) throw_unsupported("decode", "too many sequences x heads for one launch");
  p.tiles = FastDiv(static_cast<uint32_t>((p.V + R - 1) / R));
  // One slot read per CTA for a launch of one wave (at most 4 CTAs per SM) in which at least 256
  // CTAs share each sequence's slot index (N = 1 at H = 32, 64): fp32 H32 N = 1 3.97 -> 3.53 us
  // per step, H64 4.90 -> 4.59; bf16 unchanged. With fewer CTAs per sequence (N = 8) or several
  // waves the block barrier costs more (bf16 H32 N = 8: 8.98 -> 9.45 us).
  const bool slot_per_cta = blocks <= 4 * int64_t{sms} && blocks >= 256 * int64_t{p.N};
  // A compile-time choice: with the choice read at run time the kernel was 3% slower at N >= 64
  // (same FLA times: fp32 H32 N = 1024 1.498 -> 1.549 ms; bf16 H64 1.515 -> 1.564).
  auto kernel = decode_kernel<EPL, S, KLAST, kServing, kKdaServing, false>;
  if constexpr (KLAST && kServing) {
    // At T = 1 the same launches also prepare the token per warp (kOneToken): bf16 H32 N = 1
    // 3.1-3.2 -> 3.0 us per step; with several waves it lost ~1 us at N = 64.
    if (slot_per_cta)
      kernel = p.T == 1 ? decode_kernel<EPL, S, KLAST, kServing, kKdaServing, true, true>
                        : decode_kernel<EPL, S, KLAST, kServing, kKdaServing, true>;
  }
  const size_t smem = smem_bytes<S>(R, K, p.T, KLAST);
  if (smem > 48 * 1024) {
    if (smem > 200 * 1024) throw_unsupported("decode", "too many draft tokens per sequence for the CUDA decode kernel");
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem)),
          "cudaFuncSetAttribute");
  }
  // Programmatic dependent launch where the device has it (sm_90+): the launch of a step overlaps
  // the tail of the kernel before it, which is most of a small batch's time per step.
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(kWarps * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = pdl ? 1 : 0;
  check(cudaLaunchKernelEx(&cfg, kernel, p, R), "kernel launch");
}

// The serving engines' dtypes, with q, k, a per-channel gate and dt_bias aligned for one vector
// load of EPL elements per lane (views at odd offsets take the generic instantiation).
template <int EPL>
bool serving_inputs(const DecodeParams& p) {
  auto aligned = [](const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; };
  return p.q_dt == CULA_BFLOAT16 && p.v_dt == CULA_BFLOAT16 && p.out_dt == CULA_BFLOAT16 &&
         (!p.g || p.g_dt == CULA_FLOAT32) && (!p.beta || p.beta_dt == CULA_FLOAT32) &&
         aligned(p.q, EPL * 2) && aligned(p.k, EPL * 2) && (p.gate_kind != GateKind::PerChannel || !p.g || aligned(p.g, EPL * 4)) &&
         (!p.dt_bias || !p.dt_bias_per_channel || aligned(p.dt_bias, EPL * 4));
}

template <int EPL, typename S>
void launch_layout(const DecodeParams& p, bool k_last, bool pdl, int sms, cudaStream_t stream) {
  const bool kda_serving = p.gate_kind == GateKind::PerChannel && p.delta && p.l2norm && p.gate_in_kernel && p.has_lb && p.beta_sigmoid;
  // The serving instantiations exist for K <= 128 only (K = 256 takes the generic one).
  if constexpr (EPL <= 4) {
    if (k_last && serving_inputs<EPL>(p)) {
      if (kda_serving)
        launch_tile<EPL, S, true, true, true>(p, pdl, sms, stream);
      else
        launch_tile<EPL, S, true, true>(p, pdl, sms, stream);
      return;
    }
  }
  if (k_last)
    launch_tile<EPL, S, true, false>(p, pdl, sms, stream);
  else
    launch_tile<EPL, S, false, false>(p, pdl, sms, stream);
}

template <int EPL>
void launch_state(const DecodeParams& p, int state_dtype, bool k_last, bool pdl, int sms, cudaStream_t stream) {
  if (state_dtype == CULA_FLOAT32)
    launch_layout<EPL, float>(p, k_last, pdl, sms, stream);
  else
    launch_layout<EPL, __nv_bfloat16>(p, k_last, pdl, sms, stream);
}

}  // namespace

Refusal cuda_decode_declines(const Recurrence& r, const cula_decode_args& a) {
  for (auto [t, name] : {std::pair<const cula_tensor*, const char*>{a.q, "q"}, {a.k, "k"}, {a.v, "v"}, {a.g, "g"},
                         {a.beta, "beta"}, {a.out, "out"}, {a.state_pool, "state_pool"}, {a.final_state_out, "final_state_out"},
                         {a.state_indices, "state_indices"}, {a.num_accepted_tokens, "num_accepted_tokens"},
                         {a.decay, "decay"}, {a.A_log, "A_log"}, {a.dt_bias, "dt_bias"}})
    if (t && !is_contiguous(*t)) return Refusal::bad_argument(name, "a contiguous tensor for the CUDA kernel", "a strided view");
  if (a.k->dtype != a.q->dtype)
    return Refusal::bad_argument("k", std::string("the dtype of q (") + dtype_name(a.q->dtype) + ")", dtype_name(a.k->dtype));
  for (auto [t, name] : {std::pair<const cula_tensor*, const char*>{a.state_indices, "state_indices"},
                         {a.num_accepted_tokens, "num_accepted_tokens"}})
    if (t && t->device_type != CULA_CUDA)
      return Refusal::bad_argument(name, "a tensor on the device of q for the CUDA kernel (no host synchronisation)", describe(t));
  for (auto [t, name] : {std::pair<const cula_tensor*, const char*>{a.decay, "decay"}, {a.A_log, "A_log"}, {a.dt_bias, "dt_bias"}})
    if (t && t->dtype != CULA_FLOAT32) return Refusal::bad_argument(name, "a float32 tensor for the CUDA kernel", describe(t));
  if (a.state_pool->dtype != CULA_FLOAT32 && a.state_pool->dtype != CULA_BFLOAT16)
    return Refusal::bad_argument("state_pool", "a float32 or bfloat16 pool for the CUDA kernel", describe(a.state_pool));
  if (r.K != 64 && r.K != 128 && r.K != 256)
    return Refusal::unsupported("the CUDA decode kernel takes K in {64, 128, 256}, got K = " + std::to_string(r.K) +
                                "; use host tensors (the CPU backend) for other head sizes");
  if (reinterpret_cast<uintptr_t>(a.state_pool->data) % 16 != 0)
    return Refusal::bad_argument("state_pool", "a 16-byte aligned buffer for the CUDA kernel", "a misaligned view");
  if (a.final_state_out && reinterpret_cast<uintptr_t>(a.final_state_out->data) % 16 != 0)
    return Refusal::bad_argument("final_state_out", "a 16-byte aligned buffer for the CUDA kernel", "a misaligned view");
  if (r.N * r.T * r.HV * r.V >= (int64_t{1} << 31) || r.N >= (1 << 30))
    return Refusal::unsupported("problem too large for the CUDA decode kernel's 32-bit token indices");
  return Refusal::takes();
}

void cuda_decode(const Recurrence& r, const cula_decode_args& a) {
  DecodeParams p{};
  p.q = a.q->data;
  p.k = a.k->data;
  p.v = a.v->data;
  p.g = a.g ? a.g->data : nullptr;
  p.beta = a.beta ? a.beta->data : nullptr;
  p.decay = a.decay ? static_cast<const float*>(a.decay->data) : nullptr;
  p.A_log = a.A_log ? static_cast<const float*>(a.A_log->data) : nullptr;
  p.dt_bias = a.dt_bias ? static_cast<const float*>(a.dt_bias->data) : nullptr;
  p.pool = a.state_pool->data;
  p.pool_out = a.final_state_out ? a.final_state_out->data : nullptr;
  p.pool_idx = a.state_indices ? static_cast<const int32_t*>(a.state_indices->data) : nullptr;
  p.num_accepted = a.num_accepted_tokens ? static_cast<const int32_t*>(a.num_accepted_tokens->data) : nullptr;
  p.out = a.out->data;
  p.q_dt = a.q->dtype;
  p.v_dt = a.v->dtype;
  p.g_dt = a.g ? a.g->dtype : CULA_FLOAT32;
  p.beta_dt = a.beta ? a.beta->dtype : CULA_FLOAT32;
  p.out_dt = a.out->dtype;
  p.N = static_cast<int>(r.N);
  p.T = static_cast<int>(r.T);
  p.H = static_cast<int>(r.H);
  p.HV = static_cast<int>(r.HV);
  p.K = static_cast<int>(r.K);
  p.V = static_cast<int>(r.V);
  p.P = static_cast<int>(a.state_pool->shape[0]);
  p.per_token_slots = a.state_indices && a.state_indices->ndim == 2;
  p.gate_kind = r.tr.gate;
  p.delta = r.tr.delta;
  p.l2norm = r.l2norm;
  p.gate_in_kernel = r.gate_in_kernel;
  p.has_lb = r.has_lb;
  p.lb = static_cast<float>(r.lb);
  p.beta_sigmoid = r.beta_sigmoid;
  p.beta_mult = r.neg_eig ? 2.0f : 1.0f;
  p.scale = static_cast<float>(r.scale);
  p.decay_heads = static_cast<int>(r.decay_heads);
  p.dt_bias_per_channel = r.dt_bias_per_channel;
  p.value_heads_per_head = FastDiv(static_cast<uint32_t>(r.HV / r.H));
  p.value_heads = FastDiv(static_cast<uint32_t>(r.HV));
  if (r.N == 0 || r.T == 0) return;
  check(cudaSetDevice(a.q->device_id), "cudaSetDevice");
  const cudaStream_t stream = static_cast<cudaStream_t>(a.opt.stream);
  const bool k_last = r.state_layout == CULA_STATE_K_LAST;
  const bool pdl = cuda_device_arch(a.q->device_id) >= 90;
  const int sms = cuda_sm_count(a.q->device_id);
  switch (r.K) {
    case 64: launch_state<2>(p, a.state_pool->dtype, k_last, pdl, sms, stream); break;
    case 128: launch_state<4>(p, a.state_pool->dtype, k_last, pdl, sms, stream); break;
    default: launch_state<8>(p, a.state_pool->dtype, k_last, pdl, sms, stream); break;
  }
  check(cudaGetLastError(), "kernel launch");
}

}  // namespace cula
