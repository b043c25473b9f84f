// SIMD kernels for quantized linear layers: y[m, n] = sum_k x[m, k] * scale(n, k) * element(W[n, k]).
// One source, compiled twice by scripts/build_kernels.py: with -DPRELOAD_AVX512 and AVX-512 flags
// into the `kAvx512` entry points, and with AVX2 flags into `kAvx2`. The two differ only in the
// vector layer below (8 or 16 floats per register, 16 or 32 registers); everything after it is shared.
//
// The weight is decoded 32 elements at a time straight into registers and never written back, so
// a GEMV reads it once: e4m3 through F16C (its bits placed where a float16 keeps exponent and
// mantissa), e2m1 through two 16-entry tables (pshufb) of bfloat16 bytes, int8 by widening, and
// plain bfloat16 by a shift (it is the high half of a float32). Each step multiplies R weight rows by M activation rows with R x M accumulators in
// registers. No torch header is included here: see qgemv_kernels.h.
#include "qgemv_kernels.h"

#include <immintrin.h>

#include <cstring>
#include <utility>

namespace preload {
namespace {

#ifdef PRELOAD_AVX512
using Vec = __m512;
constexpr int kLanes = 16;
constexpr int kAccumulators = 16;  // of 32 registers
constexpr int kMaxM = 4;           // activation rows per pass (kernels/linear.py takes GEMM for more)
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset(float v) { return _mm512_set1_ps(v); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
#else
using Vec = __m256;
constexpr int kLanes = 8;
constexpr int kAccumulators = 8;   // of 16 registers: the rest decode
constexpr int kMaxM = 8;           // activation rows per pass: more take more passes
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float v) { return _mm256_set1_ps(v); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

constexpr int kChunk = 32;               // elements decoded per step; a 16-element tail after the last
constexpr int kVecs = kChunk / kLanes;   // registers a chunk fills
constexpr int kHalf = kVecs / 2;         // registers 16 elements fill

inline int64_t lesser(int64_t a, int64_t b) { return a < b ? a : b; }

// e4m3 bits s.eeee.mmm become the float16 s.0eeee.mmm0000000, which reads as the e4m3 value times
// 2^-8 (the biases differ by 8), subnormals included; the 2^8 goes into the scale (kFactor). From the
// sign-extended byte, a shift by 7 leaves the sign in bits 15 and 14: the mask clears bit 14.
inline __m256i e4m3_as_f16(__m128i bytes) {
  return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7), _mm256_set1_epi16(int16_t(0xBFFF)));
}

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

// For the GEMV, no conversion instruction: every e2m1 value is also a bfloat16, so two tables give
// its high and low bytes, and two zero bytes below make the float32. The codes of 8 or 16 packed
// bytes go in the two 128-bit lanes as [low nibbles | high nibbles] (even-indexed elements, then
// odd ones: a broadcast load and one shift, no shuffle); in each lane the looked-up bytes pair up
// into words in order: w0 holds the bfloat16 of codes 0-7 of each lane, w1 of codes 8-15.
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

// The words of 16 elements (w0 or w1) -> float32 registers. Each group of 16 elements of x comes
// in the matching order, kE2M1Order (qgemv.cpp reorders x).
#ifdef PRELOAD_AVX512
// One register: the 8 even-indexed elements, then the 8 odd ones.
constexpr uint8_t kE2M1Order[16] = {0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15};
inline void bf16_words_to_vecs(__m256i w, Vec* out) {
  out[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
}
#else
// Two registers, from the even words shifted up and the odd words masked (no shuffle): elements
// 0, 4, 8, 12, 1, 5, 9, 13 and 2, 6, 10, 14, 3, 7, 11, 15, the 16 as a 4 x 4 matrix transposed.
constexpr uint8_t kE2M1Order[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
inline void bf16_words_to_vecs(__m256i w, Vec* out) {
  out[0] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  out[1] = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int32_t(0xFFFF0000))));
}
#endif

// 16 elements into kHalf registers: e2m1 in the GEMV's order (above), the others in order.
template <int kElem>
inline void decode16(const uint8_t* p, Vec* out) {
  if constexpr (kElem == kE4M3) {
    f16_to_vecs(e4m3_as_f16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), out);
  } else if constexpr (kElem == kE2M1) {
    int64_t packed;
    std::memcpy(&packed, p, sizeof(packed));
    __m256i w0, w1;
    e2m1_words(_mm256_set1_epi64x(packed), w0, w1);
    bf16_words_to_vecs(w0, out);
  } else if constexpr (kElem == kBF16) {
#ifdef PRELOAD_AVX512
    out[0] = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#else
    out[0] = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
    out[1] = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))), 16));
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

