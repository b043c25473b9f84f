// The GEMV of int8 weights times rows of bfloat16 activations on integer multiply-adds, for every
// compilation of qgemv_kernels.cpp, which includes this inside its unnamed namespace: on AVX2 and
// AVX-512 at every count of rows of x; with AVX512-BF16 for 1 to 4 rows, and more where x outgrows
// L1 (int16_takes), the bfloat16 dot product (qgemv_bf16dot.h) taking the rest; with AMX for 1 and 2
// rows (and 3 and 4 where K is no multiple of 64), where its tiles take more.
//
// At a few rows of x the float32 kernels are bound by their multiply-adds, not by memory: 8 (AVX2)
// or 16 products per instruction, one instruction per row of x and register of weight. VPMADDWD
// multiplies 16 (32) pairs of int16 and sums them in pairs into int32 lanes: twice the products per
// instruction, and a sum whose add has a latency of one cycle (AVX512-VNNI's VPDPWSSD adds in the
// same instruction). On a 2-core Zen 4, independent 256-bit VPMADDWD and VPADDD ran 93 G products/s
// on one core, FMA 52-55 G. The default model's int8 projections (two threads, in cache, libraries
// alternated) took 0.3-0.6x their float32 time at 8 rows of x and 0.4-0.7x at 2-4 on the AVX2
// kernels, and with AVX512-BF16 0.4-0.7x the dot product's at 2-3 rows, 0.6-1.1x at 4 (even at 5;
// the dot product wins from 6 on). The weight widens to int16 in one instruction a register (to float32 two a
// register of 8 or 16, to bfloat16 five for 32). At one row of x, where each widened register is
// used once, that widening is most of the float32 and bfloat16 paths' work, so one row runs here
// too: a 4096x4096 int8 weight in cache took 283 against 429 us on the AVX2 kernels, 290 against
// 362 on AVX-512's and 270 against 405 on the dot product's (2-core Zen 4, builds alternated;
// from memory AVX2's 596 against 719, the others alike), and the default model's int8 layers at
// one sequence, all in one call, 4.2 against 5.0 ms (AVX2) and 4.6 against 5.8 (AVX512-BF16, 560
// positions cached; AVX-512's alike).
//
// x is packed once per product (pack_int16): each row times a power of two, 2^s, that brings its
// largest magnitude into [2^14, 2^15), rounded to int16. Every bfloat16 value of a row within 2^7 of
// its largest is an integer then, exactly; smaller ones are rounded by at most 2^-15 of the largest
// (bfloat16 itself keeps 2^-9 of each value). The products and their sums are exact integers; each
// 2048 elements of a row (under 2^31 in any lane: |int8| <= 128, |x| < 2^15) go into float32, and
// the sums are multiplied by 2^-s and the weight row's scale. A row of x with a NaN or an infinity
// (no power of two brings it into range), or whose largest magnitude is below 2^-112, runs the
// float32 kernels alone, so that it reaches y as there.

