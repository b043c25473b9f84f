// The vector layer of the quantized GEMV kernels (qgemv_kernels.cpp; quantize_kernels.cpp uses a few
// of its pieces): registers of 8 (AVX2) or 16 (AVX-512, with -DPRELOAD_AVX512) floats, the element
// decoders that fill them, the scale lookups, and bfloat16 rounding. Everything here is inline, in an
// unnamed namespace: each compilation gets its own copy, compiled for its instruction set.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>

#include "qgemv_kernels.h"

namespace preload {
namespace {

#ifdef PRELOAD_AVX512
using Vec = __m512;
constexpr int kLanes = 16;
constexpr int kAccumulators = 16;  // of 32 registers
constexpr int kMaxM = 4;           // activation rows per pass (kernels/linear.py takes GEMM for more)
constexpr int64_t kPassXBytes = INT64_MAX;  // never split (see the AVX2 one; not measured here)
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset(float v) { return _mm512_set1_ps(v); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vmin(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
template <int kImm>  // within each 128-bit lane: 2 lanes of a, 2 of b, as kImm picks
inline Vec vshuffle(Vec a, Vec b) { return _mm512_shuffle_ps(a, b, kImm); }
#else
using Vec = __m256;
constexpr int kLanes = 8;
constexpr int kAccumulators = 8;   // of 16 registers: the rest decode
constexpr int kMaxM = 8;           // activation rows per pass: more take more passes
// A pass of more than kMaxM / 2 rows of x whose float32 rows outgrow this (the L1 data cache) runs
// as passes of kMaxM / 2 instead, for weights with one scale per row (bfloat16, int8, FP8 per
// tensor or channel): with 8 rows the kernels read one weight row at a time and load x once per
// multiply-add, from L2 once x is out of L1, while 4 rows take two weight rows per load of x. The
// block-scaled schemes keep one pass: they would decode each weight twice (`preload bench quant`,
// 4096x4096, 8 rows: NVFP4 3.65 -> 4.59 ms split, MXFP4 3.53 -> 3.83, FP8 blocks and MXFP8 +4%;
// bfloat16 4.20 -> 3.14, int8 3.70 -> 2.92, FP8 per channel 3.65 -> 3.33).
// Rows of x x K, one thread, int8 unless said (2-core Zen 2, weights streamed from memory, best of 30):
// 8 x 1536 (48 KiB, the default model's down projection at 8 sequences) 326-337 -> 289-298 us,
// bfloat16 378 -> 301; 8 x 4096 1892 -> 1454; 8 x 1152 448 -> 392. With x in L1 one pass is
// faster: 8 x 1024 (32 KiB) 264 against 346 split, 8 x 576 465 against 598. At 5-7 rows of 36-42
// KiB the split is about even (int8 a little slower, bfloat16 faster), at 5-7 rows of 4096 10-20%
// faster.
constexpr int64_t kPassXBytes = int64_t(32) << 10;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float v) { return _mm256_set1_ps(v); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vmin(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
template <int kImm>  // within each 128-bit lane: 2 lanes of a, 2 of b, as kImm picks
inline Vec vshuffle(Vec a, Vec b) { return _mm256_shuffle_ps(a, b, kImm); }
#endif

// The sums of kLanes registers as one register, lane i that of r[i], each bit for bit vsum's (the
// same pairs added in the same order: halves, quarters, pairs of lanes, lanes), in a transposing tree
// of 2 shuffles and an add a step: on AVX-512 45 instructions against ~130 for 16 vsums, and no
// scalar stores. For a GEMV's last step over short rows (K = 576: 16 sums after 288 dot products at
// 8 rows of x) and attention's scores.
inline Vec lane_sums(const Vec* r) {
#ifdef PRELOAD_AVX512
  // The tree leaves the sum of register k + 4e in lane 4k + e: fed transposed, lane i gets r[i]'s.
  auto in = [r](int x) { return r[4 * (x % 4) + x / 4]; };
  Vec halves[8], quarters[4], pairs[2];
  for (int i = 0; i < 8; ++i) {
    const Vec a = in(2 * i), b = in(2 * i + 1);
    halves[i] = vadd(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    const Vec a = halves[2 * i], b = halves[2 * i + 1];
    quarters[i] = vadd(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    const __m512d a = _mm512_castps_pd(quarters[2 * i]), b = _mm512_castps_pd(quarters[2 * i + 1]);
    pairs[i] = vadd(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
#else
  // The tree leaves the sum of register h + 2e in lane 4h + e: fed transposed, lane i gets r[i]'s.
  auto in = [r](int x) { return r[4 * (x % 2) + x / 2]; };
  Vec halves[4], pairs[2];
  for (int i = 0; i < 4; ++i) {
    const Vec a = in(2 * i), b = in(2 * i + 1);
    halves[i] = vadd(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  for (int i = 0; i < 2; ++i) {
    const __m256d a = _mm256_castps_pd(halves[2 * i]), b = _mm256_castps_pd(halves[2 * i + 1]);
    pairs[i] = vadd(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
#endif
  return vadd(vshuffle<0x88>(pairs[0], pairs[1]), vshuffle<0xDD>(pairs[0], pairs[1]));
}

// Outputs of a step from which put_outputs_bf16 rounds them in registers (fewer: to_bf16 each).
constexpr int kVectorOutputs = 4;

// Floats an array of N sums takes when whole registers write it (vsums) and read it (put_outputs_bf16).
template <int N>
constexpr int kPadded = (N + kLanes - 1) / kLanes * kLanes;

// out[i] = vsum(r[i]) for i < N, bit for bit: lane_sums for 4 or more, whole registers (out holds
// kPadded<N> floats then, 0 past N), which put_outputs_bf16 reads back as they were stored.
template <int N>
inline void vsums(const Vec* r, float* out) {
  if constexpr (N < 4) {
    for (int i = 0; i < N; ++i) out[i] = vsum(r[i]);
  } else {
    for (int i0 = 0; i0 < N; i0 += kLanes) {
      Vec group[kLanes];
      for (int i = 0; i < kLanes; ++i) group[i] = i0 + i < N ? r[i0 + i] : vzero();
      vstore(out + i0, lane_sums(group));
    }
  }
}

constexpr int kChunk = 32;               // elements decoded per step; a 16-element tail after the last
constexpr int kVecs = kChunk / kLanes;   // registers a chunk fills
constexpr int kHalf = kVecs / 2;         // registers 16 elements fill

inline int64_t lesser(int64_t a, int64_t b) { return a < b ? a : b; }

// f.template operator()<i>() for i = 0 .. N - 1, each with its own constant i: accumulators indexed
// by a loop counter that the compiler does not unroll live on the stack, a store and a load per step.
template <int N, typename F>
[[gnu::always_inline]] inline void unrolled(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    (f.template operator()<I>(), ...);
  }(std::make_integer_sequence<int, N>{});
}

// e4m3 bits s.eeee.mmm become the float16 s.0eeee.mmm0000000, which reads as the e4m3 value times
// 2^-8 (the biases differ by 8), subnormals included; the 2^8 goes into the scale (kFactor). From the
// sign-extended byte, a shift by 7 leaves the sign in bits 15 and 14: the mask clears bit 14.
inline __m256i e4m3_as_f16(__m128i bytes) {
  return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7), _mm256_set1_epi16(int16_t(0xBFFF)));
}

#ifdef PRELOAD_AVX512
// The scales of blocks [b, b + 16) of row n (MX's, or NVFP4's times its global scale) as one register,
// for the GEMVs of qgemv_bf16dot.h and qgemv_e2m1_int16.h; where the row has fewer left, the codes
// past its end read as 0 (masked off: never read), and their lanes are never used.
inline __m512 scales16(const Weight& w, int64_t n, int64_t b) {
  const uint8_t* codes = static_cast<const uint8_t*>(w.scale) + n * w.scale_cols + b;
  const int64_t left = w.scale_cols - b;
  const __m128i bytes = left >= 16 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))
                                   : _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << left) - 1), codes);
  if (w.kind == kE4M3Per16)
    return _mm512_mul_ps(_mm512_cvtph_ps(e4m3_as_f16(bytes)), _mm512_set1_ps(w.global * 256.0f));
  const __m512i c = _mm512_cvtepu8_epi32(bytes);  // e8m0: 2^(c - 127); 0 is 2^-127
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(c, _mm512_setzero_si512()),
                                                     _mm512_slli_epi32(c, 23), _mm512_set1_epi32(0x00400000)));
}
#endif

// 16 float16 -> kHalf registers of float32.
inline void f16_to_vecs(__m256i h, Vec* out) {
#ifdef PRELOAD_AVX512
  out[0] = _mm512_cvtph_ps(h);
#else
  out[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  out[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
#endif
}

// Every e2m1 value is a float16 whose low byte is zero: the table holds the high bytes, indexed by
// code (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives). For dequantizing, in order.
inline void decode16_e2m1_in_order(const uint8_t* p, Vec* out) {
  const __m128i table = _mm_setr_epi8(0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46, char(0x80), char(0xB8),
                                      char(0xBC), char(0xBE), char(0xC0), char(0xC2), char(0xC4), char(0xC6));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(b, nibble), _mm_and_si128(_mm_srli_epi16(b, 4), nibble));
  f16_to_vecs(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_shuffle_epi8(table, codes)), 8), out);
}

// e2m1 and bfloat16 elements into float32 registers for the GEMV, per instruction set. Each group
// of 16 elements of x comes in the matching order, kE2M1Order (qgemv.cpp reorders x).
#ifdef PRELOAD_AVX512
// One register, elements 0 and 8, 1 and 9, ... 7 and 15 (e2m1_vec).
constexpr uint8_t kE2M1Order[16] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15};
constexpr const uint8_t* kBF16Order = nullptr;  // plain bfloat16 decodes in order here

// Every e2m1 code's value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives): a VPERMPS table.
alignas(64) constexpr float kE2M1Values[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// 16 e2m1 elements (8 packed bytes) straight into one float32 register, in kE2M1Order, in two
// instructions (e2m1_words and its widening took ten for two registers, six of them shuffles). The
// 8 bytes are loaded into every 64-bit lane, so the even 32-bit lanes hold nibbles 0-7 and the odd
// ones nibbles 8-15; lanes 2q and 2q + 1 shift their nibble q down to bits 0-3, which are all that
// VPERMPS reads of an index, and it looks the codes up in a table of their values. (A 2-core Zen 5,
// 4096x4096 from memory, builds alternated three times, medians: MXFP4 at one row of x 346-634 us
// -> 227-279, at 8 rows 1163-1338 -> 867-905; NVFP4 428-528 -> 346-399 and 1244-1576 ->
// 1082-1145. A VPERMW of bfloat16 words over a zeroed low word, after widening each byte to two
// lanes, gave MXFP4 248-352 and 943-1065.)
inline Vec e2m1_vec(const uint8_t* p) {
  int64_t packed;
  std::memcpy(&packed, p, sizeof(packed));
  const __m512i index = _mm512_srlv_epi32(_mm512_set1_epi64(packed), _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16,
                                                                                       16, 20, 20, 24, 24, 28, 28));
  return _mm512_permutexvar_ps(index, _mm512_load_ps(kE2M1Values));
}

// 32 bfloat16 words as two float32 registers, the even-indexed elements shifted up, the odd ones
// masked (AVX2's GEMV decodes bfloat16 so, below; here decode attention's values, decode_kernels.h).
inline void bf16_words_to_vecs(__m512i w, Vec* out) {
  out[0] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  out[1] = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int32_t(0xFFFF0000))));
}
#else
// For AVX2's GEMV (AVX-512's is e2m1_vec, above), no conversion instruction: every e2m1 value is
// also a bfloat16, so two tables give its high and low bytes, and two zero bytes below make the
// float32. The codes of 8 or 16 packed bytes go in the two 128-bit lanes as [low nibbles | high
// nibbles] (even-indexed elements, then odd ones: a broadcast load and one shift, no shuffle); in
// each lane the looked-up bytes pair up into words in order: w0 holds the bfloat16 of codes 0-7 of
// each lane, w1 of codes 8-15.
inline void e2m1_words(__m256i packed, __m256i& w0, __m256i& w1) {
  const __m256i high = _mm256_setr_epi8(0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, char(0x80), char(0xBF),
                                        char(0xBF), char(0xBF), char(0xC0), char(0xC0), char(0xC0), char(0xC0),
                                        0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, char(0x80), char(0xBF),
                                        char(0xBF), char(0xBF), char(0xC0), char(0xC0), char(0xC0), char(0xC0));
  const __m256i low = _mm256_setr_epi8(0x00, 0x00, char(0x80), char(0xC0), 0x00, 0x40, char(0x80), char(0xC0),
                                       0x00, 0x00, char(0x80), char(0xC0), 0x00, 0x40, char(0x80), char(0xC0),
                                       0x00, 0x00, char(0x80), char(0xC0), 0x00, 0x40, char(0x80), char(0xC0),
                                       0x00, 0x00, char(0x80), char(0xC0), 0x00, 0x40, char(0x80), char(0xC0));
  __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(packed, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                   _mm256_set1_epi8(0x0F));
  __m256i h = _mm256_shuffle_epi8(high, codes), l = _mm256_shuffle_epi8(low, codes);
  w0 = _mm256_unpacklo_epi8(l, h);
  w1 = _mm256_unpackhi_epi8(l, h);
}

