// The GEMV of bfloat16 activation rows on AVX512-BF16's dot product (VDPBF16PS: 32 bfloat16 products
// summed in pairs into 16 float32 lanes), for the compilations of qgemv_kernels.cpp with
// -DPRELOAD_BF16DOT (the avx512bf16 variant, and amx for the rows its tiles do not take), which
// include this inside their unnamed namespace: what it does not take runs that compilation's
// AVX-512 `gemv`.
//
// At decode sizes the AVX-512 kernels are bound by their own instructions, not by memory, where
// each 512-bit instruction costs two (Zen 4): per 32 elements they widen the weight into two
// float32 registers (for e2m1 a dozen shuffles, widenings and shifts then; two a register since
// e2m1_vec) and multiply-add each. Here a bfloat16 weight is multiplied as it is loaded, one
// instruction per 32 elements; int8 is widened as before and rounded into one register of
// bfloat16, exactly (8 significant bits), and e4m3 looked up in a table of bfloat16 words
// (VPERMI2W; at a few rows of x both bytes of each word, 64 elements at a time: qgemv_e4m3.h),
// exactly too (4 significant bits); and 64 e2m1 elements (32 bytes) become two
// registers of bfloat16 in four instructions: the bytes widened to words, the low nibbles looked up
// in a table of bfloat16 words (VPERMW, which reads 5 bits of each index: the table holds its 16
// words twice, so the low nibbles need no mask), the high ones shifted down and looked up. x is
// packed once per product as bfloat16 (pack_bf16dot), in order, or for e2m1 in each group of 64
// elements its 32 even-indexed ones and then its 32 odd ones, as the two registers hold the weight:
// lane i of the sums then covers elements 4i to 4i + 3 of the group, so a block of 32 (MXFP4) is 8
// lanes and a block of 16 (NVFP4) 4, and one register of block scales, spread over the lanes,
// scales a group's sums with one multiply-add. (A 2-core Zen 4, one thread, a 4096x4096 MXFP4
// weight in cache: 8.7 GB/s of packed weight on the AVX-512 kernel, 19 on this one.)
//
// Exactness as the AMX tiles': bfloat16 products are exact and summed in float32, each weight element is
// a bfloat16 value (block scales multiply the float32 sums), and x must hold bfloat16 values (bfloat16
// activations: packing is then exact). FP8's float32 scales per 128 x 128 block multiply each block's
// float32 sums (block128_rows_bf16; from 4 rows of x on two weight rows share each load of x, as
// elsewhere: 4096x4096 from memory at 8 rows of x, 2-core Zen 5, 0.99x bf16's time on the AVX-512
// kernels against 0.64-0.76x so, at 4 rows 0.55x against 0.49-0.51x). MXFP8's power-of-two scale per 32
// elements multiplies each block's sums at one and two rows of x (one multiply-add a block and row of x:
// kScaleSumsMaxM); from 3 rows on (amx: from 2, on its tiles, qgemv_amx.h) it is added to the exponents
// of its block's bfloat16 weights (a broadcast and two instructions a block, not a multiply-add a row of
// x). The scaled weights are exact wherever they stay normal bfloat16; rows with a scale outside that
// range, and from 4 rows of x the rows paired with one, run the AVX-512 kernels (e8m0_within). As
// everywhere on the dot product, products and sums below 2^-126 are flushed to zero, which with a scale
// below 1 comes sooner for folded weights than for sums scaled afterwards (the AVX-512 kernels flush
// nothing). A 2-core Zen 5, 4096x4096, builds alternated twice: 4 rows of x from memory 0.54-0.56x
// bf16's time -> 0.45-0.47x, 8 rows 0.79-0.96x -> 0.68-0.72x; one row in cache 293-311 -> 242-245 us.
// (Folding by multiplying in float32 and rounding back had cost 1.2-1.6x the AVX-512 kernels' time.)
// Float32 activations (which also have float32 outputs: everything here writes bfloat16) and K not a
// multiple of 32 (64 for e2m1) run the AVX-512 kernels.

constexpr int64_t kDotGroup = 64;  // e2m1 elements of a row per step (32 of the others)
constexpr int kDotMaxM = 8;        // activation rows per pass: more take more passes
static_assert(kDotMaxM == kIntDotRows, "qgemv_int16.h's int16_takes sizes this pass's x");

