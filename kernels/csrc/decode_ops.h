// The per-row computations of the decode path's ops, shared by decode.cpp (rms_norm, one op) and
// layer.cpp (a whole decoder layer in one call), so that both give the same bits. Plain C++ on
// float32 or bfloat16 storage, the arithmetic in float32. (Attention, which both run too, is each
// variant's Kernels::attend: decode_kernels.h.)
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace preload {

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) {  // the high half of a float32
  uint32_t bits = uint32_t(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// RMSNorm of rows [begin, end): weight * (x / sqrt(mean(x^2) + eps)), the normalisation rounded to
// T before the weight multiplies it.
template <typename T>
void norm_rows(const T* x, const T* weight, T* out, int64_t begin, int64_t end, int64_t width, int64_t x_stride,
               float eps) {
  constexpr int kLanes = 16;  // partial sums the compiler keeps in vector registers
  for (int64_t r = begin; r < end; ++r) {
    const T* row = x + r * x_stride;
    float partial[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= width; j += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        float v = widen(row[j + l]);
        partial[l] += v * v;
      }
    float sum = 0.0f;
    for (; j < width; ++j) sum += widen(row[j]) * widen(row[j]);
    for (int l = 0; l < kLanes; ++l) sum += partial[l];
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(width) + eps);
    T* dst = out + r * width;
    for (j = 0; j < width; ++j) dst[j] = static_cast<T>(widen(weight[j]) * widen(static_cast<T>(widen(row[j]) * scale)));
  }
}

}  // namespace preload
