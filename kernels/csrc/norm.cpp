// RMSNorm for the decode path: weight * (x / sqrt(mean(x^2) + eps)), the normalisation computed in
// float32 and rounded to x's dtype before the weight multiplies it, as kernels/norm.py's torch path
// does (and Llama/Qwen reference code). torch's fused rms_norm costs ~30-40 us a call on a CPU
// whatever the size, about as much as a 576-wide layer's GEMV; this costs a few. Each row is
// computed alone, so a row's result does not depend on how many rows come with it. Plain C++:
// compiled for any x86-64, vectorized by the compiler.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <algorithm>

namespace {

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
void rows(const T* x, const T* weight, T* out, int64_t begin, int64_t end, int64_t width, int64_t x_stride,
          float eps) {
  constexpr int kLanes = 16;  // partial sums the compiler keeps in vector registers
  for (int64_t r = begin; r < end; ++r) {
    const T* row = x + r * x_stride;
    float partial[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= width; j += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        float v = widen(row[j + l]);
        partial[l] += v * v;
      }
    float sum = 0.0f;
    for (; j < width; ++j) sum += widen(row[j]) * widen(row[j]);
    for (int l = 0; l < kLanes; ++l) sum += partial[l];
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(width) + eps);
    T* dst = out + r * width;
    for (j = 0; j < width; ++j) dst[j] = static_cast<T>(widen(weight[j]) * widen(static_cast<T>(widen(row[j]) * scale)));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x and weight must both be float32 or both bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1),
              "weight must be contiguous [K] for x [M, K]");
  const int64_t m = x.size(0), width = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({m, width}, x.options());
  const float e = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(width, 1));
  at::parallel_for(0, m, grain, [&](int64_t begin, int64_t end) {
    if (x.scalar_type() == at::kFloat)
      rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), begin, end, width, stride, e);
    else
      rows(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), begin, end,
           width, stride, e);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(preload, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(preload, CPU, m) { m.impl("rms_norm", &rms_norm); }