// Whether bfloat16 rows of x times w run here (then x gets its packed copy), or on the AVX-512 kernels.
inline bool bf16dot_takes(const Weight& w) {
  return w.k % (w.element == kE2M1 ? kDotGroup : kChunk) == 0;
}

#include "qgemv_e4m3.h"  // in this namespace: e4m3 straight to bfloat16

// The chunks of each e4m3 row that the dot product decodes in pairs (e4m3_bf16_pair) for m_rows rows of
// x, x packed to match (pack_bf16dot): every whole group of 64 up to kDotPairMaxM rows, none from there
// on; one choice for all of a product's passes. At a few rows the decode bounds a step: five
// instructions for 64 elements against six for 32 (a 2-core Zen 4, 2 threads, 4096x4096, medians of 4
// runs, builds alternated, us at 1, 2 and 4 rows of x in cache: FP8 per channel 378 -> 280, 522 -> 406,
// 608 -> 472; MXFP8 499 -> 324, 660 -> 529, 760 -> 647; FP8 blocks at 1 and 2 rows 476 -> 341, 608 ->
// 488, and at 3 and 4, with one bank of block sums a pair (block128_rows_bf16), 752 -> 658, 784 -> 649;
// from memory at 2 and 4 rows FP8 per channel 596 -> 526, 698 -> 630, MXFP8 736 -> 651, 882 -> 738, FP8
// blocks at 4 rows 936 -> 809; at one row, bound by memory, alike). Paired at every count of rows, FP8
// blocks took longer at 8 rows (1293 -> 1630 us in cache, 1359 -> 1696 from memory) and FP8 per channel
// from memory from 8 (999 -> 1059): two weight registers more a row, beside each row of x's
// accumulators.
constexpr int64_t kDotPairMaxM = 4;
inline int64_t dot_paired_chunks(const Weight& w, int64_t m_rows) {
  return m_rows <= kDotPairMaxM ? e4m3_paired_chunks(w) : 0;
}

// The permutation of 16 words in kE2M1Order that leaves the 8 even-indexed elements first, then the
// 8 odd ones (a VPERMW index).
struct EvenOdd {
  uint16_t index[16] = {};
  constexpr EvenOdd() {
    for (int p = 0; p < 16; ++p) index[kE2M1Order[p] % 2 * 8 + kE2M1Order[p] / 2] = static_cast<uint16_t>(p);
  }
};
constexpr EvenOdd kEvenOdd;

// x's bfloat16 copy after x, row m's words at m * k: in order, or for e2m1 each group of 64 as its 32
// even-indexed elements, then its 32 odd ones, and for e4m3's paired chunks (dot_paired_chunks) as
// e4m3_bf16_pair decodes them. x comes in the kernels' order (qgemv_kernels.h): for
// e2m1 each group of 16 in kE2M1Order, so each quarter of a group is one conversion, one
// permutation and two stores; the others in order.
void pack_bf16dot(float* x, int64_t m_rows, const Weight& w, int part, int parts) {
  if (int16_takes(w, m_rows)) return pack_int16(x, m_rows, w, part, parts);
  if (!bf16dot_takes(w)) return;
  const int64_t paired = dot_paired_chunks(w, m_rows);
  static_assert(!kBF16Order, "pack_bf16dot reads x in order for bfloat16 weights");
  const __m256i even_odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kEvenOdd.index));
  uint16_t* words = reinterpret_cast<uint16_t*>(x + m_rows * w.k);
  const auto [first, end] = pack_share(w.k, part, parts);
  for (int64_t m = 0; m < m_rows; ++m)
    for (int64_t i = m * w.k + first; i < m * w.k + end; i += 16) {
      __m256i both = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
      // These 16 elements' halves go 32 words apart: for e4m3's paired chunks 8 and 8, as
      // e4m3_bf16_pair decodes them; for e2m1 the even-indexed ones and the odd ones.
      const int64_t e = i % w.k, at = i - e % kDotGroup;  // e within its row; at: its group's first
      uint16_t* group;
      if (e < paired * kChunk) {
        group = words + at + e % kDotGroup / 16 * 8;
      } else if (w.element == kE2M1) {
        both = _mm256_permutexvar_epi16(even_odd, both);
        group = words + at + e % kDotGroup / 2;
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + i), both);
        continue;
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(group), _mm256_castsi256_si128(both));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(group + kDotGroup / 2), _mm256_extracti128_si256(both, 1));
    }
}

