// Quantized linear layers on x86-64 CPUs: y[m, n] = sum_k x[m, k] * scale(n, k) * element(W[n, k]),
// and plain bfloat16 ones (element kBF16, a per-tensor scale of 1) for few activation rows, where
// these kernels stream the weight faster than torch's bfloat16 GEMV.
//
// The torch ops, one pair per instruction set: preload::qgemv_avx2 / qgemm_avx2 and
// preload::qgemv_avx512 / qgemm_avx512 (kernels/native.py picks one). qgemv (a few activation
// rows): the fused kernels of qgemv_kernels.cpp, rows of N split between threads. qgemm (more rows):
// the weight is dequantized by the same kernels into cache-sized tiles that torch's GEMM multiplies.
// This file is compiled for plain x86-64; only the kernels it calls use the wider instructions, and
// each op refuses to run on a CPU without them. The pure torch path in kernels/linear.py is the
// reference for both.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "qgemv_kernels.h"

namespace {

using preload::Kernels;
using preload::Weight;

constexpr int64_t kTileBytes = int64_t(4) << 20;  // qgemm: dequantized weight per GEMM call
constexpr int64_t kGemvWork = int64_t(1) << 16;   // qgemv: multiply-adds per block of rows a thread takes

bool runs_here(const Kernels* kernels) {
  __builtin_cpu_init();
  bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (kernels == &preload::kAvx2) return avx2;
  return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

const char* name_of(const Kernels* kernels) { return kernels == &preload::kAvx2 ? "avx2" : "avx512"; }

template <const Kernels* K>
void check_cpu() {
  static const bool ok = runs_here(K);
  TORCH_CHECK(ok, "the ", name_of(K), " kernels need instructions this CPU lacks; choose another variant "
              "(kernels.native.available() lists those it can run)");
}

// Everything the kernels index is checked here: a bad shape is an error, never a stray read.
Weight check_weight(const at::Tensor& weight, const at::Tensor& scale, const std::optional<at::Tensor>& global_scale,
                    int64_t scale_kind, int64_t block, int64_t element) {
  TORCH_CHECK(element >= preload::kE4M3 && element <= preload::kBF16, "unknown element format ", element);
  TORCH_CHECK(weight.device().is_cpu() && scale.device().is_cpu(), "the native kernels run on CPU tensors");
  bool bf16 = element == preload::kBF16;
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
              (bf16 ? weight.scalar_type() == at::kBFloat16 : weight.element_size() == 1),
              bf16 ? "weight must be contiguous bfloat16 [N, K]" : "weight must be contiguous bytes [N, K]");
  int64_t n = weight.size(0), k = weight.size(1) * (element == preload::kE2M1 ? 2 : 1);
  bool per_block = scale_kind >= preload::kBlock128;
  if (!per_block) block = k;
  TORCH_CHECK(k % 16 == 0 && k > 0 && block % 16 == 0 && block > 0, "K and the block size must be multiples of 16");
  TORCH_CHECK(scale.is_contiguous(), "scale must be contiguous");
  float global = 1.0f;
  switch (scale_kind) {
    case preload::kPerTensor:
      TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1, "per-tensor scale: one float32");
      break;
    case preload::kPerRow:
      TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == n, "per-row scale: N float32");
      break;
    case preload::kBlock128:
      TORCH_CHECK(scale.scalar_type() == at::kFloat && block == 128 && scale.dim() == 2 &&
                  scale.size(0) == (n + 127) / 128 && scale.size(1) == (k + 127) / 128,
                  "block scale: float32 [ceil(N/128), ceil(K/128)]");
      break;
    case preload::kE8M0Per32:
    case preload::kE4M3Per16:
      TORCH_CHECK(scale.element_size() == 1 && scale.dim() == 2 && scale.size(0) == n &&
                  block == (scale_kind == preload::kE8M0Per32 ? 32 : 16) && k % block == 0 &&
                  scale.size(1) == k / block,
                  "MX/NVFP4 scale: bytes [N, K / block]");
      if (scale_kind == preload::kE4M3Per16) {
        TORCH_CHECK(global_scale && global_scale->device().is_cpu() && global_scale->scalar_type() == at::kFloat &&
                    global_scale->numel() == 1, "NVFP4 needs its float32 global scale");
        global = *global_scale->data_ptr<float>();
      }
      break;
    default:
      TORCH_CHECK(false, "unknown scale kind ", scale_kind);
  }
  bool scheme = element == preload::kE2M1 ? scale_kind >= preload::kE8M0Per32
                : element == preload::kInt8 ? scale_kind <= preload::kPerRow
                : bf16                      ? scale_kind == preload::kPerTensor
                                            : scale_kind <= preload::kE8M0Per32;
  TORCH_CHECK(scheme, "no scheme has element format ", element, " with scale kind ", scale_kind);
  return Weight{static_cast<const uint8_t*>(weight.data_ptr()), n, k, weight.size(1) * weight.element_size(),
                static_cast<preload::Element>(element), static_cast<preload::ScaleKind>(scale_kind),
                scale.data_ptr(), scale.dim() == 2 ? scale.size(1) : 0, block, global};
}

