// A weight's quantization (Kernels::quantize, for kernels/csrc/quantize.cpp's op): plain C++ loops
// that the compiler vectorizes, compiled twice by scripts/build_kernels.py: for AVX2 into
// quantize_avx2 (the avx2 variant's), with -DPRELOAD_AVX512 and AVX-512 flags into quantize_avx512
// (the other variants'). Both with -fno-trapping-math (no code here reads the FP flags): with traps
// kept, the compiler turned none of the per-element loops' clamps and selects into vector blends. A
// unit of its own, so that flag leaves the GEMV kernels' code as it was. Each row (or fp8_block's
// band of 128 rows) is read from the weight as stored, its scale found, and its elements written
// while it is in cache.
//
// The arithmetic is kernels/quant.py's torch code, operation for operation, in float32, so the bits
// are the same: scale = largest magnitude / the format's largest value (1 where that is 0), each
// element divided by it (not multiplied by its inverse) and rounded to nearest, ties to even: int8
// after a clamp to +-127, E4M3 by c10's rounding after a clamp to +-448, E2M1 to the nearest of 0,
// 0.5, 1, 1.5, 2, 3, 4, 6 (the even code at a tie, 6 past it; the sign is the input's sign bit). MX: a
// power-of-two E8M0 scale per 32 elements (the block's largest exponent less the element format's:
// e4m3 8, e2m1 2), multiplied in. NVFP4: an E4M3 scale per 16 elements of the block's largest
// magnitude / 6 / the global scale, divided out together with the global scale. Finite weights only.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "qgemv_kernels.h"
#include "qgemv_simd.h"

namespace preload {
namespace {

constexpr float kQuantE4M3Max = 448.0f, kQuantInt8Max = 127.0f, kQuantE2M1Max = 6.0f;
constexpr int64_t kQuantSpan = 4096;  // elements of a row widened to float32 at a time (16 KiB, in L1)

// src[0, count) as float32 into dst (a float32 source is read in place instead).
inline void widen(const uint16_t* src, int64_t count, float* dst) {  // bfloat16: the high half of a float32
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) vstore(dst + i, widen_bf16(src + i));
  for (; i < count; ++i) dst[i] = std::bit_cast<float>(static_cast<uint32_t>(src[i]) << 16);
}
struct Float16 {  // float16 bits (not _Float16, which g++ takes in C++ from version 12 only)
  uint16_t bits;
};
inline void widen(const Float16* src, int64_t count, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < count; ++i) dst[i] = _cvtsh_ss(src[i].bits);
}

inline Vec vabs(Vec v) {
#ifdef PRELOAD_AVX512
  return _mm512_abs_ps(v);
#else
  return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
#endif
}

inline float vmax_of(Vec v) {  // the largest lane
#ifdef PRELOAD_AVX512
  return _mm512_reduce_max_ps(v);
#else
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#endif
}

// The largest |value| of p[0, count).
inline float largest(const float* p, int64_t count) {
  Vec m0 = vzero(), m1 = vzero();
  int64_t i = 0;
  for (; i + 2 * kLanes <= count; i += 2 * kLanes) {
    m0 = vmax(m0, vabs(vload(p + i)));
    m1 = vmax(m1, vabs(vload(p + i + kLanes)));
  }
  for (; i + kLanes <= count; i += kLanes) m0 = vmax(m0, vabs(vload(p + i)));
  float amax = vmax_of(vmax(m0, m1));
  for (; i < count; ++i) amax = std::max(amax, std::fabs(p[i]));
  return amax;
}

// Whether every element of p[0, count) is finite: x - x is 0 for a finite x and NaN for an infinity
// or a NaN, and a NaN stays in a sum. (The weight's one check for them, where its largest magnitude
// is not needed before it is quantized.) Four sums: with one, each add waited on the one before.
inline bool all_finite(const float* p, int64_t count) {
  const Vec minus = vset(-1.0f);
  Vec s0 = vzero(), s1 = vzero(), s2 = vzero(), s3 = vzero();
  int64_t i = 0;
  for (; i + 4 * kLanes <= count; i += 4 * kLanes) {
    const Vec x0 = vload(p + i), x1 = vload(p + i + kLanes), x2 = vload(p + i + 2 * kLanes),
              x3 = vload(p + i + 3 * kLanes);
    s0 = vadd(s0, vfma(x0, minus, x0));
    s1 = vadd(s1, vfma(x1, minus, x1));
    s2 = vadd(s2, vfma(x2, minus, x2));
    s3 = vadd(s3, vfma(x3, minus, x3));
  }
  for (; i + kLanes <= count; i += kLanes) {
    const Vec x = vload(p + i);
    s0 = vadd(s0, vfma(x, minus, x));
  }
  float rest = vsum(vadd(vadd(s0, s1), vadd(s2, s3)));
  for (; i < count; ++i) rest += p[i] - p[i];
  return rest == 0.0f;
}