// Every e2m1 code's bfloat16 (kE2M1Values' high halves: each value is a bfloat16 exactly), twice: a
// VPERMW table of 32 words (VPERMW reads the low 5 bits of each index: bit 4 may hold anything).
struct E2M1Bf16x2 {
  alignas(64) uint16_t words[32] = {};
  constexpr E2M1Bf16x2() {
    for (int i = 0; i < 32; ++i) words[i] = static_cast<uint16_t>(std::bit_cast<uint32_t>(kE2M1Values[i % 16]) >> 16);
  }
};
constexpr E2M1Bf16x2 kE2M1Bf16x2;
static_assert(kE2M1Bf16x2.words[3] == 0x3FC0 && kE2M1Bf16x2.words[24] == 0x8000 && kE2M1Bf16x2.words[31] == 0xC0C0,
              "1.5, -0 and -6 as bfloat16");

// An e8m0 code's power of two, 2^(code - 127), as what adds it to a bfloat16's exponent, in every word.
inline __m512i e8m0_exponent(uint8_t code) { return _mm512_set1_epi16(static_cast<int16_t>((code - 127) << 7)); }

// Whether each of row n's e8m0 codes lies in [lo, hi], where its block's values times its scale are
// normal bfloat16 (and the scale is not NaN, 255): then the scales fold into the weight exactly.
inline bool e8m0_within(const Weight& w, int64_t n, uint8_t lo, uint8_t hi) {
  const uint8_t* codes = static_cast<const uint8_t*>(w.scale) + n * w.scale_cols;
  const int64_t count = w.k / w.block;
  for (int64_t b = 0; b < count; b += 64) {
    const __mmask64 live = count - b >= 64 ? ~__mmask64(0) : (__mmask64(1) << (count - b)) - 1;
    const __m512i c = _mm512_maskz_loadu_epi8(live, codes + b);
    if (_mm512_mask_cmplt_epu8_mask(live, c, _mm512_set1_epi8(char(lo))) |
        _mm512_mask_cmpgt_epu8_mask(live, c, _mm512_set1_epi8(char(hi))))
      return false;
  }
  return true;
}

// Below 4 rows of x, one weight row at a time, front to back, with the weight kDotAhead bytes ahead
// prefetched: rows read side by side (as the AVX-512 kernels step 4 of them) stream at ~17 GB/s
// from memory on a 2-core Zen 4, a row at a time at ~29 (a 4096x4096 bfloat16 weight, 2 threads; a
// 49152x576 one: 17 and 28). From 4 rows of x on, the loads of x bound a step instead, and two
// weight rows share each (plain_rows_bf16); a step then takes longer per byte, and kDotWideAhead
// covers the memory's latency (a 2-core Zen 5, 49152x576 bfloat16 from memory, 2 threads: 4 rows of
// x 1.37 -> 0.98 ms, 8 rows 1.55 -> 1.40; one thread, 8 rows, 0.42 -> 0.27 ns a dot product).
// e2m1 rows pair up likewise (e2m1_rows_bf16; 4096x4096 MXFP4 and NVFP4 from memory, builds
// alternated twice: 4 rows of x 0.59-0.66x bf16's time -> 0.32-0.34x, 8 rows 0.83-1.07x ->
// 0.67-0.85x; in cache at 4 rows 448 -> 270 us).
// Since the prefetches go into L2 (prefetch_weight), a row at a time asks kDotAhead = 8 KiB ahead, not 4:
// 4 KiB was enough from memory, but not from L3, whose latency the single stream then waited on (a
// 2-core Zen 4, 2 threads, minimum of 200 calls, builds alternated: 4096x4096 bfloat16 in cache at
// one row of x 533-786 -> 424-598 us, at 2 rows 626-651 -> 443-494, at 3 rows 732-759 -> 554-570,
// int8 at 3 rows 540-547 -> 485-505; 49152x576 1.31-1.51 -> 0.99-1.40 ms; from memory, 184320x576
// 6.05-7.91 vs 6.28-7.79 ms, and int8 and FP8 at one row, alike).
constexpr int64_t kDotAhead = 8192;
constexpr int64_t kDotWideAhead = 16384;
// Those prefetches put the weight in L2, not L1 (prefetch_weight). L1 (32 KiB on Zen 4) cannot hold
// 16 KiB of weight on its way besides x and the rows being read, so prefetches into it evicted each
// other before their loads came (a 2-core Zen 4, 2 threads, 184320x576 bfloat16 from memory,
// minimum of 55 calls, builds alternated: 4 rows of x 13.1-14.7 -> 7.8-8.8 ms, 8 rows 15.2-17.7 ->
// 8.3-9.3, one row 7.5-9.3 -> 5.8-8.4 (the hint alone, six times: 7.7-8.2 -> 6.5-7.0); int8 at one
// row 4.1-5.8 -> 3.8-4.0, at 8 alike; FP8, MXFP4 and NVFP4 at one row alike).
// e2m1 rows take longer per byte and prefetch further ahead (a 2-core Zen 5, a 4096x4096 weight from
// memory: NVFP4 0.30-0.37 -> 0.27-0.29 ms, MXFP4 0.27-0.29 -> 0.26; the other formats are slower so).
constexpr int64_t kE2M1Ahead = 16384;

