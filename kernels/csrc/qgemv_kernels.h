// The interface between the torch-facing ops (qgemv.cpp, compiled for any x86-64) and the SIMD
// kernels (qgemv_kernels.cpp, compiled once per instruction set). Plain C++ only: the kernel
// translation units must not include torch headers, whose inline functions, compiled there with
// AVX-512 enabled, could be the copy the linker keeps for the whole library.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

namespace preload {

enum Element : int {
  kE4M3 = 0,  // one byte per element (the FP8 schemes, MXFP8)
  kE2M1 = 1,  // two per byte, low nibble first (MXFP4, NVFP4)
  kInt8 = 2,  // one signed byte per element (INT8)
  kBF16 = 3,  // two bytes per element, unquantized (scale kind kPerTensor, a scale of 1)
};

enum ScaleKind : int {
  kPerTensor = 0,   // float32 scalar
  kPerRow = 1,      // float32 [N]
  kBlock128 = 2,    // float32 [ceil(N/128), ceil(K/128)]
  kE8M0Per32 = 3,   // e8m0 bytes [N, K/32]
  kE4M3Per16 = 4,   // e4m3 bytes [N, K/16], times a float32 global scale
};

// One quantized [N, K] weight, already checked against its scales by the caller.
struct Weight {
  const uint8_t* data;
  int64_t n;
  int64_t k;          // elements per row as stored (padded for MX/NVFP4), a multiple of 16
  int64_t row_bytes;  // k, k / 2 for e2m1, 2k for bfloat16
  Element element;
  ScaleKind kind;
  const void* scale;
  int64_t scale_cols;  // scales per row of the scale tensor (the per-block kinds)
  int64_t block;       // elements per scale along K: k for the per-row kinds, else 16, 32 or 128
  float global;        // NVFP4's global scale; 1 elsewhere
};

// One query head group of one sequence over its kv head's cached keys and values (the decode
// attention of kernels/csrc/decode.cpp and layer.cpp): out[g] = softmax(q[g] . K^T * scale) V over
// positions [0, length), in float32 whatever the storage (float32, or bfloat16 with bf16). With
// `partial`, a part of a longer sequence's positions instead (weights.h's AttendPlan::merge sums
// the parts): there go, in float32, the outputs weighed by exp(score - the part's largest) without
// dividing by their sum [group, d], then each head's largest score [group], then its sum [group].
struct AttendJob {
  const void* q;      // [group, d]
  const void* keys;   // [length, d]: one kv head's keys, position after position
  const void* values; // likewise
  void* out;          // [group, d]
  int64_t group, length, d;
  float scale;
  float* scratch;     // attend_floats(group, length, d) floats
  float* partial;     // null, or group * (d + 2) floats
  int64_t reach = 0;  // positions of the row from `keys` on, its later parts' too (how far prefetches go: 0, none)
};

constexpr int64_t kAttendBlock = 16;  // positions whose keys a step widens at once (at most: AVX2 takes 8)
inline int64_t attend_floats(int64_t group, int64_t length, int64_t d) {
  return group * (length + d) + kAttendBlock * d;
}

// Causal attention of one prompt's bfloat16 queries over its own keys and values (a prefill from
// position 0: kernels/csrc/decode.cpp's prefill_attention): the query at position p of each head of
// one kv head's group sees positions [0, p], for the queries at positions [q0, q1). q and out hold
// position p's head g at element p * q_stride + g * d; keys and values are the kv head's [q1, d].
// Float32 sums and softmax; d is 32, 64, 96 or 128.
struct PrefillJob {
  const uint16_t* q;
  const uint16_t* keys;
  const uint16_t* values;
  uint16_t* out;
  int64_t group, q0, q1, d, q_stride;
  float scale;
  float* scratch;  // prefill_floats(group, q1 - q0, d) floats
};

constexpr int64_t kPrefillQueries = 16;  // positions of queries a job takes at most (decode.cpp)
constexpr int64_t kPrefillChunk = 32;    // positions of keys and values a query's softmax takes at a time
inline int64_t prefill_floats(int64_t group, int64_t positions, int64_t d) {
  return positions * group * (d + 2) + kPrefillChunk / 2 * d;
}

// A weight quantized into its parts (quantize_kernels.cpp): w [n, k] as stored, rows `stride` elements
// apart; weight [n, stored columns] (k, or k padded to whole blocks for the per-block kinds, half
// that for e2m1); scale float32 [n] (kPerRow), [ceil(n/128), ceil(k/128)] (kBlock128), or one byte
// per block (kE8M0Per32, kE4M3Per16 with `block` 32 or 16). `tensor_scale` is kPerTensor's scale, or
// NVFP4's global scale.
enum Source : int { kSourceFloat32 = 0, kSourceBFloat16 = 1, kSourceFloat16 = 2 };
struct QuantizeJob {
  const void* w;
  Source source;
  int64_t n, k, stride;
  ScaleKind kind;
  int64_t block;
  Element element;
  float tensor_scale;
  uint8_t* weight;
  void* scale;
};

// Entry points of one instruction set. Rows [begin, end) of the output; begin and end need not
// fall on any step, so callers may split N between threads however they like.
struct Kernels {
  // y[m, n] = sum_k x[m, k] * dequantized W[n, k] for x float32 [m_rows, k]; y float32 or, with
  // bf16, bfloat16 (rounded to nearest even), row stride y_stride elements. Any m_rows >= 1.
  // For e2m1 weights x comes reordered: in each group of 16 elements, position p holds element
  // e2m1_order[p] (the order in which the packed nibbles decode fastest); for bfloat16 weights
  // likewise by bf16_order where that is not null.
  void (*gemv)(const Weight& w, const float* x, int64_t m_rows, int64_t begin, int64_t end, void* y,
               int64_t y_stride, bool bf16);
  // Rows [begin, end) of the dequantized weight into out ([end - begin, k], float32 or bfloat16).
  void (*dequantize)(const Weight& w, int64_t begin, int64_t end, void* out, bool bf16);
  const uint8_t* e2m1_order;  // 16 entries
  const uint8_t* bf16_order;  // 16 entries, or null: in order
  // Where not null, gemv with bf16 (bfloat16 activations: the only ones it reads so) also reads x in
  // a second layout of its own, which pack writes once per x into the pack_floats(m_rows, k) floats
  // after x's m_rows * k (the caller sizes its buffer so, and calls pack for bfloat16 x only), once
  // every row of x is in: share `part` of `parts` of x's columns a call (pack_share), every row, so
  // that threads may pack side by side. Shares of rows would write the same cache lines from two
  // threads, where a layout interleaves the rows (the tiles', int16's).
  void (*pack)(float* x, int64_t m_rows, const Weight& w, int part, int parts);
  int64_t block_unit;  // rows: callers that split N between threads do so in multiples of this
  void (*attend)(const AttendJob& job, bool bf16);
  // Where not null (the variants with AVX512-BF16's dot product): a prefill's attention.
  void (*prefill)(const PrefillJob& job);
  // out[i] = silu(gate[i]) * up[i], i < n, float32 or (bf16) bfloat16 storage, silu rounded to it.
  void (*silu_mul)(const void* gate, const void* up, void* out, int64_t n, bool bf16);
  // Rows [begin, end) of a QuantizeJob's weight (for kBlock128, bands of 128 rows); false where any
  // element read was not finite (kPerTensor reads none for that), and its codes then mean nothing.
  bool (*quantize)(const QuantizeJob& job, int64_t begin, int64_t end);
  // The scale that spans a QuantizeJob's weight (kPerTensor's, or kE4M3Per16's global one) from its
  // largest magnitude, into *scale; false where any element is not finite.
  bool (*tensor_scale)(const QuantizeJob& job, float* scale);
};

inline int64_t pack_floats(int64_t m_rows, int64_t k) { return m_rows * k / 2 + m_rows; }

// Share `part` of `parts` of x's k columns for pack, [first, end): whole groups of 64 (a multiple of
// 64 bytes in every packed layout), the last share to k; a share may be empty.
inline std::pair<int64_t, int64_t> pack_share(int64_t k, int part, int parts) {
  const int64_t groups = (k + 63) / 64;
  return {std::min(k, groups * part / parts * 64), std::min(k, groups * (part + 1) / parts * 64)};
}

// quantize_kernels.cpp's, for AVX2 (kAvx2) and AVX-512 (the others): Kernels::quantize and ::tensor_scale.
bool quantize_avx2(const QuantizeJob& job, int64_t begin, int64_t end);
bool quantize_avx512(const QuantizeJob& job, int64_t begin, int64_t end);
bool tensor_scale_avx2(const QuantizeJob& job, float* scale);
bool tensor_scale_avx512(const QuantizeJob& job, float* scale);

extern const Kernels kAvx2;    // AVX2 + FMA + F16C
extern const Kernels kAvx512;  // AVX-512 F/BW/VL + FMA + F16C
extern const Kernels kAvx512Bf16;  // kAvx512's, plus AVX512-BF16's dot product for bfloat16 x (qgemv_bf16dot.h),
                                   // AVX512-VNNI's for int8 (qgemv_int16.h) and AVX512-VBMI (qgemv_e4m3.h)
extern const Kernels kAmx;     // kAvx512Bf16's, plus AMX-TILE, AMX-BF16 and AMX-INT8 (qgemv_amx.h)

}  // namespace preload
