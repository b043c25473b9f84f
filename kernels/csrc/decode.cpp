// The decode path's other ops, beside the linear layers of qgemv.cpp: RMSNorm, decode attention, and
// a prefill's causal attention (prefill_attention, on the variants with AVX512-BF16's dot product).
// They work in float32 whatever the tensors' dtype (float32 or bfloat16; the prefill attention takes
// bfloat16 only), and compute each row alone, so that a row's result does not depend on how many
// rows come with it. RMSNorm is plain C++ (any x86-64, vectorized by the compiler); the attentions
// run the chosen variant's Kernels::attend and Kernels::prefill (decode_kernels.h), the decode one
// being what the fused layer of layer.cpp runs.
//
// RMSNorm: weight * (x / sqrt(mean(x^2) + eps)), the normalisation rounded to x's dtype before the
// weight multiplies it, as kernels/norm.py's torch path does (and Llama/Qwen reference code).
// torch's fused rms_norm costs ~30-40 us a call on a CPU whatever the size, about as much as a
// 576-wide layer's GEMV; this costs a few.
//
// Decode attention: one new query per sequence over that sequence's cached keys and values, read
// in place from the engine's KV cache (worker/kv_cache.py's KVCache, one layer of it: [slots, 2,
// kv_heads, max_len, head_dim], each kv head's keys and values in order of position). torch's CPU
// flash attention costs ~100-150 us a call for one query over a short cache, and a batch needs its
// live cache gathered and converted first; this reads each key and value once and costs a few
// microseconds (three heads of 64 over 80 positions: ~2.3 us on AVX-512, against ~6.7 us for the
// plain C++ it replaced).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "decode_ops.h"
#include "weights.h"

namespace {

using preload::norm_rows;

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
      norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), begin, end, width, stride, e);
    else
      norm_rows(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), begin, end,
           width, stride, e);
  });
  return out;
}

// q [B, H, D]; cache [slots, 2, KV, max_len, D] contiguous, q's dtype; slots, lengths int64 [B]:
// row b reads positions [0, lengths[b]) of cache slot slots[b]. Returns [B, H, D] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& slots,
                            const at::Tensor& lengths, double scale, int64_t variant) {
  const preload::Kernels* kernels = preload::variant_kernels(variant);
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu() && slots.device().is_cpu() && lengths.device().is_cpu(),
              "decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [B, H, D]");
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous() && cache.size(1) == 2 && cache.size(4) == q.size(2),
              "cache must be contiguous [slots, 2, KV, max_len, D] with q's D");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type() &&
              (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "q and cache must both be float32 or both bfloat16");
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = cache.size(2);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, heads, " query heads are not a multiple of ", kv_heads,
              " kv heads");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && slots.dim() == 1 &&
              lengths.dim() == 1 && slots.size(0) == batch && lengths.size(0) == batch && slots.is_contiguous() &&
              lengths.is_contiguous(), "slots and lengths must be contiguous int64 [B]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < cache.size(0) && length[b] >= 1 && length[b] <= cache.size(3),
                "row ", b, ": slot ", slot[b], " or length ", length[b], " is outside the cache's ", cache.size(0),
                " slots of ", cache.size(3), " positions");
  at::Tensor out = at::empty({batch, heads, d}, q.options());
  const int64_t group = heads / kv_heads;
  preload::AttendPlan plan;
  plan.build(length, batch, kv_heads, group, d);
  const int64_t jobs = static_cast<int64_t>(plan.jobs.size());
  int64_t work = 0;
  for (int64_t b = 0; b < batch; ++b) work += length[b];
  const int64_t grain = work * heads * d < (int64_t(1) << 16) ? jobs : 1;  // small: one thread
  const float s = static_cast<float>(scale);
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  at::parallel_for(0, jobs, grain, [&](int64_t begin, int64_t end) {
    preload::LineVector<float> scratch;
    for (int64_t i = begin; i < end; ++i) {
      const preload::AttendPlan::Job& job = plan.jobs[i];
      scratch.resize(preload::attend_floats(group, job.end - job.begin, d));
      kernels->attend(preload::attend_job(q.data_ptr(), cache.data_ptr(), out.data_ptr(), q.element_size(), job.b,
                                          job.j, heads, kv_heads, d, slot[job.b], job.begin, job.end, cache.size(3), s,
                                          scratch.data(), job.partial, job.row_end),
                      bf16);
    }
  });
  for (int64_t b = 0; b < batch; ++b) {
    if (bf16) plan.merge(b, out.data_ptr<at::BFloat16>(), heads);
    else plan.merge(b, out.data_ptr<float>(), heads);
  }
  return out;
}

