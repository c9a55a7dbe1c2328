// Tensor views over cula_tensor: dtype conversion, element offsets, description strings.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cula/cula.h"

namespace cula {

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, NaN kept a NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float half_to_float(uint16_t h);
uint16_t float_to_half(float f);

size_t dtype_size(int32_t dtype);
const char* dtype_name(int32_t dtype);
bool is_float_dtype(int32_t dtype);

inline double load_as_double(const void* base, int32_t dtype, int64_t off) {
  switch (dtype) {
    case CULA_FLOAT32: return static_cast<const float*>(base)[off];
    case CULA_FLOAT64: return static_cast<const double*>(base)[off];
    case CULA_BFLOAT16: return bf16_to_float(static_cast<const uint16_t*>(base)[off]);
    case CULA_FLOAT16: return half_to_float(static_cast<const uint16_t*>(base)[off]);
    case CULA_INT32: return static_cast<const int32_t*>(base)[off];
    case CULA_INT64: return static_cast<double>(static_cast<const int64_t*>(base)[off]);
    default: return 0.0;
  }
}

inline void store_from_double(void* base, int32_t dtype, int64_t off, double v) {
  switch (dtype) {
    case CULA_FLOAT32: static_cast<float*>(base)[off] = static_cast<float>(v); break;
    case CULA_FLOAT64: static_cast<double*>(base)[off] = v; break;
    case CULA_BFLOAT16: static_cast<uint16_t*>(base)[off] = float_to_bf16(static_cast<float>(v)); break;
    case CULA_FLOAT16: static_cast<uint16_t*>(base)[off] = float_to_half(static_cast<float>(v)); break;
    case CULA_INT32: static_cast<int32_t*>(base)[off] = static_cast<int32_t>(v); break;
    case CULA_INT64: static_cast<int64_t*>(base)[off] = static_cast<int64_t>(v); break;
    default: break;
  }
}

inline int64_t load_index(const cula_tensor& t, int64_t off) {
  return t.dtype == CULA_INT64 ? static_cast<const int64_t*>(t.data)[off]
                               : static_cast<const int32_t*>(t.data)[off];
}

// Read-only strided view. Indexing is by up to CULA_MAX_DIMS coordinates.
struct View {
  const cula_tensor* t = nullptr;
  View() = default;
  explicit View(const cula_tensor* tensor) : t(tensor) {}
  explicit operator bool() const { return t != nullptr; }
  int64_t off(int64_t i0) const { return i0 * t->strides[0]; }
  int64_t off(int64_t i0, int64_t i1) const { return i0 * t->strides[0] + i1 * t->strides[1]; }
  int64_t off(int64_t i0, int64_t i1, int64_t i2) const {
    return i0 * t->strides[0] + i1 * t->strides[1] + i2 * t->strides[2];
  }
  int64_t off(int64_t i0, int64_t i1, int64_t i2, int64_t i3) const {
    return i0 * t->strides[0] + i1 * t->strides[1] + i2 * t->strides[2] + i3 * t->strides[3];
  }
  int64_t off(int64_t i0, int64_t i1, int64_t i2, int64_t i3, int64_t i4) const {
    return off(i0, i1, i2, i3) + i4 * t->strides[4];
  }
  template <typename... I>
  double at(I... idx) const {
    return load_as_double(t->data, t->dtype, off(static_cast<int64_t>(idx)...));
  }
  // Element i in logical order of a contiguous tensor of any rank (a per-channel dt_bias is
  // [HV*K] or [HV, K]; at(i) would step by the first dimension's stride).
  double flat(int64_t i) const { return load_as_double(t->data, t->dtype, i); }
  // n elements starting at offset `base`, `stride` apart, converted to R (dtype switch hoisted).
  template <typename R>
  void row(int64_t base, int64_t n, int64_t stride, R* dst) const {
    const void* p = t->data;
    switch (t->dtype) {
      case CULA_FLOAT32:
        for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<R>(static_cast<const float*>(p)[base + i * stride]);
        break;
      case CULA_BFLOAT16:
        for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<R>(bf16_to_float(static_cast<const uint16_t*>(p)[base + i * stride]));
        break;
      case CULA_FLOAT64:
        for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<R>(static_cast<const double*>(p)[base + i * stride]);
        break;
      default:
        for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<R>(load_as_double(p, t->dtype, base + i * stride));
    }
  }
  template <typename... I>
  void set(double v, I... idx) const {
    store_from_double(t->data, t->dtype, off(static_cast<int64_t>(idx)...), v);
  }
};

int64_t numel(const cula_tensor& t);
bool is_contiguous(const cula_tensor& t);
std::string shape_string(const cula_tensor& t);
// "bf16 tensor of shape [2, 8, 4, 64] on cuda:0"
std::string describe(const cula_tensor* t);

// Copies a tensor to a contiguous float (or double) host buffer in its logical order.
void gather(const cula_tensor& t, float* dst);
void gather(const cula_tensor& t, double* dst);

}  // namespace cula
