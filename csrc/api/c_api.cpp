// The C ABI: validation, then one dispatch table per op.
#include <cmath>
#include <cstddef>
#include <cstring>
#include <initializer_list>
#include <string>
#include <tuple>

#include "common/error.h"
#include "common/parallel.h"
#include "common/problem.h"
#include "cpu/cpu_backend.h"
#include "cuda/backward/chunk_bwd.h"
#include "cuda/backward/recurrent_bwd.h"
#include "cuda/decode/decode.h"
#include "cuda/dist/cp_correct.h"
#include "cuda/gate/kda_gate.h"
#include "cuda/prefill/chunk_engines.h"
#include "cuda/prefill/recurrent/recurrent_fwd.h"
#include "cuda/runtime/runtime.h"
#include "reference/reference.h"

#ifndef CULA_VERSION_STRING
#define CULA_VERSION_STRING "0.0.0"
#endif
#ifndef CULA_CUDA_ARCHS
#define CULA_CUDA_ARCHS ""
#endif

namespace cula {
namespace {

// One row of a dispatch table: which backend, on which device, runs what. Problem: what the op's
// validator returns (the recurrence; the gate op's shape).
template <typename Args, typename Problem = Recurrence>
struct Kernel {
  int32_t backend;
  int32_t device_type;
  const char* name;
  void (*run)(const Problem&, const Args&);
  // Why the row will not run the call (Refusal: AUTO tries the next row), or Refusal::takes(); no
  // predicate: the row takes every call of its device. Every backend-specific input rule lives
  // here, so the capability answer (explain) states it before anything runs.
  Refusal (*declines)(const Problem&, const Args&) = nullptr;
  // float32 arithmetic throughout (no bf16 tiles): the rows CULA_BACKEND_CUDA_FP32 selects
  bool float32_throughout = false;
};

// A predicate that names only why (the tensor-core engines'), as a refusal of kind Unsupported.
template <typename Args, const char* (*Why)(const Recurrence&, const Args&)>
Refusal cannot(const Recurrence& r, const Args& a) {
  const char* why = Why(r, a);
  return why ? Refusal::unsupported(why) : Refusal::takes();
}

// float64 inputs ask for float64 arithmetic: AUTO sends them to the reference, not the float32 path.
template <typename Args>
Refusal float64_inputs(const Recurrence& r, const Args&) {
  return r.q.t->dtype == CULA_FLOAT64 ? Refusal::prefers("float64 inputs (the float64 reference takes them)") : Refusal::takes();
}

// The gate op: its CUDA kernel reads g, A_log and dt_bias as contiguous tensors, the parameters as float32.
Refusal cuda_kda_gate_declines(const KdaGateShape&, const cula_kda_gate_args& a) {
  for (auto [t, name, fp32] : {std::tuple<const cula_tensor*, const char*, bool>{a.g, "g", false},
                               {a.A_log, "A_log", true}, {a.dt_bias, "dt_bias", true}}) {
    if (!t) continue;
    const bool dense = is_contiguous(*t);
    if (!dense || (fp32 && t->dtype != CULA_FLOAT32))
      return Refusal::bad_argument(name, fp32 ? "a contiguous float32 tensor for the CUDA kernel" : "a contiguous tensor for the CUDA kernel",
                                   describe(t) + (dense ? "" : " (a strided view)"));
  }
  return Refusal::takes();
}
void run_cuda_kda_gate(const KdaGateShape& s, const cula_kda_gate_args& a) { cuda_kda_gate(a, s.HV, s.K); }
void run_cpu_kda_gate(const KdaGateShape& s, const cula_kda_gate_args& a) { cpu_kda_gate(a, *a.g, s.HV, s.K); }

// The host decoders update a pool in place; with final_state_out they run on it, after the pool's
// first N rows (sequence n reads row n: no state_indices) are copied there, so the pool stays as it was.
template <void (*kDecoder)(const Recurrence&, const cula_decode_args&)>
void host_decode(const Recurrence& r, const cula_decode_args& a) {
  if (!a.final_state_out) return kDecoder(r, a);
  const size_t row = dtype_size(a.state_pool->dtype) * static_cast<size_t>(numel(*a.state_pool) / a.state_pool->shape[0]);
  std::memmove(a.final_state_out->data, a.state_pool->data, row * static_cast<size_t>(r.N));
  cula_decode_args b = a;
  b.state_pool = a.final_state_out;
  b.final_state_out = nullptr;
  kDecoder(r, b);
}

// Tables are ordered best first; AUTO takes the first row for the tensors' device.
const Kernel<cula_chunk_fwd_args> kChunkFwd[] = {
    {CULA_BACKEND_CUDA, CULA_CUDA, "cuda_fused", cuda_chunk_fwd_fused, cannot<cula_chunk_fwd_args, chunk_fwd_fused_declines>},
    {CULA_BACKEND_CUDA, CULA_CUDA, "cuda_mma", cuda_chunk_fwd_mma, cannot<cula_chunk_fwd_args, chunk_fwd_mma_declines>},
    {CULA_BACKEND_CUDA, CULA_CUDA, "cuda", cuda_recurrent_fwd, cuda_recurrent_fwd_declines, true},
    {CULA_BACKEND_CPU, CULA_CPU, "cpu", cpu_chunk_fwd, float64_inputs},
    {CULA_BACKEND_ORACLE, CULA_CPU, "reference", reference_chunk_fwd},
};
const Kernel<cula_decode_args> kDecode[] = {
    {CULA_BACKEND_CUDA, CULA_CUDA, "cuda", cuda_decode, cuda_decode_declines, true},
    {CULA_BACKEND_CPU, CULA_CPU, "cpu", host_decode<cpu_decode>, float64_inputs},
    {CULA_BACKEND_ORACLE, CULA_CPU, "reference", host_decode<reference_decode>},
};
const Kernel<cula_chunk_bwd_args> kChunkBwd[] = {
    {CULA_BACKEND_CUDA, CULA_CUDA, "cuda_chunk", cuda_chunk_bwd, cuda_chunk_bwd_declines},
    {CULA_BACKEND_CUDA, CULA_CUDA, "cuda", cuda_recurrent_bwd, cuda_recurrent_bwd_declines, true},
    {CULA_BACKEND_ORACLE, CULA_CPU, "reference", reference_chunk_bwd},
};
const Kernel<cula_kda_gate_args, KdaGateShape> kKdaGate[] = {
    {CULA_BACKEND_CUDA, CULA_CUDA, "cuda", run_cuda_kda_gate, cuda_kda_gate_declines, true},
    {CULA_BACKEND_CPU, CULA_CPU, "cpu", run_cpu_kda_gate},
    // (the CPU gate is elementwise in float64: it is its own reference)
    {CULA_BACKEND_ORACLE, CULA_CPU, "reference", run_cpu_kda_gate},
};
const Kernel<cula_cp_correct_args, CpCorrectShape> kCpCorrect[] = {
    {CULA_BACKEND_CUDA, CULA_CUDA, "cuda", cuda_cp_correct, cuda_cp_correct_declines},
    {CULA_BACKEND_CPU, CULA_CPU, "cpu", host_cp_correct},
    // (the host row sums in float64: it is its own reference)
    {CULA_BACKEND_ORACLE, CULA_CPU, "reference", host_cp_correct},
};

// What an op computes, for the "no kernel runs ..." error.
const char* problem_name(const Recurrence& r) { return r.tr.name; }
const char* problem_name(const KdaGateShape&) { return "the KDA gate"; }
const char* problem_name(const CpCorrectShape&) { return "the carried-state correction"; }

// The device of an op's tensors (validated to agree): the gate op has no q.
template <typename Args>
int32_t device_of(const Args& a) { return a.q->device_type; }
int32_t device_of(const cula_kda_gate_args& a) { return a.g->device_type; }
int32_t device_of(const cula_cp_correct_args& a) { return a.ow->device_type; }

const char* backend_name(int32_t b) {
  switch (b) {
    case CULA_BACKEND_ORACLE: return "ORACLE";
    case CULA_BACKEND_CPU: return "CPU";
    case CULA_BACKEND_CUDA: return "CUDA";
    case CULA_BACKEND_CUDA_FP32: return "CUDA_FP32";
    default: return "AUTO";
  }
}

// AUTO: the first row for the tensors' device that takes the call. An explicit backend: the first
// of its rows that takes the call, else its last row that only prefers another (float64 inputs on
// the CPU). When no row takes the call, the last refusal is its error (named argument, expected,
// given; or what is unsupported). Each row tried and declined adds "name: why" to declined.
template <typename Args, typename Problem, size_t N>
const Kernel<Args, Problem>* select(const Kernel<Args, Problem> (&table)[N], const char* op, const Problem& r,
                                    const Args& args, int32_t backend, int32_t device_type, std::string* declined = nullptr) {
  const Kernel<Args, Problem>* fallback = nullptr;
  Refusal last;
  for (const auto& k : table) {
    const bool mine = backend == CULA_BACKEND_AUTO        ? k.device_type == device_type
                      : backend == CULA_BACKEND_CUDA_FP32 ? k.backend == CULA_BACKEND_CUDA && k.float32_throughout
                                                          : k.backend == backend;
    if (!mine) continue;
    if (k.device_type != device_type)
      throw_arg(op, "backend", std::string("a backend for ") + (device_type == CULA_CUDA ? "CUDA" : "host") + " tensors",
                std::string(backend_name(backend)) + ", which runs on " + (k.device_type == CULA_CUDA ? "CUDA" : "host") + " tensors");
    const Refusal why = k.declines ? k.declines(r, args) : Refusal::takes();
    if (!why) return &k;
    if (declined) *declined += std::string(k.name) + ": " + why.reason() + "\n";
    if (why.kind == Refusal::Prefers && backend != CULA_BACKEND_AUTO) fallback = &k;
    if (why.kind != Refusal::Prefers) last = why;
  }
  if (fallback) return fallback;
  if (last) last.raise(op);
  throw_unsupported(op, std::string("no ") + backend_name(backend) + " kernel in this build runs " + problem_name(r) + " on " +
                            (device_type == CULA_CUDA ? "CUDA tensors yet; use host tensors (the CPU backend)"
                                                      : "host tensors"));
}

thread_local const char* g_last_kernel = "";
// The last explain call's answer on this thread (cula_explained_kernel, cula_explained_declines).
thread_local std::string g_explained_kernel, g_explained_declines;

enum class Entry { Run, Explain, Validate };

// An op's C entry: the arguments checked and validated, then the table's row for the call run
// (Run) or only named, with why each row before it declined (Explain); Validate stops after the
// checks (a host copy of device indices is validated so, without asking a kernel to take it).
template <typename Args, typename Problem, size_t N>
cula_status enter(const Kernel<Args, Problem> (&table)[N], const char* op, const char* args_type, const Args* args,
                  Problem (*validate)(const Args&), Entry what) {
  return guarded([&] {
    if (!args) throw_arg(op, "args", std::string("a pointer to ") + args_type, "NULL");
    const Problem r = validate(*args);
    if (what == Entry::Validate) return;
    if (what == Entry::Explain) {
      std::string declined;
      g_explained_kernel = select(table, op, r, *args, args->opt.backend, device_of(*args), &declined)->name;
      g_explained_declines = declined;
      return;
    }
    const Kernel<Args, Problem>* k = select(table, op, r, *args, args->opt.backend, device_of(*args));
    k->run(r, *args);
    g_last_kernel = k->name;
  });
}

template <typename Args, typename Problem, size_t N>
const char* first_name(const Kernel<Args, Problem> (&table)[N], int32_t device_type) {
  // The backend (not the kernel row: several rows may share one backend, see cula_last_kernel).
  for (const auto& k : table)
    if (k.device_type == device_type)
      return k.backend == CULA_BACKEND_CUDA ? "cuda" : k.backend == CULA_BACKEND_CPU ? "cpu" : "reference";
  return "none";
}

// Callers built before a field was appended pass the shorter struct (struct_size = the offset of
// that field): copied into a whole one whose later fields are NULL.
template <typename Args>
const Args* current_args(const Args* args, std::initializer_list<size_t> older_sizes, Args& full) {
  for (const size_t older_size : older_sizes)
    if (args && args->struct_size == older_size) {
      full = Args{};
      std::memcpy(&full, args, older_size);
      full.struct_size = sizeof(full);
      return &full;
    }
  return args;
}

// The C entries of the ops whose argument structs grew: the struct of an older caller completed
// (current_args), then enter().
cula_status fwd_entry(const cula_chunk_fwd_args* args, Entry what) {
  cula_chunk_fwd_args full;
  return enter(kChunkFwd, "chunk_fwd", "cula_chunk_fwd_args",
               current_args(args, {offsetof(cula_chunk_fwd_args, cu_seqlens_host), offsetof(cula_chunk_fwd_args, value_dim),
                                  offsetof(cula_chunk_fwd_args, segment_len)},
                            full), validate_chunk_fwd, what);
}

cula_status decode_entry(const cula_decode_args* args, Entry what) {
  cula_decode_args full;
  return enter(kDecode, "decode", "cula_decode_args",
               current_args(args, {offsetof(cula_decode_args, final_state_out)}, full), validate_decode, what);
}

cula_status bwd_entry(const cula_chunk_bwd_args* args, Entry what) {
  cula_chunk_bwd_args full;
  return enter(kChunkBwd, "chunk_bwd", "cula_chunk_bwd_args",
               current_args(args, {offsetof(cula_chunk_bwd_args, decay)}, full), validate_chunk_bwd, what);
}

}  // namespace
}  // namespace cula

