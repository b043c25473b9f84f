// Quantized linear layers on AVX-512 CPUs: y[m, n] = sum_k x[m, k] * scale(n, k) * element(W[n, k]).
//
// qgemv (a few activation rows): the weight is decoded 16 elements at a time straight into
// registers and never written back, so it is read once per call, as in a bf16 GEMV. qgemm (more
// rows): the weight is decoded into cache-sized tiles that torch's GEMM multiplies. Elements: see
// Element; scales: see ScaleKind. The pure torch path in kernels/linear.py is the reference for both.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr int kMaxRows = 16;
constexpr int64_t kTileBytes = int64_t(4) << 20;  // qgemm: dequantized rows per GEMM call

enum Element : int {
  kE4M3 = 0,  // one byte per element (the FP8 schemes, MXFP8)
  kE2M1 = 1,  // two per byte, low nibble first (MXFP4, NVFP4)
  kInt8 = 2,  // one signed byte per element (INT8)
};

enum ScaleKind : int64_t {
  kPerTensor = 0,   // float32 scalar
  kPerRow = 1,      // float32 [N]
  kBlock128 = 2,    // float32 [ceil(N/128), ceil(K/128)]
  kE8M0Per32 = 3,   // e8m0 bytes [N, K/32]
  kE4M3Per16 = 4,   // e4m3 bytes [N, K/16], times a float32 global scale
};

// e4m3 -> float32: place the 7 magnitude bits where a float16 keeps its exponent and mantissa. The
// float16 then reads as the e4m3 value times 2^-8 (the bias differs by 8), subnormals included.
inline __m512 decode_e4m3(const uint8_t* p) {
  __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
  __m256i mag = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, mag)), _mm512_set1_ps(256.0f));
}

// 16 int8 -> 16 floats.
inline __m512 decode_int8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// 8 bytes of packed e2m1 -> 16 floats, through a 16-entry table held in a register.
inline __m512 decode_e2m1(const uint8_t* p, __m512 table) {
  __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m128i lo = _mm_and_si128(b, _mm_set1_epi16(0x0F));
  __m128i hi = _mm_slli_epi16(_mm_srli_epi16(b, 4), 8);
  __m512i idx = _mm512_cvtepu8_epi32(_mm_or_si128(lo, hi));  // lo0, hi0, lo1, hi1, ...
  return _mm512_permutexvar_ps(idx, table);
}

float e4m3_to_float(uint8_t v) {
  int exp = (v >> 3) & 0xF, man = v & 7;
  float mag = exp ? std::ldexp(1.0f + man / 8.0f, exp - 7) : std::ldexp(man / 8.0f, -6);
  return (v & 0x80) ? -mag : mag;
}

struct Scales {
  ScaleKind kind;
  const void* data;
  int64_t cols;  // scales per row, for the per-block kinds
  int64_t block;
  float global;
  float e4m3[256];

  Scales(const at::Tensor& scale, double global_scale, int64_t scale_kind, int64_t block_size)
      : kind(static_cast<ScaleKind>(scale_kind)), data(scale.data_ptr()), cols(scale.dim() == 2 ? scale.size(1) : 0),
        block(block_size), global(static_cast<float>(global_scale)) {
    for (int v = 0; v < 256; ++v) e4m3[v] = e4m3_to_float(static_cast<uint8_t>(v));
  }

  bool per_row() const { return kind == kPerTensor || kind == kPerRow; }

  float row_scale(int64_t n) const {
    if (kind == kPerTensor) return *static_cast<const float*>(data);
    if (kind == kPerRow) return static_cast<const float*>(data)[n];
    return 1.0f;
  }

  float block_scale(int64_t n, int64_t b) const {
    if (kind == kBlock128) return static_cast<const float*>(data)[(n / 128) * cols + b];
    uint8_t code = static_cast<const uint8_t*>(data)[n * cols + b];
    if (kind == kE4M3Per16) return e4m3[code] * global;
    uint32_t bits = code ? uint32_t(code) << 23 : 0x00400000u;  // e8m0: 2^(code - 127); 0 is 2^-127
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
  }
};

// The block scales of one row, looked up once per block as the vectors go by.
struct RowScales {
  const Scales* scales = nullptr;
  int64_t n = 0;
  int shift = 0;  // vector index >> shift = block index (blocks are 16 * 2^shift elements)
  int64_t current = -1;
  float value = 1.0f;

  void reset(const Scales& s, int64_t row) {
    scales = &s;
    n = row;
    shift = __builtin_ctzll(s.block / 16);
    current = -1;
  }

  inline float at(int64_t vector) {
    int64_t b = vector >> shift;
    if (b != current) {
      current = b;
      value = scales->block_scale(n, b);
    }
    return value;
  }
};

