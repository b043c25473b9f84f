// A whole decoder layer of a decode step in one call (torch class preload.DecodeLayer): the input
// norm, the q/k/v projections and their biases, the q/k norms (Qwen3), rope, the cache write,
// attention over each sequence's cache, o, the residual, the post-attention norm, gate and up,
// SwiGLU, down and the residual, for B sequences of one new token each; and every layer of a model
// in one call (preload.DecodeStack).
//
// Each step computes what the per-op path of worker/model.py computes at decode sizes, rounded where
// it rounds (to the model's dtype after every operation): the products run the fused GEMV of
// qgemv_kernels.cpp (the bfloat16 element format, or the weight's quantized one), the norms and
// attention the rows of decode_ops.h, rope and SwiGLU as torch's arithmetic does them. With bfloat16
// activations that is the same bits wherever the per-op path picks the same GEMV; with float32 ones
// SwiGLU's exp may differ from torch's in the last bit. What the call saves is
// everything between the products: no Python, no torch dispatch, no output tensors and no thread
// pool woken per operation (a layer of the default model runs about 25 of them). One OpenMP region
// runs all the layers of a call; its threads split each product's rows (blocks taken from a shared
// counter) and attention's heads, meet at a spinning barrier (barrier.h) after each step, and the
// one-thread steps run on thread 0. A call per layer instead cost the default model ~55 us a layer
// on a 2-core Xeon (1.7 ms of a 16 ms token): the interpreter's and the dispatcher's code and data
// come back from memory each time, after the layer's weights have streamed through the caches.
//
// Built once per layer by kernels/decode_layer.py over the layer's weight tensors (which it keeps
// alive); the kernel variant is chosen per call.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <omp.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <memory>
#include <optional>
#include <vector>

#include "barrier.h"
#include "decode_ops.h"
#include "qgemv_kernels.h"
#include "weights.h"