// The words of 16 elements (w0 or w1) -> two registers, from the even words shifted up and the odd
// words masked (no shuffle): elements 0, 4, 8, 12, 1, 5, 9, 13 and 2, 6, 10, 14, 3, 7, 11, 15, the
// 16 as a 4 x 4 matrix transposed.
constexpr uint8_t kE2M1Order[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
// Plain bfloat16 in the GEMV: 16 elements in one register of words, the even-indexed ones shifted
// up, the odd ones masked (decode16), half the operations of widening 8 at a time, which AMD's
// first Zen cores split into two halves each (a GEMV in cache: ~20 -> ~30 GB/s on two of them).
constexpr uint8_t kBF16Order_[16] = {0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15};
constexpr const uint8_t* kBF16Order = kBF16Order_;
inline void bf16_words_to_vecs(__m256i w, Vec* out) {
  out[0] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  out[1] = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int32_t(0xFFFF0000))));
}
#endif

// kLanes bfloat16 values, in order, as one register of float32 (each the high half of its float).
inline Vec widen_bf16(const uint16_t* p) {
#ifdef PRELOAD_AVX512
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(p))), 16));
#else
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(p))), 16));
#endif
}

// 16 elements into kHalf registers: e2m1 and (AVX2) bfloat16 in the GEMV's orders (above), the
// others in order.
template <int kElem>
inline void decode16(const uint8_t* p, Vec* out) {
  if constexpr (kElem == kE4M3) {
    f16_to_vecs(e4m3_as_f16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), out);
  } else if constexpr (kElem == kE2M1) {
#ifdef PRELOAD_AVX512
    out[0] = e2m1_vec(p);
#else
    int64_t packed;
    std::memcpy(&packed, p, sizeof(packed));
    __m256i w0, w1;
    e2m1_words(_mm256_set1_epi64x(packed), w0, w1);
    bf16_words_to_vecs(w0, out);
#endif
  } else if constexpr (kElem == kBF16) {
#ifdef PRELOAD_AVX512
    out[0] = widen_bf16(reinterpret_cast<const uint16_t*>(p));
#else
    // One load and two operations for 16 elements, the even-indexed ones then the odd ones
    // (kBF16Order): x comes in that order.
    bf16_words_to_vecs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), out);
