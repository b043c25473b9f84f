// What the torch-facing translation units (qgemv.cpp, layer.cpp, decode.cpp) share about weights:
// which kernel variants this CPU runs, a weight and its scales checked into the kernels' Weight, x
// laid out in the order the kernels read it, in cache-line-aligned buffers. Torch headers are fine
// here: these units are compiled for plain x86-64 (see qgemv_kernels.h for the ones that must not
// see them).
#pragma once

#include <ATen/core/Tensor.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <new>
#include <optional>
#include <utility>
#include <vector>

#include "decode_ops.h"
#include "qgemv_kernels.h"

namespace preload {

// Memory aligned to a cache line (64 bytes), for the buffers whose rows the kernels load a register
// at a time: x as they read it (and its packed copy), attention's scratch. A std::vector's own is
// aligned to 16 bytes, which left 64-byte loads split across two lines wherever the allocation
// fell: x 16 bytes off a line took 1.02-1.17x the time on avx512bf16 and up to 1.42x on AVX2 (a
// 2-core Zen 4, one thread, 1024x576 in L2, the same kernels in one process, alternated: AVX2 at 8
// rows of x bfloat16 1.42x, FP8 1.33x, int8 1.18x).
template <typename T>
struct LineAligned {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kAlign); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
};
template <typename T>
using LineVector = std::vector<T, LineAligned<T>>;

// Linux hands a process the AMX tile state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA); a kernel that refuses, or predates AMX, leaves the AMX kernels off.
inline bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

inline bool runs_here(const Kernels* kernels) {
  __builtin_cpu_init();
  bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (kernels == &kAvx2) return avx2;
  bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl");
  if (kernels == &kAvx512) return avx512;
  bool bf16 = avx512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni") &&
              __builtin_cpu_supports("avx512vbmi");
  if (kernels == &kAvx512Bf16) return bf16;
  return bf16 && __builtin_cpu_supports("amx-tile") &&
         __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("amx-int8") && amx_permitted();
}

inline const char* name_of(const Kernels* kernels) {
  return kernels == &kAvx2 ? "avx2" : kernels == &kAvx512 ? "avx512" : kernels == &kAvx512Bf16 ? "avx512bf16" : "amx";
}

template <const Kernels* K>
void check_cpu() {
  static const bool ok = runs_here(K);
  TORCH_CHECK(ok, "the ", name_of(K), " kernels need instructions this CPU lacks; choose another variant "
              "(kernels.native.available() lists those it can run)");
}

// The kernels of variant index `variant` as the layer ops take it (0 avx2, 1 avx512, 2 amx, 3
// avx512bf16), checked to run on this CPU.
inline const Kernels* variant_kernels(int64_t variant) {
  TORCH_CHECK(variant >= 0 && variant <= 3, "kernel variant 0 (avx2), 1 (avx512), 2 (amx) or 3 (avx512bf16), not ",
              variant);
  if (variant == 0) return check_cpu<&kAvx2>(), &kAvx2;
  if (variant == 1) return check_cpu<&kAvx512>(), &kAvx512;
  if (variant == 3) return check_cpu<&kAvx512Bf16>(), &kAvx512Bf16;
  return check_cpu<&kAmx>(), &kAmx;
}

// Positions an attention job takes at most. A longer sequence's kv head is split into parts of
// kAttendPart positions (the last one shorter), which the threads share, and AttendPlan::merge sums
// their partial results in order. The split depends on the length alone, so a row's result does not
// depend on the rows beside it or on the number of threads. One sequence of 500 positions on 2
// threads, 2-core Zen 2: its 3 kv heads as 3 jobs kept one thread idle for a third of the phase.
// Parts of 256, not 128: a job streams twice as far through its kv head's keys and values, and
// fewer parts merge (8 sequences of 500 positions, 30 layers' caches from memory, 2 threads, 2-core
// Zen 4, builds alternated three times, ns a position and kv head: avx512bf16 12.0-12.1 -> 10.5-11.3,
// avx2 14.1-15.3 -> 12.7-13.1; in cache, avx512bf16, 5.8-6.5 -> 5.5; one sequence, avx2, 14.2-18.1
// -> 13.4-16.7). Parts of 512 gained more at 8 sequences (avx512bf16 9.8-10.0), but one sequence's 3
// kv heads were 3 jobs again (avx2 14.2-17.8 -> 17.5-18.5).
constexpr int64_t kAttendPart = 256;

