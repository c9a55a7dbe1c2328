/*
 * cula C ABI: the only door into the engine.
 *
 * Every entry takes an argument struct whose first field is its own size (so
 * the struct can grow without breaking old callers), validates every tensor
 * it is given, and returns a status. On failure, cula_last_error() returns a
 * message that names the argument, what was expected and what was given; no
 * output buffer is written unless the call returns CULA_OK.
 *
 * Tensors are views: pointer, dtype, shape, strides (in elements) and device.
 * A NULL tensor pointer means "argument not given".
 */
#ifndef CULA_CULA_H_
#define CULA_CULA_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define CULA_API __declspec(dllexport)
#else
#define CULA_API __attribute__((visibility("default")))
#endif

#define CULA_ABI_VERSION 1
#define CULA_MAX_DIMS 6

typedef enum cula_status {
  CULA_OK = 0,
  CULA_ERROR_INVALID_ARGUMENT = 1, /* a bad shape, dtype, device, stride, index or option */
  CULA_ERROR_UNSUPPORTED = 2,      /* valid input that the chosen backend cannot run */
  CULA_ERROR_CUDA = 3,             /* a CUDA runtime error */
  CULA_ERROR_INTERNAL = 4
} cula_status;

/* Numeric codes follow DLPack's (type code << 8 | bits) so bindings can map them directly. */
typedef enum cula_dtype {
  CULA_INT32 = (0 << 8) | 32,
  CULA_INT64 = (0 << 8) | 64,
  CULA_FLOAT16 = (2 << 8) | 16,
  CULA_FLOAT32 = (2 << 8) | 32,
  CULA_FLOAT64 = (2 << 8) | 64,
  CULA_BFLOAT16 = (4 << 8) | 16
} cula_dtype;

/* Device types follow DLPack: 1 = CPU, 2 = CUDA. */
typedef enum cula_device_type { CULA_CPU = 1, CULA_CUDA = 2 } cula_device_type;

typedef struct cula_tensor {
  void* data;
  int32_t dtype;       /* cula_dtype */
  int32_t ndim;
  int64_t shape[CULA_MAX_DIMS];
  int64_t strides[CULA_MAX_DIMS]; /* in elements */
  int32_t device_type; /* cula_device_type */
  int32_t device_id;
} cula_tensor;

typedef enum cula_family {
  CULA_KDA = 0,        /* per-channel gate, delta rule */
  CULA_GDN = 1,        /* scalar gate, delta rule (Gated DeltaNet) */
  CULA_GLA = 2,        /* per-channel gate, no delta */
  CULA_SIMPLE_GLA = 3, /* scalar gate, no delta */
  CULA_LIGHTNING = 4   /* constant per-head decay, no delta */
} cula_family;

/* Recurrent state layout per (sequence, value head). */
typedef enum cula_state_layout {
  CULA_STATE_K_LAST = 0, /* [.., HV, V, K]: the RFC's canonical layout (Level 1, decode pools) */
  CULA_STATE_K_FIRST = 1 /* [.., HV, K, V]: FLA's default */
} cula_state_layout;

typedef enum cula_backend {
  CULA_BACKEND_AUTO = 0,   /* best available for the tensors' device */
  CULA_BACKEND_ORACLE = 1, /* float64 CPU recurrence, straight from the math (the test reference) */
  CULA_BACKEND_CPU = 2,    /* fast CPU path (chunked, multi-threaded, float32) */
  CULA_BACKEND_CUDA = 3,   /* CUDA kernels */
  CULA_BACKEND_CUDA_FP32 = 4 /* the CUDA kernels whose arithmetic is float32 throughout (the recurrent
                                form): no bf16 tiles, for callers that need float32 results from
                                float32 inputs */
} cula_backend;