// The checks both ops start with: this CPU runs variant K, and x fits the weight.
template <const Kernels* K>
Weight checked_weight(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                      const std::optional<at::Tensor>& global_scale, int64_t scale_kind, int64_t block_size,
                      int64_t element) {
  check_cpu<K>();
  Weight w = check_weight(weight, scale, global_scale, scale_kind, block_size, element);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a float32 or bfloat16 [M, K] CPU tensor");
  TORCH_CHECK(x.size(1) <= w.k, "x has K=", x.size(1), ", more than the weight's ", w.k);
  return w;
}

// x as the kernels read it: contiguous float32 [M, k], zero-padded to the stored width, and for
// e2m1 weights each group of 16 elements in the kernels' order (see qgemv_kernels.h). x itself where
// it already is all that.
const float* kernel_rows(const at::Tensor& x, const Weight& w, const uint8_t* e2m1_order, std::vector<float>& buffer) {
  bool reorder = w.element == preload::kE2M1;
  if (x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == w.k && !reorder) return x.data_ptr<float>();
  int64_t m_rows = x.size(0), width = x.size(1), s0 = x.stride(0), s1 = x.stride(1), k = w.k;
  buffer.assign(m_rows * k, 0.0f);
  for (int64_t m = 0; m < m_rows; ++m) {
    float* dst = buffer.data() + m * k;
    if (x.scalar_type() == at::kFloat) {
      const float* src = x.data_ptr<float>() + m * s0;
      for (int64_t j = 0; j < width; ++j) dst[j] = src[j * s1];
    } else {  // bfloat16: the high half of a float32
      const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + m * s0;
      auto widen = [&](int64_t j, uint16_t v) {
        uint32_t bits = uint32_t(v) << 16;
        std::memcpy(dst + j, &bits, sizeof(bits));
      };
      if (s1 == 1) {
        for (int64_t j = 0; j < width; ++j) widen(j, src[j]);
      } else {
        for (int64_t j = 0; j < width; ++j) widen(j, src[j * s1]);
      }
    }
    if (reorder) {
      float group[16];
      for (int64_t g = 0; g < k; g += 16) {  // k is a multiple of 16
        for (int p = 0; p < 16; ++p) group[p] = dst[g + e2m1_order[p]];
        std::copy(group, group + 16, dst + g);
      }
    }
  }
  return buffer.data();
}