#ifdef PRELOAD_AVX512
using IVec = __m512i;
constexpr int kIntLanes = 32;         // int16 elements a register holds
constexpr int kIntAccumulators = 16;  // of 32 registers
inline IVec izero() { return _mm512_setzero_si512(); }
inline IVec iwiden(const uint8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline IVec iload(const int16_t* p) { return _mm512_loadu_si512(p); }
#ifdef PRELOAD_BF16DOT
// AVX512-VNNI (on every CPU with AVX512-BF16): the multiply-add and the sum in one instruction.
inline IVec imadd(IVec acc, IVec a, IVec b) { return _mm512_dpwssd_epi32(acc, a, b); }
#else
inline IVec imadd(IVec acc, IVec a, IVec b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
#endif
inline Vec itof(IVec v) { return _mm512_cvtepi32_ps(v); }
// The last 16 elements of a row: masked loads, which read nothing past them.
inline IVec imadd_tail(IVec acc, const uint8_t* w, const int16_t* x) {
  const IVec wv = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(0xFFFF, w));
  return imadd(acc, wv, _mm512_maskz_loadu_epi16(0xFFFF, x));
}
#else
using IVec = __m256i;
constexpr int kIntLanes = 16;
constexpr int kIntAccumulators = 8;   // of 16 registers
inline IVec izero() { return _mm256_setzero_si256(); }
inline IVec iwiden(const uint8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline IVec iload(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline IVec imadd(IVec acc, IVec a, IVec b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
inline Vec itof(IVec v) { return _mm256_cvtepi32_ps(v); }
inline IVec imadd_tail(IVec acc, const uint8_t* w, const int16_t* x) { return imadd(acc, iwiden(w), iload(x)); }
#endif

#ifdef PRELOAD_AMX
// Intel's cores (the amx compilation): a weight row at a time. A 2-core Xeon (Emerald Rapids), int8
// 4096x4096 at one row: 1.46 ms in cache on the dot product, 1.03 here with 4 weight rows side by
// side, 0.42-0.47 one at a time (0.65-0.79 from memory, where bf16 takes 1.32-1.46); at 2 rows from
// memory 0.92 -> 0.70-0.82 ms one at a time.
constexpr bool kIntRowAtATime = true;
#else
constexpr bool kIntRowAtATime = false;  // but at one row of x (int16_pass)
#endif
#ifdef PRELOAD_BF16DOT
constexpr int64_t kIntMaxRows = 4;    // and up to which (the bfloat16 dot product takes more)
#else
constexpr int64_t kIntMaxRows = INT64_MAX;
#endif
// Rows of x per pass: more take more passes. From 5 rows a pass reads one weight row at a time and
// loads x once per multiply-add, where 4 rows take 2 (AVX2) or 4 (AVX-512) weight rows per load of x,
// the weight's second pass coming from L2 (in_passes' tiles). On AVX-512 passes of 4 are faster at
// every K measured (a 2-core Zen 4, two threads, int8, one pass of 8 and passes of 4 switched within
// one process, medians of 40: 8 rows of 960x576, 576x576 and 3072x576 0.81-0.87x the time, 576x1536
// 0.81-1.00x, 4096x1024 to 4096x2048 0.66-0.80x; 4096x1024 at 5 to 16 rows 0.74-0.88x; 5 and 6 rows
// of K = 576 alike); on AVX2 only past kIntPassXBytes (int16_pass_rows).
#ifdef PRELOAD_AVX512
constexpr int kIntMaxM = 4;
#else
constexpr int kIntMaxM = 8;
#endif
#ifdef PRELOAD_AMX
constexpr int64_t kE2M1IntMaxM = 2;   // e2m1 (MXFP4, NVFP4) rows of x here, below amx_min_rows (qgemv_e2m1_int16.h)
#else
constexpr int64_t kE2M1IntMaxM = 0;
#endif
constexpr int64_t kE2M1IntGroup = 128;  // e2m1 elements a step: 64 bytes (K a multiple of half of it)
constexpr int64_t kIntSegment = 64;   // chunks (2048 elements) summed in int32 before float32
constexpr int kIntVecs = kChunk / kIntLanes;

// Where a product's packed x lies in its buffer (pack_floats): the int16 rows after x's float32
// ones, then each row's 2^-s (0 for a row the float32 kernels take), this many floats on.
inline int64_t int16_scales_at(int64_t m_rows, int64_t k) { return m_rows * k + m_rows * k / 2; }

// AVX2: more than kIntMaxM / 2 rows of x whose int16 rows outgrow this (L1) run as passes of
// kIntMaxM / 2, as the float32 kernels' rows do past kPassXBytes: the one pass's loads of x come from
// L2 then. A 2-core Zen 4, two threads, int8 4096xK, medians, the two alternated, us: K = 4096 at 8
// rows 1984-2905 -> 1190-1230 in cache, 1778-1980 -> 1152-1423 from memory; K = 3072 at 6 rows from
// memory 946-991 -> 636-895. Below it, switched within one process, 8 rows split took 1.12-1.15x
// the time at K = 576, 0.93-0.99x at 1024, 0.89-0.99x at 1536 and 0.88-0.89x at 2048, but 5 and 6
// rows 1.11-1.18x at 1536 and 2048: no lower threshold gains at every count of rows. (AVX-512's
// passes take 4 rows already.)
#ifdef PRELOAD_AVX512
constexpr int64_t kIntPassXBytes = INT64_MAX;
#else
constexpr int64_t kIntPassXBytes = int64_t(32) << 10;
#endif

// Bytes of x's int16 copy that a pass of up to `per_pass` of m_rows rows of K elements holds.
inline int64_t int16_pass_bytes(int64_t m_rows, int64_t per_pass, int64_t k) {
  return lesser(m_rows, per_pass) * k * int64_t(sizeof(int16_t));
}

// Rows of x a pass of the int16 GEMV takes (the last pass fewer), for m_rows rows of K elements.
inline int64_t int16_pass_rows(int64_t m_rows, int64_t k) {
  const bool split = m_rows > kIntMaxM / 2 && int16_pass_bytes(m_rows, kIntMaxM, k) > kIntPassXBytes;
  return split ? kIntMaxM / 2 : kIntMaxM;
}

// The int16 rows come interleaved, as a pass reads them: each pass's rows (int16_pass_rows; fewer in
// the last) register by register, the first kIntLanes elements of each of its rows, then the next
// kIntLanes of each, and so on (a last 16 of a row on AVX-512 likewise), so that one pointer with
// fixed offsets reaches every row (8 row pointers had left the loop short of registers). Element e
// of row m is at this index.
inline int64_t int16_index(int64_t m_rows, int64_t k, int64_t m, int64_t e) {
  const int64_t per_pass = int16_pass_rows(m_rows, k);
  const int64_t pass = m / per_pass, rows = lesser(per_pass, m_rows - pass * per_pass), j = m % per_pass;
  const int64_t full = k / kIntLanes, group = e / kIntLanes, base = pass * per_pass * k;
  if (group < full) return base + (group * rows + j) * kIntLanes + e % kIntLanes;
  return base + full * rows * kIntLanes + j * (k - full * kIntLanes) + (e - full * kIntLanes);
}

// With AVX512-BF16 (not amx: not measured there), more than kIntMaxRows rows of x run here too, in
// passes of 4, where the dot product's pass of up to 8 rows would hold at least this much of x (L1)
// and read it from L2: a 2-core Zen 4, two threads, int8, switched within one process, medians of 30-40:
// 8 rows of 4096x2048 0.85-0.87x the time, of 4096x4096 0.83-0.92x in cache and 0.75-0.83x from
// memory, 16 rows 0.81-0.90x; 4096x8192 at 6-16 rows 0.80-0.90x; 4096x3072 at 5-16 rows and 5 of
// 4096x4096 0.91-1.03x. Below it the dot product is faster: 8 rows of 960x576 to 4096x1536 took
// 1.13-1.35x as long here.
#if defined(PRELOAD_BF16DOT) && !defined(PRELOAD_AMX)
constexpr int64_t kIntOverDotXBytes = int64_t(32) << 10;
#else
constexpr int64_t kIntOverDotXBytes = INT64_MAX;  // AVX2, AVX-512: every count of rows anyway; amx: its own
#endif
constexpr int64_t kIntDotRows = 8;  // the dot product's rows a pass (qgemv_bf16dot.h's kDotMaxM)

// Whether int8 weights times these rows of bfloat16 x run here (then x gets its packed copy). On amx
// its byte tiles take 3 and 4 rows first where K is a multiple of 64 (gemv_amx and pack_amx ask them
// first).
inline bool int16_takes(const Weight& w, int64_t m_rows) {
  if (w.element == kE2M1) return m_rows <= kE2M1IntMaxM && w.k % (kE2M1IntGroup / 2) == 0;
  if (w.element != kInt8) return false;
  return m_rows <= kIntMaxRows || int16_pass_bytes(m_rows, kIntDotRows, w.k) >= kIntOverDotXBytes;
}

// 2^s for a row of x: the power of two that brings its largest magnitude into [2^14, 2^15), or 0
// where the float32 kernels take the row instead: a NaN or an infinity (no power of two brings it
// into range), or a row so small that 2^-s would not be a normal float.
inline float int16_factor(const float* row, int64_t k) {
  const __m256 sign = _mm256_set1_ps(-0.0f), infinity = _mm256_set1_ps(INFINITY);
  __m256 largest = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    const __m256 magnitude = _mm256_andnot_ps(sign, _mm256_loadu_ps(row + i));
    largest = _mm256_max_ps(largest, magnitude);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(magnitude, infinity, _CMP_NLT_UQ));  // an infinity or a NaN
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, largest);
  const float top = *std::max_element(lanes, lanes + 8);
  int exponent = 0;
  if (top > 0.0f) std::frexp(top, &exponent);  // top < 2^exponent
  const int shift = 15 - exponent;             // top * 2^shift < 2^15
  return _mm256_testz_ps(bad, bad) && shift <= 126 ? std::ldexp(1.0f, shift) : 0.0f;
}

// Rows of x the packing left out (2^-s of 0: their packed values are zeros) run the float32 kernels
// alone, after the pass, so that the other rows' bits do not depend on them. `inverse`: the rows' 2^-s.
inline void rerun_left_out(const Weight& w, const float* x, int64_t m_rows, const float* inverse, int64_t begin,
                           int64_t end, uint16_t* y, int64_t y_stride) {
  for (int64_t m = 0; m < m_rows; ++m)
    if (inverse[m] == 0.0f) gemv(w, x + m * w.k, 1, begin, end, y + m * y_stride, y_stride, true);
}

#ifdef PRELOAD_AMX
#include "qgemv_e2m1_int16.h"  // in this namespace: e2m1 at one or two rows of x on the integers
#endif

// Share `part` of `parts` of x's columns packed, every row (the float32 rows stay, for the float32
// kernels); each share finds each row's 2^s over the whole row, the first stores 2^-s. 256-bit on
// both compilations: a few microseconds a product.
void pack_int16(float* x, int64_t m_rows, const Weight& w, int part, int parts) {
  if (!int16_takes(w, m_rows)) return;
#ifdef PRELOAD_AMX
  if (w.element == kE2M1) return pack_int16_e2m1(x, m_rows, w, part, parts);
#endif
  int16_t* words = reinterpret_cast<int16_t*>(x + m_rows * w.k);
  float* scales = x + int16_scales_at(m_rows, w.k);
  const auto [first, end] = pack_share(w.k, part, parts);
  for (int64_t m = 0; m < m_rows; ++m) {
    const float* row = x + m * w.k;
    const float power = int16_factor(row, w.k);  // 2^s, or 0
    if (part == 0) scales[m] = power != 0.0f ? 1.0f / power : 0.0f;  // exact: a power of two
    const __m256 factor = _mm256_set1_ps(power);
    for (int64_t i = first; i < end; i += 16) {
      // Rounded to nearest even and saturated (float32 x, not packed here, could round up to 2^15).
      const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + i), factor));
      const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + i + 8), factor));
      const __m256i packed =
          power != 0.0f ? _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8) : _mm256_setzero_si256();
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + int16_index(m_rows, w.k, m, i)), packed);
    }
  }
}