/* Options shared by every recurrence entry. */
typedef struct cula_recurrence_options {
  int32_t family;          /* cula_family */
  double scale;            /* applied to q; pass a NaN for the default K^-0.5 */
  int32_t use_qk_l2norm;   /* q <- q/||q||, k <- k/||k|| (eps 1e-6 inside the sqrt) */
  int32_t use_gate_in_kernel; /* gate from raw g with A_log/dt_bias (KDA, GDN) */
  int32_t safe_gate;       /* requires lower_bound in [-5, 0) when the gate is computed in kernel */
  int32_t has_lower_bound; /* lower_bound given: gate = lb * sigmoid(...) */
  double lower_bound;
  int32_t use_beta_sigmoid;   /* beta <- sigmoid(beta) */
  int32_t allow_neg_eigval;   /* beta <- 2 sigmoid(beta); needs use_beta_sigmoid */
  int32_t state_layout;    /* cula_state_layout for every state tensor of the call */
  int32_t backend;         /* cula_backend */
  void* stream;            /* cudaStream_t for CUDA backends; ignored on CPU */
} cula_recurrence_options;

/*
 * Chunked (prefill/training) forward.
 *   q, k: [B, T, H, K]; v: [B, T, HV, V]; HV % H == 0.
 *   g: [B, T, HV, K] (KDA, GLA) or [B, T, HV] (GDN, simple GLA); NULL for Lightning.
 *   beta: [B, T, HV] (KDA, GDN); NULL otherwise.
 *   decay: [H] or [HV] (Lightning): the per-step log-decay is -decay[h] (MiniMax slope convention).
 *   A_log: [HV]; dt_bias: [HV*K] or [HV, K] (KDA) / [HV] (GDN), with use_gate_in_kernel.
 *   cu_seqlens: [N+1] int32/int64 on the CPU or the compute device; requires B == 1.
 *   initial_state: [N, HV, V, K] (K-last) or [N, HV, K, V] (K-first), fp32 or bf16.
 *   state_pool + state_indices ([N] int32): read the initial state from pool[idx[n]] and write
 *     the final state back there; a negative index starts from zero and leaves the pool alone.
 *   out: [B, T, HV, V] (caller allocated); final_state like initial_state;
 *   intermediate_states: [NT_total, HV, K|V, V|K]: the state before each chunk of chunk_size tokens.
 *   cu_seqlens_host: optional, the same offsets as cu_seqlens on the host, when cu_seqlens lives on
 *     the device: the count of intermediate states is taken from it (FLA's cu_seqlens_cpu); the
 *     kernels read cu_seqlens. Callers built before this field (a smaller struct_size) pass none.
 *   value_dim: 0, or the value size V of out and the states when it is larger than v's: v then holds
 *     the first v.shape[3] columns of each value row and the columns past them read as zeros (context
 *     parallelism's pass over values extended by the identity state's columns, with no zero-padded
 *     copy of v). Callers built before this field pass 0.
 *   segment_len: 0, or a positive multiple of 64: the tensor-core chunk engine (cuda_mma) runs each
 *     sequence as segments of that many tokens in parallel, joined by their state summaries (for few
 *     sequences and heads on long sequences); the result is the uncut call's within float32 rounding.
 *     Dense calls only (no cu_seqlens, state_pool, intermediate_states or value_dim); rows other than
 *     cuda_mma compute the call uncut. Callers built before this field pass 0.
 */
typedef struct cula_chunk_fwd_args {
  size_t struct_size;
  cula_recurrence_options opt;
  const cula_tensor* q;
  const cula_tensor* k;
  const cula_tensor* v;
  const cula_tensor* g;
  const cula_tensor* beta;
  const cula_tensor* decay;
  const cula_tensor* A_log;
  const cula_tensor* dt_bias;
  const cula_tensor* cu_seqlens;
  const cula_tensor* initial_state;
  cula_tensor* state_pool;
  const cula_tensor* state_indices;
  cula_tensor* out;
  cula_tensor* final_state;
  cula_tensor* intermediate_states;
  int32_t chunk_size; /* 0 = 64 */
  const cula_tensor* cu_seqlens_host;
  int64_t value_dim;
  int64_t segment_len;
} cula_chunk_fwd_args;

CULA_API cula_status cula_chunk_fwd(const cula_chunk_fwd_args* args);

