// SIMD kernels for quantized linear layers: y[m, n] = sum_k x[m, k] * scale(n, k) * element(W[n, k]).
// One source, compiled four times by scripts/build_kernels.py: with -DPRELOAD_AVX512 and AVX-512
// flags into the `kAvx512` entry points, with AVX2 flags into `kAvx2`, with AVX512-BF16 and
// AVX512-VNNI as well and -DPRELOAD_BF16DOT into `kAvx512Bf16` (qgemv_bf16dot.h's GEMV of bfloat16
// rows on its dot product), and with AMX as well and -DPRELOAD_AMX into `kAmx` (qgemv_amx.h's GEMV
// on the matrix units); the last two run this file's AVX-512 code for what they do not take. AVX2
// and AVX-512 differ only in the vector layer of qgemv_simd.h (8 or 16 floats per register, 16 or 32
// registers); the rest is shared.
// Every compilation runs int8 weights times a few rows of bfloat16 x on integer multiply-adds
// (qgemv_int16.h, with AVX512-VNNI in the last two).
//
// The weight is decoded 32 elements at a time straight into registers and never written back, so
// a GEMV reads it once: e4m3 through F16C (its bits placed where a float16 keeps exponent and
// mantissa), e2m1 through tables (AVX2: two of bfloat16 bytes, pshufb; AVX-512: one of float32
// values, VPERMPS), int8 by widening, and plain bfloat16 by a shift (it is the high half of a float32). Each step multiplies R weight rows
// by M activation rows with R x M accumulators in registers. No torch header is included here: see
// qgemv_kernels.h.
#include "qgemv_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "qgemv_simd.h"