template <int kElem>
inline __m512 decode(const uint8_t* w, int64_t vector, __m512 table) {
  if constexpr (kElem == kE2M1) return decode_e2m1(w + vector * 8, table);
  else if constexpr (kElem == kInt8) return decode_int8(w + vector * 16);
  else return decode_e4m3(w + vector * 16);
}

__m512 e2m1_table() {
  alignas(64) static const float values[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  return _mm512_load_ps(values);
}

// R output rows for M activation rows (GEMV). Each x load feeds R rows and each decoded weight
// vector feeds M rows, so neither the loads nor the decoding dominate; the R x M accumulators are
// independent FMA chains. M and R are template parameters so that the accumulators stay in registers.
template <int kElem, int M, int R>
void gemv_rows(const float* x, int64_t k, const uint8_t* w, int64_t row_bytes, const Scales& scales, int64_t n,
               float* y, int64_t y_stride) {
  __m512 table = e2m1_table();
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  bool per_block = !scales.per_row();
  RowScales block[R] = {};
  for (int r = 0; r < R; ++r) block[r].reset(scales, n + r);
  for (int64_t j = 0; j < k / 16; ++j) {
    __m512 v[R];
    for (int r = 0; r < R; ++r) {
      v[r] = decode<kElem>(w + r * row_bytes, j, table);
      if (per_block) v[r] = _mm512_mul_ps(v[r], _mm512_set1_ps(block[r].at(j)));
    }
    for (int m = 0; m < M; ++m) {
      __m512 xv = _mm512_loadu_ps(x + m * k + j * 16);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(v[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float row_scale = scales.row_scale(n + r);
    for (int m = 0; m < M; ++m) y[m * y_stride + r] = _mm512_reduce_add_ps(acc[r][m]) * row_scale;
  }
}

// Rows per step for M activation rows: at most 16 accumulators, and at least 4 chains.
constexpr int rows_for(int m) { return m <= 4 ? 4 : m <= 8 ? 2 : 1; }

using RowsFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, const Scales&, int64_t, float*, int64_t);

template <int kElem, int... Ms>
std::pair<RowsFn, RowsFn> pick_rows(int64_t m_rows, std::integer_sequence<int, Ms...>) {
  RowsFn blocked[] = {&gemv_rows<kElem, Ms + 1, rows_for(Ms + 1)>...};
  RowsFn single[] = {&gemv_rows<kElem, Ms + 1, 1>...};
  return {blocked[m_rows - 1], single[m_rows - 1]};
}

std::pair<RowsFn, RowsFn> pick(int64_t element, int64_t m_rows) {
  auto ms = std::make_integer_sequence<int, kMaxRows>{};
  if (element == kE2M1) return pick_rows<kE2M1>(m_rows, ms);
  if (element == kInt8) return pick_rows<kInt8>(m_rows, ms);
  return pick_rows<kE4M3>(m_rows, ms);
}

// Everything the kernels index is checked here: a bad shape is an error, never a stray read.
void check_inputs(const at::Tensor& weight, const at::Tensor& scale, int64_t scale_kind, int64_t k, int64_t block,
                  int64_t element) {
  TORCH_CHECK(element == kE4M3 || element == kE2M1 || element == kInt8, "unknown element format ", element);
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.element_size() == 1,
              "weight must be contiguous bytes [N, K]");
  TORCH_CHECK(k % 16 == 0 && block % 16 == 0, "K and the block size must be multiples of 16");
  bool per_block = scale_kind == kBlock128 || scale_kind == kE8M0Per32 || scale_kind == kE4M3Per16;
  TORCH_CHECK(!per_block || (block & (block - 1)) == 0, "block sizes must be powers of two");
  TORCH_CHECK(weight.size(1) == (element == kE2M1 ? k / 2 : k), "weight width does not match K");
  TORCH_CHECK(scale.is_contiguous(), "scale must be contiguous");
  int64_t n = weight.size(0);
  switch (scale_kind) {
    case kPerTensor:
      TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1, "per-tensor scale: one float32");
      break;
    case kPerRow:
      TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == n, "per-row scale: N float32");
      break;
    case kBlock128:
      TORCH_CHECK(scale.scalar_type() == at::kFloat && block == 128 && scale.dim() == 2 &&
                  scale.size(0) == (n + 127) / 128 && scale.size(1) == (k + 127) / 128,
                  "block scale: float32 [ceil(N/128), ceil(K/128)]");
      break;
    case kE8M0Per32:
    case kE4M3Per16:
      TORCH_CHECK(scale.element_size() == 1 && scale.dim() == 2 && scale.size(0) == n &&
                  scale.size(1) == k / block && block == (scale_kind == kE8M0Per32 ? 32 : 16),
                  "MX/NVFP4 scale: bytes [N, K / block]");
      break;
    default:
      TORCH_CHECK(false, "unknown scale kind ", scale_kind);
  }
}


