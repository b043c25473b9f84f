// e4m3 straight to bfloat16 for the GEMVs on the bfloat16 dot product (qgemv_bf16dot.h) and the AMX
// tiles (qgemv_amx.h): 32 elements at a time (e4m3_bf16), and with AVX512-VBMI (which both variants
// that include this need) 64 at a time, in pairs of chunks (e4m3_bf16_pair), x packed to match.
// Included by qgemv_bf16dot.h inside qgemv_kernels.cpp's unnamed namespace.
#pragma once

// Chunks of an e4m3 row that can decode in pairs, 64 elements at a time (e4m3_bf16_pair), x packed
// to match: those of the row's whole groups of 64; 0 for other elements. The AMX tiles pair them at
// every count of x's rows, the dot product at a few (dot_paired_chunks, qgemv_bf16dot.h).
inline int64_t e4m3_paired_chunks(const Weight& w) { return w.element == kE4M3 ? w.k / 64 * 2 : 0; }

// The bfloat16 bits of e4m3 magnitude code c (eeee.mmm) times 2^-8, as decode32 scales e4m3: exact,
// subnormals included (4 significant bits fit in bfloat16's 8; the smallest, 2^-17, is a normal
// bfloat16, which the dot product does not flush). Code 0x7F is NaN.
constexpr uint16_t e4m3_bf16_bits(int c) {
  const int e = c >> 3, m = c & 7;
  if (c == 0x7F) return 0x7FC0;
  if (e == 0) {  // m x 2^-17: the leading one of m at bit p
    if (m == 0) return 0;
    const int p = m >= 4 ? 2 : m >= 2 ? 1 : 0;
    return static_cast<uint16_t>(((p - 17 + 127) << 7) | ((m << (7 - p)) & 0x7F));
  }
  return static_cast<uint16_t>(((e - 15 + 127) << 7) | (m << 4));  // 2^(e - 7) (1 + m / 8) x 2^-8
}

struct E4M3Bf16Table {
  alignas(64) uint16_t words[128];
  constexpr E4M3Bf16Table() : words() {
    for (int c = 0; c < 128; ++c) words[c] = e4m3_bf16_bits(c);
  }
};
constexpr E4M3Bf16Table kE4M3Bf16;

// 32 e4m3 elements as bfloat16 (times 2^-8) in 6 instructions, where widening them through float16
// and float32 and rounding back takes 9: the bytes sign-extended to words (bit 15 the sign), the
// magnitude looked up in two halves of a 128-word table (VPERMI2W reads the low 6 bits; bit 6
// picks the half), the sign put back. (A 2-core Zen 5, 4096x4096 at one row of x in cache, builds
// alternated twice: FP8 per channel 328 -> 205-260 us, FP8 blocks 379-382 -> 247-335; outputs bitwise
// equal for every code but NaN.)
// With kScaled, times an MX block's scale 2^e (e8m0_exponent: e << 7 in every word), added to the
// exponent of every nonzero magnitude in two more instructions: exact where the scaled values stay
// normal bfloat16 (e8m0_within). A NaN code (0x7F) then reads as some other value (the AVX-512
// kernels read it as 480): no quantizer writes one.
template <bool kScaled = false>
inline __m512bh e4m3_bf16(const uint8_t* p, __m512i exponent = __m512i()) {
  const __m512i codes = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i* table = reinterpret_cast<const __m512i*>(kE4M3Bf16.words);
#ifdef PRELOAD_AMX
  // Intel's cores, where VPERMI2W is 3 micro-ops on the one port that also widens: a normal code's
  // exponent and mantissa bits moved into place and its exponent rebiased (+112: 2^-8 and bfloat16's
  // 127 against e4m3's 7), and only the codes of exponent 0 (zeros and subnormals) looked up, in the
  // table's first 8 words (VPERMW reads the low 5 bits: the mantissa there). The NaN code reads as 480
  // then, as on the AVX-512 kernels. (A 2-core Emerald Rapids, FP8 per channel 4096x4096 at one row of
  // x in cache: 0.91-1.04 -> 0.67-0.76 ms, runs alternated; at 8 rows, on the tiles, 1.26-2.12 -> 0.92-1.01.)
  // Since then amx decodes 64 elements at a time (e4m3_bf16_pair, below); this takes the chunk an odd
  // count of chunks leaves.
  __m512i magnitude = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(codes, 4), _mm512_set1_epi16(0x07F0)),
                                       _mm512_set1_epi16(112 << 7));
  magnitude = _mm512_mask_permutexvar_epi16(magnitude, _mm512_testn_epi16_mask(codes, _mm512_set1_epi16(0x78)), codes,
                                            _mm512_load_si512(table));
