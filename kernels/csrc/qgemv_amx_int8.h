// int8 weights on AMX-INT8's byte tiles, for qgemv_amx.h (its includer, inside qgemv_kernels.cpp's
// unnamed namespace, after its tile configuration and prefetch helpers).
#pragma once

// int8 weights times 3 to 16 rows of bfloat16 x on AMX-INT8, whose tiles multiply bytes: nothing
// to decode. Each row of x is scaled into int16 as qgemv_int16.h does (the same values, and the same
// rows left to the float32 kernels), and split into a signed high byte and an unsigned low one, v =
// 256 hi + lo. For 16 weight rows and 64 elements, TDPBSSD adds W hi and TDPBSUD W lo into two int32
// tiles, straight from the weight; every 16384 elements the two go into exact sums (doubles, as
// 256 hi + lo), which the row's 2^-s and the weight row's scale multiply once at the end. The bfloat16
// tiles (amx_gemv) decode 16 x 32 weights for each of their products, which bound int8 there: a
// 2-core Emerald Rapids, 4096x4096 at 8 rows, 0.67-0.70 ms in cache against 0.91-1.09 (1.08-1.11
// from memory against 1.20-1.40), the default model's 1536x576 33-40 us against 83-93 (runs alternated).
constexpr int64_t kAmxIntSegment = 256;  // 64-element chunks summed in int32: |W lo| < 2^15 * 16384 = 2^29

// From 3 rows, as the other formats: one tile product a chunk takes every row, where the integer
// multiply-adds (qgemv_int16.h) take one a row. A 2-core Emerald Rapids, 3 and 4 rows, runs
// alternated: one thread, minima, 1536x576 60-64 and 81-87 -> 39-41 and 42-44 us, 576x1536 60-64 and
// 73-75 -> 34-35 and 35-37, 4096x4096 960-1076 and 1146-1287 -> 817-847 and 842-864; two threads from
// memory, 4096x4096, medians 864-984 and 985-1127 -> 853-907 and 848-910. At 1 and 2 rows the tiles
// were faster in cache but slower from memory (two threads, 4096x4096: 696-882 -> 834-1014 us at one
// row, 760-970 -> 868-1022 at two), as e4m3's at one row (amx_min_rows).
inline bool amx_int8_takes(const Weight& w, int64_t m_rows, bool bf16) {
  return bf16 && w.element == kInt8 && w.kind <= kPerRow && m_rows >= kAmxMinM && m_rows <= kAmxMaxM && w.k % 64 == 0;
}

// Byte b of x's bytes (each region m_rows * k of them: the high bytes, then the low) for element e of
// row m, as the tiles take them: 16 quads of elements a tile row, row m's quad at 4m of each.
inline int64_t amx_int8_at(int64_t m_rows, int64_t m, int64_t e) { return (e >> 2) * 4 * m_rows + 4 * m + (e & 3); }

// Share `part` of `parts` of x's columns, every row, as pack_int16 shares them.
void pack_amx_int8(float* x, int64_t m_rows, const Weight& w, int part, int parts) {
  const int64_t k = w.k;
  uint8_t* high = reinterpret_cast<uint8_t*>(x + m_rows * k);
  uint8_t* low = high + m_rows * k;
  float* scales = x + int16_scales_at(m_rows, k);
  const auto [first, end] = pack_share(k, part, parts);
  for (int64_t m = 0; m < m_rows; ++m) {
    const float* row = x + m * k;
    const float power = int16_factor(row, k);  // 2^s, or 0
    if (part == 0) scales[m] = power != 0.0f ? 1.0f / power : 0.0f;  // exact: a power of two
    const __m512 factor = _mm512_set1_ps(power);
    for (int64_t e = first; e < end; e += 16) {
      __m512i v = _mm512_setzero_si512();
      if (power != 0.0f) {  // rounded to nearest even and saturated to int16, as pack_int16 does
        v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + e), factor));
        v = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(32767)), _mm512_set1_epi32(-32768));
      }
      alignas(16) uint32_t hi[4], lo[4];  // four quads each
      _mm_store_si128(reinterpret_cast<__m128i*>(hi), _mm512_cvtepi32_epi8(_mm512_srai_epi32(v, 8)));
      _mm_store_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtepi32_epi8(v));
      for (int q = 0; q < 4; ++q) {
        std::memcpy(high + amx_int8_at(m_rows, m, e + 4 * q), &hi[q], 4);
        std::memcpy(low + amx_int8_at(m_rows, m, e + 4 * q), &lo[q], 4);
      }
    }
  }
}

