// Forward of every family on CUDA tensors, token by token (the recurrent form of SPEC §2).
//
// The GPU path for every call the chunk engines decline (the dispatch table tries them first):
// every option (varlen with device-side cu_seqlens, GVA, gates in kernel, states in either layout
// and dtype, state pools, intermediate states) in one kernel, no workspace, no host
// synchronisation. Today that is key head sizes other than 64, 128 and 256 and value head sizes
// not a multiple of 64 at Level 0 (the front pads both), and float32 state arithmetic on request
// (backend "cuda_fp32", which FLA's fused_recurrent drop-ins take for float32 inputs).
//
// Design: one CTA per (sequence n, value head hv, tile of 32 state rows along V), warp-specialised.
// - 8 consumer warps own the state: warp w holds tile rows [4 w, 4 w + 4), lane l elements
//   [l EPL, (l + 1) EPL) of each (EPL = K / 32), in registers for the whole sequence. They run the
//   token chain only, reading prepared tokens from shared memory.
// - 8 producer warps (4 at K = 256, for registers) prepare 32 tokens at a time into a shared-memory
//   stage: q scale / |q|, k / |k|, the decay e^a (the gate activated in the kernel where asked, a
//   scalar gate repeated along K), beta (sigmoid in the kernel where asked), k . q, and the tile's
//   values of v. One warp per token (warp sums for the norms). They also write the outputs the
//   consumers left in the stage back to global memory in the output's dtype.
// - Two stages; named barriers 1 + s (stage s prepared: producers arrive, consumers wait) and
//   3 + s (stage s consumed: consumers arrive, producers wait before writing its outputs back and
//   refilling it). The racecheck instantiation (CULA_BLOCK_BARRIERS_ONLY=1) takes block barriers
//   instead: the two sides pass the same number of them, in lockstep.
// Per token a consumer warp computes S' = S * decay and, from S', the dot products S'^T k and
// S'^T q of its 4 rows in one reduce-scatter of 8 sums; then u = beta (v - S'^T k) (u = v without
// the delta rule), S = S' + k u^T and o = S'^T q + u (k . q), which equals S^T q. That one
// reduction is the chain per token: the global loads, the norms and the gate are the producers'.
// States go out at chunk boundaries (intermediate states) and at the end (final state or pool slot).
//
// Where the time goes: a sequence takes T times the chain's latency (0.28 us per token on an H100
// with 16-row tiles) while the tiles fit the GPU at once; the 32-row tiles halve the CTAs, so twice
// the heads fit before a second wave (one CTA per SM: 120 registers x 512 threads). Tried: a row
// spread over K / 16 lanes (16 elements each, a 3-level butterfly): every lane then reads 48 floats
// of the stage per token, 4-way bank conflicts on top, and the shared-memory traffic made it 3x
// slower per token. The first form of this kernel (every warp loading, normalising and reducing
// twice per token) took 1.6 us per token, 0.51x FLA's fused_recurrent on float32 GDN.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

#include "common/error.h"
#include "cuda/common/fwd_params.cuh"
#include "cuda/common/recurrence_math.cuh"
#include "cuda/kerutils/mbarrier.cuh"
#include "cuda/prefill/chunk_common.cuh"
#include "cuda/prefill/recurrent/recurrent_fwd.h"
#include "cuda/runtime/check.h"