// c10's float -> E4M3 rounding (c10::detail::fp8e4m3fn_from_fp32_value) without its branches, so that
// it vectorizes; |f| <= 448 (clamped before), so the result is never NaN.
inline uint8_t e4m3_code(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (bits >> 24) & 0x80u, a = bits & 0x7fffffffu;
  constexpr uint32_t kDenormMask = 141u << 23;  // below 2^-6 this sum rounds to the subnormal's code
  const uint32_t subnormal =
      std::bit_cast<uint32_t>(std::bit_cast<float>(a) + std::bit_cast<float>(kDenormMask)) - kDenormMask;
  const uint32_t normal = (a + (uint32_t(7 - 127) << 23) + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  return static_cast<uint8_t>((a < (121u << 23) ? subnormal : normal) | sign);
}

inline uint8_t e2m1_code(float v) {
  const float a = std::fabs(v);
  const int code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return static_cast<uint8_t>(code | (std::signbit(v) ? 8 : 0));
}

inline float clamped(float v, float limit) { return std::min(std::max(v, -limit), limit); }

// torch's round then clamp to +-127: rounding is monotonic and +-127 are integers, so clamping first
// is the same; then adding and taking away 1.5 * 2^23 rounds to nearest, ties to even.
inline uint8_t int8_code(float v) {
  constexpr float kRound = 12582912.0f;
  const float c = clamped(v, kQuantInt8Max);
  return static_cast<uint8_t>(static_cast<int8_t>(static_cast<int32_t>((c + kRound) - kRound)));
}

inline float clamp_e4m3(float v) { return clamped(v, kQuantE4M3Max); }
inline float scale_of(float amax, float limit) {  // 1 where the quotient is 0 (kernels/quant.py's _scale_of)
  const float scale = amax / limit;
  return scale > 0.0f ? scale : 1.0f;
}

// p[0, count), each divided by `scale`, into int8 or E4M3 codes.
inline void divided(const float* p, int64_t count, float scale, Element element, uint8_t* out) {
  if (element == kInt8) {
    for (int64_t i = 0; i < count; ++i) out[i] = int8_code(p[i] / scale);
  } else {
    for (int64_t i = 0; i < count; ++i) out[i] = e4m3_code(clamp_e4m3(p[i] / scale));
  }
}

// Row r's elements [start, start + count) as float32: in place, or widened into `buffer`.
template <typename T>
const float* row_span(const QuantizeJob& job, const T* w, int64_t r, int64_t start, int64_t count, float* buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return w + r * job.stride + start;
  } else {
    widen(w + r * job.stride + start, count, buffer);
    return buffer;
  }
}

// The largest |value| of row r, max-ed into *amax; whether every element of it is finite.
template <typename T>
bool row_largest(const QuantizeJob& job, const T* w, int64_t r, float* buffer, float* amax) {
  bool finite = true;
  for (int64_t at = 0; at < job.k; at += kQuantSpan) {
    const int64_t count = std::min(kQuantSpan, job.k - at);
    const float* p = row_span(job, w, r, at, count, buffer);
    finite &= all_finite(p, count);
    *amax = std::max(*amax, largest(p, count));
  }
  return finite;
}

// The largest value of FP8 per row or per tensor, and of int8.
inline float row_limit(const QuantizeJob& job) { return job.element == kInt8 ? kQuantInt8Max : kQuantE4M3Max; }

// Each of these returns whether every element it read was finite (FP8 per tensor: not looked at;
// its caller found the weight's largest magnitude, and so that, first).
template <typename T>
bool rows_scaled(const QuantizeJob& job, const T* w, int64_t begin, int64_t end, float* buffer) {
  float* scales = static_cast<float*>(job.scale);
  bool finite = true;
  for (int64_t r = begin; r < end; ++r) {
    float scale = job.tensor_scale;
    if (job.kind == kPerRow) {
      float amax = 0.0f;
      finite &= row_largest(job, w, r, buffer, &amax);
      scales[r] = scale = scale_of(amax, row_limit(job));
    }
    for (int64_t at = 0; at < job.k; at += kQuantSpan) {
      const int64_t count = std::min(kQuantSpan, job.k - at);
      divided(row_span(job, w, r, at, count, buffer), count, scale, job.element, job.weight + r * job.k + at);
    }
  }
  return finite;
}

