#include "common/tensor.h"

#include <cmath>
#include <sstream>

namespace cula {

float half_to_float(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1u, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    v = mant ? NAN : INFINITY;
  } else {
    v = std::ldexp(static_cast<float>(mant | 0x400u), static_cast<int>(exp) - 25);
  }
  return sign ? -v : v;
}

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (ax < 0x38800000u) {                                               // subnormal or zero
    const float a = std::fabs(f);
    const float m = std::nearbyint(a * 16777216.0f);  // units of 2^-24, round to even
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(m));
  }
  uint32_t r = ax - 0x38000000u;  // rebias exponent
  r += 0xfffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}

size_t dtype_size(int32_t dtype) { return static_cast<size_t>(dtype & 0xff) / 8; }

const char* dtype_name(int32_t dtype) {
  switch (dtype) {
    case CULA_INT32: return "int32";
    case CULA_INT64: return "int64";
    case CULA_FLOAT16: return "float16";
    case CULA_FLOAT32: return "float32";
    case CULA_FLOAT64: return "float64";
    case CULA_BFLOAT16: return "bfloat16";
    default: return "unknown dtype";
  }
}

bool is_float_dtype(int32_t dtype) {
  return dtype == CULA_FLOAT16 || dtype == CULA_FLOAT32 || dtype == CULA_FLOAT64 || dtype == CULA_BFLOAT16;
}

int64_t numel(const cula_tensor& t) {
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  return n;
}

bool is_contiguous(const cula_tensor& t) {
  int64_t expected = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.shape[i] != 1 && t.strides[i] != expected) return false;
    expected *= t.shape[i];
  }
  return true;
}

std::string shape_string(const cula_tensor& t) {
  if (t.ndim < 0 || t.ndim > CULA_MAX_DIMS) return "of rank " + std::to_string(t.ndim);  // messages about bad input
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < t.ndim; ++i) os << (i ? ", " : "") << t.shape[i];
  os << "]";
  return os.str();
}

std::string describe(const cula_tensor* t) {
  if (!t) return "nothing (None)";
  std::ostringstream os;
  os << dtype_name(t->dtype) << " tensor of shape " << shape_string(*t) << " on "
     << (t->device_type == CULA_CUDA ? "cuda:" + std::to_string(t->device_id)
                                     : t->device_type == CULA_CPU ? std::string("cpu")
                                                                  : "device type " + std::to_string(t->device_type));
  return os.str();
}

template <typename T>
static void gather_impl(const cula_tensor& t, T* dst) {
  const int64_t n = numel(t);
  int64_t idx[CULA_MAX_DIMS] = {0};
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = 0;
    for (int d = 0; d < t.ndim; ++d) off += idx[d] * t.strides[d];
    dst[i] = static_cast<T>(load_as_double(t.data, t.dtype, off));
    for (int d = t.ndim - 1; d >= 0; --d) {
      if (++idx[d] < t.shape[d]) break;
      idx[d] = 0;
    }
  }
}

void gather(const cula_tensor& t, float* dst) { gather_impl(t, dst); }
void gather(const cula_tensor& t, double* dst) { gather_impl(t, dst); }

}  // namespace cula