namespace cula {
namespace {

using dev::ld;
using dev::st;

constexpr int kConsumerWarps = 8;
// Producer warps: 8, or 4 at K = 256, where the consumers' rows take 168 registers a thread (the
// budget of 12 warps); the 4 then prepare 8 tokens a stage each.
template <int K>
constexpr int producer_warps() {
  return K == 256 ? 4 : 8;
}
template <int K>
constexpr int block_threads() {
  return (kConsumerWarps + producer_warps<K>()) * 32;
}
constexpr int kRows = 4;  // state rows per consumer warp
constexpr int kTileRows = kConsumerWarps * kRows;
constexpr int kStageTokens = 32;
constexpr int kStages = 2;
constexpr int kFullBarrier = 1;             // + stage
constexpr int kEmptyBarrier = 1 + kStages;  // + stage
static_assert(kEmptyBarrier + kStages <= 16, "named barriers 1..15");
static_assert(kTileRows == 32, "a producer lane loads one value of v per token");

// One stage of prepared tokens (float32, K-contiguous rows).
template <int K>
struct Stage {
  float q[kStageTokens][K];      // q * scale / |q| (|q| = 1 without l2norm)
  float k[kStageTokens][K];      // k / |k|
  float decay[kStageTokens][K];  // e^a per channel
  float v[kStageTokens][kTileRows];
  float o[kStageTokens][kTileRows];  // the consumers' outputs, written back by the producers
  float beta[kStageTokens];
  float kq[kStageTokens];  // k . q of the two vectors above
};

// N consecutive floats of shared memory (N a multiple of 2), as float4s where N allows.
template <int N>
__device__ __forceinline__ void load_row(const float* src, float (&x)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int e = 0; e < N; e += 4) {
      const float4 f = *reinterpret_cast<const float4*>(src + e);
      x[e] = f.x, x[e + 1] = f.y, x[e + 2] = f.z, x[e + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; e += 2) {
      const float2 f = *reinterpret_cast<const float2*>(src + e);
      x[e] = f.x, x[e + 1] = f.y;
    }
  }
}
template <int N>
__device__ __forceinline__ void store_row(float* dst, const float (&x)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int e = 0; e < N; e += 4)
      *reinterpret_cast<float4*>(dst + e) = make_float4(x[e], x[e + 1], x[e + 2], x[e + 3]);
  } else {
#pragma unroll
    for (int e = 0; e < N; e += 2) *reinterpret_cast<float2*>(dst + e) = make_float2(x[e], x[e + 1]);
  }
}

struct Span {
  int64_t bos, eos;
  int b_row;
  __device__ int64_t chunks() const { return (eos - bos + kStageTokens - 1) / kStageTokens; }
  __device__ int tokens(int64_t c) const {
    const int64_t left = eos - bos - c * kStageTokens;
    return static_cast<int>(left < kStageTokens ? left : kStageTokens);
  }
};

// Producer warp pw of PW: fill stage `sg` with tokens [t0, t0 + ntok) (ntok >= 1); warp pw takes
// tokens pw, pw + PW, ... of the stage, G at a time (every load of a group out before the first
// use; at K = 256 two at a time keep the raw rows within the register budget), and lane l the
// value of tile row l. Tokens past ntok repeat the last one (read, never used).
template <int K>
__device__ __forceinline__ void prepare_tokens(const FwdParams& p, Stage<K>& sg, const Span& sp, int64_t t0, int ntok,
                                               int h, int hv, int j_tile, int pw, int lane,
                                               const float (&bias)[K / 32], float eA, float const_decay) {
  constexpr int EPL = K / 32;
  constexpr int PW = producer_warps<K>(), kTokensPerProducer = kStageTokens / PW;
  constexpr int G = EPL >= 8 ? 2 : kTokensPerProducer;
  static_assert(kTokensPerProducer % G == 0, "whole groups");
  const int k0 = lane * EPL;
#pragma unroll 1
  for (int g0 = 0; g0 < kTokensPerProducer; g0 += G) {
    float q[G][EPL], k[G][EPL], g[G][EPL], beta[G], v[G];
#pragma unroll
    for (int i = 0; i < G; ++i) {
      const int64_t t = t0 + min(pw + (g0 + i) * PW, ntok - 1);
      const int64_t qb = sp.b_row * p.q_s[0] + t * p.q_s[1] + h * p.q_s[2];
      const int64_t kb = sp.b_row * p.k_s[0] + t * p.k_s[1] + h * p.k_s[2];
      const int64_t gb = sp.b_row * p.g_s[0] + t * p.g_s[1] + hv * p.g_s[2];
      const int64_t vb = sp.b_row * p.v_s[0] + t * p.v_s[1] + hv * p.v_s[2];
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        q[i][e] = ld(p.q, p.q_dt, qb + (k0 + e) * p.q_s[3]);
        k[i][e] = ld(p.k, p.k_dt, kb + (k0 + e) * p.k_s[3]);
        g[i][e] = p.gate_kind == GateKind::PerChannel ? ld(p.g, p.g_dt, gb + (k0 + e) * p.g_s[3])
                  : p.gate_kind == GateKind::Scalar   ? ld(p.g, p.g_dt, gb)
                                                      : const_decay;
      }
      beta[i] = p.delta ? ld(p.beta, p.beta_dt, sp.b_row * p.beta_s[0] + t * p.beta_s[1] + hv * p.beta_s[2]) : 1.0f;
      v[i] = ld(p.v, p.v_dt, vb + min(j_tile + lane, p.v_cols - 1) * p.v_s[3]);  // (zeroed past v_cols below)
    }
#pragma unroll
    for (int i = 0; i < G; ++i) {
      const int tt = pw + (g0 + i) * PW;
      float qq = 0, kk = 0, qk = 0;
#pragma unroll
      for (int e = 0; e < EPL; ++e) qq += q[i][e] * q[i][e], kk += k[i][e] * k[i][e], qk += q[i][e] * k[i][e];
      float qs = p.scale, ks = 1.0f;
      if (p.l2norm) {
        qs *= rsqrtf(dev::warp_sum(qq) + 1e-6f);
        ks = rsqrtf(dev::warp_sum(kk) + 1e-6f);
      }
      qk = dev::warp_sum(qk);
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        float a = g[i][e];
        if (p.gate_in_kernel) a = dev::activate_gate(a + bias[e], eA, p.has_lb, p.lb);
        g[i][e] = __expf(a);
        q[i][e] *= qs;
        k[i][e] *= ks;
      }
      store_row<EPL>(&sg.q[tt][k0], q[i]);
      store_row<EPL>(&sg.k[tt][k0], k[i]);
      store_row<EPL>(&sg.decay[tt][k0], g[i]);
      sg.v[tt][lane] = j_tile + lane < p.v_cols ? v[i] : 0.0f;  // (value_dim: the columns past v's are zeros)
      if (lane == 0) {
        sg.beta[tt] = p.beta_sigmoid ? dev::beta_sigmoid(beta[i], p.beta_mult) : beta[i];
        sg.kq[tt] = qk * qs * ks;
      }
    }
  }
}