// Rows [n, n + R) times the M packed rows of a pass of x: sums[r * M + m], before 2^-s and the row
// scale.
template <int M, int R>
inline void int16_rows_dot(const Weight& w, const int16_t* xq, int64_t n, float* sums) {
  const uint8_t* row[R];
  for (int r = 0; r < R; ++r) row[r] = w.data + (n + r) * w.row_bytes;
  const int64_t chunks = w.k / kChunk, ahead = std::max<int64_t>(prefetch_distance(w), R * w.row_bytes);
  Vec total[R * M];
  for (int i = 0; i < R * M; ++i) total[i] = vzero();
  IVec acc[R * M];
  for (int64_t c0 = 0; c0 <= chunks; c0 += kIntSegment) {
    for (int i = 0; i < R * M; ++i) acc[i] = izero();
    const int64_t c1 = lesser(c0 + kIntSegment, chunks);
#pragma GCC unroll 2
    for (int64_t c = c0; c < c1; ++c) {
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = row[r] + c * kChunk;
        prefetch_weight(p, c * kChunk, ahead);
        for (int h = 0; h < kIntVecs; ++h) {
          const IVec v = iwiden(p + h * kIntLanes);
          const int16_t* xs = xq + (c * kIntVecs + h) * M * kIntLanes;
          for (int m = 0; m < M; ++m) acc[r * M + m] = imadd(acc[r * M + m], v, iload(xs + m * kIntLanes));
          // Each register's products into the sums before the next's: g++ otherwise adds the two
          // registers' products first, which takes M registers more and spills sums at 8 rows.
          for (int i = 0; i < R * M; ++i) __asm__("" : "+v"(acc[i]));
        }
      }
    }
    if (c1 == chunks && w.k % kChunk)  // the last 16 elements
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m)
          acc[r * M + m] = imadd_tail(acc[r * M + m], row[r] + chunks * kChunk, xq + chunks * kChunk * M + m * 16);
    for (int i = 0; i < R * M; ++i) total[i] = vadd(total[i], itof(acc[i]));
    if (c1 == chunks) break;
  }
  vsums<R * M>(total, sums);
}