#endif
  } else {
#ifdef PRELOAD_AVX512
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
#endif
  }
}

// 16 elements in order (for dequantizing): decode16 but for the orders the GEMV reads x in.
template <int kElem>
inline void decode16_in_order(const uint8_t* p, Vec* out) {
  if constexpr (kElem == kE2M1) {
    decode16_e2m1_in_order(p, out);
  } else if constexpr (kElem == kBF16) {
#ifdef PRELOAD_AVX512
    decode16<kBF16>(p, out);
#else
    for (int h = 0; h < 2; ++h) out[h] = widen_bf16(reinterpret_cast<const uint16_t*>(p + 16 * h));
#endif
  } else {
    decode16<kElem>(p, out);
  }
}

template <int kElem>
constexpr int kChunkBytes = kElem == kE2M1 ? kChunk / 2 : kElem == kBF16 ? kChunk * 2 : kChunk;

// 32 elements into kVecs registers, as decode16 orders them.
template <int kElem>
inline void decode32(const uint8_t* p, Vec* out) {
  if constexpr (kElem == kE2M1) {
#ifdef PRELOAD_AVX512
    out[0] = e2m1_vec(p);
    out[1] = e2m1_vec(p + 8);
#else
    __m256i w0, w1;
    e2m1_words(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), w0, w1);
    bf16_words_to_vecs(w0, out);
    bf16_words_to_vecs(w1, out + kHalf);
#endif
  } else {
    decode16<kElem>(p, out);
    decode16<kElem>(p + kChunkBytes<kElem> / 2, out + kHalf);
  }
}