// Producer warps: the outputs of stage `sg` (tokens [t0, t0 + ntok)) to global memory.
template <int K>
__device__ __forceinline__ void write_outputs(const FwdParams& p, const Stage<K>& sg, const Span& sp, int64_t t0,
                                              int ntok, int hv, int j_tile, int ptid) {
  constexpr int TR = kTileRows;
  for (int i = ptid; i < ntok * TR; i += producer_warps<K>() * 32) {
    const int tt = i / TR, r = i % TR;
    if (j_tile + r < p.V)
      st(p.out, p.out_dt, sp.b_row * p.out_s[0] + (t0 + tt) * p.out_s[1] + hv * p.out_s[2] + (j_tile + r) * p.out_s[3],
         sg.o[tt][r]);
  }
}

// The hand-over of a stage: named barriers, or block barriers in the racecheck instantiation.
template <int K, bool kBlockBarriersOnly>
__device__ __forceinline__ void wait_stage(int id) {
  if constexpr (kBlockBarriersOnly) __syncthreads();
  else mbar::named_sync(id, block_threads<K>());
}
template <int K, bool kBlockBarriersOnly>
__device__ __forceinline__ void signal_stage(int id) {
  if constexpr (kBlockBarriersOnly) __syncthreads();
  else mbar::named_arrive(id, block_threads<K>());
}

