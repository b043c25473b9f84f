// The loading path's op: preload::quantize, a weight quantized in one pass straight into its parts,
// for kernels/quant.py (whose torch code is the reference: the same bits). In torch a scheme is a
// dozen passes over float32 temporaries of the weight (its float32 copy, the scaled copy, the
// clamped copy, the codes), which bounded a quantizing cold load below the disk's rate. Here the
// chosen variant's Kernels::quantize (quantize_kernels.cpp, vectorized for its instruction set) reads
// each row as stored, float32, bfloat16 or float16, and writes its scale and elements; the rows are
// shared out between at::parallel_for's threads. And preload::quantize_many, many small weights in
// one call on the calling thread, for a load's runs of small tensors. This file is compiled for plain
// x86-64.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "qgemv_kernels.h"
#include "weights.h"

namespace {

constexpr int64_t kGrain = 1 << 16;  // elements of a chunk of the work (whole rows or bands: at least one)

using namespace preload;

// One scheme of kernels/quant.py as the GEMV takes it (kernels/formats.py), and its parts' sizes.
struct Scheme {
  ScaleKind kind;
  int64_t block;
  Element element;

  Scheme(int64_t scale_kind, int64_t block_, int64_t element_)
      : kind(static_cast<ScaleKind>(scale_kind)), block(block_), element(static_cast<Element>(element_)) {
    const bool known = (scale_kind == kPerTensor || scale_kind == kPerRow) ? (element == kE4M3 || element == kInt8)
                       : scale_kind == kBlock128                           ? element == kE4M3 && block == 128
                       : scale_kind == kE8M0Per32 ? (element == kE4M3 || element == kE2M1) && block == 32
                       : scale_kind == kE4M3Per16 ? element == kE2M1 && block == 16
                                                  : false;
    TORCH_CHECK(known, "no such scheme: scale kind ", scale_kind, ", block ", block_, ", element ", element_);
  }
  bool blocked() const { return kind == kE8M0Per32 || kind == kE4M3Per16; }
  at::ScalarType weight_dtype() const {
    return element == kInt8 ? at::kChar : element == kE4M3 ? at::kFloat8_e4m3fn : at::kByte;
  }
  at::ScalarType scale_dtype() const {
    return kind == kE8M0Per32 ? at::kFloat8_e8m0fnu : kind == kE4M3Per16 ? at::kFloat8_e4m3fn : at::kFloat;
  }
  int64_t columns(int64_t k) const {  // bytes of a stored row: K padded to whole blocks, halved for e2m1
    const int64_t padded = blocked() ? (k + block - 1) / block * block : k;
    return element == kE2M1 ? padded / 2 : padded;
  }
  int64_t scales(int64_t n, int64_t k) const {
    return kind == kPerTensor ? 1
           : kind == kPerRow  ? n
           : kind == kBlock128 ? (n + 127) / 128 * ((k + 127) / 128)
                               : n * ((k + block - 1) / block);
  }
  // FP8 per tensor's scale and NVFP4's global scale span the weight.
  bool spans() const { return kind == kPerTensor || kind == kE4M3Per16; }
  int64_t units(int64_t n) const { return kind == kBlock128 ? (n + 127) / 128 : n; }  // rows, or bands of 128
};

Source source_of(at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "quantization reads float32, bfloat16 or float16 weights, got ", dtype);
  return dtype == at::kFloat ? kSourceFloat32 : dtype == at::kBFloat16 ? kSourceBFloat16 : kSourceFloat16;
}

