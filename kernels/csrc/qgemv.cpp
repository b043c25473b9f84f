// Quantized linear layers on x86-64 CPUs: y[m, n] = sum_k x[m, k] * scale(n, k) * element(W[n, k]),
// and plain bfloat16 ones (element kBF16, a per-tensor scale of 1) for few activation rows, where
// these kernels stream the weight faster than torch's bfloat16 GEMV.
//
// The torch ops, one pair per instruction set: preload::qgemv_avx2 / qgemm_avx2,
// preload::qgemv_avx512 / qgemm_avx512, preload::qgemv_avx512bf16 / qgemm_avx512bf16 and
// preload::qgemv_amx / qgemm_amx (kernels/native.py picks
// one). qgemv (a few activation rows): the fused kernels of qgemv_kernels.cpp, rows of N split
// between threads. qgemm (more rows): the weight is dequantized by the same kernels into cache-sized
// tiles that torch's GEMM multiplies.
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
#include <string>
#include <vector>

#include "qgemv_kernels.h"
#include "weights.h"

namespace {

using preload::Kernels;
using preload::Weight;
using preload::check_cpu;
using preload::check_weight;
using preload::name_of;
using preload::runs_here;

constexpr int64_t kTileBytes = int64_t(4) << 20;  // qgemm: dequantized weight per GEMM call

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

// x as the kernels read it: contiguous float32 [M, k], zero-padded to the stored width, and each
// group of 16 elements in the kernels' order for the weight's element format where they have one
// (`order`: see qgemv_kernels.h), then their packed copy where they make one. x itself where it
// already is all that.
const float* kernel_rows(const Kernels* kernels, const at::Tensor& x, const Weight& w,
                         preload::LineVector<float>& buffer) {
  const uint8_t* order = preload::x_order(kernels, w);
  if (x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == w.k && !order)  // pack: bf16 x only
    return x.data_ptr<float>();
  int64_t m_rows = x.size(0), width = x.size(1), s0 = x.stride(0), s1 = x.stride(1), k = w.k;
  buffer.resize(preload::x_floats(kernels, m_rows, k));
  for (int64_t m = 0; m < m_rows; ++m) {
    float* dst = buffer.data() + m * k;
    if (x.scalar_type() == at::kFloat)
      preload::kernel_row(x.data_ptr<float>() + m * s0, s1, width, k, order, dst);
    else
      preload::kernel_row(x.data_ptr<at::BFloat16>() + m * s0, s1, width, k, order, dst);
  }
  if (kernels->pack && x.scalar_type() != at::kFloat)  // bf16 x only
    kernels->pack(buffer.data(), m_rows, w, 0, 1);
  return buffer.data();
}

// x [M, K] (float32 or bfloat16; K up to the stored width, zero-padded) -> [M, N] in x's dtype.
template <const Kernels* K>
at::Tensor qgemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                 const std::optional<at::Tensor>& global_scale, int64_t scale_kind, int64_t block_size,
                 int64_t element) {
  Weight w = checked_weight<K>(x, weight, scale, global_scale, scale_kind, block_size, element);
  thread_local preload::LineVector<float> buffer;
  int64_t m_rows = x.size(0);
  if (m_rows == 0) return at::empty({0, w.n}, x.options());
  const float* xp = kernel_rows(K, x, w, buffer);
  bool bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({m_rows, w.n}, x.options());
  void* yp = y.data_ptr();
  const int64_t rows = preload::gemv_block_rows(K, w, w.n, at::get_num_threads());
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
  at::ScalarType dtype = K != &preload::kAvx2 ? x.scalar_type() : at::kFloat;
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
  for (const Kernels* k : {&preload::kAmx, &preload::kAvx512Bf16, &preload::kAvx512, &preload::kAvx2})
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
  m.def("qgemv_avx512bf16" PRELOAD_ARGS);
  m.def("qgemm_avx512bf16" PRELOAD_ARGS);
  m.def("qgemv_amx" PRELOAD_ARGS);
  m.def("qgemm_amx" PRELOAD_ARGS);
#undef PRELOAD_ARGS
  m.def("variants() -> str[]", &variants);
}

TORCH_LIBRARY_IMPL(preload, CPU, m) {
  m.impl("qgemv_avx2", &qgemv<&preload::kAvx2>);
  m.impl("qgemm_avx2", &qgemm<&preload::kAvx2>);
  m.impl("qgemv_avx512", &qgemv<&preload::kAvx512>);
  m.impl("qgemm_avx512", &qgemm<&preload::kAvx512>);
  m.impl("qgemv_avx512bf16", &qgemv<&preload::kAvx512Bf16>);
  m.impl("qgemm_avx512bf16", &qgemm<&preload::kAvx512Bf16>);
  m.impl("qgemv_amx", &qgemv<&preload::kAmx>);
  m.impl("qgemm_amx", &qgemm<&preload::kAmx>);
}