// Query heads [j * group, (j + 1) * group) of row b over positions [begin, end) of kv head j of
// cache slot `slot`, for Kernels::attend: q and out [B, heads, d], the cache [slots, 2, kv_heads,
// max_len, d] (one layer: per slot the keys, then the values, each kv head's positions one after
// another), `element` bytes each. With `partial` the job writes there, not to out (AttendJob).
inline AttendJob attend_job(const void* q, const void* cache, void* out, size_t element, int64_t b, int64_t j,
                            int64_t heads, int64_t kv_heads, int64_t d, int64_t slot, int64_t begin, int64_t end,
                            int64_t max_len, float scale, float* scratch, float* partial = nullptr,
                            int64_t row_end = 0) {
  const int64_t group = heads / kv_heads, first = (b * heads + j * group) * d, plane = kv_heads * max_len * d;
  const char* keys = static_cast<const char*>(cache) + (((slot * 2 * kv_heads + j) * max_len + begin) * d) * element;
  return {static_cast<const char*>(q) + first * element, keys, keys + plane * element,
          static_cast<char*>(out) + first * element, group, end - begin, d, scale, scratch, partial,
          std::max(end, row_end) - begin};
}

// One call's attention jobs, by row, kv head and position, and room for the partial results of the
// rows longer than kAttendPart positions.
struct AttendPlan {
  struct Job {
    int64_t b, j, begin, end;
    float* partial;  // null: the row's only part, written to the output
    int64_t row_end;  // the row's length: its last part's end
  };
  std::vector<Job> jobs;
  std::vector<int64_t> first;  // row b's jobs: [first[b], first[b + 1])
  std::vector<float> partials;
  int64_t group = 0, d = 0, kv_heads = 0;

  void build(const int64_t* length, int64_t batch, int64_t kv_heads_, int64_t group_, int64_t d_) {
    group = group_, d = d_, kv_heads = kv_heads_;
    jobs.clear(), first.assign(1, 0);
    int64_t floats = 0;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t parts = (length[b] + kAttendPart - 1) / kAttendPart;
      for (int64_t j = 0; j < kv_heads; ++j)
        for (int64_t p = 0; p < parts; ++p)
          jobs.push_back({b, j, p * kAttendPart, std::min(length[b], (p + 1) * kAttendPart), nullptr, length[b]});
      if (parts > 1) floats += kv_heads * parts * group * (d + 2);
      first.push_back(static_cast<int64_t>(jobs.size()));
    }
    partials.resize(floats);
    float* next = partials.data();
    for (Job& job : jobs)
      if (length[job.b] > kAttendPart) job.partial = next, next += group * (d + 2);
  }

  // The jobs of kv head u % kv_heads of row u / kv_heads (its parts, in order): [begin, end).
  std::pair<int64_t, int64_t> kv_head_jobs(int64_t u) const {
    const int64_t b = u / kv_heads, j = u % kv_heads, parts = (first[b + 1] - first[b]) / kv_heads;
    return {first[b] + j * parts, first[b] + (j + 1) * parts};
  }

  // Row b's output (out [B, heads, d]) from its parts, if it has several: per head, each part's
  // output times exp(its largest score - the largest of all), summed in order, over the parts' sums
  // of exps weighed likewise.
  template <typename T>
  void merge(int64_t b, T* out, int64_t heads) const {
    const int64_t count = first[b + 1] - first[b], kv_heads = heads / group, parts = count / kv_heads;
    if (parts < 2) return;
    std::vector<float> sum(d);
    for (int64_t i = first[b]; i < first[b + 1]; i += parts)
      for (int64_t g = 0; g < group; ++g) {
        float top = -INFINITY, total = 0.0f;
        for (int64_t c = 0; c < parts; ++c) top = std::max(top, jobs[i + c].partial[group * d + g]);
        std::fill(sum.begin(), sum.end(), 0.0f);
        for (int64_t c = 0; c < parts; ++c) {
          const float* part = jobs[i + c].partial;
          const float w = std::exp(part[group * d + g] - top);
          total += w * part[group * (d + 1) + g];
          for (int64_t e = 0; e < d; ++e) sum[e] += w * part[g * d + e];
        }
        T* row = out + (b * heads + jobs[i].j * group + g) * d;
        for (int64_t e = 0; e < d; ++e) row[e] = static_cast<T>(sum[e] / total);
      }
  }
};