// Accumulators a row's M sums are split across: enough chains to hide the dot product's latency (on a
// 2-core Zen 5, 16 chains run 1.6x as many dot products a second as 8 do, 8 chains 2x as many as 4).
template <int M>  // M: rows of x times rows of the weight; at most 16 accumulators from 3 on (no spills)
constexpr int kDotBanks = M <= 2 ? 8 : M >= 16 ? 1 : 16 / M;

template <int kBanks, int M>
inline void reduce_banks(__m512 (&acc)[kBanks][M], float* sums) {
  for (int m = 0; m < M; ++m)
    for (int b = 1; b < kBanks; ++b) acc[0][m] = vadd(acc[0][m], acc[b][m]);
  vsums<M>(acc[0], sums);
}

// Rows [n, n + R) of e2m1 times the M rows of packed x: sums[r * M + m], scaled (MX and NVFP4 have no
// row scale). kBlocks: scales per group of 64 (2 for MXFP4's blocks of 32, 4 for NVFP4's of 16).
template <int kBlocks, int M, int R>
void e2m1_rows_bf16(const Weight& w, const uint16_t* xp, int64_t n, float* sums) {
  const __m512i table = _mm512_load_si512(kE2M1Bf16x2.words);  // VPERMW reads a byte's low nibble and one bit more
  // Lane i of a group's sums is in the group's block i / (16 / kBlocks): group q of the 16 / kBlocks
  // groups whose scales one register holds takes its lanes' scales from spread[q]. Each group's dots
  // start from zero, so only the scaled sums chain from group to group (kBanks of them).
  constexpr int kGroups = 16 / kBlocks, kBanks = M == 1 ? 4 : R * M <= 4 ? 2 : 1;
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i spread[kGroups];
  for (int q = 0; q < kGroups; ++q)
    spread[q] = _mm512_add_epi32(_mm512_srli_epi32(lanes, kBlocks == 2 ? 3 : 2), _mm512_set1_epi32(q * kBlocks));
  const int64_t groups = w.k / kDotGroup;
  __m512 acc[kBanks][R * M];  // acc[b][r * M + m]
  zero(acc);
  for (int64_t g0 = 0; g0 < groups; g0 += kGroups) {
    __m512 scales[R];
    for (int r = 0; r < R; ++r) scales[r] = scales16(w, n + r, g0 * kBlocks);
    unrolled<kGroups>([&]<int q>() __attribute__((always_inline)) {
      const int64_t g = g0 + q;
      if (g >= groups) return;
      __m512bh even[R], odd[R];
      __m512 scale[R];
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w.data + (n + r) * w.row_bytes + g * (kDotGroup / 2);
        prefetch_weight(p, q * (kDotGroup / 2), kE2M1Ahead);  // every other group: g0 steps by an even kGroups
        const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        even[r] = (__m512bh)_mm512_permutexvar_epi16(codes, table);
        odd[r] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), table);
        scale[r] = _mm512_permutexvar_ps(spread[q], scales[r]);
      }
      for (int m = 0; m < M; ++m) {
        const uint16_t* x = xp + m * w.k + g * kDotGroup;
        const __m512bh x0 = (__m512bh)_mm512_loadu_si512(x), x1 = (__m512bh)_mm512_loadu_si512(x + kDotGroup / 2);
        for (int r = 0; r < R; ++r) {
          const __m512 dots = _mm512_dpbf16_ps(_mm512_dpbf16_ps(vzero(), even[r], x0), odd[r], x1);
          acc[q % kBanks][r * M + m] = _mm512_fmadd_ps(dots, scale[r], acc[q % kBanks][r * M + m]);
        }
      }
    });
  }
  reduce_banks(acc, sums);
}