// What the decoders leave out of each element: 2^8 for e4m3.
template <int kElem>
constexpr float kFactor = kElem == kE4M3 ? 256.0f : 1.0f;

inline float e4m3_value(uint8_t v) { return _cvtsh_ss(static_cast<uint16_t>(((v & 0x80) << 8) | ((v & 0x7F) << 7))); }

// Scale of block b (along K) of row n, for the per-block kinds (kFactor is applied to the sums).
// e4m3_value is the value times 2^-8, as decoded: the global scale takes the 2^8.
inline float block_scale(const Weight& w, int64_t n, int64_t b) {
  if (w.kind == kBlock128) return static_cast<const float*>(w.scale)[(n / 128) * w.scale_cols + b];
  uint8_t code = static_cast<const uint8_t*>(w.scale)[n * w.scale_cols + b];
  if (w.kind == kE4M3Per16) return e4m3_value(code) * (w.global * 256.0f);
  uint32_t bits = code ? uint32_t(code) << 23 : 0x00400000u;  // e8m0: 2^(code - 127); 0 is 2^-127
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// The scales of blocks [b, b + count) of row n, 8 at a time where there are 8.
inline void block_scales(const Weight& w, int64_t n, int64_t b, int64_t count, float* out) {
  if (count < 8) {
    for (int64_t i = 0; i < count; ++i) out[i] = block_scale(w, n, b + i);
    return;
  }
  __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(w.scale) +
                                                                    n * w.scale_cols + b));
  if (w.kind == kE4M3Per16) {
    __m256 v = _mm256_cvtph_ps(_mm256_castsi256_si128(e4m3_as_f16(codes)));
    _mm256_storeu_ps(out, _mm256_mul_ps(v, _mm256_set1_ps(w.global * 256.0f)));
  } else {
    __m256i c = _mm256_cvtepu8_epi32(codes);
    __m256i bits = _mm256_blendv_epi8(_mm256_slli_epi32(c, 23), _mm256_set1_epi32(0x00400000),
                                      _mm256_cmpeq_epi32(c, _mm256_setzero_si256()));
    _mm256_storeu_ps(out, _mm256_castsi256_ps(bits));
  }
}