// q [B, T, H, D] contiguous bfloat16; cache [slots, 2, KV, max_len, D] contiguous bfloat16, holding
// each row's keys and values at positions [0, T) of slot slots[b] (written there first): causal
// attention of each row over its own positions, each row computed alone. Returns [B, T, H, D].
// Jobs of (row, kv head, kPrefillQueries positions of queries), the latest (longest) first, taken
// from a shared counter. Only the variants with AVX512-BF16's dot product run it (Kernels::prefill).
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& slots, double scale,
                             int64_t variant) {
  const preload::Kernels* kernels = preload::variant_kernels(variant);
  TORCH_CHECK(kernels->prefill, "prefill_attention runs on the avx512bf16 and amx kernels only");
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu() && slots.device().is_cpu(),
              "prefill_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous(), "q must be contiguous [B, T, H, D]");
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous() && cache.size(1) == 2 && cache.size(4) == q.size(3),
              "cache must be contiguous [slots, 2, KV, max_len, D] with q's D");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && cache.scalar_type() == at::kBFloat16,
              "q and cache must both be bfloat16");
  const int64_t batch = q.size(0), t = q.size(1), heads = q.size(2), d = q.size(3), kv_heads = cache.size(2);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, heads, " query heads are not a multiple of ", kv_heads,
              " kv heads");
  TORCH_CHECK(d == 32 || d == 64 || d == 96 || d == 128, "head size ", d, " is not 32, 64, 96 or 128");
  TORCH_CHECK(t >= 1 && t <= cache.size(3), t, " positions do not fit the cache's ", cache.size(3));
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == batch && slots.is_contiguous(),
              "slots must be contiguous int64 [B]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < cache.size(0), "row ", b, ": slot ", slot[b], " is outside the cache's ",
                cache.size(0), " slots");
  at::Tensor out = at::empty(q.sizes(), q.options());
  const int64_t group = heads / kv_heads, blocks = (t + preload::kPrefillQueries - 1) / preload::kPrefillQueries;
  const int64_t jobs = batch * kv_heads * blocks, max_len = cache.size(3), plane = kv_heads * max_len * d;
  const uint16_t* queries = static_cast<const uint16_t*>(q.data_ptr());
  const uint16_t* stored = static_cast<const uint16_t*>(cache.data_ptr());
  uint16_t* outputs = static_cast<uint16_t*>(out.data_ptr());
  const float s = static_cast<float>(scale);
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), jobs));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    preload::LineVector<float> scratch(preload::prefill_floats(group, preload::kPrefillQueries, d));
    for (int64_t i = next++; i < jobs; i = next++) {
      const int64_t block = blocks - 1 - i / (batch * kv_heads), b = i % (batch * kv_heads) / kv_heads,
                    j = i % kv_heads, first = (b * t * heads + j * group) * d;
      const uint16_t* keys = stored + (slot[b] * 2 * kv_heads + j) * max_len * d;
      kernels->prefill({queries + first, keys, keys + plane, outputs + first, group, block * preload::kPrefillQueries,
                        std::min(t, (block + 1) * preload::kPrefillQueries), d, heads * d, s, scratch.data()});
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(preload, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor cache, Tensor slots, Tensor lengths, float scale, int variant) -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor cache, Tensor slots, float scale, int variant) -> Tensor");
}

TORCH_LIBRARY_IMPL(preload, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("decode_attention", &decode_attention);
  m.impl("prefill_attention", &prefill_attention);
}