// Rows of x up to which MXFP8's scales multiply each block's sums, not its weights (see the top): at 2
// rows the multiply-adds cost less than folding (three instructions a pair of chunks against a dozen),
// at 3 and 4 about as much (a 2-core Zen 4, 4096x4096 at 2 rows of x, medians of 5-6 runs, builds
// alternated: 542 -> 492 us in cache, 646 -> 568 from memory).
constexpr int kScaleSumsMaxM = 2;

// MXFP8 codes within which e4m3 (times 2^-8: 2^-17 to 1.75) times 2^(code - 127) is normal bfloat16.
constexpr uint8_t kMxfp8Fold[2] = {18, 254};

// 32 elements of a bfloat16, int8 or e4m3 row (e4m3 times 2^-8, as decode32 leaves it) as bfloat16,
// in order.
template <int kElem>
inline __m512bh decode32_bf16(const uint8_t* p) {
  if constexpr (kElem == kBF16) {
    return (__m512bh)_mm512_loadu_si512(p);
  } else if constexpr (kElem == kE4M3) {
    return e4m3_bf16(p);
  } else {
    Vec v[kVecs];
    decode32<kElem>(p, v);
    return _mm512_cvtne2ps_pbh(v[1], v[0]);
  }
}

// Rows [n, n + R) of bfloat16, int8 or e4m3 (one scale per row), or of MXFP8 whose scales fold into
// the weight (e8m0_within), times the M rows of packed x: sums[r * M + m], before the row scale and
// kFactor. R > 1 loads each x register once for R weight rows: from 4 rows of x on, the loads (one
// per dot product at R = 1) bound a step, not memory.
template <int kElem, int kMode, int M, int R>
void plain_rows_bf16(const Weight& w, const uint16_t* xp, int64_t n, int64_t paired, float* sums) {
  constexpr int kBanks = kDotBanks<M * R>;
  constexpr int64_t kAhead = M >= 4 ? kDotWideAhead : kDotAhead;
  // MXFP8: its scales multiply each block's sums up to kScaleSumsMaxM rows of x (R = 1 there), else
  // fold into the weight.
  constexpr bool kScaleSums = kMode == kBlock32Scale && M <= kScaleSumsMaxM;
  constexpr bool kScaled = kMode == kBlock32Scale && !kScaleSums;
  const int64_t chunks = w.k / kChunk;
  __m512 acc[kBanks][R * M];  // acc[b][r * M + m]
  zero(acc);
  const uint8_t* codes[R];  // MXFP8: each row's e8m0 codes, one a chunk
  for (int r = 0; r < R; ++r) codes[r] = static_cast<const uint8_t*>(w.scale) + (n + r) * w.scale_cols;
  alignas(64) float scales[16];  // MXFP8 up to kScaleSumsMaxM rows of x: the next 16 chunks' scales
  auto step = [&](int64_t c, __m512(&a)[R * M]) __attribute__((always_inline)) {
    __m512bh v[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = w.data + (n + r) * w.row_bytes + c * kChunkBytes<kElem>;
      prefetch_weight(p, c * kChunkBytes<kElem>, kAhead);
      if constexpr (kScaled) v[r] = e4m3_bf16<true>(p, e8m0_exponent(codes[r][c]));
      else v[r] = decode32_bf16<kElem>(p);
    }
    if constexpr (kScaleSums) {
      if (c % 16 == 0) _mm512_store_ps(scales, scales16(w, n, c));
      const __m512 scale = vset(scales[c % 16]);
      for (int m = 0; m < M; ++m) {
        const __m512 dots = _mm512_dpbf16_ps(vzero(), v[0], (__m512bh)_mm512_loadu_si512(xp + m * w.k + c * kChunk));
        a[m] = vfma(dots, scale, a[m]);
      }
      return;
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh x = (__m512bh)_mm512_loadu_si512(xp + m * w.k + c * kChunk);
      for (int r = 0; r < R; ++r) a[r * M + m] = _mm512_dpbf16_ps(a[r * M + m], v[r], x);
    }
  };
  int64_t c = 0;
  if constexpr (kElem == kE4M3) {  // pairs of chunks, pair b of a round into banks b and b + kBanks / 2
    auto pair = [&](int64_t c, __m512(&a0)[R * M], __m512(&a1)[R * M]) __attribute__((always_inline)) {
      if (kScaleSums && c % 16 == 0) _mm512_store_ps(scales, scales16(w, n, c));
      e4m3_pair_dots<kScaled, kScaleSums, M, R>(w, xp, n, c, kAhead, codes, scales, a0, a1);
    };
    for (; c + 2 * kBanks <= paired; c += 2 * kBanks)
      unrolled<kBanks>([&]<int b>() __attribute__((always_inline)) {
        pair(c + 2 * b, acc[b], acc[(b + kBanks / 2) % kBanks]);
      });
    for (; c < paired; c += 2) pair(c, acc[0], acc[kBanks / 2]);
  }
  for (; c + kBanks <= chunks; c += kBanks)
    unrolled<kBanks>([&]<int b>() __attribute__((always_inline)) { step(c + b, acc[b]); });
  for (; c < chunks; ++c) step(c, acc[0]);
  reduce_banks(acc, sums);
}