template <int K, bool kDelta, bool kBlockBarriersOnly>
__global__ void __launch_bounds__(block_threads<K>()) recurrent_fwd_kernel(const FwdParams p) {
  constexpr int TR = kTileRows, EPL = K / 32;
  extern __shared__ float4 smem_raw[];
  Stage<K>* stages = reinterpret_cast<Stage<K>*>(smem_raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tiles = (p.V + TR - 1) / TR;
  const int64_t bid = blockIdx.x;
  const int tile = static_cast<int>(bid % tiles);
  const int hv = static_cast<int>((bid / tiles) % p.HV);
  const int n = static_cast<int>(bid / (static_cast<int64_t>(tiles) * p.HV));
  const int h = hv / (p.HV / p.H);
  const int j_tile = tile * TR;
  const Seq sq = seq_of(p, n);
  const Span sp{sq.bos, sq.eos, sq.b_row};
  const int64_t chunks = sp.chunks();

  if (warp >= kConsumerWarps) {  // producers
    const int pw = warp - kConsumerWarps, ptid = threadIdx.x - kConsumerWarps * 32;
    float eA = 1.0f, bias[EPL];
    if (p.gate_in_kernel && p.A_log) eA = __expf(ld(p.A_log, p.A_log_dt, hv));
#pragma unroll
    for (int e = 0; e < EPL; ++e)
      bias[e] = (p.gate_in_kernel && p.dt_bias)
                    ? ld(p.dt_bias, p.dt_bias_dt, p.dt_bias_per_channel ? hv * K + lane * EPL + e : hv)
                    : 0.0f;
    const float const_decay =
        p.gate_kind == GateKind::Constant ? -ld(p.decay, p.decay_dt, p.decay_heads == p.HV ? hv : h) : 0.0f;
    for (int64_t c = 0; c < chunks; ++c) {
      const int s = static_cast<int>(c % kStages);
      if (c >= kStages) {
        wait_stage<K, kBlockBarriersOnly>(kEmptyBarrier + s);
        write_outputs<K>(p, stages[s], sp, sp.bos + (c - kStages) * kStageTokens, sp.tokens(c - kStages), hv, j_tile,
                         ptid);
      }
      prepare_tokens<K>(p, stages[s], sp, sp.bos + c * kStageTokens, sp.tokens(c), h, hv, j_tile, pw, lane, bias, eA,
                        const_decay);
      signal_stage<K, kBlockBarriersOnly>(kFullBarrier + s);
    }
    for (int64_t c = chunks > kStages ? chunks - kStages : 0; c < chunks; ++c) {
      const int s = static_cast<int>(c % kStages);
      wait_stage<K, kBlockBarriersOnly>(kEmptyBarrier + s);
      write_outputs<K>(p, stages[s], sp, sp.bos + c * kStageTokens, sp.tokens(c), hv, j_tile, ptid);
    }
    return;
  }

  // consumers: warp w holds tile rows [4 w, 4 w + 4), lane l elements [l EPL, (l + 1) EPL) of each
  const int r0 = warp * kRows, j0 = j_tile + r0;
  const int k0 = lane * EPL;
  int64_t chunk_base = 0;  // first intermediate-state index of this sequence
  if (p.inter && p.cu)
    for (int m = 0; m < n; ++m) chunk_base += (cu_at(p, m + 1) - cu_at(p, m) + p.chunk - 1) / p.chunk;

  float s[kRows][EPL];
  int64_t slot = -1;
  if (p.pool) slot = p.pool_idx ? p.pool_idx[n] : n;
  if (slot >= p.P) slot = -1;
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      const int j = min(j0 + r, p.V - 1);
      float x = 0.0f;
      if (p.h0) x = ld(p.h0, p.h0_dt, state_elem(p, n, hv, j, k0 + e));
      else if (slot >= 0) x = ld(p.pool, p.pool_dt, state_elem(p, slot, hv, j, k0 + e));
      s[r][e] = x;
    }
  auto store_state = [&](void* dst, int dt, auto&& index_of) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (j0 + r >= p.V) continue;
#pragma unroll
      for (int e = 0; e < EPL; ++e) st(dst, dt, index_of(j0 + r, k0 + e), s[r][e]);
    }
  };
  auto store_inter = [&](int64_t t) {  // the state before token t, at a chunk boundary
    // [B, NT] flattened: varlen packs every sequence's chunks in one row (B = 1)
    const int64_t ci = chunk_base + (t - sp.bos) / p.chunk;
    const int64_t row = p.cu ? ci : static_cast<int64_t>(n) * ((p.T + p.chunk - 1) / p.chunk) + ci;
    store_state(p.inter, p.inter_dt, [&](int j, int kk) { return state_elem(p, row, hv, j, kk); });
  };
  // One token: S' = S * decay; dots[r] = S'^T k (delta rule only) and dots[D - 4 + r] = S'^T q of
  // row r in one reduce-scatter; u; S = S' + k u^T; the output of this lane's row (if it holds one)
  // goes to the stage.
  auto step = [&](Stage<K>& sg, int tt) {
    float qv[EPL], kv[EPL], dv[EPL];
    load_row<EPL>(&sg.q[tt][k0], qv);
    load_row<EPL>(&sg.k[tt][k0], kv);
    load_row<EPL>(&sg.decay[tt][k0], dv);
    const float4 vv = *reinterpret_cast<const float4*>(&sg.v[tt][r0]);
    float u[kRows] = {vv.x, vv.y, vv.z, vv.w};
    static_assert(kRows == 4, "one float4 of values per warp");
    const float beta = sg.beta[tt], kq = sg.kq[tt];
    constexpr int D = kDelta ? 2 * kRows : kRows;
    float dots[D];
#pragma unroll
    for (int i = 0; i < D; ++i) dots[i] = 0.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        s[r][e] *= dv[e];
        if constexpr (kDelta) dots[r] += s[r][e] * kv[e];
        dots[D - kRows + r] += s[r][e] * qv[e];
      }
    const float mine = dev::warp_sum_scatter<D>(dots, lane);  // lane l: sum l / (32 / D)
    if constexpr (kDelta) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) u[r] = (u[r] - __shfl_sync(0xffffffffu, mine, dev::scatter_lane<D>(r))) * beta;
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int e = 0; e < EPL; ++e) s[r][e] += kv[e] * u[r];
    const int row = dev::scatter_index<D>(lane) - (D - kRows);  // the row whose S'^T q this lane holds
    float u_row = 0.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) u_row = row == r ? u[r] : u_row;
    if (row >= 0 && dev::scatter_leader<D>(lane)) sg.o[tt][r0 + row] = mine + u_row * kq;
  };

  // Intermediate states fall on stage starts when the chunk is a multiple of the stage (FLA's 64):
  // the token loop then has no per-token branch.
  const bool inter_per_token = p.inter && p.chunk % kStageTokens != 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int si = static_cast<int>(c % kStages);
    Stage<K>& sg = stages[si];
    const int64_t t0 = sp.bos + c * kStageTokens;
    const int ntok = sp.tokens(c);
    wait_stage<K, kBlockBarriersOnly>(kFullBarrier + si);
    if (inter_per_token) {
      for (int tt = 0; tt < ntok; ++tt) {
        if ((t0 + tt - sp.bos) % p.chunk == 0) store_inter(t0 + tt);
        step(sg, tt);
      }
    } else {
      if (p.inter && (t0 - sp.bos) % p.chunk == 0) store_inter(t0);
      for (int tt = 0; tt < ntok; ++tt) step(sg, tt);
    }
    signal_stage<K, kBlockBarriersOnly>(kEmptyBarrier + si);
  }
  if (p.ht) store_state(p.ht, p.ht_dt, [&](int j, int kk) { return state_elem(p, n, hv, j, kk); });
  if (slot >= 0) store_state(p.pool, p.pool_dt, [&](int j, int kk) { return state_elem(p, slot, hv, j, kk); });
}