template <int kElem>
constexpr int kChunkBytes = kElem == kE2M1 ? kChunk / 2 : kElem == kBF16 ? kChunk * 2 : kChunk;

// 32 elements into kVecs registers, as decode16 orders them.
template <int kElem>
inline void decode32(const uint8_t* p, Vec* out) {
  if constexpr (kElem == kE2M1) {
    __m256i w0, w1;
    e2m1_words(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), w0, w1);
    bf16_words_to_vecs(w0, out);
    bf16_words_to_vecs(w1, out + kHalf);
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

// How the scales fall on the chunks: one per row (applied to the sums), one per block of 128
// elements (4 chunks), of 32 (a chunk) or of 16 (half a chunk).
enum Mode : int { kRowScale, kBlock128Scale, kBlock32Scale, kBlock16Scale };

// acc[m] += v[h] . x[m] at `at` + h vectors, for the N registers of v (one weight row).
template <int M, int N>
inline __attribute__((always_inline)) void madd(const Vec (&v)[N], const float* x, int64_t k, int64_t at, Vec* acc) {
  for (int h = 0; h < N; ++h)
    for (int m = 0; m < M; ++m) acc[m] = vfma(v[h], vload(x + m * k + at + h * kLanes), acc[m]);
}

// The same into two banks of accumulators, alternating, for two dependency chains instead of one.
template <int M, int N>
inline __attribute__((always_inline)) void madd2(const Vec (&v)[N], const float* x, int64_t k, int64_t at, Vec* acc,
                                                 Vec* acc2) {
  for (int h = 0; h < N; ++h)
    for (int m = 0; m < M; ++m) {
      Vec& a = h % 2 ? acc2[m] : acc[m];
      a = vfma(v[h], vload(x + m * k + at + h * kLanes), a);
    }
}

// sum_h v[h] . x[h vectors on] for h < N, in two chains.
template <int N>
inline __attribute__((always_inline)) Vec dot(const Vec* v, const float* x) {
  Vec even = vmul(v[0], vload(x));
  if constexpr (N == 1) return even;
  Vec odd = vmul(v[1], vload(x + kLanes));
  for (int h = 2; h < N; ++h) {
    Vec& a = h % 2 ? odd : even;
    a = vfma(v[h], vload(x + h * kLanes), a);
  }
  return vadd(even, odd);
}

template <int M, int R>
inline void zero(Vec (&acc)[R][M]) {
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = vzero();
}

// Blocks of 16 and 32 elements, a chunk at a time: a chunk's registers fall into kSlots groups
// (its first and second 16 elements, for 16-element blocks) of one scale register each.
template <int kMode>
constexpr int kSlots = kMode == kBlock16Scale ? 2 : 1;

// Rows [n, n + R) times activation rows [0, M): sums[m][r], before the row scale and kFactor. Each
// row's chunk is decoded and used before the next row's, so that few registers hold decoded weights.
template <int kElem, int kMode, int M, int R>
void dot_rows(const Weight& w, const float* x, int64_t n, float (*sums)[4]) {
  Vec acc[R][M];
  zero(acc);
  const uint8_t* row[R];
  for (int r = 0; r < R; ++r) row[r] = w.data + (n + r) * w.row_bytes;
  const int64_t chunks = w.k / kChunk;
  if constexpr (kMode == kRowScale) {
    // Where the registers allow, a second bank of accumulators halves the dependency chains.
    constexpr bool kTwoBanks = 2 * R * M <= kAccumulators;
    Vec acc2[R][M];
    zero(acc2);
    for (int64_t c = 0; c < chunks; ++c) {
      for (int r = 0; r < R; ++r) {
        Vec v[kVecs];
        decode32<kElem>(row[r] + c * kChunkBytes<kElem>, v);
        if constexpr (kTwoBanks) madd2<M>(v, x, w.k, c * kChunk, acc[r], acc2[r]);
        else madd<M>(v, x, w.k, c * kChunk, acc[r]);
      }
    }
    if constexpr (kTwoBanks)
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) acc[r][m] = vadd(acc[r][m], acc2[r][m]);
  } else if constexpr (kMode == kBlock128Scale) {
    // Each block summed apart and scaled once where the registers allow, else every register scaled.
    constexpr bool kPartial = 2 * R * M <= kAccumulators;
    for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
      Vec scale[R], part[R][M];
      for (int r = 0; r < R; ++r) scale[r] = vset(block_scale(w, n + r, c0 / 4));
      zero(part);
      for (int64_t c = c0; c < lesser(c0 + 4, chunks); ++c) {
        for (int r = 0; r < R; ++r) {
          Vec v[kVecs];
          decode32<kElem>(row[r] + c * kChunkBytes<kElem>, v);
          if constexpr (kPartial) {
            madd<M>(v, x, w.k, c * kChunk, part[r]);
          } else {
            for (int h = 0; h < kVecs; ++h) v[h] = vmul(v[h], scale[r]);
            madd<M>(v, x, w.k, c * kChunk, acc[r]);
          }
        }
      }
      if constexpr (kPartial)
        for (int r = 0; r < R; ++r)
          for (int m = 0; m < M; ++m) acc[r][m] = vfma(part[r][m], scale[r], acc[r][m]);
    }
  } else {
    // A chunk's blocks summed apart and scaled once (few M), or every register scaled (more M).
    constexpr int kSlotCount = kSlots<kMode>, kPerSlot = kVecs / kSlotCount;
    constexpr int kBlocksPerChunk = kMode == kBlock16Scale ? 2 : 1;
    constexpr bool kScaleRegisters = kSlotCount * M > kVecs;
    alignas(32) float scales[R][8];
    for (int64_t c0 = 0; c0 < chunks; c0 += 8 / kBlocksPerChunk) {
      const int64_t c1 = lesser(c0 + 8 / kBlocksPerChunk, chunks);
      for (int r = 0; r < R; ++r) block_scales(w, n + r, c0 * kBlocksPerChunk, (c1 - c0) * kBlocksPerChunk, scales[r]);
      for (int64_t c = c0; c < c1; ++c) {
        for (int r = 0; r < R; ++r) {
          Vec v[kVecs], scale[kSlotCount];
          decode32<kElem>(row[r] + c * kChunkBytes<kElem>, v);
          for (int slot = 0; slot < kSlotCount; ++slot)
            scale[slot] = vset(scales[r][(c - c0) * kBlocksPerChunk + slot]);
          if constexpr (kScaleRegisters) {
            for (int h = 0; h < kVecs; ++h) v[h] = vmul(v[h], scale[h / kPerSlot]);
            madd<M>(v, x, w.k, c * kChunk, acc[r]);
          } else {
            for (int m = 0; m < M; ++m)
              for (int slot = 0; slot < kSlotCount; ++slot) {
                const float* xs = x + m * w.k + c * kChunk + slot * kPerSlot * kLanes;
                acc[r][m] = vfma(dot<kPerSlot>(v + slot * kPerSlot, xs), scale[slot], acc[r][m]);
              }
          }
        }
      }
    }
  }
  if (w.k % kChunk) {  // the last 16 elements, in order (fp8 and int8 with K % 32 = 16, NVFP4)
    const int64_t at = chunks * kChunk;
    for (int r = 0; r < R; ++r) {
      Vec v[kHalf];
      decode16<kElem>(row[r] + chunks * kChunkBytes<kElem>, v);
      if constexpr (kMode != kRowScale) {
        Vec scale = vset(block_scale(w, n + r, at / w.block));
        for (int h = 0; h < kHalf; ++h) v[h] = vmul(v[h], scale);
      }
      madd<M>(v, x, w.k, at, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) sums[m][r] = vsum(acc[r][m]);
}

// Weight rows per step for M activation rows: enough independent chains, no spilled accumulators.
constexpr int rows_for(int m) {
  return m * 4 <= kAccumulators ? 4 : m * 2 <= kAccumulators ? 2 : 1;
}

template <int kElem, int kMode, int M>
void gemv_pass(const Weight& w, const float* x, int64_t begin, int64_t end, void* y, int64_t y_stride, bool bf16) {
  constexpr int R = rows_for(M);
  float sums[M][4];
  auto store = [&](int64_t n, int rows) {
    for (int r = 0; r < rows; ++r) {
      float scale = (kMode == kRowScale ? row_scale(w, n + r) : 1.0f) * kFactor<kElem>;
      for (int m = 0; m < M; ++m) {
        float v = sums[m][r] * scale;
        if (bf16) static_cast<uint16_t*>(y)[m * y_stride + n + r] = to_bf16(v);
        else static_cast<float*>(y)[m * y_stride + n + r] = v;
      }
    }
  };
  int64_t n = begin;
  for (; n + R <= end; n += R) {
    dot_rows<kElem, kMode, M, R>(w, x, n, sums);
    store(n, R);
  }
  for (; n < end; ++n) {
    dot_rows<kElem, kMode, M, 1>(w, x, n, sums);
    store(n, 1);
  }
}

using PassFn = void (*)(const Weight&, const float*, int64_t, int64_t, void*, int64_t, bool);

template <int kElem, int kMode, int... Ms>
PassFn pick_pass(int m, std::integer_sequence<int, Ms...>) {
  static constexpr PassFn passes[] = {&gemv_pass<kElem, kMode, Ms + 1>...};
  return passes[m - 1];
}

// The element formats and scale kinds of the schemes (qgemv.cpp refuses other pairs).
PassFn pick_pass(const Weight& w, int m) {
  auto ms = std::make_integer_sequence<int, kMaxM>{};
  if (w.element == kE2M1) {
    return w.kind == kE4M3Per16 ? pick_pass<kE2M1, kBlock16Scale>(m, ms) : pick_pass<kE2M1, kBlock32Scale>(m, ms);
  }
  if (w.element == kInt8) return pick_pass<kInt8, kRowScale>(m, ms);
  if (w.element == kBF16) return pick_pass<kBF16, kRowScale>(m, ms);
  if (w.kind == kBlock128) return pick_pass<kE4M3, kBlock128Scale>(m, ms);
  if (w.kind == kE8M0Per32) return pick_pass<kE4M3, kBlock32Scale>(m, ms);
  return pick_pass<kE4M3, kRowScale>(m, ms);
}

// More than kMaxM activation rows take several passes; rows are walked in tiles small enough to
// stay in L2 across the passes.
void gemv(const Weight& w, const float* x, int64_t m_rows, int64_t begin, int64_t end, void* y, int64_t y_stride,
          bool bf16) {
  const int64_t tile = m_rows <= kMaxM ? end - begin : 4 + (int64_t(256) << 10) / w.row_bytes / 4 * 4;
  const size_t y_bytes = bf16 ? 2 : 4;
  for (int64_t start = begin; start < end; start += tile) {
    const int64_t stop = lesser(start + tile, end);
    for (int64_t m0 = 0; m0 < m_rows; m0 += kMaxM) {
      const int m = static_cast<int>(lesser(kMaxM, m_rows - m0));
      PassFn pass = pick_pass(w, m);
      pass(w, x + m0 * w.k, start, stop, static_cast<char*>(y) + m0 * y_stride * y_bytes, y_stride, bf16);
    }
  }
}

inline void store_bf16(uint16_t* dst, Vec v) {  // to_bf16 on every lane
#ifdef PRELOAD_AVX512
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
  __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), quiet);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(rounded));