void amx_int8_gemv(const Weight& w, const float* x, int64_t m_rows, int64_t begin, int64_t end, void* y,
                   int64_t y_stride) {
  const int64_t k = w.k, chunks = k / 64, stride = w.row_bytes, tile_row = 4 * m_rows;
  const uint8_t* high = reinterpret_cast<const uint8_t*>(x + m_rows * k);
  const uint8_t* low = high + m_rows * k;
  const float* inverse = x + int16_scales_at(m_rows, k);
  alignas(64) int32_t hi[kTileRows][16], lo[kTileRows][16];
  alignas(64) double sums[kTileRows][16];
  configure_tiles(5, 1 << 2, m_rows);  // W hi, W lo (int32) in 0, 1; 16 weight rows in 2; x's high, low bytes in 3, 4
  int64_t n = begin;
  for (; n + kTileRows <= end; n += kTileRows) {
    const uint8_t* rows = w.data + n * stride;
    const NextRun ahead(w, n, chunks);
    for (int r = 0; r < kTileRows; ++r)
      for (int h = 0; h < 2; ++h) _mm512_store_pd(sums[r] + 8 * h, _mm512_setzero_pd());
    for (int64_t c0 = 0; c0 < chunks; c0 += kAmxIntSegment) {
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t c = c0; c < std::min(chunks, c0 + kAmxIntSegment); ++c) {
        ahead.fetch(c);
        _tile_loadd(2, rows + c * 64, stride);
        _tile_loadd(3, high + c * 16 * tile_row, tile_row);
        _tile_loadd(4, low + c * 16 * tile_row, tile_row);
        _tile_dpbssd(0, 2, 3);
        _tile_dpbsud(1, 2, 4);
      }
      _tile_stored(0, hi, 64);
      _tile_stored(1, lo, 64);
      const __m512d by = _mm512_set1_pd(256.0);
      for (int r = 0; r < kTileRows; ++r)
        for (int h = 0; h < (m_rows + 7) / 8; ++h) {  // 8 rows of x a register: exact (integers below 2^53)
          const __m256i a = _mm256_load_si256(reinterpret_cast<const __m256i*>(hi[r] + 8 * h));
          const __m256i b = _mm256_load_si256(reinterpret_cast<const __m256i*>(lo[r] + 8 * h));
          const __m512d part = _mm512_fmadd_pd(_mm512_cvtepi32_pd(a), by, _mm512_cvtepi32_pd(b));
          _mm512_store_pd(sums[r] + 8 * h, _mm512_add_pd(_mm512_load_pd(sums[r] + 8 * h), part));
        }
    }
    for (int r = 0; r < kTileRows; ++r) {
      const float scale = row_scale(w, n + r);
      for (int64_t m = 0; m < m_rows; ++m)
        put_output(y, y_stride, m, n + r, static_cast<float>(sums[r][m]) * inverse[m] * scale, true);
    }
  }
  _tile_release();
  // Fewer than 16 weight rows left: the float32 kernels, on x itself (not rounded to int16).
  if (n < end) gemv(w, x, m_rows, n, end, y, y_stride, true);
  rerun_left_out(w, x, m_rows, inverse, begin, end, static_cast<uint16_t*>(y), y_stride);
}
