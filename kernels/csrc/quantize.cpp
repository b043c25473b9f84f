// The loading path's op: float32 values -> FP4 E2M1 codes packed two a byte (kernels/fp4.py's
// e2m1_encode then pack, the same bits), for MXFP4's and NVFP4's quantization (kernels/quant.py).
// In torch the encoding is seven comparisons and sums over the weight, plus its sign and the packing:
// a dozen passes that took most of a 4-bit quantizing load's time (the default model's MXFP4 cold
// load: the comparisons alone about 170 ms of 480, 2-core Zen 4). Here it is one pass, plain C++
// (any x86-64, vectorized by the compiler), the rows shared out with at::parallel_for.
//
// Rounding: to the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6, ties to the even code (the one whose
// mantissa bit is 0), so the midpoints alternate between rounding down (0.25, 1.25, 2.5, 5) and up
// (0.75, 1.75, 3.5); magnitudes above 6 saturate. The sign is the input's sign bit (-0 is code 8).
// Finite inputs only (quantize refuses a weight with a NaN or an infinity before it gets here).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kBlock = 512;  // bytes packed a step

inline uint8_t e2m1_code(float v) {
  const float a = std::fabs(v);
  const int code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return static_cast<uint8_t>(code | (std::signbit(v) ? 8 : 0));
}

// [..., 2m] float32 -> [..., m] uint8, element 2i in the low nibble of byte i.
at::Tensor e2m1_pack(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1 && x.size(-1) % 2 == 0,
              "e2m1_pack takes a contiguous float32 tensor whose last dimension is even, got ", x.scalar_type(), " ",
              x.sizes());
  auto sizes = x.sizes().vec();
  sizes.back() /= 2;
  at::Tensor out = at::empty(sizes, x.options().dtype(at::kByte));
  const float* in = x.data_ptr<float>();
  uint8_t* packed = out.data_ptr<uint8_t>();
  at::parallel_for(0, out.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    // The codes of a block of elements in one loop over contiguous floats (which the compiler
    // vectorizes; reading the pairs of each byte directly, it did not), then paired up.
    uint8_t codes[2 * kBlock];
    for (int64_t first = begin; first < end; first += kBlock) {
      const int64_t bytes = std::min(kBlock, end - first);
      const float* values = in + 2 * first;
      for (int64_t j = 0; j < 2 * bytes; ++j) codes[j] = e2m1_code(values[j]);
      for (int64_t j = 0; j < bytes; ++j)
        packed[first + j] = static_cast<uint8_t>(codes[2 * j] | (codes[2 * j + 1] << 4));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(preload, m) {
  m.def("e2m1_pack(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(preload, CPU, m) {
  m.impl("e2m1_pack", &e2m1_pack);
}
