// The loading path's op: preload::quantize, a weight quantized in one pass straight into its parts,
// for kernels/quant.py (whose torch code is the reference: the same bits). In torch a scheme is a
// dozen passes over float32 temporaries of the weight (its float32 copy, the scaled copy, the
// clamped copy, the codes), which bounded a quantizing cold load below the disk's rate. Here the
// chosen variant's Kernels::quantize (quantize_kernels.h, vectorized for its instruction set) reads
// each row as stored, float32, bfloat16 or float16, and writes its scale and elements; the rows are
// shared out with at::parallel_for. This file is compiled for plain x86-64.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>

#include "qgemv_kernels.h"
#include "weights.h"

namespace {

constexpr int64_t kGrain = 1 << 16;  // elements a thread takes at least

// w [N, K] (float32, bfloat16 or float16; rows any stride, each row contiguous) quantized into
// `weight` and `scale`, contiguous, in the scheme's layout (kernels/quant.py; scale_kind, block and
// element as the GEMV takes them: kernels/formats.py). `tensor_scale` is the per-tensor scale or
// NVFP4's global scale, which the caller stores.
void quantize(const at::Tensor& w, int64_t scale_kind, int64_t block, int64_t element, double tensor_scale,
              at::Tensor& weight, at::Tensor& scale, int64_t variant) {
  const preload::Kernels* kernels = preload::variant_kernels(variant);
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && (w.size(1) <= 1 || w.stride(1) == 1) &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf),
              "quantize takes a float32, bfloat16 or float16 [N, K] CPU weight whose rows are contiguous, got ",
              w.scalar_type(), " ", w.sizes(), " strides ", w.strides());
  using preload::kE2M1;
  const bool blocked = scale_kind == preload::kE8M0Per32 || scale_kind == preload::kE4M3Per16;
  TORCH_CHECK(scale_kind >= preload::kPerTensor && scale_kind <= preload::kE4M3Per16 && element >= preload::kE4M3 &&
                  element <= preload::kInt8 && (element != kE2M1 || blocked),
              "no such scheme: scale kind ", scale_kind, ", element ", element);
  TORCH_CHECK(scale_kind != preload::kE8M0Per32 || block == 32, "MX blocks are 32 elements, got ", block);
  TORCH_CHECK(scale_kind != preload::kE4M3Per16 || block == 16, "NVFP4 blocks are 16 elements, got ", block);
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t padded = blocked ? (k + block - 1) / block * block : k;
  const int64_t columns = element == kE2M1 ? padded / 2 : padded;
  TORCH_CHECK(weight.device().is_cpu() && weight.is_contiguous() && weight.element_size() == 1 &&
                  weight.numel() == n * columns,
              "weight must be ", n * columns, " contiguous bytes, got ", weight.sizes(), " ", weight.scalar_type());
  const int64_t bands = (n + 127) / 128, band_blocks = (k + 127) / 128;
  const int64_t scales = scale_kind == preload::kPerTensor ? 1
                         : scale_kind == preload::kPerRow  ? n
                         : scale_kind == preload::kBlock128 ? bands * band_blocks
                                                            : n * padded / block;
  TORCH_CHECK(scale.device().is_cpu() && scale.is_contiguous() && scale.numel() == scales &&
                  scale.element_size() == (blocked ? 1 : 4),
              "scale must be ", scales, " contiguous values of ", blocked ? 1 : 4, " bytes, got ", scale.sizes(),
              " ", scale.scalar_type());
  if (!n) return;  // (rows of no elements get a scale of 1, as a row of zeros)
  const preload::Source source = w.scalar_type() == at::kFloat      ? preload::kSourceFloat32
                                 : w.scalar_type() == at::kBFloat16 ? preload::kSourceBFloat16
                                                                    : preload::kSourceFloat16;
  const preload::QuantizeJob job{w.data_ptr(), source, n, k, w.stride(0), static_cast<preload::ScaleKind>(scale_kind),
                                 block, static_cast<preload::Element>(element), static_cast<float>(tensor_scale),
                                 static_cast<uint8_t*>(weight.data_ptr()), scale.data_ptr()};
  // Chunks of about kGrain elements handed out from a counter, not one share a thread: a load reads
  // the next weight on another thread meanwhile, and the thread that shares its core with that read
  // takes fewer chunks instead of holding the others up at the end.
  const bool by_band = scale_kind == preload::kBlock128;
  const int64_t units = by_band ? bands : n, unit_elements = by_band ? 128 * k : k;
  const int64_t chunk = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, unit_elements));
  std::atomic<int64_t> next{0};
  const auto work = [&] {
    for (int64_t begin; (begin = next.fetch_add(chunk)) < units;)
      kernels->quantize(job, begin, std::min(units, begin + chunk));
  };
  if (units <= chunk) {
    work();
    return;
  }
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), (units + chunk - 1) / chunk), 1,
                   [&](int64_t, int64_t) { work(); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(preload, m) {
  m.def("quantize(Tensor w, int scale_kind, int block, int element, float tensor_scale, Tensor(a!) weight, "
        "Tensor(b!) scale, int variant) -> ()");
}

TORCH_LIBRARY_IMPL(preload, CPU, m) {
  m.impl("quantize", &quantize);
}