#else
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
  __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  rounded = _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed);
#endif
}

// Rows [begin, end), 16 elements (in order) at a time.
template <int kElem>
void dequantize_rows(const Weight& w, int64_t begin, int64_t end, void* out, bool bf16) {
  const bool blocked = !(w.kind == kPerTensor || w.kind == kPerRow);
  const int64_t pieces = w.k / 16, per_block = w.block / 16;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = w.data + n * w.row_bytes;
    const int64_t offset = (n - begin) * w.k;
    for (int64_t j0 = 0, b = 0; j0 < pieces; j0 += per_block, ++b) {
      Vec scale = vset((blocked ? block_scale(w, n, b) : row_scale(w, n)) * kFactor<kElem>);
      for (int64_t j = j0; j < lesser(j0 + per_block, pieces); ++j) {
        Vec v[kHalf];
        if constexpr (kElem == kE2M1) decode16_e2m1_in_order(row + j * 8, v);
        else decode16<kElem>(row + j * kChunkBytes<kElem> / 2, v);
        for (int h = 0; h < kHalf; ++h) {
          const int64_t at = offset + j * 16 + h * kLanes;
          if (bf16) store_bf16(static_cast<uint16_t*>(out) + at, vmul(v[h], scale));
          else vstore(static_cast<float*>(out) + at, vmul(v[h], scale));
        }
      }
    }
  }
}

void dequantize(const Weight& w, int64_t begin, int64_t end, void* out, bool bf16) {
  if (w.element == kE2M1) dequantize_rows<kE2M1>(w, begin, end, out, bf16);
  else if (w.element == kInt8) dequantize_rows<kInt8>(w, begin, end, out, bf16);
  else if (w.element == kBF16) dequantize_rows<kBF16>(w, begin, end, out, bf16);
  else dequantize_rows<kE4M3>(w, begin, end, out, bf16);
}

}  // namespace

#ifdef PRELOAD_AVX512
extern const Kernels kAvx512 = {&gemv, &dequantize, kE2M1Order};
#else
extern const Kernels kAvx2 = {&gemv, &dequantize, kE2M1Order};
#endif

}  // namespace preload