#else
  const __m512i low = _mm512_permutex2var_epi16(_mm512_load_si512(table), codes, _mm512_load_si512(table + 1));
  const __m512i high = _mm512_permutex2var_epi16(_mm512_load_si512(table + 2), codes, _mm512_load_si512(table + 3));
  __m512i magnitude = _mm512_mask_mov_epi16(low, _mm512_test_epi16_mask(codes, _mm512_set1_epi16(0x40)), high);
#endif
  if constexpr (kScaled)
    magnitude = _mm512_mask_add_epi16(magnitude, _mm512_test_epi16_mask(magnitude, magnitude), magnitude, exponent);
  return (__m512bh)_mm512_ternarylogic_epi32(magnitude, codes, _mm512_set1_epi16(int16_t(0x8000)), 0xF8);
}

// Every e4m3 magnitude code's bfloat16 (e4m3_bf16_bits) as its high and its low byte; the NaN code reads
// as 480, as on the AVX-512 kernels.
struct E4M3Bf16Bytes {
  alignas(64) uint8_t high[128], low[128];
  constexpr E4M3Bf16Bytes() : high(), low() {
    for (int c = 0; c < 128; ++c) {
      const uint16_t word = c == 0x7F ? uint16_t(0x3FF0) : e4m3_bf16_bits(c);
      high[c] = static_cast<uint8_t>(word >> 8), low[c] = static_cast<uint8_t>(word);
    }
  }
};
constexpr E4M3Bf16Bytes kE4M3Bf16Bytes;

// 64 e4m3 elements as two registers of bfloat16 (times 2^-8), with AVX512-VBMI: each code's
// magnitude looks up its bfloat16's high and low byte in two tables of 128 bytes (VPERMI2B reads 7
// bits of each byte), the sign joins the high byte, and
// VPUNPCKLBW / VPUNPCKHBW pair the bytes into words within each 128-bit lane: `first` holds elements
// 0-7, 16-23, 32-39 and 48-55, `second` the others, the two chunks of a pair as x is packed for them
// (pack_bf16dot, pack_amx). Five instructions for 64 elements, none widening, where e4m3_bf16 takes
// eight for 32 (a 2-core Emerald Rapids, one thread in L1, with the dot product: 2.3 -> 1.8 ns per 32
// elements; VPERMI2B and VPERMI2W cost 2 and 3 cycles there, VPERMW and the unpacks 1). The GEMV at
// one row of x, one thread, 256x4096 in L2, minima of 4 alternated runs: FP8 per channel 77 -> 64 us,
// FP8 blocks 88 -> 71, MXFP8 87 -> 75 (bfloat16 76 -> 74). The dot product pairs them at a few rows
// of x on avx512bf16 too (dot_paired_chunks, qgemv_bf16dot.h, with the figures of a Zen 4).
// With kScaled, times MX block scales (e8m0_exponents: the pair's first block's in words 0-15 of
// each register, the second's in 16-31), added to the exponent of every nonzero value (the sign bit
// stays: the scaled values are normal bfloat16, e8m0_within).
template <bool kScaled = false>
inline void e4m3_bf16_pair(const uint8_t* p, __m512bh& first, __m512bh& second, __m512i exponents = __m512i()) {
  const __m512i codes = _mm512_loadu_si512(p);
  const __m512i* high_table = reinterpret_cast<const __m512i*>(kE4M3Bf16Bytes.high);
  const __m512i* low_table = reinterpret_cast<const __m512i*>(kE4M3Bf16Bytes.low);
  __m512i high = _mm512_permutex2var_epi8(_mm512_load_si512(high_table), codes, _mm512_load_si512(high_table + 1));
  const __m512i low = _mm512_permutex2var_epi8(_mm512_load_si512(low_table), codes, _mm512_load_si512(low_table + 1));
  high = _mm512_ternarylogic_epi32(high, codes, _mm512_set1_epi8(char(0x80)), 0xF8);  // high | (codes & 0x80)
  __m512i words[2] = {_mm512_unpacklo_epi8(low, high), _mm512_unpackhi_epi8(low, high)};
  if constexpr (kScaled)
    for (__m512i& v : words)
      v = _mm512_mask_add_epi16(v, _mm512_test_epi16_mask(v, _mm512_set1_epi16(0x7FFF)), v, exponents);
  first = (__m512bh)words[0], second = (__m512bh)words[1];
}