// Rows [n, n + R) of e4m3 with float32 scales per 128 x 128 block (FP8 block) times the M rows of
// packed x: sums[r * M + m], scaled but for kFactor. Each block's 4 chunks are summed apart, in
// kParts banks, then scaled into the rows' sums. Up to 4 sums (R * M) a block's dot products chain
// in one bank: each block's banks start from zero, so the next block's chains run beside this one's
// in the core's out-of-order window, and a bank a chunk (as before) only added 3 adds a block (a
// 2-core Zen 4, 4096x4096 in cache, two sets of runs with the builds alternated 5 and 6 times,
// medians: 2 rows of x 546 -> 469 and 508 -> 472 us; 1 row 373 -> 324, then alike, 348 -> 350; 3
// rows 639 -> 613 and 653 -> 651; from memory alike; not measured on amx, which runs this at one
// row). At 5 to 8 sums two banks (only the chunks that do not pair use the second: e4m3_pair_dots
// chains a pair's two).
template <int M, int R>
void block128_rows_bf16(const Weight& w, const uint16_t* xp, int64_t n, int64_t paired, float* sums) {
  constexpr int kBlockChunks = 128 / kChunk, kParts = R * M > 4 && R * M <= 8 ? 2 : 1;
  constexpr int64_t kAhead = M >= 4 ? kDotWideAhead : kDotAhead;
  const int64_t chunks = w.k / kChunk;
  __m512 acc[R * M];  // acc[r * M + m]
  for (int i = 0; i < R * M; ++i) acc[i] = vzero();
  auto step = [&](int64_t c, __m512(&bank)[R * M]) __attribute__((always_inline)) {
    __m512bh v[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = w.data + (n + r) * w.row_bytes + c * kChunkBytes<kE4M3>;
      prefetch_weight(p, c * kChunkBytes<kE4M3>, kAhead);
      v[r] = decode32_bf16<kE4M3>(p);
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh x = (__m512bh)_mm512_loadu_si512(xp + m * w.k + c * kChunk);
      for (int r = 0; r < R; ++r) bank[r * M + m] = _mm512_dpbf16_ps(bank[r * M + m], v[r], x);
    }
  };
  for (int64_t c0 = 0; c0 < chunks; c0 += kBlockChunks) {
    __m512 part[kParts][R * M];
    zero(part);
    // A whole block is paired whole, or not at all (paired chunks are all but an odd count's last).
    if (c0 + kBlockChunks <= paired) {
      unrolled<kBlockChunks / 2>([&]<int b>() __attribute__((always_inline)) {
        e4m3_pair_dots<false, false, M, R>(w, xp, n, c0 + 2 * b, kAhead, nullptr, nullptr, part[0], part[0]);
      });
    } else if (c0 + kBlockChunks <= chunks) {
      unrolled<kBlockChunks>([&]<int b>() __attribute__((always_inline)) { step(c0 + b, part[b % kParts]); });
    } else {  // a last block narrower than 128
      int64_t c = c0;
      for (; c < paired; c += 2)
        e4m3_pair_dots<false, false, M, R>(w, xp, n, c, kAhead, nullptr, nullptr, part[0], part[0]);
      for (; c < chunks; ++c) step(c, part[0]);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 scale = vset(block_scale(w, n + r, c0 / kBlockChunks));
      for (int m = 0; m < M; ++m) {
        for (int b = 1; b < kParts; ++b) part[0][r * M + m] = vadd(part[0][r * M + m], part[b][r * M + m]);
        acc[r * M + m] = vfma(part[0][r * M + m], scale, acc[r * M + m]);
      }
    }
  }
  vsums<R * M>(acc, sums);
}