/*
 * Decode: a few tokens per sequence against states held in a pool, updated in place.
 *   q, k: [N, T, H, K]; v: [N, T, HV, V]; g, beta, decay, A_log, dt_bias as in cula_chunk_fwd.
 *   state_pool: [P, HV, V, K] (K-last) or [P, HV, K, V]; fp32 or bf16.
 *   state_indices: [N] int32 (the state is read from and written back to one slot), or [N, T]
 *     int32 (speculative decoding: the state after token t goes to slot idx[n, t]). NULL means
 *     slot n. A negative index is a padding slot: nothing is read or written there; a sequence
 *     whose read slot is negative gets zeros in out and leaves the pool alone.
 *   num_accepted_tokens: [N] int32 with [N, T] indices: the initial state is read from slot
 *     idx[n, a - 1] (FLA's fused_recurrent_kda convention), with a clamped to [1, T] so that
 *     a = 0 (every draft rejected) continues from the committed token's slot idx[n, 0].
 *   out: [N, T, HV, V].
 */
typedef struct cula_decode_args {
  size_t struct_size;
  cula_recurrence_options opt;
  const cula_tensor* q;
  const cula_tensor* k;
  const cula_tensor* v;
  const cula_tensor* g;
  const cula_tensor* beta;
  const cula_tensor* decay;
  const cula_tensor* A_log;
  const cula_tensor* dt_bias;
  cula_tensor* state_pool;
  const cula_tensor* state_indices;
  const cula_tensor* num_accepted_tokens;
  cula_tensor* out;
  /* Optional [N, HV, V, K] (K-first: [N, HV, K, V]) buffer of the pool's dtype: the final states
   * are written here (row n) and the pool is only read (FLA's fused_recurrent without in-place
   * update). Not with state_indices (row n is read). Appended: callers built before it pass the
   * shorter struct (struct_size) and get the in-place update. */
  cula_tensor* final_state_out;
} cula_decode_args;

CULA_API cula_status cula_decode(const cula_decode_args* args);

/*
 * Backward of every family: the reverse-time recurrence.
 *   Inputs as in cula_chunk_fwd (decay for Lightning) plus d_out ([B, T, HV, V]) and optional
 *   d_final_state. Gradients (each optional; written when given): dq, dk, dv, dg (of the raw g
 *   when the gate is computed in kernel), dbeta (of the raw beta when the sigmoid is applied in
 *   kernel), dA_log, ddt_bias, d_initial_state. Lightning's decay is a constant: no gradient.
 *   Deterministic: the same call gives bitwise-identical gradients on every run.
 */
typedef struct cula_chunk_bwd_args {
  size_t struct_size;
  cula_recurrence_options opt;
  const cula_tensor* q;
  const cula_tensor* k;
  const cula_tensor* v;
  const cula_tensor* g;
  const cula_tensor* beta;
  const cula_tensor* A_log;
  const cula_tensor* dt_bias;
  const cula_tensor* cu_seqlens;
  const cula_tensor* initial_state;
  const cula_tensor* d_out;
  const cula_tensor* d_final_state;
  cula_tensor* dq;
  cula_tensor* dk;
  cula_tensor* dv;
  cula_tensor* dg;
  cula_tensor* dbeta;
  cula_tensor* dA_log;
  cula_tensor* ddt_bias;
  cula_tensor* d_initial_state;
  const cula_tensor* decay; /* Lightning's per-head decay rate [H] or [HV]; appended: a struct_size that
                              ends before it (callers built before it) reads as decay = NULL */
} cula_chunk_bwd_args;

CULA_API cula_status cula_chunk_bwd(const cula_chunk_bwd_args* args);

/*
 * KDA gate activation (FLA's fused_kda_gate), also the pre-pass of the fused kernels:
 *   g_out = -exp(A_log[h]) * softplus(g + dt_bias[h])            without lower_bound
 *   g_out = lb * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))       with lower_bound (A_log may be NULL)
 *   g: [B, T, HV, K]; A_log: [HV]; dt_bias: [HV*K] or [HV, K] (optional); g_out: like g, fp32 or bf16.
 * Uses opt.has_lower_bound, opt.lower_bound, opt.backend, opt.stream.
 */
typedef struct cula_kda_gate_args {
  size_t struct_size;
  cula_recurrence_options opt;
  const cula_tensor* g;
  const cula_tensor* A_log;
  const cula_tensor* dt_bias;
  cula_tensor* g_out;
} cula_kda_gate_args;

CULA_API cula_status cula_kda_gate(const cula_kda_gate_args* args);

