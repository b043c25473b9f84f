// The per-row computations of the decode path's ops, shared by decode.cpp (rms_norm and
// decode_attention, one op each) and layer.cpp (a whole decoder layer in one call), so that both
// give the same bits. Plain C++ on float32 or bfloat16 storage, the arithmetic in float32.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

// What attend works in: reserved by the caller for `group` heads, `length` positions and `d`
// dimensions, it allocates nothing (so it cannot throw inside an OpenMP region).
struct AttendScratch {
  std::vector<float> scores, query, sum, key;
  void reserve(int64_t group, int64_t length, int64_t d) {
    scores.reserve(group * length), query.reserve(group * d), sum.reserve(group * d), key.reserve(d);
  }
};

// Query heads [h0, h0 + group) of row b, which all read kv head j: out[b, h] = softmax(q.K^T *
// scale) V over positions [0, length).
template <typename T>
void attend(const T* q, const T* cache, T* out, int64_t b, int64_t j, int64_t group, int64_t slot, int64_t length,
            int64_t heads, int64_t kv_heads, int64_t d, int64_t position_stride, int64_t slot_stride, float scale,
            AttendScratch& scratch) {
  std::vector<float>&scores = scratch.scores, &query = scratch.query, &sum = scratch.sum, &key = scratch.key;
  scores.assign(group * length, 0.0f);
  query.resize(group * d);
  sum.assign(group * d, 0.0f);
  key.resize(d);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t e = 0; e < d; ++e) query[g * d + e] = widen(q[(b * heads + j * group + g) * d + e]);
  const T* keys = cache + slot * slot_stride + j * d;           // [length] rows, position_stride apart
  const T* values = keys + kv_heads * d;                        // the value half of each position
  constexpr int kLanes = 8;  // partial sums the compiler keeps in vector registers
  for (int64_t s = 0; s < length; ++s) {
    const T* row = keys + s * position_stride;
    for (int64_t e = 0; e < d; ++e) key[e] = widen(row[e]);  // widened once for the group's heads
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = query.data() + g * d;
      float partial[kLanes] = {};
      int64_t e = 0;
      for (; e + kLanes <= d; e += kLanes)
        for (int l = 0; l < kLanes; ++l) partial[l] += qg[e + l] * key[e + l];
      float dot = 0.0f;
      for (; e < d; ++e) dot += qg[e] * key[e];
      for (int l = 0; l < kLanes; ++l) dot += partial[l];
      scores[g * length + s] = dot * scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores.data() + g * length;
    const float top = *std::max_element(row, row + length);
    float total = 0.0f;
    for (int64_t s = 0; s < length; ++s) total += (row[s] = std::exp(row[s] - top));
    const float inverse = 1.0f / total;
    for (int64_t s = 0; s < length; ++s) row[s] *= inverse;
  }
  std::vector<float>& value = key;
  for (int64_t s = 0; s < length; ++s) {
    const T* row = values + s * position_stride;
    for (int64_t e = 0; e < d; ++e) value[e] = widen(row[e]);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * length + s];
      float* acc = sum.data() + g * d;
      for (int64_t e = 0; e < d; ++e) acc[e] += p * value[e];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t e = 0; e < d; ++e) out[(b * heads + j * group + g) * d + e] = static_cast<T>(sum[g * d + e]);
}

}  // namespace preload