// Everything the kernels index is checked here: a bad shape is an error, never a stray read.
inline Weight check_weight(const at::Tensor& weight, const at::Tensor& scale,
                           const std::optional<at::Tensor>& global_scale, int64_t scale_kind, int64_t block,
                           int64_t element) {
  TORCH_CHECK(element >= kE4M3 && element <= kBF16, "unknown element format ", element);
  TORCH_CHECK(weight.device().is_cpu() && scale.device().is_cpu(), "the native kernels run on CPU tensors");
  bool bf16 = element == kBF16;
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
              (bf16 ? weight.scalar_type() == at::kBFloat16 : weight.element_size() == 1),
              bf16 ? "weight must be contiguous bfloat16 [N, K]" : "weight must be contiguous bytes [N, K]");
  int64_t n = weight.size(0), k = weight.size(1) * (element == kE2M1 ? 2 : 1);
  bool per_block = scale_kind >= kBlock128;
  if (!per_block) block = k;
  TORCH_CHECK(k % 16 == 0 && k > 0 && block % 16 == 0 && block > 0, "K and the block size must be multiples of 16");
  TORCH_CHECK(scale.is_contiguous(), "scale must be contiguous");
  float global = 1.0f;
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
                  block == (scale_kind == kE8M0Per32 ? 32 : 16) && k % block == 0 &&
                  scale.size(1) == k / block,
                  "MX/NVFP4 scale: bytes [N, K / block]");
      if (scale_kind == kE4M3Per16) {
        TORCH_CHECK(global_scale && global_scale->device().is_cpu() && global_scale->scalar_type() == at::kFloat &&
                    global_scale->numel() == 1, "NVFP4 needs its float32 global scale");
        global = *global_scale->data_ptr<float>();
      }
      break;
    default:
      TORCH_CHECK(false, "unknown scale kind ", scale_kind);
  }
  bool scheme = element == kE2M1 ? scale_kind >= kE8M0Per32
                : element == kInt8 ? scale_kind <= kPerRow
                : bf16                      ? scale_kind == kPerTensor
                                            : scale_kind <= kE8M0Per32;
  TORCH_CHECK(scheme, "no scheme has element format ", element, " with scale kind ", scale_kind);
  return Weight{static_cast<const uint8_t*>(weight.data_ptr()), n, k, weight.size(1) * weight.element_size(),
                static_cast<Element>(element), static_cast<ScaleKind>(scale_kind),
                scale.data_ptr(), scale.dim() == 2 ? scale.size(1) : 0, block, global};
}

// Each group of 16 elements of a row of x in the kernels' `order` (k a multiple of 16).
inline void order_groups(float* row, int64_t k, const uint8_t* order) {
  float group[16];
  for (int64_t g = 0; g < k; g += 16) {
    for (int p = 0; p < 16; ++p) group[p] = row[g + order[p]];
    std::copy(group, group + 16, row + g);
  }
}

// The order x comes in for a weight's element format on variant K, or null: in order.
inline const uint8_t* x_order(const Kernels* kernels, const Weight& w) {
  return w.element == kE2M1 ? kernels->e2m1_order : w.element == kBF16 ? kernels->bf16_order : nullptr;
}

// One row of x (`width` elements of T, `stride` apart) as the kernels read it: float32, `k` wide,
// zero-padded, each group of 16 in `order` where there is one. (Kernels::pack, where there is one,
// then lays the rows out again after them.)
template <typename T>
void kernel_row(const T* src, int64_t stride, int64_t width, int64_t k, const uint8_t* order, float* dst) {
  for (int64_t j = 0; j < width; ++j) dst[j] = widen(src[j * stride]);
  std::fill(dst + width, dst + k, 0.0f);
  if (order) order_groups(dst, k, order);
}

// A GEMV hands its threads blocks of rows taken from a shared counter, not one share each: on a
// busy machine a thread that runs late takes fewer blocks instead of holding up the call. A block
// is a multiple of the kernels' block_unit rows (every step of the kernels divides it) of about
// kGemvBytes of weight, whatever the rows of x or the element format: each block starts a new stream
// of reads, whose first bytes no prefetch has asked for yet. (Blocks of 64K multiply-adds shrank as
// x's rows grew, to 16 rows of 576 at 8 rows of x, and two threads then ran a 49152x576 bfloat16
// GEMV from memory little faster than one: 2.6 ms against 1.3-1.5 with 512 KiB blocks, a 2-core
// Zen 5. Blocks of 256K elements, as they were, gave 4-bit weights 128 KiB blocks, and their one-row
// GEMV from memory took 5-10% longer than with 512 KiB.) Each thread gets at least
// kGemvBlocksPerThread blocks where the weight has the rows.
constexpr int64_t kGemvBytes = int64_t(512) << 10;
constexpr int64_t kGemvBlocksPerThread = 2;

inline int64_t gemv_block_rows(const Kernels* kernels, const Weight& w, int64_t n, int64_t threads) {
  const int64_t unit = kernels->block_unit;
  const int64_t rows = std::min(kGemvBytes / w.row_bytes, n / (std::max<int64_t>(threads, 1) * kGemvBlocksPerThread));
  return std::max<int64_t>(unit, rows / unit * unit);
}

// Floats a buffer of x needs for m rows of k: the rows, and the kernels' packed copy where they make one.
inline int64_t x_floats(const Kernels* kernels, int64_t m, int64_t k) {
  return m * k + (kernels->pack ? pack_floats(m, k) : 0);
}

}  // namespace preload