using namespace cula;

extern "C" {

cula_status cula_chunk_fwd(const cula_chunk_fwd_args* args) { return fwd_entry(args, Entry::Run); }

cula_status cula_decode(const cula_decode_args* args) { return decode_entry(args, Entry::Run); }

cula_status cula_chunk_fwd_explain(const cula_chunk_fwd_args* args) { return fwd_entry(args, Entry::Explain); }

cula_status cula_decode_explain(const cula_decode_args* args) { return decode_entry(args, Entry::Explain); }

cula_status cula_chunk_fwd_validate(const cula_chunk_fwd_args* args) { return fwd_entry(args, Entry::Validate); }

cula_status cula_decode_validate(const cula_decode_args* args) { return decode_entry(args, Entry::Validate); }

const char* cula_explained_kernel(void) { return g_explained_kernel.c_str(); }
const char* cula_explained_declines(void) { return g_explained_declines.c_str(); }

cula_status cula_chunk_bwd(const cula_chunk_bwd_args* args) { return bwd_entry(args, Entry::Run); }

cula_status cula_chunk_bwd_explain(const cula_chunk_bwd_args* args) { return bwd_entry(args, Entry::Explain); }

cula_status cula_kda_gate(const cula_kda_gate_args* args) {
  return enter(kKdaGate, "kda_gate", "cula_kda_gate_args", args, validate_kda_gate, Entry::Run);
}

cula_status cula_kda_gate_explain(const cula_kda_gate_args* args) {
  return enter(kKdaGate, "kda_gate", "cula_kda_gate_args", args, validate_kda_gate, Entry::Explain);
}

cula_status cula_cp_correct(const cula_cp_correct_args* args) {
  return enter(kCpCorrect, "cp_correct", "cula_cp_correct_args", args, validate_cp_correct, Entry::Run);
}

cula_status cula_cp_correct_explain(const cula_cp_correct_args* args) {
  return enter(kCpCorrect, "cp_correct", "cula_cp_correct_args", args, validate_cp_correct, Entry::Explain);
}

const char* cula_last_error(void) { return last_error(); }
const char* cula_version(void) { return CULA_VERSION_STRING; }
int32_t cula_abi_version(void) { return CULA_ABI_VERSION; }

const char* cula_build_info(void) {
  static const std::string info = std::string("cula ") + CULA_VERSION_STRING + "; C++ " +
#if defined(__clang__)
                                  "clang " __clang_version__
#elif defined(__GNUC__)
                                  "gcc " __VERSION__
#else
                                  "unknown compiler"
#endif
                                  + "; CUDA architectures: " + CULA_CUDA_ARCHS + "; CPU kernels: " + cpu_isa();
  return info.c_str();
}

int32_t cula_cuda_device_count(void) { return cuda_device_count(); }

cula_status cula_cuda_device_info(int32_t device, char* buf, size_t buf_len) {
  return guarded([&] {
    std::string s;
    if (device < 0 || device >= cuda_device_count() || !cuda_device_info(device, s))
      throw_arg("cuda_device_info", "device", "an index below " + std::to_string(cuda_device_count()), std::to_string(device));
    if (buf && buf_len) {
      std::strncpy(buf, s.c_str(), buf_len - 1);
      buf[buf_len - 1] = 0;
    }
  });
}

const char* cula_backend_for(const char* op, int32_t device_type, int32_t family) {
  (void)family;
  const std::string o = op ? op : "";
  if (o == "chunk_fwd") return first_name(kChunkFwd, device_type);
  if (o == "decode") return first_name(kDecode, device_type);
  if (o == "chunk_bwd") return first_name(kChunkBwd, device_type);
  if (o == "kda_gate") return first_name(kKdaGate, device_type);
  if (o == "cp_correct") return first_name(kCpCorrect, device_type);
  return "none";
}

void cula_set_num_threads(int32_t n) { set_num_threads(n); }

const char* cula_last_kernel(void) { return g_last_kernel; }

int64_t cula_workspace_peak_bytes(int32_t device, int32_t reset) {
  int64_t bytes = 0;
  guarded([&] { bytes = cuda_workspace_peak_bytes(device, reset != 0); });
  return bytes;
}

}  // extern "C"
