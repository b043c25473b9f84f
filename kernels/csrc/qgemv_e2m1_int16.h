// MXFP4's and NVFP4's e2m1 weights times one or two rows of bfloat16 activations on AVX512-VNNI's
// integer multiply-adds, for the amx compilation of qgemv_kernels.cpp (Intel's cores), which
// includes this from qgemv_int16.h inside its unnamed namespace: x is packed as pack_int16 packs it
// for int8 weights (each row times the power of two that brings its largest magnitude into
// [2^14, 2^15), rounded to int16), laid out for e2m1 here.
//
// At one and two rows of x the bfloat16 dot product (qgemv_bf16dot.h) was bound by VDPBF16PS, not
// by memory: on Emerald Rapids one a 2-3 cycles (VPDPWSSD and FMA: about two a cycle), two per 64
// elements and row of x. Every e2m1 value times 2 is an integer (0, 1, 2, 3, 4, 6, 8, 12 and their
// negatives), so here VPERMW looks the codes up as int16 words and VPDPWSSD multiplies them by x's
// int16 and sums them exactly in int32 lanes; each step's sums go into float32 once, times their
// blocks' scales. No widening either: 64 bytes of weight are read as 32 words, each holding the
// nibbles of 4 elements, and shifted right by 0, 4, 8 and 12 (VPERMW reads the low 5 bits of each
// index; the table holds its 16 words twice), so register s holds element 4j + s of the step's 128
// in word j, and x comes in that order (pack_int16_e2m1). Lane i of the sums then covers elements
// 8i to 8i + 7: a block of 32 (MXFP4) is 4 lanes, one of 16 (NVFP4) 2. A 2-core Emerald Rapids, two
// threads, 4096x4096, medians of 50 calls, builds alternated: MXFP4 at one row of x 504 -> 316 us in
// cache, 508 -> 425 from memory (bfloat16's 1413: 0.30x), NVFP4 517 -> 360 and 541 -> 474; at two
// rows, against the tiles, MXFP4 511 -> 445 and 581 -> 476, NVFP4 532 -> 459 and 658 -> 496. From 3
// rows the tiles win (MXFP4 at 3 and 4 rows 495-553 us in cache against 677-945 here).
//
// Exactness as qgemv_int16.h's: the products and sums are exact integers (8 a lane a step, each
// under 12 * 2^15), and only x's elements more than 2^7 below its largest are rounded, by at most
// 2^-15 of the largest. A row of x the packing leaves out (a NaN, an infinity, or all below 2^-112)
// runs the float32 kernels, as there.

constexpr int64_t kE2M1IntAhead = 16384;  // bytes of the row prefetched ahead, as qgemv_bf16dot.h's e2m1

// The int16 word of each e2m1 code, the value times 2, twice (a VPERMW table of 32 words).
struct E2M1Int16x2 {
  alignas(64) int16_t words[32] = {};
  constexpr E2M1Int16x2() {
    for (int i = 0; i < 32; ++i) words[i] = static_cast<int16_t>(kE2M1Values[i % 16] * 2.0f);
  }
};
constexpr E2M1Int16x2 kE2M1Int16x2;
static_assert(kE2M1Int16x2.words[7] == 12 && kE2M1Int16x2.words[9] == -1 && kE2M1Int16x2.words[24] == 0,
              "6, -0.5 and -0 times 2");

// For each position o of 16 packed words, where in 16 of x in kE2M1Order (as qgemv.cpp reorders x)
// its element is: the words for s = 0 to 3 (4 each) hold the 16 elements 4jj + s, jj = 0 to 3.
struct E2M1Int16From {
  alignas(64) int32_t at[16] = {};
  constexpr E2M1Int16From() {
    for (int o = 0; o < 16; ++o)
      for (int p = 0; p < 16; ++p)
        if (kE2M1Order[p] == 4 * (o % 4) + o / 4) at[o] = p;
  }
};
constexpr E2M1Int16From kE2M1Int16From;

// pack_int16 for e2m1 weights: each 16 of x (one 16th of a step, or of a last half step) times 2^s,
// rounded to nearest even and saturated as pack_int16 does, its 4 words for each s stored apart. A
// step's elements [first, first + w) (w = 128, or 64 for a row's last half step) lie in its packed
// row with element first + 4j + s at first + s * w / 4 + j.
void pack_int16_e2m1(float* x, int64_t m_rows, const Weight& w, int part, int parts) {
  int16_t* words = reinterpret_cast<int16_t*>(x + m_rows * w.k);
  float* scales = x + int16_scales_at(m_rows, w.k);
  const __m512i from = _mm512_load_si512(kE2M1Int16From.at);
  const auto [first, end] = pack_share(w.k, part, parts);
  for (int64_t m = 0; m < m_rows; ++m) {
    const float* row = x + m * w.k;
    int16_t* out = words + m * w.k;
    const float power = int16_factor(row, w.k);  // 2^s, or 0
    if (part == 0) scales[m] = power != 0.0f ? 1.0f / power : 0.0f;  // exact: a power of two
    for (int64_t i = first; i < end; i += 16) {
      const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(row + i), _mm512_set1_ps(power));
      const __m512i ints = power != 0.0f ? _mm512_permutexvar_epi32(from, _mm512_cvtps_epi32(scaled))
                                         : _mm512_setzero_si512();  // a row the float32 kernels take
      const __m256i packed = _mm512_cvtsepi32_epi16(ints);
      const int64_t step = i / kE2M1IntGroup * kE2M1IntGroup, quarter = lesser(kE2M1IntGroup, w.k - step) / 4;
      const int64_t at = step + (i - step) / 4;  // s = 0: i is a multiple of 16
      const __m128i low = _mm256_castsi256_si128(packed), high = _mm256_extracti128_si256(packed, 1);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + at), low);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + at + quarter), _mm_unpackhi_epi64(low, low));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + at + 2 * quarter), high);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + at + 3 * quarter), _mm_unpackhi_epi64(high, high));
    }
  }
}