// w [N, K] (float32, bfloat16 or float16; rows any stride, each row contiguous) quantized into
// `weight` and `scale`, contiguous, in the scheme's layout (kernels/quant.py; scale_kind, block and
// element as the GEMV takes them: kernels/formats.py). `tensor_scale` is the per-tensor scale or
// NVFP4's global scale, which the caller stores. Returns whether every element was finite (for FP8
// per tensor, which the caller checked with the largest magnitude it needed first: true); where not,
// the parts hold nothing of use.
bool quantize(const at::Tensor& w, int64_t scale_kind, int64_t block, int64_t element, double tensor_scale,
              at::Tensor& weight, at::Tensor& scale, int64_t variant) {
  const Kernels* kernels = variant_kernels(variant);
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && (w.size(1) <= 1 || w.stride(1) == 1),
              "quantize takes a [N, K] CPU weight whose rows are contiguous, got ", w.sizes(), " strides ",
              w.strides());
  const Source source = source_of(w.scalar_type());
  const Scheme scheme(scale_kind, block, element);
  TORCH_CHECK(weight.scalar_type() == scheme.weight_dtype() && scale.scalar_type() == scheme.scale_dtype(),
              "the parts must be ", scheme.weight_dtype(), " and ", scheme.scale_dtype(), ", got ",
              weight.scalar_type(), " and ", scale.scalar_type());
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(weight.device().is_cpu() && weight.is_contiguous() && weight.numel() == n * scheme.columns(k),
              "weight must be ", n * scheme.columns(k), " contiguous bytes, got ", weight.sizes(), " ",
              weight.scalar_type());
  TORCH_CHECK(scale.device().is_cpu() && scale.is_contiguous() && scale.numel() == scheme.scales(n, k),
              "scale must be ", scheme.scales(n, k), " contiguous values, got ", scale.sizes());
  if (!n) return true;
  const QuantizeJob job{w.data_ptr(), source, n, k, w.stride(0), scheme.kind, block, scheme.element,
                        static_cast<float>(tensor_scale), static_cast<uint8_t*>(weight.data_ptr()),
                        scale.data_ptr()};
  // Chunks of about kGrain elements handed out from a counter, not one share a thread: a load reads
  // the next weight on another thread meanwhile, and the thread that shares its core with that read
  // takes fewer chunks instead of holding the others up at the end.
  const int64_t units = scheme.units(n), unit_elements = scale_kind == kBlock128 ? 128 * k : k;
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

// Whether [offset, offset + count * size) lies within [0, total), without overflowing.
bool within(int64_t offset, int64_t count, int64_t size, int64_t total) {
  return offset >= 0 && offset <= total && count >= 0 && size > 0 && count <= (total - offset) / size;
}

constexpr int64_t kManyFields = 8;