// One scale per row (or one for the whole tensor): bfloat16, int8, FP8 per tensor or channel.
inline bool row_scaled(const Weight& w) { return w.kind == kPerTensor || w.kind == kPerRow; }

inline float row_scale(const Weight& w, int64_t n) {
  if (w.kind == kPerTensor) return *static_cast<const float*>(w.scale);
  if (w.kind == kPerRow) return static_cast<const float*>(w.scale)[n];
  return 1.0f;
}

inline uint16_t to_bf16(float v) {  // round to nearest even, as torch rounds; a NaN stays a (quiet) NaN
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// Output n of row m of a GEMV's y (row stride y_stride): v as float32, or with bf16 rounded to bfloat16.
inline void put_output(void* y, int64_t y_stride, int64_t m, int64_t n, float v, bool bf16) {
  if (bf16) static_cast<uint16_t*>(y)[m * y_stride + n] = to_bf16(v);
  else static_cast<float*>(y)[m * y_stride + n] = v;
}

// v rounded to bfloat16 (to nearest even, as to_bf16; a NaN stays a quiet NaN) and widened back.
inline Vec vround_bf16(Vec v) {
#ifdef PRELOAD_AVX512
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)),
                                     _mm512_set1_epi32(int32_t(0xFFFF0000)));
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                  _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
  return _mm512_castsi512_ps(rounded);
#else
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)),
                                     _mm256_set1_epi32(int32_t(0xFFFF0000)));
  rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000)),
                               _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm256_castsi256_ps(rounded);
#endif
}