void check(cudaError_t e, const char* what) { cuda_check(e, "chunk_fwd", what); }

template <int K, bool kDelta, bool kBlockBarriersOnly>
void launch(const FwdParams& p, unsigned grid, cudaStream_t stream) {
  constexpr int bytes = kStages * static_cast<int>(sizeof(Stage<K>));
  auto kernel = recurrent_fwd_kernel<K, kDelta, kBlockBarriersOnly>;
  chunk::allow_smem(kernel, bytes);
  kernel<<<grid, block_threads<K>(), bytes, stream>>>(p);
}

template <int K>
void launch(const Recurrence& r, const FwdParams& p, cudaStream_t stream) {
  // CULA_BLOCK_BARRIERS_ONLY=1 (read once per process): the racecheck instantiation (see above)
  static const bool block_barriers_only = [] {
    const char* e = std::getenv("CULA_BLOCK_BARRIERS_ONLY");
    return e && *e && *e != '0';
  }();
  constexpr int TR = kTileRows;
  const int64_t blocks = r.N * r.HV * ((r.V + TR - 1) / TR);
  if (blocks >= (int64_t{1} << 31)) throw_unsupported("chunk_fwd", "too many sequences x heads for one launch");
  const unsigned grid = static_cast<unsigned>(blocks);
  if (block_barriers_only) {
    if (p.delta) launch<K, true, true>(p, grid, stream);
    else launch<K, false, true>(p, grid, stream);
  } else {
    if (p.delta) launch<K, true, false>(p, grid, stream);
    else launch<K, false, false>(p, grid, stream);
  }
}

}  // namespace

Refusal cuda_recurrent_fwd_declines(const Recurrence& r, const cula_chunk_fwd_args& a) {
  if (r.K != 64 && r.K != 128 && r.K != 256)
    return Refusal::unsupported("the CUDA forward takes K in {64, 128, 256}, got K = " + std::to_string(r.K) +
                                "; use host tensors (the CPU backend) for other head sizes");
  if (const UnreadableInput u = first_unreadable_input(a); u.name) return Refusal::bad_argument(u.name, u.expected, u.given);
  return Refusal::takes();
}

void cuda_recurrent_fwd(const Recurrence& r, const cula_chunk_fwd_args& a) {
  const FwdParams p = make_fwd_params(r, a);
  if (r.N == 0) return;
  check(cudaSetDevice(a.q->device_id), "cudaSetDevice");
  const cudaStream_t stream = static_cast<cudaStream_t>(a.opt.stream);
  switch (r.K) {
    case 64: launch<64>(r, p, stream); break;
    case 128: launch<128>(r, p, stream); break;
    default: launch<256>(r, p, stream); break;
  }
  check(cudaGetLastError(), "kernel launch");
}

}  // namespace cula