// The MX scales of a pair's two blocks (codes[0], codes[1]) as e4m3_bf16_pair<true> adds them.
// Both codes are broadcast as one word, and VPSHUFB spreads codes[0] over the low 256 bits' words and
// codes[1] over the high ones' (a shuffle and two arithmetic instructions, no insert).
inline __m512i e8m0_exponents(const uint8_t* codes) {
  uint16_t both;
  std::memcpy(&both, codes, sizeof(both));
  const __m512i spread = _mm512_set_epi64(0x8001800180018001, 0x8001800180018001, 0x8001800180018001,
                                          0x8001800180018001, 0x8000800080008000, 0x8000800080008000,
                                          0x8000800080008000, 0x8000800080008000);
  const __m512i words = _mm512_shuffle_epi8(_mm512_set1_epi16(static_cast<int16_t>(both)), spread);
  return _mm512_sub_epi16(_mm512_slli_epi16(words, 7), _mm512_set1_epi16(127 << 7));
}

// For the pair at chunk 2j of 16 (j < 8): which of the 16 scales each lane of its sums takes.
struct PairScales {
  alignas(64) int32_t lanes[8][16] = {};
  constexpr PairScales() {
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 16; ++i) lanes[j][i] = 2 * j + i / 8;
  }
};
constexpr PairScales kPairScales;

// Chunks c and c + 1 (a pair) of rows [n, n + R) times the M rows of packed x, into a0 and a1 (or,
// kScaleSums, one weight row, both sums times each block's scale into a0: `scales` holds the 16 from
// chunk c - c % 16 on). codes[r]: row n + r's MX scale codes, for kScaled (MXFP8 from 3 rows of x). On
// amx only one row of x reaches the dot product with e4m3 weights (the tiles take 2 and more:
// amx_min_rows); on avx512bf16 up to dot_paired_chunks' rows.
template <bool kScaled, bool kScaleSums, int M, int R>
[[gnu::always_inline]] inline void e4m3_pair_dots(const Weight& w, const uint16_t* xp, int64_t n, int64_t c,
                                                  int64_t ahead, const uint8_t* const* codes, const float* scales,
                                                  __m512 (&a0)[R * M], __m512 (&a1)[R * M]) {
  __m512bh v0[R], v1[R];
  for (int r = 0; r < R; ++r) {
    const uint8_t* p = w.data + (n + r) * w.row_bytes + c * kChunk;
    prefetch_weight(p, c * kChunk, ahead);
    if constexpr (kScaled) e4m3_bf16_pair<true>(p, v0[r], v1[r], e8m0_exponents(codes[r] + c));
    else e4m3_bf16_pair(p, v0[r], v1[r]);
  }
  __m512 scale;
  if constexpr (kScaleSums) scale = _mm512_permutexvar_ps(_mm512_load_si512(kPairScales.lanes[c % 16 / 2]),
                                                          _mm512_load_ps(scales));
  for (int m = 0; m < M; ++m) {
    const __m512bh x0 = (__m512bh)_mm512_loadu_si512(xp + m * w.k + c * kChunk);
    const __m512bh x1 = (__m512bh)_mm512_loadu_si512(xp + m * w.k + (c + 1) * kChunk);
    for (int r = 0; r < R; ++r) {
      if constexpr (kScaleSums) {  // lanes 0-7 of either register's sums are block c's, 8-15 block c + 1's
        static_assert(R == 1, "the scales are one row's");
        const __m512 dots = _mm512_dpbf16_ps(_mm512_dpbf16_ps(vzero(), v0[r], x0), v1[r], x1);
        a0[r * M + m] = vfma(dots, scale, a0[r * M + m]);
      } else {
        a0[r * M + m] = _mm512_dpbf16_ps(a0[r * M + m], v0[r], x0);
        a1[r * M + m] = _mm512_dpbf16_ps(a1[r * M + m], v1[r], x1);
      }
    }
  }
}