// Row n of the weight times the M packed rows of x from xq: sums[m]. `unit[m]`: row m's 2^-s over the
// table's factor 2, which each step's integer sums are multiplied by first, exactly (a power of two
// no smaller than 2^-127 times an integer), so that the block scales multiply sums of the products'
// own size, as on the dot product (which a large block scale could otherwise overflow).
template <int kMode, int M>
void e2m1_int16_rows(const Weight& w, const int16_t* xq, int64_t n, const float* unit, float* sums) {
  constexpr int kBlocks = kMode == kBlock16Scale ? 8 : 4;  // blocks a step
  constexpr int kSteps = 16 / kBlocks;                     // steps a register of scales covers
  constexpr int kBanks = M == 1 ? 4 : 2;
  const __m512i table = _mm512_load_si512(kE2M1Int16x2.words);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i spread[kSteps];  // step q of a register's: lane i's block
  for (int q = 0; q < kSteps; ++q)
    spread[q] = _mm512_add_epi32(_mm512_srli_epi32(lanes, kBlocks == 8 ? 1 : 2), _mm512_set1_epi32(q * kBlocks));
  const uint8_t* row = w.data + n * w.row_bytes;
  const int64_t steps = (w.k + kE2M1IntGroup - 1) / kE2M1IntGroup;
  __m512 acc[kBanks][M];
  for (int b = 0; b < kBanks; ++b)
    for (int m = 0; m < M; ++m) acc[b][m] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < steps; g0 += kSteps) {
    const __m512 scales = scales16(w, n, g0 * kBlocks);
    unrolled<kSteps>([&]<int q>() __attribute__((always_inline)) {
      const int64_t g = g0 + q, first = g * kE2M1IntGroup;
      if (g >= steps) return;
      const uint8_t* p = row + first / 2;
      const bool whole = w.k - first >= kE2M1IntGroup;
      __m512i codes;
      if (whole) {
        prefetch_weight(p, first / 2, kE2M1IntAhead);
        codes = _mm512_loadu_si512(p);
      } else {  // a last half step: 32 bytes, 16 words of x for each s; the rest zeros (code 0 is +0)
        codes = _mm512_maskz_loadu_epi8(0xFFFFFFFFull, p);
      }
      const __m512i v0 = _mm512_permutexvar_epi16(codes, table);
      const __m512i v1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), table);
      const __m512i v2 = _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 8), table);
      const __m512i v3 = _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 12), table);
      const __m512 scale = _mm512_permutexvar_ps(spread[q], scales);
      for (int m = 0; m < M; ++m) {
        const int16_t* xs = xq + m * w.k + first;
        __m512i x[4];
        for (int s = 0; s < 4; ++s)
          x[s] = whole ? _mm512_loadu_si512(xs + 32 * s) : _mm512_maskz_loadu_epi16(0xFFFF, xs + 16 * s);
        const __m512i even = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), v0, x[0]), v2, x[2]);
        const __m512i odd = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), v1, x[1]), v3, x[3]);
        const __m512 step = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(even, odd)), _mm512_set1_ps(unit[m]));
        acc[q % kBanks][m] = _mm512_fmadd_ps(step, scale, acc[q % kBanks][m]);
      }
    });
  }
  for (int m = 0; m < M; ++m) {
    for (int b = 1; b < kBanks; ++b) acc[0][m] = _mm512_add_ps(acc[0][m], acc[b][m]);
    sums[m] = _mm512_reduce_add_ps(acc[0][m]);
  }
}

template <int kMode, int M>
void e2m1_int16_pass(const Weight& w, const int16_t* xq, const float* inverse, int64_t begin, int64_t end,
                     uint16_t* y, int64_t y_stride) {
  float unit[M], sums[M];
  for (int m = 0; m < M; ++m) unit[m] = 0.5f * inverse[m];
  for (int64_t n = begin; n < end; ++n) {
    e2m1_int16_rows<kMode, M>(w, xq, n, unit, sums);
    for (int m = 0; m < M; ++m) y[m * y_stride + n] = to_bf16(sums[m]);
  }
}

// gemv_int16 for e2m1 weights: the rows of x the packing left out run the float32 kernels after.
void gemv_int16_e2m1(const Weight& w, const float* x, const int16_t* xq, const float* inverse, int64_t m_rows,
                     int64_t begin, int64_t end, uint16_t* y, int64_t y_stride) {
  with_format(w, [&]<int kElem, int kMode>() {
    if constexpr (kElem == kE2M1) {
      static_assert(kE2M1IntMaxM <= 2);
      if (m_rows == 1) e2m1_int16_pass<kMode, 1>(w, xq, inverse, begin, end, y, y_stride);
      else e2m1_int16_pass<kMode, 2>(w, xq, inverse, begin, end, y, y_stride);
    }
  });
  rerun_left_out(w, x, m_rows, inverse, begin, end, y, y_stride);
}