// Rows of x from which int16_pass rounds its outputs in registers (put_outputs_bf16): at 2 rows (4
// weight rows side by side on AVX-512, 8 outputs) that took 1.25x the time of one output at a time
// (AVX-512 without VNNI, 1024x576, one thread in L2; alike on AVX2 and with VNNI).
constexpr int kIntVectorOutputsM = 3;

template <int M>
void int16_pass(const Weight& w, const int16_t* xq, const float* inverse, int64_t begin, int64_t end, uint16_t* y,
                int64_t y_stride) {
  // Weight rows side by side, each load of x shared by them, from 2 up to 4 rows of x; at one row and
  // from 5 on (AVX2), one at a time (AVX-512 at 8 rows of x, when it took them in one pass: two side by
  // side took 5-20% longer, a 2-core Zen 4; at one row, 4 side by side took 2-3x as long as one). On
  // Intel's cores one at a time (above).
  constexpr int R = kIntRowAtATime || M == 1 ? 1
                    : M * 4 <= kIntAccumulators ? 4 : M * 2 <= kIntAccumulators && M <= 4 ? 2 : 1;
  alignas(64) float sums[kPadded<R * M>];
  auto store = [&](int64_t n, int rows) {
    float scales[R];
    for (int r = 0; r < rows; ++r) scales[r] = row_scale(w, n + r);
    put_outputs_bf16<R, M, (M >= kIntVectorOutputsM)>(sums, inverse, scales, rows, y, y_stride, n);
  };
  int64_t n = begin;
  for (; n + R <= end; n += R) {
    int16_rows_dot<M, R>(w, xq, n, sums);
    store(n, R);
  }
  for (; n < end; ++n) {
    int16_rows_dot<M, 1>(w, xq, n, sums);
    store(n, 1);
  }
}