// Many small weights of one scheme and one stored dtype, on the calling thread alone (a load runs
// several such calls side by side): a cold load of many small tensors spent most of its time on
// each one's Python and dispatch, not on its bytes. `weights` holds 8 integers a weight: its first
// byte in `source`, N, K (each at least 1), and in `dest` the byte offset and length of its quantized
// elements, the offset and length of its scales, and the offset of its global scale (NVFP4; -1 for
// the others); each place aligned for what it holds, and none overlapping another or `source` (not
// checked: that would corrupt results, not memory). Each weight is quantized as `quantize` quantizes
// it; FP8 per tensor's scale and NVFP4's global one come from its own largest magnitude
// (Kernels::tensor_scale, as kernels/quant.py's tensor_scale), and are written at their offsets too.
// Every place is checked against its buffer before anything is written. Returns the index of the
// first weight with a value that is not finite (what its parts and the later weights' hold is then
// of no use), or -1.
int64_t quantize_many(const at::Tensor& source, at::ScalarType dtype, at::IntArrayRef weights, at::Tensor& dest,
                      int64_t scale_kind, int64_t block, int64_t element, int64_t variant) {
  const Kernels* kernels = variant_kernels(variant);
  const Scheme scheme(scale_kind, block, element);
  const Source stored = source_of(dtype);
  TORCH_CHECK(source.device().is_cpu() && source.scalar_type() == at::kByte && source.dim() == 1 &&
                  source.is_contiguous() && dest.device().is_cpu() && dest.scalar_type() == at::kByte &&
                  dest.dim() == 1 && dest.is_contiguous(),
              "quantize_many takes contiguous 1-D uint8 CPU source and dest");
  TORCH_CHECK(weights.size() % kManyFields == 0, "weights must be ", kManyFields, " integers a weight, got ",
              weights.size());
  const uint8_t* in = source.data_ptr<uint8_t>();
  uint8_t* out = dest.data_ptr<uint8_t>();
  const int64_t count = static_cast<int64_t>(weights.size()) / kManyFields, item = at::elementSize(dtype);
  const int64_t scale_item = scheme.scale_dtype() == at::kFloat ? 4 : 1;
  const auto aligned = [](const uint8_t* base, int64_t offset, int64_t size) {
    return (reinterpret_cast<uintptr_t>(base) + static_cast<uint64_t>(offset)) % size == 0;
  };
  for (int64_t i = 0; i < count; ++i) {
    const int64_t* f = weights.data() + i * kManyFields;
    const int64_t n = f[1], k = f[2];
    TORCH_CHECK(n >= 1 && k >= 1 && k <= source.numel() / item && within(f[0], n, k * item, source.numel()),
                "weight ", i, ": ", n, "x", k, " elements from byte ", f[0], " do not lie within the ",
                source.numel(), "-byte source");
    TORCH_CHECK(aligned(in, f[0], item), "weight ", i, ": its elements at byte ", f[0], " of the source are not ",
                "aligned to their ", item, " bytes");
    const int64_t columns = scheme.columns(k), scales = scheme.scales(n, k);
    TORCH_CHECK(f[4] % n == 0 && f[4] / n == columns && within(f[3], f[4], 1, dest.numel()),
                "weight ", i, ": its elements must be ", n, "x", columns, " bytes within the ", dest.numel(),
                "-byte destination, got ", f[4], " at ", f[3]);
    TORCH_CHECK(f[6] == scales * scale_item && within(f[5], f[6], 1, dest.numel()), "weight ", i,
                ": its scales must be ", scales * scale_item, " bytes within the destination, got ", f[6], " at ",
                f[5]);
    TORCH_CHECK(aligned(out, f[5], scale_item), "weight ", i, ": its scales at byte ", f[5], " of the destination ",
                "are not aligned to their ", scale_item, " bytes");
    const bool global = scheme.kind == kE4M3Per16;
    TORCH_CHECK(global ? within(f[7], 1, 4, dest.numel()) && aligned(out, f[7], 4) : f[7] == -1, "weight ", i, ": ",
                global ? "its global scale must be 4 aligned bytes within the destination"
                       : "no global scale in this scheme (-1)",
                ", got ", f[7]);
  }
  for (int64_t i = 0; i < count; ++i) {
    const int64_t* f = weights.data() + i * kManyFields;
    QuantizeJob job{in + f[0], stored, f[1], f[2], f[2], scheme.kind, block, scheme.element, 1.0f, out + f[3],
                    out + f[5]};
    if (scheme.spans()) {
      if (!kernels->tensor_scale(job, &job.tensor_scale)) return i;
      std::memcpy(out + (scheme.kind == kPerTensor ? f[5] : f[7]), &job.tensor_scale, 4);
    }
    if (!kernels->quantize(job, 0, scheme.units(job.n))) return i;  // (FP8 per tensor's: checked above)
  }
  return -1;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(preload, m) {
  m.def("quantize(Tensor w, int scale_kind, int block, int element, float tensor_scale, Tensor(a!) weight, "
        "Tensor(b!) scale, int variant) -> bool");
  m.def("quantize_many(Tensor source, ScalarType dtype, int[] weights, Tensor(a!) dest, int scale_kind, int block, "
        "int element, int variant) -> int");
}

TORCH_LIBRARY_IMPL(preload, CPU, m) {
  m.impl("quantize", &quantize);
  m.impl("quantize_many", &quantize_many);
}