inline void store_bf16(uint16_t* dst, Vec v) {  // to_bf16 on every lane
  const Vec rounded = vround_bf16(v);
#ifdef PRELOAD_AVX512
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
#else
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1)));
#endif
}

// Which of x's rows each lane of R x M outputs holds (r-major, as vsums leaves them: lane r * M +
// m), a register of kLanes at a time.
template <int R, int M>
struct RowOfX {
  alignas(64) int32_t lane[kPadded<R * M>] = {};
  constexpr RowOfX() {
    for (int i = 0; i < R * M; ++i) lane[i] = i % M;
  }
};

// Register i of R x M outputs (lanes i kLanes on): of_w[r] in the lanes of weight row r, made in
// registers (of_w was just stored: a load spanning its stores would wait for them to retire).
template <int R, int M>
inline Vec row_factors(const float* of_w, int i) {
  Vec v = vzero();
  for (int r = 0; r < R; ++r) {
    const int lo = std::max(0, r * M - i * kLanes), hi = std::min(kLanes, (r + 1) * M - i * kLanes);
    if (lo >= hi) continue;
#ifdef PRELOAD_AVX512
    v = _mm512_mask_mov_ps(v, static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1)), vset(of_w[r]));
#else
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i in = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(lo), lane),
                                           _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), lane));
    v = _mm256_blendv_ps(v, vset(of_w[r]), _mm256_castsi256_ps(in));
#endif
  }
  return v;
}

// Register i of R x M outputs: of_x[m] in the lanes of x's row m.
template <int R, int M>
inline Vec x_factors(const float* of_x, int i) {
  static constexpr RowOfX<R, M> kRows;
#ifdef PRELOAD_AVX512
  return _mm512_permutexvar_ps(_mm512_load_si512(kRows.lane + i * kLanes),
                               _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << M) - 1), of_x));
#else
  const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(M), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_permutevar8x32_ps(_mm256_maskload_ps(of_x, live),
                                  _mm256_load_si256(reinterpret_cast<const __m256i*>(kRows.lane + i * kLanes)));
#endif
}

// y[m * y_stride + n + r] = to_bf16(sums[r * M + m] * of_x[m] * of_w[r]) for r < rows (R, or fewer
// at the end of a range), m < M, bit for bit (without of_x: sums[r * M + m] * of_w[r]). sums:
// r-major, as vsums leaves R x M sums, in kPadded<R * M> floats. From kVectorOutputs outputs a step
// (and where the caller's kRegisters allows) the products and the rounding (vround_bf16) run a
// register at a time, then each output's high half is stored; fewer, one output at a time. That
// took a dozen scalar instructions an output, which at K = 576 (18 dot products an output) weighed
// on the step: a 2-core Zen 4, one thread, 1024x576 in L2, both builds in one process and
// alternated, time in registers against one at a time: avx512bf16 at 3 to 8 rows of x int8
// 0.86-0.92x, bfloat16 (5 to 8 rows) 0.80-0.92x, FP8 (7 and 8) 0.81-0.87x; avx512 int8 0.83-0.94x,
// bfloat16 0.91-0.96x; AVX2 alike (0.93-1.07x).
template <int R, int M, bool kRegisters = true>
inline void put_outputs_bf16(const float* sums, const float* of_x, const float* of_w, int rows, uint16_t* y,
                             int64_t y_stride, int64_t n) {
  if constexpr (kRegisters && R * M >= kVectorOutputs) {
    if (rows == R) {
      alignas(64) uint32_t bits[kPadded<R * M>];
      for (int i = 0; i < R * M; i += kLanes) {
        Vec v = vload(sums + i);
        if (of_x) v = vmul(v, x_factors<R, M>(of_x, i / kLanes));
        vstore(reinterpret_cast<float*>(bits + i), vround_bf16(vmul(v, row_factors<R, M>(of_w, i / kLanes))));
      }
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) y[m * y_stride + n + r] = static_cast<uint16_t>(bits[r * M + m] >> 16);
      return;
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int m = 0; m < M; ++m)
      y[m * y_stride + n + r] = to_bf16(of_x ? sums[r * M + m] * of_x[m] * of_w[r] : sums[r * M + m] * of_w[r]);
}

}  // namespace
}  // namespace preload