// Rows [n, n + R) times the M rows of packed x into y (bfloat16). From 3 rows of x, MXFP8 rows whose
// scales do not fold into the weight (e8m0_within) run the AVX-512 kernels on x's float32 rows, with
// the row paired with them.
template <int kElem, int kMode, int M, int R>
inline void bf16dot_rows(const Weight& w, const float* x, const uint16_t* xp, int64_t n, int64_t paired,
                         uint16_t* y, int64_t y_stride) {
  alignas(64) float sums[kPadded<R * M>];
  if constexpr (kElem == kE4M3 && kMode == kBlock32Scale && M > kScaleSumsMaxM) {
    for (int r = 0; r < R; ++r)
      if (!e8m0_within(w, n + r, kMxfp8Fold[0], kMxfp8Fold[1]))
        return gemv(w, x, M, n, n + R, y, y_stride, true);  // as the AVX-512 variant runs them: the same bits
  }
  if constexpr (kElem == kE2M1) {
    e2m1_rows_bf16<kMode == kBlock16Scale ? 4 : 2, M, R>(w, xp, n, sums);
  } else if constexpr (kMode == kBlock128Scale) {
    block128_rows_bf16<M, R>(w, xp, n, paired, sums);
  } else {
    plain_rows_bf16<kElem, kMode, M, R>(w, xp, n, paired, sums);
  }
  float scales[R];
  for (int r = 0; r < R; ++r) scales[r] = output_scale<kElem, kMode>(w, n + r);
  put_outputs_bf16<R, M>(sums, nullptr, scales, R, y, y_stride, n);
}

// A pass takes weight rows two at a time from 4 rows of x on, and the last one of an odd range
// alone, whose sums run in another order: a row's bits depend on where its range starts. Callers
// split N at even rows (block_unit and in_passes' tiles are even), so every row's bits are the same
// however the work is split, as the AVX-512 kernels' are.
template <int kElem, int kMode, int M>
void bf16dot_pass(const Weight& w, const float* x, const uint16_t* xp, int64_t begin, int64_t end, int64_t paired,
                  uint16_t* y, int64_t y_stride) {
  constexpr int R = M >= 4 ? 2 : 1;
  int64_t n = begin;
  for (; n + R <= end; n += R) bf16dot_rows<kElem, kMode, M, R>(w, x, xp, n, paired, y, y_stride);
  for (; n < end; ++n) bf16dot_rows<kElem, kMode, M, 1>(w, x, xp, n, paired, y, y_stride);
}

using Bf16DotFn = void (*)(const Weight&, const float*, const uint16_t*, int64_t, int64_t, int64_t, uint16_t*,
                           int64_t);

template <int kElem, int kMode, int... Ms>
Bf16DotFn bf16dot_for(int m, std::integer_sequence<int, Ms...>) {
  static constexpr Bf16DotFn passes[] = {&bf16dot_pass<kElem, kMode, Ms + 1>...};
  return passes[m - 1];
}

// More than kDotMaxM activation rows take several passes, as gemv's.
void gemv_bf16dot(const Weight& w, const float* x, int64_t m_rows, int64_t begin, int64_t end, void* y,
                  int64_t y_stride, bool bf16) {
  if (bf16 && int16_takes(w, m_rows)) return gemv_int16(w, x, m_rows, begin, end, y, y_stride, bf16);
  if (!bf16 || !bf16dot_takes(w)) return gemv(w, x, m_rows, begin, end, y, y_stride, bf16);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x + m_rows * w.k);
  const int64_t paired = dot_paired_chunks(w, m_rows);  // as pack_bf16dot packed x
  in_passes<kDotMaxM>(w, m_rows, begin, end, [&](int64_t m0, int m, int64_t start, int64_t stop) {
    const Bf16DotFn pass = with_format(w, [m]<int kElem, int kMode>() {
      return bf16dot_for<kElem, kMode>(m, std::make_integer_sequence<int, kDotMaxM>{});
    });
    pass(w, x + m0 * w.k, xp + m0 * w.k, start, stop, paired, static_cast<uint16_t*>(y) + m0 * y_stride, y_stride);
  });
}
