// The loading path's op: preload::quantize, a weight quantized in one pass straight into its parts,
// for kernels/quant.py (whose torch code is the reference: the same bits). In torch a scheme is a
// dozen passes over float32 temporaries of the weight (its float32 copy, the scaled copy, the
// clamped copy, the codes), which bounded a quantizing cold load below the disk's rate. Here the
// chosen variant's Kernels::quantize (quantize_kernels.cpp, vectorized for its instruction set) reads
// each row as stored, float32, bfloat16 or float16, and writes its scale and elements; the rows are
// shared out between at::parallel_for's threads. This file is compiled for plain x86-64.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>

#include "qgemv_kernels.h"
#include "weights.h"

namespace {

constexpr int64_t kGrain = 1 << 16;  // elements of a chunk of the work (whole rows or bands: at least one)

// w [N, K] (float32, bfloat16 or float16; rows any stride, each row contiguous) quantized into
// `weight` and `scale`, contiguous, in the scheme's layout (kernels/quant.py; scale_kind, block and
// element as the GEMV takes them: kernels/formats.py). `tensor_scale` is the per-tensor scale or
// NVFP4's global scale, which the caller stores. Returns whether every element was finite (for FP8
// per tensor, which the caller checked with the largest magnitude it needed first: true); where not,
// the parts hold nothing of use.
bool quantize(const at::Tensor& w, int64_t scale_kind, int64_t block, int64_t element, double tensor_scale,
              at::Tensor& weight, at::Tensor& scale, int64_t variant) {
  const preload::Kernels* kernels = preload::variant_kernels(variant);
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && (w.size(1) <= 1 || w.stride(1) == 1) &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf),
              "quantize takes a float32, bfloat16 or float16 [N, K] CPU weight whose rows are contiguous, got ",
              w.scalar_type(), " ", w.sizes(), " strides ", w.strides());
  using namespace preload;
  // The schemes of kernels/quant.py: (scale kind, block, element), and the parts' dtypes.
  const bool scheme = (scale_kind == kPerTensor || scale_kind == kPerRow) ? (element == kE4M3 || element == kInt8)
                      : scale_kind == kBlock128                           ? element == kE4M3 && block == 128
                      : scale_kind == kE8M0Per32 ? (element == kE4M3 || element == kE2M1) && block == 32
                      : scale_kind == kE4M3Per16 ? element == kE2M1 && block == 16
                                                 : false;
  TORCH_CHECK(scheme, "no such scheme: scale kind ", scale_kind, ", block ", block, ", element ", element);
  const bool blocked = scale_kind == kE8M0Per32 || scale_kind == kE4M3Per16;
  const auto weight_dtype = element == kInt8 ? at::kChar : element == kE4M3 ? at::kFloat8_e4m3fn : at::kByte;
  const auto scale_dtype = scale_kind == kE8M0Per32 ? at::kFloat8_e8m0fnu
                           : scale_kind == kE4M3Per16 ? at::kFloat8_e4m3fn : at::kFloat;
  TORCH_CHECK(weight.scalar_type() == weight_dtype && scale.scalar_type() == scale_dtype, "the parts must be ",
              weight_dtype, " and ", scale_dtype, ", got ", weight.scalar_type(), " and ", scale.scalar_type());
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t padded = blocked ? (k + block - 1) / block * block : k;
  const int64_t columns = element == kE2M1 ? padded / 2 : padded;
  TORCH_CHECK(weight.device().is_cpu() && weight.is_contiguous() && weight.numel() == n * columns,
              "weight must be ", n * columns, " contiguous bytes, got ", weight.sizes(), " ", weight.scalar_type());
  const int64_t bands = (n + 127) / 128, band_blocks = (k + 127) / 128;
  const int64_t scales = scale_kind == kPerTensor ? 1
                         : scale_kind == kPerRow  ? n
                         : scale_kind == kBlock128 ? bands * band_blocks
                                                   : n * padded / block;
  TORCH_CHECK(scale.device().is_cpu() && scale.is_contiguous() && scale.numel() == scales, "scale must be ", scales,
              " contiguous values, got ", scale.sizes());
  if (!n) return true;
  const Source source = w.scalar_type() == at::kFloat      ? kSourceFloat32
                        : w.scalar_type() == at::kBFloat16 ? kSourceBFloat16
                                                           : kSourceFloat16;
  const QuantizeJob job{w.data_ptr(), source, n, k, w.stride(0), static_cast<ScaleKind>(scale_kind),
                        block, static_cast<Element>(element), static_cast<float>(tensor_scale),
                        static_cast<uint8_t*>(weight.data_ptr()), scale.data_ptr()};
  // Chunks of about kGrain elements handed out from a counter, not one share a thread: a load reads
  // the next weight on another thread meanwhile, and the thread that shares its core with that read
  // takes fewer chunks instead of holding the others up at the end.
  const bool by_band = scale_kind == kBlock128;
  const int64_t units = by_band ? bands : n, unit_elements = by_band ? 128 * k : k;
  const int64_t chunk = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, unit_elements));
  std::atomic<int64_t> next{0};
  std::atomic<bool> finite{true};
  const auto work = [&] {
    for (int64_t begin; (begin = next.fetch_add(chunk)) < units;)
      if (!kernels->quantize(job, begin, std::min(units, begin + chunk))) finite = false;
  };
  if (units <= chunk)
    work();
  else
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), (units + chunk - 1) / chunk), 1,
                     [&](int64_t, int64_t) { work(); });
  return finite;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(preload, m) {
  m.def("quantize(Tensor w, int scale_kind, int block, int element, float tensor_scale, Tensor(a!) weight, "
        "Tensor(b!) scale, int variant) -> bool");
}

TORCH_LIBRARY_IMPL(preload, CPU, m) {
  m.impl("quantize", &quantize);
}