// fp8_block: rows [band * 128, ...) as one band of 128x128 blocks.
template <typename T>
bool band_scaled(const QuantizeJob& job, const T* w, int64_t band, float* buffer) {
  constexpr int64_t kSide = 128;
  const int64_t blocks = (job.k + kSide - 1) / kSide;
  const int64_t first = band * kSide, last = std::min(job.n, first + kSide);
  float* scales = static_cast<float*>(job.scale) + band * blocks;
  std::fill(scales, scales + blocks, 0.0f);
  bool finite = true;
  for (int64_t r = first; r < last; ++r)
    for (int64_t at = 0; at < job.k; at += kQuantSpan) {
      const int64_t count = std::min(kQuantSpan, job.k - at);
      const float* p = row_span(job, w, r, at, count, buffer);
      finite &= all_finite(p, count);
      for (int64_t b = at / kSide; b * kSide < at + count; ++b)
        scales[b] = std::max(scales[b], largest(p + b * kSide - at, std::min(kSide, job.k - b * kSide)));
    }
  for (int64_t b = 0; b < blocks; ++b) scales[b] = scale_of(scales[b], kQuantE4M3Max);
  for (int64_t r = first; r < last; ++r)
    for (int64_t at = 0; at < job.k; at += kQuantSpan) {
      const int64_t count = std::min(kQuantSpan, job.k - at);
      const float* p = row_span(job, w, r, at, count, buffer);
      for (int64_t b = at / kSide; b * kSide < at + count; ++b)
        divided(p + b * kSide - at, std::min(kSide, job.k - b * kSide), scales[b], job.element,
                job.weight + r * job.k + b * kSide);
    }
  return finite;
}

// MX's shared exponent of a block whose largest magnitude is amax: floor(log2(amax)) - emax, from the
// float's exponent field (a subnormal or zero amax gives -127, as frexp's exponent would after the
// clamp), and the power of two 2^-shared that scales the block (2^-127 is a subnormal).
inline int shared_exponent(float amax, int emax) {
  const int field = static_cast<int>(std::bit_cast<uint32_t>(amax) >> 23);
  return field ? std::clamp(field - 127 - emax, -127, 127) : -127;
}
inline float power_of_two(int exponent) {  // -127 <= exponent <= 127
  return std::bit_cast<float>(exponent > -127 ? static_cast<uint32_t>(exponent + 127) << 23 : 0x00400000u);
}

// The exact value of a non-negative E4M3 code (0 to 0x7E): 2^(e - 7) * (1 + m/8), or m * 2^-9 for the
// subnormals (exponent field 0), made from its bits so that a loop of them vectorizes.
inline float e4m3_float(uint8_t code) {
  const uint32_t e = code >> 3, m = code & 7u;
  return e ? std::bit_cast<float>(((e + 120u) << 23) | (m << 20)) : static_cast<float>(m) * 0x1p-9f;
}

// NVFP4: each of `count` blocks' E4M3 scale code, of its largest magnitude / 6 / the global scale,
// and that code's value times the global scale, by which the block's elements are divided (0 for a
// block of zeros). A loop over a span's blocks, which the compiler vectorizes: a block at a time,
// the scalar chain of each (two divisions among it) had bound NVFP4's quantization. (MX's shared
// exponent is a few integer operations: there a block at a time was faster, 7-9%.)
inline void nvfp4_scales(const float* amax, int64_t count, float tensor_scale, uint8_t* codes, float* divisors) {
  for (int64_t b = 0; b < count; ++b) {
    const uint8_t code = e4m3_code(std::min(amax[b] / kQuantE2M1Max / tensor_scale, kQuantE4M3Max));
    codes[b] = code;
    divisors[b] = e4m3_float(code) * tensor_scale;
  }
}