namespace {

using preload::Kernels;
using preload::Weight;
using preload::widen;


enum Phase : int64_t { kQkv = 0, kOut = 1, kGateUp = 2, kDown = 3, kPhases = 4 };

struct Projection {
  at::Tensor weight, scale;
  std::optional<at::Tensor> global;  // kept alive: `w` points into them
  Weight w;
  int64_t column;  // its first output column within the phase
};

// The work of one product step: blocks of rows of the phase's projections, taken in turn.
struct Blocks {
  std::vector<int64_t> first;  // per projection: its first block; then the total
  int64_t rows = 0;            // rows per block
};

template <typename T>
struct Scratch {  // one set per thread that calls forward (the engine's one), sized before the region
  preload::LineVector<T> h, qkv, q, attn, out, gate_up, act, down, normed;
  preload::LineVector<float> x;                 // a product's input, in the kernels' order, zero-padded
  std::vector<preload::LineVector<float>> attend;  // attention's scratch, one per thread of the region
};

struct Rows {  // where each row's keys and values go: cache slot, length with the new token; the cache's layout
  const int64_t *slot, *length;
  int64_t max_len, layer_stride;
  const preload::AttendPlan* attention;  // the same jobs for every layer
};

struct Work {  // one layer's products and attention in one call: blocks, and the counters threads take them from
  Blocks blocks[kPhases];
  std::atomic<int64_t> next[kPhases + 2] = {};  // each phase's blocks; attention's whole kv heads, then its parts
};

template <typename T>
struct Vectors {  // the norms' and biases' data, read before the region (nothing in it may throw)
  const T *input_norm, *post_norm, *q_norm, *k_norm, *qkv_bias, *o_bias;
};

class DecodeLayer : public torch::CustomClassHolder {
 public:
  DecodeLayer(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
              double scale)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), d_(head_dim), inter_(intermediate),
        eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)) {
    TORCH_CHECK(hidden > 0 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0 &&
                head_dim % 2 == 0 && intermediate > 0, "DecodeLayer: bad dimensions");
  }

  // A projection of `phase` (0 q/k/v, 1 o, 2 gate/up, 3 down), its columns after those added before.
  void add(int64_t phase, at::Tensor weight, at::Tensor scale, std::optional<at::Tensor> global, int64_t kind,
           int64_t block, int64_t element) {
    TORCH_CHECK(phase >= 0 && phase < kPhases, "DecodeLayer: unknown phase ", phase);
    Weight w = preload::check_weight(weight, scale, global, kind, block, element);
    auto& list = phases_[phase];
    TORCH_CHECK(list.empty() || (list[0].w.element == w.element && list[0].w.k == w.k),
                "DecodeLayer: the projections of one step must share an element format and width");
    TORCH_CHECK(w.k >= inputs(phase) && w.k - inputs(phase) < 32, "DecodeLayer: a phase ", phase, " weight of width ",
                w.k, " does not take ", inputs(phase), " inputs");
    const std::vector<int64_t> rows = phase == kQkv ? std::vector<int64_t>{heads_ * d_, kv_heads_ * d_, kv_heads_ * d_}
                                      : phase == kGateUp ? std::vector<int64_t>{inter_, inter_}
                                                         : std::vector<int64_t>{hidden_};
    TORCH_CHECK(list.size() < rows.size() && w.n == rows[list.size()], "DecodeLayer: phase ", phase, " takes ",
                rows.size(), " projection(s), in order (q, k, v; gate, up), of ",
                rows[std::min(list.size(), rows.size() - 1)], " rows; this one has ", w.n);
    int64_t column = list.empty() ? 0 : list.back().column + list.back().w.n;
    list.push_back({std::move(weight), std::move(scale), std::move(global), w, column});
  }

  void norms(at::Tensor input, at::Tensor post, std::optional<at::Tensor> q, std::optional<at::Tensor> k) {
    check_vector(input, hidden_, "input norm");
    check_vector(post, hidden_, "post-attention norm");
    TORCH_CHECK(q.has_value() == k.has_value(), "DecodeLayer: q and k norms come together");
    if (q) check_vector(*q, d_, "q norm"), check_vector(*k, d_, "k norm");
    input_norm_ = std::move(input), post_norm_ = std::move(post), q_norm_ = std::move(q), k_norm_ = std::move(k);
  }

  void biases(std::optional<at::Tensor> qkv, std::optional<at::Tensor> out) {
    if (qkv) check_vector(*qkv, outputs(kQkv), "q/k/v bias");
    if (out) check_vector(*out, hidden_, "o bias");
    qkv_bias_ = std::move(qkv), o_bias_ = std::move(out);
  }

  // x [B, hidden]; cache: this layer's [slots, 2, KV, max_len, D]; slots, lengths int64 [B] (the new
  // token sits at lengths - 1); rope [B, 1, 2, D]: cos and sign-folded sin rows (kernels/rope.py).
  // variant: 0 avx2, 1 avx512, 2 amx, 3 avx512bf16. Returns the layer's output [B, hidden], x's dtype.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& lengths,
                     const at::Tensor& rope, int64_t variant) {
    TORCH_CHECK(cache.dim() == 5, "DecodeLayer: cache must be contiguous [slots, 2, ", kv_heads_, ", max_len, ", d_,
                "]");
    return decode({this}, x, cache.unsqueeze(0), slots, lengths, rope, variant);
  }

  // The layers in order over x, as forward runs one: cache [layers, slots, 2, KV, max_len, D].
  static at::Tensor decode(const std::vector<const DecodeLayer*>& layers, const at::Tensor& x, const at::Tensor& cache,
                           const at::Tensor& slots, const at::Tensor& lengths, const at::Tensor& rope,
                           int64_t variant) {
    const Kernels* kernels = preload::variant_kernels(variant);
    TORCH_CHECK(!layers.empty(), "DecodeStack: no layers added");
    const at::ScalarType dtype = x.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "DecodeLayer: float32 or bfloat16 x");
    const DecodeLayer& first = *layers[0];
    TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.size(1) == first.hidden_,
                "DecodeLayer: x must be contiguous [B, ", first.hidden_, "]");
    TORCH_CHECK(cache.device().is_cpu() && cache.dim() == 6 && cache.is_contiguous() &&
                cache.size(0) == static_cast<int64_t>(layers.size()) && cache.size(2) == 2 &&
                cache.size(3) == first.kv_heads_ && cache.size(5) == first.d_ && cache.scalar_type() == dtype,
                "DecodeStack: cache must be contiguous [", layers.size(), " layers, slots, 2, ", first.kv_heads_,
                ", max_len, ", first.d_, "] in x's dtype");
    for (const DecodeLayer* layer : layers) layer->check(first, dtype);
    const int64_t batch = x.size(0);
    TORCH_CHECK(rope.device().is_cpu() && rope.is_contiguous() && rope.numel() == batch * 2 * first.d_ &&
                rope.scalar_type() == dtype,
                "DecodeLayer: rope must be [B, 1, 2, ", first.d_, "] contiguous on the CPU, in x's dtype");
    TORCH_CHECK(slots.device().is_cpu() && lengths.device().is_cpu() && slots.scalar_type() == at::kLong &&
                lengths.scalar_type() == at::kLong && slots.is_contiguous() &&
                lengths.is_contiguous() && slots.numel() == batch && lengths.numel() == batch,
                "DecodeLayer: slots and lengths must be contiguous int64 [B]");
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t* length = lengths.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b)
      TORCH_CHECK(slot[b] >= 0 && slot[b] < cache.size(1) && length[b] >= 1 && length[b] <= cache.size(4), "row ", b,
                  ": slot ", slot[b], " or length ", length[b], " is outside the cache's ", cache.size(1),
                  " slots of ", cache.size(4), " positions");
    at::Tensor out = x.clone();
    if (batch == 0) return out;
    preload::AttendPlan attention;
    attention.build(length, batch, first.kv_heads_, first.heads_ / first.kv_heads_, first.d_);
    const Rows where{slot, length, cache.size(4), cache.stride(0), &attention};
    if (dtype == at::kFloat)
      run<float>(layers, kernels, out.data_ptr<float>(), cache.data_ptr<float>(), where, rope.data_ptr<float>(), batch);
    else
      run<at::BFloat16>(layers, kernels, out.data_ptr<at::BFloat16>(), cache.data_ptr<at::BFloat16>(), where,
                        rope.data_ptr<at::BFloat16>(), batch);
    return out;
  }

 private:
  int64_t inputs(int64_t phase) const {
    return phase == kOut ? heads_ * d_ : phase == kDown ? inter_ : hidden_;
  }
  int64_t outputs(int64_t phase) const {
    return phase == kQkv ? (heads_ + 2 * kv_heads_) * d_ : phase == kGateUp ? 2 * inter_ : hidden_;
  }
  int64_t width(int64_t phase) const {
    const auto& list = phases_[phase];
    return list.empty() ? 0 : list.back().column + list.back().w.n;
  }
  // What decode needs of every layer of a call: complete, the shape of the first, its norms and biases in x's dtype.
  void check(const DecodeLayer& first, at::ScalarType dtype) const {
    for (int64_t p = 0; p < kPhases; ++p)
      TORCH_CHECK(!phases_[p].empty() && width(p) == outputs(p), "DecodeLayer: phase ", p, " has ", width(p),
                  " output columns, not ", outputs(p));
    TORCH_CHECK(input_norm_.defined(), "DecodeLayer: norms() first");
    TORCH_CHECK(hidden_ == first.hidden_ && heads_ == first.heads_ && kv_heads_ == first.kv_heads_ &&
                d_ == first.d_ && inter_ == first.inter_,
                "DecodeStack: the layers of one stack must share their shape");
    TORCH_CHECK(input_norm_.scalar_type() == dtype && post_norm_.scalar_type() == dtype,
                "DecodeLayer: the norms, cache and rope rows must be in x's dtype");
    if (q_norm_) TORCH_CHECK(q_norm_->scalar_type() == dtype && k_norm_->scalar_type() == dtype, "q/k norm dtype");
    if (qkv_bias_) TORCH_CHECK(qkv_bias_->scalar_type() == dtype, "DecodeLayer: q/k/v bias in x's dtype");
    if (o_bias_) TORCH_CHECK(o_bias_->scalar_type() == dtype, "DecodeLayer: o bias in x's dtype");
  }

  static void check_vector(const at::Tensor& t, int64_t n, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.is_contiguous() && t.size(0) == n, "DecodeLayer: the ", what,
                " must be contiguous [", n, "]");
  }

  Blocks blocks(const Kernels* kernels, int64_t phase) const {
    Blocks out;
    const auto& list = phases_[phase];
    int64_t n = 0;
    for (const auto& p : list) n += p.w.n;
    out.rows = preload::gemv_block_rows(kernels, list[0].w, n, at::get_num_threads());
    int64_t total = 0;
    for (const auto& p : list) {
      out.first.push_back(total);
      total += (p.w.n + out.rows - 1) / out.rows;
    }
    out.first.push_back(total);
    return out;
  }

  // Rows [b0, b1) of src ([batch, width] in T) into x as the phase's kernels read it: float32
  // [batch, k], zero-padded, each group of 16 in the kernels' order. Then, for bfloat16 x, the
  // kernels' packed copy: one row by its thread; more, once all are in, each thread a share of the
  // columns of every row (qgemv_kernels.h: their packed layouts may interleave the rows).
  template <typename T>
  void prepare(const Kernels* kernels, int64_t phase, const T* src, int64_t batch, int64_t b0, int64_t b1,
               preload::LineVector<float>& x, int thread, int team, preload::Barrier& barrier) const {
    const Weight& w = phases_[phase][0].w;
    const int64_t width = inputs(phase);
    const uint8_t* order = preload::x_order(kernels, w);
    for (int64_t r = b0; r < b1; ++r) preload::kernel_row(src + r * width, 1, width, w.k, order, x.data() + r * w.k);
    if (!kernels->pack || !std::is_same_v<T, at::BFloat16>) return;  // bf16 x only
    if (batch == 1) {
      if (b0 < b1) kernels->pack(x.data(), 1, w, 0, 1);
      return;
    }
    barrier.wait();
    kernels->pack(x.data(), batch, w, thread, team);
  }

  // This thread's share of a product step: y [rows, width(phase)] in T.
  template <typename T>
  void product(const Kernels* kernels, int64_t phase, const Blocks& work, std::atomic<int64_t>& next, const float* x,
               int64_t rows, T* y) const {
    const auto& list = phases_[phase];
    const int64_t total = work.first.back(), stride = width(phase);
    size_t p = 0;
    for (int64_t b = next++; b < total; b = next++) {
      while (work.first[p + 1] <= b) ++p;
      const Projection& proj = list[p];
      const int64_t begin = (b - work.first[p]) * work.rows, end = std::min(begin + work.rows, proj.w.n);
      kernels->gemv(proj.w, x, rows, begin, end, y + proj.column, stride, std::is_same_v<T, at::BFloat16>);
    }
  }

  // q/k/v of rows [b0, b1): biases, q/k norms, rope (as kernels/rope.py's rotate rounds: x * cos and
  // the rolled x * sin each, then their sum), k and v into the cache, q into s.q. `normed`: d scratch.
  template <typename T>
  void heads(Scratch<T>& s, const Vectors<T>& v, T* cache, const int64_t* slot, const int64_t* length, const T* rope,
             int64_t max_len, int64_t b0, int64_t b1, T* normed) const {
    const int64_t all = heads_ + 2 * kv_heads_, width = all * d_, half = d_ / 2;
    for (int64_t b = b0; b < b1; ++b) {
      T* row = s.qkv.data() + b * width;
      if (v.qkv_bias)
        for (int64_t c = 0; c < width; ++c) row[c] = static_cast<T>(widen(row[c]) + widen(v.qkv_bias[c]));
      const T* cos = rope + b * 2 * d_;
      const T* sin = cos + d_;
      for (int64_t h = 0; h < heads_ + kv_heads_; ++h) {
        T* head = row + h * d_;
        if (v.q_norm)
          preload::norm_rows(head, h < heads_ ? v.q_norm : v.k_norm, normed, 0, 1, d_, d_, eps_);
        else
          std::copy(head, head + d_, normed);
        for (int64_t i = 0; i < d_; ++i) {  // the rolled x: element i + half, or i - half past the middle
          const T a = static_cast<T>(widen(normed[i]) * widen(cos[i]));
          const T r = static_cast<T>(widen(normed[i < half ? i + half : i - half]) * widen(sin[i]));
          head[i] = static_cast<T>(widen(a) + widen(r));
        }
      }
      T* position = cache + (slot[b] * 2 * kv_heads_ * max_len + length[b] - 1) * d_;  // kv head 0's key
      for (int64_t h = 0; h < 2 * kv_heads_; ++h)  // the keys' kv heads, then the values'
        std::copy(row + (heads_ + h) * d_, row + (heads_ + h + 1) * d_, position + h * max_len * d_);
      std::copy(row, row + heads_ * d_, s.q.data() + b * heads_ * d_);
    }
  }

  template <typename T>
  Vectors<T> vectors() const {
    auto data = [](const std::optional<at::Tensor>& t) -> const T* { return t ? t->data_ptr<T>() : nullptr; };
    return {input_norm_.data_ptr<T>(), post_norm_.data_ptr<T>(), data(q_norm_), data(k_norm_), data(qkv_bias_),
            data(o_bias_)};
  }

  template <typename T>
  static void run(const std::vector<const DecodeLayer*>& layers, const Kernels* kernels, T* out, T* cache,
                  const Rows& rows, const T* rope, int64_t batch) {
    thread_local Scratch<T> mine;
    Scratch<T>& s = mine;  // the region's threads share the caller's (each has a thread_local of its own)
    const DecodeLayer& l = *layers[0];  // every layer has its shape (check)
    int64_t k_max = 0;
    for (const DecodeLayer* layer : layers)
      for (const auto& list : layer->phases_) k_max = std::max(k_max, list[0].w.k);
    s.h.resize(batch * l.hidden_), s.qkv.resize(batch * l.outputs(kQkv)), s.q.resize(batch * l.heads_ * l.d_);
    s.attn.resize(batch * l.heads_ * l.d_), s.out.resize(batch * l.hidden_), s.gate_up.resize(batch * 2 * l.inter_);
    const int threads = std::max(1, at::get_num_threads());
    s.act.resize(batch * l.inter_), s.down.resize(batch * l.hidden_), s.normed.resize(threads * l.d_);
    s.x.resize(preload::x_floats(kernels, batch, k_max));
    s.attend.resize(threads);
    const int64_t part = std::min(rows.max_len, preload::kAttendPart);
    for (auto& a : s.attend) a.resize(preload::attend_floats(l.heads_ / l.kv_heads_, part, l.d_));
    const size_t count = layers.size();
    std::vector<Vectors<T>> vectors;
    std::unique_ptr<Work[]> work(new Work[count]);
    for (size_t i = 0; i < count; ++i) {
      vectors.push_back(layers[i]->vectors<T>());
      for (int64_t p = 0; p < kPhases; ++p) work[i].blocks[p] = layers[i]->blocks(kernels, p);
    }
    preload::Barrier barrier;
#pragma omp parallel num_threads(threads)
    {
      const int thread = omp_get_thread_num(), team = omp_get_num_threads();
      barrier.join(team);
      for (size_t i = 0; i < count; ++i)
        layers[i]->step(kernels, s, vectors[i], work[i], out, cache + i * rows.layer_stride, rows, rope, batch, thread,
                        team, barrier);
    }
  }

  // This thread's share of attention: whole kv heads of rows (all their parts, one after another),
  // taken in turn, but for the last `team` kv heads, whose parts are taken one by one so that the
  // threads finish together. A kv head's parts run on in memory, keys after keys and values after
  // values, and memory streams long runs faster: on a 2-core Zen 4 VM, two threads summing runs of
  // 32 KiB (a part's keys or values at the default model's head size) at scattered places read 21
  // GB/s, runs of 64 KiB 25, of 256 KiB 30 (4 KiB pages). Taken one by one, a thread's parts had
  // been every other one. Which thread runs a part does not change its result (each writes its
  // own partial, merged in order by its row's thread), so the bits are as before. The default
  // model's layers, int8, 8 sequences of 560 positions, all in one call, switched within one
  // process (20 rounds of 8 calls, 3 processes): 0.91-0.96x the time; one sequence 0.99-1.01x.
  template <typename T>
  void attention(const Kernels* kernels, Scratch<T>& s, Work& work, const T* cache, const Rows& rows, int64_t batch,
                 int thread, int team) const {
    const preload::AttendPlan& plan = *rows.attention;
    auto run = [&](int64_t i) {
      const preload::AttendPlan::Job& job = plan.jobs[i];
      kernels->attend(preload::attend_job(s.q.data(), cache, s.attn.data(), sizeof(T), job.b, job.j, heads_,
                                          kv_heads_, d_, rows.slot[job.b], job.begin, job.end, rows.max_len, scale_,
                                          s.attend[thread].data(), job.partial, job.row_end),
                      std::is_same_v<T, at::BFloat16>);
    };
    const int64_t kv = batch * kv_heads_, whole = std::max<int64_t>(0, kv - team);
    for (int64_t u = work.next[kPhases]++; u < whole; u = work.next[kPhases]++) {
      const auto [begin, end] = plan.kv_head_jobs(u);
      for (int64_t i = begin; i < end; ++i) run(i);
    }
    const int64_t jobs = static_cast<int64_t>(plan.jobs.size());
    const int64_t rest = whole < kv ? plan.kv_head_jobs(whole).first : jobs;
    for (int64_t i = rest + work.next[kPhases + 1]++; i < jobs; i = rest + work.next[kPhases + 1]++) run(i);
  }

  // One thread's part of this layer's step, in the region of run. The work on whole rows of the
  // batch (norms, residual sums, x made ready for a product) is split by rows between the threads,
  // the same rows to the same thread throughout, so that a row needs no barrier between its steps
  // (nor between the layers); the products take blocks of weight rows, attention (row, kv head,
  // positions) jobs (AttendPlan; a row's parts merged by the thread of its row), and SwiGLU columns.
  // Past one row, x's packed copy is the exception: shares of its columns, after a barrier (prepare).
  template <typename T>
  void step(const Kernels* kernels, Scratch<T>& s, const Vectors<T>& v, Work& work, T* out, T* cache, const Rows& rows,
            const T* rope, int64_t batch, int thread, int team, preload::Barrier& barrier) const {
    const int64_t *slot = rows.slot, *length = rows.length;
    const int64_t share = (batch + team - 1) / team, b0 = std::min(batch, thread * share);
    const int64_t b1 = std::min(batch, b0 + share);
    preload::norm_rows(out, v.input_norm, s.h.data(), b0, b1, hidden_, hidden_, eps_);
    prepare(kernels, kQkv, s.h.data(), batch, b0, b1, s.x, thread, team, barrier);
    barrier.wait();
    product(kernels, kQkv, work.blocks[kQkv], work.next[kQkv], s.x.data(), batch, s.qkv.data());
    barrier.wait();
    heads(s, v, cache, slot, length, rope, rows.max_len, b0, b1, s.normed.data() + thread * d_);
    barrier.wait();
    attention(kernels, s, work, cache, rows, batch, thread, team);
    barrier.wait();
    for (int64_t b = b0; b < b1; ++b) rows.attention->merge(b, s.attn.data(), heads_);
    prepare(kernels, kOut, s.attn.data(), batch, b0, b1, s.x, thread, team, barrier);
    barrier.wait();
    product(kernels, kOut, work.blocks[kOut], work.next[kOut], s.x.data(), batch, s.out.data());
    barrier.wait();
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < hidden_; ++c) {
        const int64_t i = b * hidden_ + c;
        const T o = v.o_bias ? static_cast<T>(widen(s.out[i]) + widen(v.o_bias[c])) : s.out[i];
        out[i] = static_cast<T>(widen(out[i]) + widen(o));
      }
    preload::norm_rows(out, v.post_norm, s.h.data(), b0, b1, hidden_, hidden_, eps_);
    prepare(kernels, kGateUp, s.h.data(), batch, b0, b1, s.x, thread, team, barrier);
    barrier.wait();
    product(kernels, kGateUp, work.blocks[kGateUp], work.next[kGateUp], s.x.data(), batch, s.gate_up.data());
    barrier.wait();
    {  // SwiGLU as torch runs it on x's dtype, silu(gate) rounded, times up rounded; columns split
      const int64_t columns = (inter_ + team - 1) / team;
      const int64_t c0 = std::min(inter_, thread * columns), c1 = std::min(inter_, c0 + columns);
      for (int64_t b = 0; b < batch; ++b) {
        const T* gate = s.gate_up.data() + b * 2 * inter_;
        kernels->silu_mul(gate + c0, gate + inter_ + c0, s.act.data() + b * inter_ + c0, c1 - c0,
                          std::is_same_v<T, at::BFloat16>);
      }
    }
    barrier.wait();
    prepare(kernels, kDown, s.act.data(), batch, b0, b1, s.x, thread, team, barrier);
    barrier.wait();
    product(kernels, kDown, work.blocks[kDown], work.next[kDown], s.x.data(), batch, s.down.data());
    barrier.wait();
    for (int64_t i = b0 * hidden_; i < b1 * hidden_; ++i) out[i] = static_cast<T>(widen(out[i]) + widen(s.down[i]));
  }

  int64_t hidden_, heads_, kv_heads_, d_, inter_;
  float eps_, scale_;
  std::vector<Projection> phases_[kPhases];
  at::Tensor input_norm_, post_norm_;
  std::optional<at::Tensor> q_norm_, k_norm_, qkv_bias_, o_bias_;
};

// A model's layers in order, each decode step over all of them in one call (one OpenMP region).
class DecodeStack : public torch::CustomClassHolder {
 public:
  void append(c10::intrusive_ptr<DecodeLayer> layer) {
    TORCH_CHECK(layer, "DecodeStack: append a DecodeLayer");
    owned_.push_back(layer);
    layers_.push_back(layer.get());
  }

  // x [B, hidden]; cache [layers, slots, 2, KV, max_len, D]; the rest as DecodeLayer.forward takes them.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& lengths,
                     const at::Tensor& rope, int64_t variant) const {
    return DecodeLayer::decode(layers_, x, cache, slots, lengths, rope, variant);
  }

 private:
  std::vector<c10::intrusive_ptr<DecodeLayer>> owned_;
  std::vector<const DecodeLayer*> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(preload, m) {
  m.class_<DecodeLayer>("DecodeLayer")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double>())
      .def("add", &DecodeLayer::add)
      .def("norms", &DecodeLayer::norms)
      .def("biases", &DecodeLayer::biases)
      .def("forward", &DecodeLayer::forward);
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("append", &DecodeStack::append)
      .def("forward", &DecodeStack::forward);
}