/*
 * The carried-state correction of context parallelism, in one pass: a rank's engine pass over values
 * extended by K columns wrote ow = [o_local | Q~] in float32; with the incoming state X of its head,
 *   o[t, h, :] = round(ow[t, h, :V] + X[h] ow[t, h, V:V+K])
 *   ow: [L, HV, V + K] float32, unit last stride; state: [HV, V, K] float32, contiguous (K-last);
 *   o: [L, HV, V] bfloat16, float16 or float32 (CUDA: 16-bit, one TF32 product under its rounding;
 *     the host rows sum in float64), unit last stride (on the device of ow).
 * Uses opt.backend, opt.stream.
 */
typedef struct cula_cp_correct_args {
  size_t struct_size;
  cula_recurrence_options opt;
  const cula_tensor* ow;
  const cula_tensor* state;
  cula_tensor* o;
} cula_cp_correct_args;

CULA_API cula_status cula_cp_correct(const cula_cp_correct_args* args);

/* The last error message of the calling thread ("" after a success). */
CULA_API const char* cula_last_error(void);
/* Library version string, e.g. "0.1.0". */
CULA_API const char* cula_version(void);
CULA_API int32_t cula_abi_version(void);
/* Build description: compiler, CUDA toolkit, architectures compiled in. */
CULA_API const char* cula_build_info(void);
/* Number of CUDA devices usable by this build (0 when built without CUDA or no driver/GPU). */
CULA_API int32_t cula_cuda_device_count(void);
/* Writes "name (sm_XY, N SMs, M MiB)" for a device; returns CULA_OK or an error. */
CULA_API cula_status cula_cuda_device_info(int32_t device, char* buf, size_t buf_len);
/* Which backend AUTO resolves to for an op ("chunk_fwd", "decode", "chunk_bwd", "kda_gate", "cp_correct")
 * on a device type; returns a static string such as "cpu" or "cuda", or "none". */
CULA_API const char* cula_backend_for(const char* op, int32_t device_type, int32_t family);

/* The capability answer for a call, without running it: validates args as cula_chunk_fwd /
 * cula_decode / cula_chunk_bwd / cula_kda_gate do (same errors), then records which kernel
 * (dispatch-table row, as cula_last_kernel names it) would run the call and why each row tried
 * before it declined. When no row takes the call it fails with the error the op would return.
 * Outputs are neither read nor written. Read the answer with the two functions below. */
CULA_API cula_status cula_chunk_fwd_explain(const cula_chunk_fwd_args* args);
CULA_API cula_status cula_decode_explain(const cula_decode_args* args);
CULA_API cula_status cula_chunk_bwd_explain(const cula_chunk_bwd_args* args);
CULA_API cula_status cula_kda_gate_explain(const cula_kda_gate_args* args);
CULA_API cula_status cula_cp_correct_explain(const cula_cp_correct_args* args);
/* The arguments' checks alone (the errors cula_chunk_fwd / cula_decode would return for them), with
 * no kernel chosen: host slot indices are checked for range and for a slot named by two sequences
 * here even when the call itself will pass them on the device. Outputs neither read nor written. */
CULA_API cula_status cula_chunk_fwd_validate(const cula_chunk_fwd_args* args);
CULA_API cula_status cula_decode_validate(const cula_decode_args* args);
/* After a successful *_explain on this thread: the kernel's name, and one "row: reason" line per
 * row that declined the call ("" when the first row takes it). */
CULA_API const char* cula_explained_kernel(void);
CULA_API const char* cula_explained_declines(void);

/* Name of the kernel (dispatch-table row) that ran the last successful op call on this thread,
 * e.g. "cuda_mma", "cuda", "cpu", "reference"; "" before any call. */
CULA_API const char* cula_last_kernel(void);
/* Bytes of the CUDA kernels' workspace pool on a device (stream-ordered, outside the caller's
 * allocator): the most in use at once since the last reset (reset != 0 starts a new count);
 * 0 when the pool was never used or CUDA is absent. For peak-memory accounting beside torch's. */
CULA_API int64_t cula_workspace_peak_bytes(int32_t device, int32_t reset);
/* Threads used by the CPU backend (0 = hardware concurrency). */
CULA_API void cula_set_num_threads(int32_t n);

#ifdef __cplusplus
}
#endif
#endif /* CULA_CULA_H_ */
