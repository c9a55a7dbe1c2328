// The validated description of one recurrence call, shared by every backend.
//
// All five families are one recurrence (SPEC §2) with two switches: how the log-decay a_t is
// shaped (per channel, scalar, or a constant per head) and whether the delta rule applies.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/tensor.h"
#include "cula/cula.h"

namespace cula {

enum class GateKind { PerChannel, Scalar, Constant };

struct FamilyTraits {
  GateKind gate;
  bool delta;
  const char* name;
};

FamilyTraits family_traits(int32_t family);  // throws on an unknown family

// Scalar formulas of SPEC §2, shared by the reference and the fast paths.
template <typename R>
inline R softplus(R x) {  // FLA's threshold: identity above 20
  return x > R(20) ? x : std::log1p(std::exp(x));
}
template <typename R>
inline R sigmoid(R x) {
  return R(1) / (R(1) + std::exp(-x));
}
constexpr double kL2NormEps = 1e-6;
// The chunked kernels (CPU and CUDA) take each token's log-decay no lower than this: they sum
// log-decays inside a chunk and use differences G_i - G_j, which a gate of -inf (log 0, a full
// reset) would make NaN. e^-64 ~ 1.6e-28 is a full reset at fp32 resolution, and 64 tokens of it
// keep the cumulative sums small enough for their differences (~5e-4 relative at worst).
constexpr float kMinChunkLogDecay = -64.0f;

struct Recurrence {
  const char* entry = "";
  int32_t family = CULA_KDA;
  FamilyTraits tr{};
  int64_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0;
  int64_t v_cols = 0;               // columns of v read; those in [v_cols, V) are zeros (value_dim)
  int64_t N = 0;                    // sequences
  int64_t segment_len = 0;          // chunk_fwd: segments of this many tokens in parallel (0: none)
  std::vector<int64_t> seq_start;   // N+1 offsets into the flattened B*T tokens
  double scale = 1.0;
  bool l2norm = false, gate_in_kernel = false, has_lb = false, beta_sigmoid = false, neg_eig = false;
  double lb = 0.0;
  int32_t state_layout = CULA_STATE_K_LAST;
  View q, k, v, g, beta, decay, A_log, dt_bias;
  int64_t decay_heads = 0;  // H or HV for Lightning
  bool dt_bias_per_channel = false;  // [HV*K]/[HV,K] (KDA) or [HV] (GDN)

  int64_t group() const { return HV / H; }
  int64_t seq_len(int64_t n) const { return seq_start[n + 1] - seq_start[n]; }
  // flattened token f -> (b, t)
  int64_t tb(int64_t f) const { return f / T; }
  int64_t tt(int64_t f) const { return f % T; }

  // State element (i over K, j over V) offset inside one [HV, ...] state block.
  int64_t state_off(const cula_tensor& s, int64_t slot, int64_t hv, int64_t i, int64_t j) const {
    return state_layout == CULA_STATE_K_LAST
               ? slot * s.strides[0] + hv * s.strides[1] + j * s.strides[2] + i * s.strides[3]
               : slot * s.strides[0] + hv * s.strides[1] + i * s.strides[2] + j * s.strides[3];
  }

  // Preprocessed inputs of flattened token f for value head hv (SPEC §2):
  //   qo = scale * (l2norm?)(q), ko = (l2norm?)(k), ao = log-decay (K entries; scalar
  //   and constant gates are broadcast), returns beta (1 for non-delta families).
  template <typename R>
  R load_token(int64_t f, int64_t hv, R* qo, R* ko, R* ao) const {
    load_qk(f, hv, qo, ko);
    load_gate(tb(f), tt(f), hv, ao);
    return load_beta<R>(tb(f), tt(f), hv);
  }

  template <typename R>
  void load_qk(int64_t f, int64_t hv, R* qo, R* ko) const {
    const int64_t b = tb(f), t = tt(f), h = hv / group();
    R qn = 0, kn = 0;
    q.row(q.off(b, t, h, 0), K, q.t->strides[3], qo);
    k.row(k.off(b, t, h, 0), K, k.t->strides[3], ko);
    for (int64_t i = 0; i < K; ++i) {
      qn += qo[i] * qo[i];
      kn += ko[i] * ko[i];
    }
    R qs = static_cast<R>(scale), ks = 1;
    if (l2norm) {
      qs /= std::sqrt(qn + static_cast<R>(kL2NormEps));
      ks /= std::sqrt(kn + static_cast<R>(kL2NormEps));
    }
    for (int64_t i = 0; i < K; ++i) {
      qo[i] *= qs;
      ko[i] *= ks;
    }
  }