using Int16Fn = void (*)(const Weight&, const int16_t*, const float*, int64_t, int64_t, uint16_t*, int64_t);

template <int... Ms>
Int16Fn int16_for(int m, std::integer_sequence<int, Ms...>) {
  static constexpr Int16Fn passes[] = {&int16_pass<Ms + 1>...};
  return passes[m - 1];
}

// gemv, with int8 weights times the rows of bfloat16 x int16_takes on the integer multiply-adds.
void gemv_int16(const Weight& w, const float* x, int64_t m_rows, int64_t begin, int64_t end, void* y,
                int64_t y_stride, bool bf16) {
  if (!bf16 || !int16_takes(w, m_rows)) return gemv(w, x, m_rows, begin, end, y, y_stride, bf16);
  const int16_t* xq = reinterpret_cast<const int16_t*>(x + m_rows * w.k);
  const float* inverse = x + int16_scales_at(m_rows, w.k);
#ifdef PRELOAD_AMX
  if (w.element == kE2M1) return gemv_int16_e2m1(w, x, xq, inverse, m_rows, begin, end, static_cast<uint16_t*>(y),
                                                y_stride);
#endif
  auto pass = [&](int64_t m0, int m, int64_t start, int64_t stop) {
    uint16_t* out = static_cast<uint16_t*>(y) + m0 * y_stride;
    int16_for(m, std::make_integer_sequence<int, kIntMaxM>{})(w, xq + m0 * w.k, inverse + m0, start, stop, out,
                                                             y_stride);
    rerun_left_out(w, x + m0 * w.k, m, inverse + m0, start, stop, out, y_stride);
  };
  if (int16_pass_rows(m_rows, w.k) < kIntMaxM) in_passes<kIntMaxM / 2>(w, m_rows, begin, end, pass);
  else in_passes<kIntMaxM>(w, m_rows, begin, end, pass);
}
