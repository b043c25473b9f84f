// The decode path's other ops, beside the linear layers of qgemv.cpp: RMSNorm and decode attention.
// Both work in float32 whatever the tensors' dtype (float32 or bfloat16), and compute each row
// alone, so that a row's result does not depend on how many rows come with it. RMSNorm is plain
// C++ (any x86-64, vectorized by the compiler); attention runs the chosen variant's
// Kernels::attend (decode_kernels.h), the one the fused layer of layer.cpp runs.
//
// RMSNorm: weight * (x / sqrt(mean(x^2) + eps)), the normalisation rounded to x's dtype before the
// weight multiplies it, as kernels/norm.py's torch path does (and Llama/Qwen reference code).
// torch's fused rms_norm costs ~30-40 us a call on a CPU whatever the size, about as much as a
// 576-wide layer's GEMV; this costs a few.
//
// Decode attention: one new query per sequence over that sequence's cached keys and values, read
// in place from the engine's KV cache (worker/model.py's KVCache, one layer of it: [slots, 2,
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
    std::vector<float> scratch;
    for (int64_t i = begin; i < end; ++i) {
      const preload::AttendPlan::Job& job = plan.jobs[i];
      scratch.resize(preload::attend_floats(group, job.end - job.begin, d));
      kernels->attend(preload::attend_job(q.data_ptr(), cache.data_ptr(), out.data_ptr(), q.element_size(), job.b,
                                          job.j, heads, kv_heads, d, slot[job.b], job.begin, job.end, cache.size(3), s,
                                          scratch.data(), job.partial),
                      bf16);
    }
  });
  for (int64_t b = 0; b < batch; ++b) {
    if (bf16) plan.merge(b, out.data_ptr<at::BFloat16>(), heads);
    else plan.merge(b, out.data_ptr<float>(), heads);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(preload, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor cache, Tensor slots, Tensor lengths, float scale, int variant) -> Tensor");
}

TORCH_LIBRARY_IMPL(preload, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("decode_attention", &decode_attention);
}