  template <typename R>
  void load_gate(int64_t b, int64_t t, int64_t hv, R* ao) const {
    if (tr.gate == GateKind::Constant) {
      const R a = -static_cast<R>(decay.at(decay_heads == HV ? hv : hv / group()));
      for (int64_t i = 0; i < K; ++i) ao[i] = a;
      return;
    }
    const bool per_channel = tr.gate == GateKind::PerChannel;
    const int64_t n_raw = per_channel ? K : 1;
    if (per_channel)
      g.row(g.off(b, t, hv, 0), K, g.t->strides[3], ao);
    else
      ao[0] = static_cast<R>(g.at(b, t, hv));
    if (gate_in_kernel)
      for (int64_t i = 0; i < n_raw; ++i) ao[i] = gate_activation<R>(ao[i], hv, i);
    if (!per_channel)
      for (int64_t i = 1; i < K; ++i) ao[i] = ao[0];
  }

  // a = -exp(A_log) softplus(x + dt_bias), or lb * sigmoid(exp(A_log) (x + dt_bias)) with a lower bound.
  template <typename R>
  R gate_activation(R x, int64_t hv, int64_t i) const {
    if (dt_bias) x += static_cast<R>(dt_bias_per_channel ? dt_bias.flat(hv * K + i) : dt_bias.at(hv));
    if (has_lb) {
      const R z = A_log ? std::exp(static_cast<R>(A_log.at(hv))) * x : x;
      return static_cast<R>(lb) * sigmoid(z);
    }
    return -std::exp(static_cast<R>(A_log.at(hv))) * softplus(x);
  }

  template <typename R>
  R load_beta(int64_t b, int64_t t, int64_t hv) const {
    if (!tr.delta) return R(1);
    R x = static_cast<R>(beta.at(b, t, hv));
    if (beta_sigmoid) x = (neg_eig ? R(2) : R(1)) * sigmoid(x);
    return x;
  }
};

// Offset of element (i over K, j over V) of the state of chunk c, value head hv, in an
// intermediate-states tensor [B, NT, HV, ., .].
inline int64_t intermediate_off(const Recurrence& r, const cula_tensor& h, int64_t b, int64_t c, int64_t hv, int64_t i,
                                int64_t j) {
  return b * h.strides[0] + c * h.strides[1] + hv * h.strides[2] +
         (r.state_layout == CULA_STATE_K_LAST ? j * h.strides[3] + i * h.strides[4] : i * h.strides[3] + j * h.strides[4]);
}

// First chunk index of each sequence: chunk_base[n] = sum over m < n of ceil(len_m / chunk).
std::vector<int64_t> chunk_bases(const Recurrence& r, int64_t chunk);

// Decode slot bookkeeping (SPEC §2 and docs/CONVENTIONS.md): which pool slot a sequence starts
// from and where the state after token t goes.
struct DecodeSlots {
  const cula_decode_args& a;
  int64_t T;
  bool per_token() const { return a.state_indices && a.state_indices->ndim == 2; }
  int64_t at(int64_t n, int64_t t) const {
    const cula_tensor* idx = a.state_indices;
    if (!idx) return n;
    const int32_t* d = static_cast<const int32_t*>(idx->data);
    return per_token() ? d[n * idx->strides[0] + t * idx->strides[1]] : d[n * idx->strides[0]];
  }
  // FLA's num_accepted_tokens convention, with the count clamped to [1, T].
  int64_t read(int64_t n) const {
    if (!per_token()) return at(n, 0);
    int64_t acc = 1;
    if (a.num_accepted_tokens)
      acc = static_cast<const int32_t*>(a.num_accepted_tokens->data)[n * a.num_accepted_tokens->strides[0]];
    acc = acc < 1 ? 1 : acc;
    acc = acc > (T > 1 ? T : 1) ? (T > 1 ? T : 1) : acc;
    return at(n, acc - 1);
  }
};

// Validates a cula_chunk_fwd / cula_decode / cula_chunk_bwd call and builds its description.
// Tensors must be on `device_type` (the backend's device); index tensors cu_seqlens may be on
// the host as well.
Recurrence validate_chunk_fwd(const cula_chunk_fwd_args& a);
Recurrence validate_decode(const cula_decode_args& a);
Recurrence validate_chunk_bwd(const cula_chunk_bwd_args& a);

// Validates a cula_kda_gate call (every tensor on the device of g; the CUDA kernel's extra needs
// are checked by its caller). Returns g's HV and K.
struct KdaGateShape {
  int64_t HV, K;
};
KdaGateShape validate_kda_gate(const cula_kda_gate_args& a);

struct CpCorrectShape {
  int64_t L, HV, V, K;
};
CpCorrectShape validate_cp_correct(const cula_cp_correct_args& a);

int64_t chunk_count(const Recurrence& r, int64_t chunk);  // sum over sequences of ceil(len / chunk)

}  // namespace cula