// x: float32 [M <= 16, K] (K = the stored, padded width); weight: bytes [N, K], or [N, K/2] for e2m1.
at::Tensor qgemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, double global_scale,
                 int64_t scale_kind, int64_t block_size, int64_t element) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "1 to ", kMaxRows, " activation rows");
  int64_t m_rows = x.size(0), k = x.size(1), n_total = weight.size(0);
  check_inputs(weight, scale, scale_kind, k, block_size, element);
  Scales scales(scale, global_scale, scale_kind, block_size);
  auto [blocked, single] = pick(element, m_rows);
  int64_t step = rows_for(static_cast<int>(m_rows)), row_bytes = weight.size(1);
  at::Tensor y = at::empty({m_rows, n_total}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = static_cast<const uint8_t*>(weight.data_ptr());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (n_total + step - 1) / step, 4, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin * step; n < std::min(end * step, n_total);) {
      bool whole = n + step <= n_total;
      (whole ? blocked : single)(xp, k, wp + n * row_bytes, row_bytes, scales, n, yp + n, n_total);
      n += whole ? step : 1;
    }
  });
  return y;
}

// float32 -> bfloat16, round to nearest even (as torch rounds), 16 at a time.
inline __m256i to_bf16(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// Rows [begin, end) of the weight, dequantized into out ([end - begin, K], float32 or bfloat16).
template <int kElem>
void dequant_rows(const uint8_t* w, int64_t row_bytes, int64_t k, const Scales& scales, int64_t begin, int64_t end,
                  at::Tensor& out) {
  __m512 table = e2m1_table();
  bool bf16 = out.scalar_type() == at::kBFloat16, per_block = !scales.per_row();
  for (int64_t n = begin; n < end; ++n) {
    RowScales block;
    block.reset(scales, n);
    float row_scale = scales.row_scale(n);
    const uint8_t* row = w + n * row_bytes;
    char* dst = static_cast<char*>(out.data_ptr()) + (n - begin) * k * out.element_size();
    for (int64_t j = 0; j < k / 16; ++j) {
      __m512 v = _mm512_mul_ps(decode<kElem>(row, j, table), _mm512_set1_ps(per_block ? block.at(j) : row_scale));
      if (bf16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst) + j, to_bf16(v));
      else _mm512_storeu_ps(reinterpret_cast<float*>(dst) + j * 16, v);
    }
  }
}

// x [M, K] (float32 or bfloat16; K = the stored, padded width) @ dequantize(weight).T, for larger M:
// the weight is dequantized in tiles of rows that stay in cache, and each tile is multiplied by
// torch's own GEMM. Returns [M, N] in x's dtype.
at::Tensor qgemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, double global_scale,
                 int64_t scale_kind, int64_t block_size, int64_t element) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be float32 or bfloat16 [M, K]");
  int64_t k = x.size(1), n_total = weight.size(0);
  check_inputs(weight, scale, scale_kind, k, block_size, element);
  Scales scales(scale, global_scale, scale_kind, block_size);
  int64_t tile = std::max<int64_t>(16, kTileBytes / (k * x.element_size()));
  at::Tensor buffer = at::empty({std::min(tile, n_total), k}, x.options());
  at::Tensor y = at::empty({x.size(0), n_total}, x.options());
  const uint8_t* wp = static_cast<const uint8_t*>(weight.data_ptr());
  for (int64_t start = 0; start < n_total; start += tile) {
    int64_t rows = std::min(tile, n_total - start);
    at::Tensor slice = buffer.narrow(0, 0, rows);
    at::parallel_for(start, start + rows, 8, [&](int64_t begin, int64_t end) {
      at::Tensor part = slice.narrow(0, begin - start, end - begin);
      if (element == kE2M1) dequant_rows<kE2M1>(wp, weight.size(1), k, scales, begin, end, part);
      else if (element == kInt8) dequant_rows<kInt8>(wp, weight.size(1), k, scales, begin, end, part);
      else dequant_rows<kE4M3>(wp, weight.size(1), k, scales, begin, end, part);
    });
    y.narrow(1, start, rows).copy_(at::mm(x, slice.t()));
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(preload, m) {
  m.def("qgemv(Tensor x, Tensor weight, Tensor scale, float global_scale, int scale_kind, int block_size, "
        "int element) -> Tensor");
  m.def("qgemm(Tensor x, Tensor weight, Tensor scale, float global_scale, int scale_kind, int block_size, "
        "int element) -> Tensor");
}

TORCH_LIBRARY_IMPL(preload, CPU, m) {
  m.impl("qgemv", &qgemv);
  m.impl("qgemm", &qgemm);
}