namespace preload {
namespace {

// How the scales fall on the chunks: one per row (applied to the sums), one per block of 128
// elements (4 chunks), of 32 (a chunk) or of 16 (half a chunk).
enum Mode : int { kRowScale, kBlock128Scale, kBlock32Scale, kBlock16Scale };

// What output row n's sums are multiplied by when they are put: its scale where there is one a row
// (or one for the tensor), times what the decoders leave out of each element (kFactor).
template <int kElem, int kMode>
inline float output_scale(const Weight& w, int64_t n) {
  return (kMode == kRowScale ? row_scale(w, n) : 1.0f) * kFactor<kElem>;
}

// acc[m] += v[h] . x[m] at `at` + h vectors, for the N registers of v (one weight row).
template <int M, int N>
inline __attribute__((always_inline)) void madd(const Vec (&v)[N], const float* x, int64_t k, int64_t at, Vec* acc) {
  for (int h = 0; h < N; ++h)
    for (int m = 0; m < M; ++m) acc[m] = vfma(v[h], vload(x + m * k + at + h * kLanes), acc[m]);
}

// The same into kBanks banks of accumulators in turn (register h into bank h % kBanks), for kBanks
// dependency chains instead of one.
template <int kBanks, int M, int N>
inline __attribute__((always_inline)) void madd_banks(const Vec (&v)[N], const float* x, int64_t k, int64_t at,
                                                      Vec (*banks)[M]) {
  for (int h = 0; h < N; ++h)
    for (int m = 0; m < M; ++m) {
      Vec& a = banks[h % kBanks][m];
      a = vfma(v[h], vload(x + m * k + at + h * kLanes), a);
    }
}

// sum_h v[h] . x[h vectors on] for h < N, in one chain (a block's few registers: the rows and
// chunks in flight give the parallelism, and one chain saves the add of two).
template <int N>
inline __attribute__((always_inline)) Vec dot(const Vec* v, const float* x) {
  Vec sum = vmul(v[0], vload(x));
  for (int h = 1; h < N; ++h) sum = vfma(v[h], vload(x + h * kLanes), sum);
  return sum;
}

template <int M, int R>
inline void zero(Vec (&acc)[R][M]) {
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = vzero();
}

// How far ahead of its reads a step prefetches each weight row: the hardware prefetchers do not keep
// up with the R rows a step reads side by side (a 2-core Zen 1 VM: a bfloat16 GEMV from memory
// streamed at ~6 GB/s without, ~16 GB/s with this; 8 KiB to 64 KiB measured alike). Into L2, not
// L1: half of a 32 KiB L1 on its way evicts itself before its loads come (a 2-core Zen 4, 2
// threads, 184320x576 from memory, minimum of 55 calls, builds alternated four times: bfloat16 at
// one row of x 8.6-11.3 -> 6.0-8.7 ms on AVX-512, 7.6-12.1 -> 7.1-9.3 on AVX2; int8 at one row
// 3.8-5.8 -> 3.2-4.5 on AVX-512; int8 at 8 rows, and AVX2's at 1, alike).
constexpr int64_t kPrefetchBytes = int64_t(16) << 10;

// The weight `ahead` bytes past p asked for into L2 (above), once per cache line: `at` is p's byte
// offset in its row. Every GEMV's weight prefetch goes through this (qgemv_bf16dot.h's too).
inline __attribute__((always_inline)) void prefetch_weight(const uint8_t* p, int64_t at, int64_t ahead) {
  if (at % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T1);
}

// Whole rows at least kPrefetchBytes past a row (the same chunk of a later row is prefetched).
inline int64_t prefetch_distance(const Weight& w) {
  return (kPrefetchBytes + w.row_bytes - 1) / w.row_bytes * w.row_bytes;
}

// Chunk c of a row into registers, prefetching the same chunk `ahead` bytes on once per cache line.
template <int kElem>
inline __attribute__((always_inline)) void decode_chunk(const uint8_t* row, int64_t c, int64_t ahead, Vec* v) {
  const uint8_t* p = row + c * kChunkBytes<kElem>;
  prefetch_weight(p, c * kChunkBytes<kElem>, ahead);
  decode32<kElem>(p, v);
}

// Blocks of 16 and 32 elements, a chunk at a time: a chunk's registers fall into kSlots groups
// (its first and second 16 elements, for 16-element blocks) of one scale register each.
template <int kMode>
constexpr int kSlots = kMode == kBlock16Scale ? 2 : 1;

// Rows [n, n + R) times activation rows [0, M): sums[r * M + m], before the row scale and kFactor. Each
// row's chunk is decoded and used before the next row's, so that few registers hold decoded weights.
template <int kElem, int kMode, int M, int R>
void dot_rows(const Weight& w, const float* x, int64_t n, float* sums) {
  Vec acc[R][M];
  zero(acc);
  const uint8_t* row[R];
  for (int r = 0; r < R; ++r) row[r] = w.data + (n + r) * w.row_bytes;
  const int64_t chunks = w.k / kChunk, ahead = std::max<int64_t>(prefetch_distance(w), R * w.row_bytes);
  if constexpr (kMode == kRowScale) {
    // Banks of accumulators split the dependency chains: one a register of the chunk where a single
    // weight row meets a single row of x (R = M = 1), else two where the registers allow.
    constexpr int kBanks = R * M == 1 ? kVecs : 2 * R * M <= kAccumulators ? 2 : 1;
    Vec banks[R][kBanks][M];
    for (int r = 0; r < R; ++r) zero(banks[r]);
    // Two chunks an iteration: a row at a time is a short loop (AVX2 int8 at one row of x 4-5% faster;
    // 2-8 rows no slower, AVX2 and AVX-512).
#pragma GCC unroll 2
    for (int64_t c = 0; c < chunks; ++c) {
      for (int r = 0; r < R; ++r) {
        Vec v[kVecs];
        decode_chunk<kElem>(row[r], c, ahead, v);
        madd_banks<kBanks, M>(v, x, w.k, c * kChunk, banks[r]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) {
        acc[r][m] = banks[r][0][m];
        for (int b = 1; b < kBanks; ++b) acc[r][m] = vadd(acc[r][m], banks[r][b][m]);
      }
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
          decode_chunk<kElem>(row[r], c, ahead, v);
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
    const int64_t ahead_rows = ahead / w.row_bytes;
    for (int64_t c0 = 0; c0 < chunks; c0 += 8 / kBlocksPerChunk) {
      const int64_t c1 = lesser(c0 + 8 / kBlocksPerChunk, chunks);
      for (int r = 0; r < R; ++r) {
        const int64_t b = c0 * kBlocksPerChunk;
        if (b % 64 == 0 && n + r + ahead_rows < w.n)  // the scales a row `ahead` bytes on will read
          _mm_prefetch(static_cast<const char*>(w.scale) + (n + r + ahead_rows) * w.scale_cols + b, _MM_HINT_T0);
        block_scales(w, n + r, b, (c1 - c0) * kBlocksPerChunk, scales[r]);
      }
      for (int64_t c = c0; c < c1; ++c) {
        for (int r = 0; r < R; ++r) {
          Vec v[kVecs], scale[kSlotCount];
          decode_chunk<kElem>(row[r], c, ahead, v);
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
  if (w.k % kChunk) {  // the last 16 elements, as decode16 orders them (K % 32 = 16: fp8, int8, bf16, NVFP4)
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
  vsums<R * M>(&acc[0][0], sums);
}

// Weight rows per step for M activation rows: enough independent chains, no spilled accumulators.
// One row of x with one scale per row (bfloat16, int8, FP8 per tensor or channel) reads one weight
// row at a time, front to back, its chains in banks of its own: one stream from memory, which the
// prefetchers follow better than four rows side by side (a 2-core Zen 5, 4096x4096 streamed from
// memory at one row, builds alternated 3-4 times: bfloat16 -16% time on the AVX2 kernels and -15% on
// the AVX-512 ones, int8 -7% and -20%, FP8 +2% and -9%). The per-block scales keep four rows (one
// row at a time was slower: NVFP4 on AVX2 +25%).
constexpr int rows_for(int mode, int m) {
  if (mode == kRowScale && m == 1) return 1;
  return m * 4 <= kAccumulators ? 4 : m * 2 <= kAccumulators ? 2 : 1;
}

template <int kElem, int kMode, int M>
void gemv_pass(const Weight& w, const float* x, int64_t begin, int64_t end, void* y, int64_t y_stride, bool bf16) {
  constexpr int R = rows_for(kMode, M);
  alignas(64) float sums[kPadded<R * M>];
  auto store = [&](int64_t n, int rows) {
    float scales[R];
    for (int r = 0; r < rows; ++r) scales[r] = output_scale<kElem, kMode>(w, n + r);
    if (bf16) return put_outputs_bf16<R, M>(sums, nullptr, scales, rows, static_cast<uint16_t*>(y), y_stride, n);
    for (int r = 0; r < rows; ++r)
      for (int m = 0; m < M; ++m) put_output(y, y_stride, m, n + r, sums[r * M + m] * scales[r], false);
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

// f.template operator()<kElem, kMode>() for w's element format and scale kind: the schemes' pairs
// (qgemv.cpp refuses the others).
template <typename F>
auto with_format(const Weight& w, F f) {
  if (w.element == kE2M1)
    return w.kind == kE4M3Per16 ? f.template operator()<kE2M1, kBlock16Scale>()
                                : f.template operator()<kE2M1, kBlock32Scale>();
  if (w.element == kInt8) return f.template operator()<kInt8, kRowScale>();
  if (w.element == kBF16) return f.template operator()<kBF16, kRowScale>();
  if (w.kind == kBlock128) return f.template operator()<kE4M3, kBlock128Scale>();
  if (w.kind == kE8M0Per32) return f.template operator()<kE4M3, kBlock32Scale>();
  return f.template operator()<kE4M3, kRowScale>();
}

// Weight rows [begin, end) times m_rows of x in passes of up to kRows x rows: pass(m0, m, start, stop)
// for x rows [m0, m0 + m) and weight rows [start, stop). Several passes walk the weight in tiles
// small enough to stay in L2 across them.
template <int kRows, typename Pass>
void in_passes(const Weight& w, int64_t m_rows, int64_t begin, int64_t end, Pass pass) {
  const int64_t tile = m_rows <= kRows ? end - begin : 4 + (int64_t(256) << 10) / w.row_bytes / 4 * 4;
  for (int64_t start = begin; start < end; start += tile) {
    const int64_t stop = lesser(start + tile, end);
    for (int64_t m0 = 0; m0 < m_rows; m0 += kRows) pass(m0, static_cast<int>(lesser(kRows, m_rows - m0)), start, stop);
  }
}

using PassFn = void (*)(const Weight&, const float*, int64_t, int64_t, void*, int64_t, bool);

template <int kElem, int kMode, int... Ms>
PassFn pass_for(int m, std::integer_sequence<int, Ms...>) {
  static constexpr PassFn passes[] = {&gemv_pass<kElem, kMode, Ms + 1>...};
  return passes[m - 1];
}

// More than kMaxM activation rows take several passes, and so do more than kMaxM / 2 of a weight
// with one scale per row whose x outgrows kPassXBytes (passes of kMaxM / 2 then).
void gemv(const Weight& w, const float* x, int64_t m_rows, int64_t begin, int64_t end, void* y, int64_t y_stride,
          bool bf16) {
  const size_t y_bytes = bf16 ? 2 : 4;
  auto run = [&](int64_t m0, int m, int64_t start, int64_t stop) {
    const PassFn pass = with_format(w, [m]<int kElem, int kMode>() {
      return pass_for<kElem, kMode>(m, std::make_integer_sequence<int, kMaxM>{});
    });
    pass(w, x + m0 * w.k, start, stop, static_cast<char*>(y) + m0 * y_stride * y_bytes, y_stride, bf16);
  };
  if (row_scaled(w) && m_rows > kMaxM / 2 && lesser(m_rows, kMaxM) * w.k * int64_t(sizeof(float)) > kPassXBytes)
    in_passes<kMaxM / 2>(w, m_rows, begin, end, run);
  else
    in_passes<kMaxM>(w, m_rows, begin, end, run);
}

// Rows [begin, end), 16 elements (in order) at a time.
template <int kElem>
void dequantize_rows(const Weight& w, int64_t begin, int64_t end, void* out, bool bf16) {
  const bool blocked = !row_scaled(w);
  const int64_t pieces = w.k / 16, per_block = w.block / 16;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = w.data + n * w.row_bytes;
    const int64_t offset = (n - begin) * w.k;
    for (int64_t j0 = 0, b = 0; j0 < pieces; j0 += per_block, ++b) {
      Vec scale = vset((blocked ? block_scale(w, n, b) : row_scale(w, n)) * kFactor<kElem>);
      for (int64_t j = j0; j < lesser(j0 + per_block, pieces); ++j) {
        Vec v[kHalf];
        decode16_in_order<kElem>(row + j * kChunkBytes<kElem> / 2, v);
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

#include "decode_kernels.h"  // in this namespace, compiled for this instruction set

#include "qgemv_int16.h"  // in this namespace: it calls the kernels above for what it does not take

#ifdef PRELOAD_BF16DOT
#include "qgemv_bf16dot.h"  // in this namespace: it calls the kernels above for what it does not take
#endif

#ifdef PRELOAD_AMX
#include "qgemv_amx.h"  // in this namespace: it calls the kernels above for what it does not take
#endif

}  // namespace

#if defined(PRELOAD_AMX)
extern const Kernels kAmx = {&gemv_amx, &dequantize, kE2M1Order, kBF16Order, &pack_amx, kAmxRows, &attend, &prefill,
                           &silu_mul, &quantize_avx512, &tensor_scale_avx512};
#elif defined(PRELOAD_BF16DOT)
extern const Kernels kAvx512Bf16 = {&gemv_bf16dot, &dequantize, kE2M1Order, kBF16Order, &pack_bf16dot, 4, &attend,
                                    &prefill, &silu_mul, &quantize_avx512, &tensor_scale_avx512};
#elif defined(PRELOAD_AVX512)
extern const Kernels kAvx512 = {&gemv_int16, &dequantize, kE2M1Order, kBF16Order, &pack_int16, 4, &attend, nullptr,
                                &silu_mul, &quantize_avx512, &tensor_scale_avx512};
#else
extern const Kernels kAvx2 = {&gemv_int16, &dequantize, kE2M1Order, kBF16Order, &pack_int16, 4, &attend, nullptr,
                              &silu_mul, &quantize_avx2, &tensor_scale_avx2};
#endif

}  // namespace preload