// x [M, K] (float32 or bfloat16; K up to the stored width, zero-padded) -> [M, N] in x's dtype.
template <const Kernels* K>
at::Tensor qgemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                 const std::optional<at::Tensor>& global_scale, int64_t scale_kind, int64_t block_size,
                 int64_t element) {
  Weight w = checked_weight<K>(x, weight, scale, global_scale, scale_kind, block_size, element);
  thread_local std::vector<float> buffer;
  int64_t m_rows = x.size(0);
  if (m_rows == 0) return at::empty({0, w.n}, x.options());
  const float* xp = kernel_rows(x, w, K->e2m1_order, buffer);
  bool bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({m_rows, w.n}, x.options());
  void* yp = y.data_ptr();
  // Rows go to the threads in blocks taken from a shared counter, not in one share each: on a busy
  // machine a thread that runs late takes fewer blocks instead of holding up the call.
  constexpr int64_t kUnit = 4;  // rows; a multiple of every step of the kernels
  int64_t rows = std::max<int64_t>(kUnit, kGemvWork / (w.k * m_rows) / kUnit * kUnit);
  int64_t blocks = (w.n + rows - 1) / rows;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(blocks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t b = next++; b < blocks; b = next++)
      K->gemv(w, xp, m_rows, b * rows, std::min((b + 1) * rows, w.n), yp, w.n, bf16);
  });
  return y;
}

// x [M, K] (float32 or bfloat16) @ dequantize(weight).T for larger M: the weight is dequantized in
// tiles of rows that stay in cache, and each tile is multiplied by torch's own GEMM. Without
// AVX-512 there are no bfloat16 units, and torch's bfloat16 GEMM is several times slower than its
// float32 one: there the tiles and the product are float32 whatever x is.
template <const Kernels* K>
at::Tensor qgemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                 const std::optional<at::Tensor>& global_scale, int64_t scale_kind, int64_t block_size,
                 int64_t element) {
  Weight w = checked_weight<K>(x, weight, scale, global_scale, scale_kind, block_size, element);
  at::ScalarType dtype = K == &preload::kAvx512 ? x.scalar_type() : at::kFloat;
  at::Tensor xs = x.to(dtype);
  if (x.size(1) != w.k) {
    xs = at::zeros({x.size(0), w.k}, x.options().dtype(dtype));
    xs.narrow(1, 0, x.size(1)).copy_(x);
  }
  int64_t tile = std::max<int64_t>(16, kTileBytes / (w.k * xs.element_size()));
  at::Tensor buffer = at::empty({std::min(tile, w.n), w.k}, xs.options());
  at::Tensor y = at::empty({x.size(0), w.n}, xs.options());
  bool bf16 = dtype == at::kBFloat16;
  for (int64_t start = 0; start < w.n; start += tile) {
    int64_t rows = std::min(tile, w.n - start);
    at::Tensor slice = buffer.narrow(0, 0, rows);
    char* base = static_cast<char*>(slice.data_ptr());
    at::parallel_for(start, start + rows, 8, [&](int64_t begin, int64_t end) {
      K->dequantize(w, begin, end, base + (begin - start) * w.k * slice.element_size(), bf16);
    });
    y.narrow(1, start, rows).copy_(at::mm(xs, slice.t()));
  }
  return y.to(x.scalar_type());
}

std::vector<std::string> variants() {
  std::vector<std::string> out;
  for (const Kernels* k : {&preload::kAvx512, &preload::kAvx2})
    if (runs_here(k)) out.emplace_back(name_of(k));
  return out;
}

}  // namespace

TORCH_LIBRARY(preload, m) {
#define PRELOAD_ARGS "(Tensor x, Tensor weight, Tensor scale, Tensor? global_scale, int scale_kind, int block_size, " \
                     "int element) -> Tensor"
  m.def("qgemv_avx2" PRELOAD_ARGS);
  m.def("qgemm_avx2" PRELOAD_ARGS);
  m.def("qgemv_avx512" PRELOAD_ARGS);
  m.def("qgemm_avx512" PRELOAD_ARGS);
#undef PRELOAD_ARGS
  m.def("variants() -> str[]", &variants);
}

TORCH_LIBRARY_IMPL(preload, CPU, m) {
  m.impl("qgemv_avx2", &qgemv<&preload::kAvx2>);
  m.impl("qgemm_avx2", &qgemm<&preload::kAvx2>);
  m.impl("qgemv_avx512", &qgemv<&preload::kAvx512>);
  m.impl("qgemm_avx512", &qgemm<&preload::kAvx512>);
}