// MX (kBlock 32) and NVFP4 (kBlock 16): each row's blocks along K, the last zero-padded. A span of a
// row at a time: its blocks' scales (NVFP4's all first: nvfp4_scales), their elements scaled into
// `scaled`, then the whole span's elements encoded in one loop (in loops of one block the compiler
// vectorized the encoding of none).
template <int64_t kBlock, typename T>
bool rows_microscaled(const QuantizeJob& job, const T* w, int64_t begin, int64_t end, float* buffer,
                      float* scaled) {
  constexpr int64_t kSpanBlocks = kQuantSpan / kBlock;
  const int64_t blocks = (job.k + kBlock - 1) / kBlock;
  const bool fp4 = job.element == kE2M1;
  const int emax = fp4 ? 2 : 8;
  alignas(64) float padded[kBlock], amax[kSpanBlocks], divisors[kSpanBlocks];
  bool finite = true;
  for (int64_t r = begin; r < end; ++r) {
    uint8_t* out = job.weight + r * (fp4 ? blocks * kBlock / 2 : blocks * kBlock);
    uint8_t* scales = static_cast<uint8_t*>(job.scale) + r * blocks;
    for (int64_t at = 0; at < job.k; at += kQuantSpan) {  // kQuantSpan is whole blocks
      const int64_t count = std::min(kQuantSpan, job.k - at), stored = (count + kBlock - 1) / kBlock * kBlock;
      const float* span = row_span(job, w, r, at, count, buffer);
      finite &= all_finite(span, count);
      const int64_t whole = count / kBlock, used = stored / kBlock;
      if (whole < used)
        std::fill(std::copy(span + whole * kBlock, span + count, padded), padded + kBlock, 0.0f);
      const auto block = [&](int64_t b) { return b < whole ? span + b * kBlock : padded; };
      if constexpr (kBlock == 16) {
        for (int64_t b = 0; b < used; ++b) amax[b] = largest(block(b), kBlock);
        nvfp4_scales(amax, used, job.tensor_scale, scales + at / kBlock, divisors);
      }
      for (int64_t b = 0; b < used; ++b) {
        const float* p = block(b);
        float* q = scaled + b * kBlock;
        // (Whole registers: the compiler's loop of 16 stored a block in pieces of 4, 2 and 1 floats,
        // which the encoding's wide loads then waited on.)
        if constexpr (kBlock == 32) {
          const int shared = shared_exponent(largest(p, kBlock), emax);
          scales[at / kBlock + b] = static_cast<uint8_t>(shared + 127);
          const Vec multiplier = vset(power_of_two(-shared));
          for (int64_t i = 0; i < kBlock; i += kLanes) vstore(q + i, vmul(vload(p + i), multiplier));
        } else {
          const Vec divisor = vset(divisors[b]);
          for (int64_t i = 0; i < kBlock; i += kLanes)
            vstore(q + i, divisors[b] > 0.0f ? vdiv(vload(p + i), divisor) : vzero());
        }
      }
      if (fp4) {
        uint8_t* packed = out + at / 2;
        for (int64_t i = 0; i < stored / 2; ++i)
          packed[i] = static_cast<uint8_t>(e2m1_code(scaled[2 * i]) | (e2m1_code(scaled[2 * i + 1]) << 4));
      } else {
        for (int64_t i = 0; i < stored; ++i) out[at + i] = e4m3_code(clamp_e4m3(scaled[i]));
      }
    }
  }
  return finite;
}

template <typename T>
bool quantize_typed(const QuantizeJob& job, const T* w, int64_t begin, int64_t end) {
  alignas(64) float buffer[kQuantSpan], scaled[kQuantSpan];
  if (job.kind == kBlock128) {
    bool finite = true;
    for (int64_t band = begin; band < end; ++band) finite &= band_scaled(job, w, band, buffer);
    return finite;
  }
  if (job.kind == kPerTensor || job.kind == kPerRow) return rows_scaled(job, w, begin, end, buffer);
  if (job.block == 16) return rows_microscaled<16>(job, w, begin, end, buffer, scaled);
  return rows_microscaled<32>(job, w, begin, end, buffer, scaled);
}

// f(the job's weight as the type it is stored in).
template <typename F>
bool as_stored(const QuantizeJob& job, F&& f) {
  if (job.source == kSourceFloat32) return f(static_cast<const float*>(job.w));
  if (job.source == kSourceBFloat16) return f(static_cast<const uint16_t*>(job.w));
  return f(static_cast<const Float16*>(job.w));
}

bool quantize_rows(const QuantizeJob& job, int64_t begin, int64_t end) {
  return as_stored(job, [&](const auto* w) { return quantize_typed(job, w, begin, end); });
}

// FP8 per tensor's scale or NVFP4's global one, which span the weight: its largest magnitude / the
// format's largest value (NVFP4: 448 x 6), 1 where that is 0, into *scale; whether every element is
// finite.
template <typename T>
bool tensor_scale_typed(const QuantizeJob& job, const T* w, float* scale) {
  alignas(64) float buffer[kQuantSpan];
  bool finite = true;
  float amax = 0.0f;
  for (int64_t r = 0; r < job.n; ++r) finite &= row_largest(job, w, r, buffer, &amax);
  *scale = scale_of(amax, job.kind == kE4M3Per16 ? kQuantE4M3Max * kQuantE2M1Max : row_limit(job));
  return finite;
}

bool tensor_scale_of(const QuantizeJob& job, float* scale) {
  return as_stored(job, [&](const auto* w) { return tensor_scale_typed(job, w, scale); });
}

}  // namespace

#ifdef PRELOAD_AVX512
bool quantize_avx512(const QuantizeJob& job, int64_t begin, int64_t end) { return quantize_rows(job, begin, end); }
bool tensor_scale_avx512(const QuantizeJob& job, float* scale) { return tensor_scale_of(job, scale); }
#else
bool quantize_avx2(const QuantizeJob& job, int64_t begin, int64_t end) { return quantize_rows(job, begin, end); }
bool tensor_scale_avx2(const QuantizeJob& job, float* scale) { return tensor_scale_of(job, scale); }
#endif

}  // namespace preload
