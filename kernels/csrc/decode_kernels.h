// The decode step's vector kernels beside the GEMV, in the vector layer of qgemv_simd.h: attention
// (one query head group over its kv head's cached keys and values) and SwiGLU; and, on AVX512-BF16,
// a prefill's causal attention (prefill_job, below). Included by qgemv_kernels.cpp inside its
// unnamed namespace, so that each of its compilations (AVX2, AVX-512, AMX) has a copy for its
// instruction set (Kernels::attend, Kernels::prefill, Kernels::silu_mul).
//
// Scores a block of positions at a time (their keys widened once for the group's heads, or on
// AVX512-BF16 multiplied as stored), each block's sums out of their registers at once; the
// softmax's exp a register at a time (a polynomial within ~2 ulp of the C library's); each output
// summed over the positions in order, in registers, the values widened once for several heads. The
// plain C++ this replaced (compiled for any x86-64) spent ~55 ns a position on three heads of 64;
// this spends ~7.5 (8 sequences of 500 positions, 2-core Zen 5, avx512bf16).

template <bool kBF16>
inline Vec load_widened(const void* p, int64_t at) {
  if constexpr (kBF16) {
    return widen_bf16(static_cast<const uint16_t*>(p) + at);
  } else {
    return vload(static_cast<const float*>(p) + at);
  }
}

template <bool kBF16>
inline float widened(const void* p, int64_t at) {
  if constexpr (kBF16) {
    const uint32_t bits = uint32_t(static_cast<const uint16_t*>(p)[at]) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
  } else {
    return static_cast<const float*>(p)[at];
  }
}

template <bool kBF16>
inline void store_out(void* p, int64_t at, float v) {
  if constexpr (kBF16) static_cast<uint16_t*>(p)[at] = to_bf16(v);
  else static_cast<float*>(p)[at] = v;
}

// exp(x) for x <= 88.7, clamped at -87 (~1e-38, float32's smallest normal: nothing beside a softmax
// row's largest, 1, or SwiGLU's 1 + exp): n = round(x / ln 2), r = x - n ln 2 in two steps, a
// degree-6 polynomial for exp(r), times 2^n made from its exponent bits.
inline Vec vexp_nonpositive(Vec x) {
  x = vmax(x, vset(-87.0f));
#ifdef PRELOAD_AVX512
  const Vec n = _mm512_roundscale_ps(vmul(x, vset(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const Vec n = _mm256_round_ps(vmul(x, vset(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  const Vec r = vfma(n, vset(2.12194440e-4f), vfma(n, vset(-0.693359375f), x));
  Vec p = vfma(vset(1.9875691500e-4f), r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  const Vec e = vadd(vfma(p, vmul(r, r), r), vset(1.0f));
#ifdef PRELOAD_AVX512
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return vmul(e, _mm512_castsi512_ps(bits));
#else
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return vmul(e, _mm256_castsi256_ps(bits));
#endif
}

inline float lane_max(Vec v) {
#ifdef PRELOAD_AVX512
  return _mm512_reduce_max_ps(v);
#else
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  return *std::max_element(lanes, lanes + 8);
#endif
}

// softmax over row[0, length) in place; with `top_out` and `sum_out`, exp(row - its largest)
// instead, the largest in *top_out and the sum of the exps in *sum_out.
inline void softmax_row(float* row, int64_t length, float* top_out = nullptr, float* sum_out = nullptr) {
  const int64_t full = length / kLanes * kLanes;
  float top = -INFINITY;
  if (full) {
    Vec m = vload(row);
    for (int64_t s = kLanes; s < full; s += kLanes) m = vmax(m, vload(row + s));
    top = lane_max(m);
  }
  for (int64_t s = full; s < length; ++s) top = std::max(top, row[s]);
  Vec total = vzero();
  for (int64_t s = 0; s < full; s += kLanes) {
    const Vec e = vexp_nonpositive(vadd(vload(row + s), vset(-top)));
    vstore(row + s, e);
    total = vadd(total, e);
  }
  float sum = vsum(total);
  if (full < length) {  // the tail through the same exp, in a register padded with -inf's zeros
    alignas(64) float tail[kLanes];
    for (int l = 0; l < kLanes; ++l) tail[l] = full + l < length ? row[full + l] - top : -INFINITY;
    vstore(tail, vexp_nonpositive(vload(tail)));
    for (int64_t s = full; s < length; ++s) sum += (row[s] = tail[s - full]);
  }
  if (top_out) {
    *top_out = top, *sum_out = sum;
    return;
  }
  const float inverse = 1.0f / sum;
  for (int64_t s = 0; s < full; s += kLanes) vstore(row + s, vmul(vload(row + s), vset(inverse)));
  for (int64_t s = full; s < length; ++s) row[s] *= inverse;
}

// On amx (Intel's cores), how far ahead the bfloat16 dot product's scores ask for a job's keys, and
// weigh_values for its values, into L2 (prefetch_l2). Without it a thread's demand loads, which wait
// in L1's few miss buffers, streamed the cache at ~7 GB/s: decode attention of 8 sequences of 550
// positions over 30 layers' caches in turn (101 MB), 2 threads, a 2-core Emerald Rapids, the builds
// alternated 6 times: 294-349 us a layer before (median 320), 200-332 after (254), faster every
// time (in scratch builds 2 KiB ahead timed as before, 8 KiB as 4). Only on amx, the one CPU it was
// measured on (on a Zen 4, L1 prefetches of the same, prefetch_ahead, had timed alike).
constexpr int64_t kAttendL2Ahead = 4096;

// Asks for [p + kAttendL2Ahead, + bytes) into L2, short of `end` (the row's keys or values end: its
// later parts' are read next, by this thread or the other, so a job's prefetches run on into them).
inline __attribute__((always_inline)) void prefetch_l2(const void* p, int64_t bytes, const void* end) {
  const char* from = static_cast<const char*>(p) + kAttendL2Ahead;
  const char* to = std::min(from + bytes, static_cast<const char*>(end));
  for (; from < to; from += 64) _mm_prefetch(from, _MM_HINT_T1);
}

// Heads [g0, g0 + G) of the group, output registers [e0, e0 + B registers): the positions' values
// weighted by each head's probabilities, each value register widened once for the G heads, each
// output lane summed over the positions in order. On AVX-512, bfloat16 values are widened 32 at a
// time, as two registers of their even and their odd elements: a load, a shift and a mask, where
// widening them in order took two widening loads (each a shuffle) and two shifts. The sums are put
// back in order at the end: the same sums, bit for bit (8 sequences of 560 positions, 3 heads of 64
// a kv head, 2-core Zen 4, builds alternated ten times, this and the scores' store below together:
// 91 -> 87 us a layer in cache, median; the engine's int8 decode of 8 requests after a 500-token
// prompt, four rounds: 474 -> 496 tokens/s, median).
template <bool kBF16, int G, int B>
void weigh_values(const AttendJob& a, const float* probs, int64_t g0, int64_t e0) {
  Vec acc[G][B];
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < B; ++i) acc[h][i] = vzero();
  for (int64_t s = 0; s < a.length; ++s) {
#ifdef PRELOAD_AMX
    // The first pass over bfloat16 values, which the dot product's scores left unasked (score_widened asks).
    if (kBF16 && g0 == 0 && e0 == 0)
      prefetch_l2(static_cast<const uint16_t*>(a.values) + s * a.d, a.d * 2,
                  static_cast<const uint16_t*>(a.values) + a.reach * a.d);
#endif
    Vec v[B];
#ifdef PRELOAD_AVX512
    if constexpr (kBF16 && B % 2 == 0) {  // v[2j]: elements 2i of the j-th 32, v[2j + 1]: elements 2i + 1
      for (int j = 0; j < B / 2; ++j)
        bf16_words_to_vecs(_mm512_loadu_si512(static_cast<const uint16_t*>(a.values) + s * a.d + e0 + j * 32),
                           v + 2 * j);
    } else
#endif
    for (int i = 0; i < B; ++i) v[i] = load_widened<kBF16>(a.values, s * a.d + e0 + i * kLanes);
    for (int h = 0; h < G; ++h) {
      const Vec weight = vset(probs[(g0 + h) * a.length + s]);
      for (int i = 0; i < B; ++i) acc[h][i] = vfma(weight, v[i], acc[h][i]);
    }
  }
#ifdef PRELOAD_AVX512
  if constexpr (kBF16 && B % 2 == 0) {  // the even and odd elements' sums interleaved back in order
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int h = 0; h < G; ++h)
      for (int j = 0; j < B / 2; ++j) {
        const Vec even = acc[h][2 * j], odd = acc[h][2 * j + 1];
        acc[h][2 * j] = _mm512_permutex2var_ps(even, first, odd);
        acc[h][2 * j + 1] = _mm512_permutex2var_ps(even, second, odd);
      }
  }
#endif
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < B; ++i) {
      const int64_t at = (g0 + h) * a.d + e0 + i * kLanes;
      if (a.partial) vstore(a.partial + at, acc[h][i]);
      else if constexpr (kBF16) store_bf16(static_cast<uint16_t*>(a.out) + at, acc[h][i]);
      else vstore(static_cast<float*>(a.out) + at, acc[h][i]);
    }
}

// Registers of output (of d / kLanes) and heads that weigh_values takes at once: G * B accumulators
// and B values in registers. AVX2 takes 3 x 3 (a group of 3 heads widens each value once), not 2
// x 4: the default model's 3 heads of 64 a kv head, 8 sequences of 40 positions in L2, one thread:
// 31.2 -> 29.6 ns a position for the whole of attention (1,000 positions: 32.3 -> 29.8).
constexpr int kValueRegisters = kLanes == 16 ? 4 : 3;
constexpr int kValueHeads = kLanes == 16 ? 4 : 3;

template <bool kBF16, int G>
void weigh_heads(const AttendJob& a, const float* probs, int64_t g0) {
  const int64_t full = a.d / kLanes * kLanes;
  int64_t e0 = 0;
  for (; e0 + kValueRegisters * kLanes <= full; e0 += kValueRegisters * kLanes)
    weigh_values<kBF16, G, kValueRegisters>(a, probs, g0, e0);
  const int64_t left = (full - e0) / kLanes;
  if (left == 1) weigh_values<kBF16, G, 1>(a, probs, g0, e0);
  if constexpr (kValueRegisters > 2)
    if (left == 2) weigh_values<kBF16, G, 2>(a, probs, g0, e0);
  if constexpr (kValueRegisters > 3)
    if (left == 3) weigh_values<kBF16, G, 3>(a, probs, g0, e0);
  static_assert(kValueRegisters <= 4, "weigh_heads takes the registers left one count at a time");
}

// How far ahead of the position it widens score_widened asks for keys and values (bytes). A job
// reads up to kAttendPart positions' keys, then their values, a few pages each, and the hardware's
// prefetchers alone leave the widening waiting on memory (8 sequences of 500 positions from memory,
// 2-core Zen 4, the avx2 variant, one thread: 41 -> 27 ns a position and kv head, two threads 23 ->
// 15; 512 to 4096 bytes ahead time alike). The bfloat16 dot product's scores do not ask: there it
// timed the same or slightly slower (25.5 -> 26.3 ns on one thread), both at ~14 ns on two threads.
constexpr int64_t kAttendAhead = 1024;

// Prefetches the key and the value kAttendAhead bytes past the position at element `at`.
template <bool kBF16>
inline __attribute__((always_inline)) void prefetch_ahead(const AttendJob& a, int64_t at) {
  constexpr int64_t kSize = kBF16 ? 2 : 4;
  for (int64_t o = 0; o < a.d * kSize; o += 64) {
    _mm_prefetch(static_cast<const char*>(a.keys) + at * kSize + kAttendAhead + o, _MM_HINT_T0);
    _mm_prefetch(static_cast<const char*>(a.values) + at * kSize + kAttendAhead + o, _MM_HINT_T0);
  }
}

// Registers of one head's query that score_widened holds while it walks a block's keys.
constexpr int kQueryRegisters = 4;

// dots[p] += q . key p over N registers of d, for the block's positions p: q held in registers, so
// each multiply-add loads only its key (loading both, the loads bounded it: on a 2-core Zen 2, as
// above, 37.4 -> 32.3 ns a position for the whole of attention, 1,000 positions 38.6-40.3 ->
// 31.4-33.0, from memory 86-89 -> 79-82).
template <int N>
inline __attribute__((always_inline)) void score_part(const float* q, const float* keys, int64_t d, int64_t block,
                                                      Vec* dots) {
  Vec query[N];
  for (int i = 0; i < N; ++i) query[i] = vload(q + i * kLanes);
#pragma GCC unroll 16
  for (int p = 0; p < kLanes; ++p)
    if (p < block)
      for (int i = 0; i < N; ++i) dots[p] = vfma(query[i], vload(keys + p * d + i * kLanes), dots[p]);
}

// scores[g][s] = q[g] . key[s] * scale for every head and position, a block of kLanes positions at
// a time: the block's keys widened once for the group's heads; per head, each position's dot product
// in a register, summed over d in order, then the block's kLanes registers summed at once
// (lane_sums: each bit for bit vsum).
template <bool kBF16>
void score_widened(const AttendJob& a, float* scores) {
  const int64_t group = a.group, length = a.length, d = a.d, full = d / kLanes * kLanes;
  float* query = scores + group * length;  // [group, d]
  float* keys = query + group * d;         // [kLanes, d]: a block of positions' keys
  static_assert(kLanes <= kAttendBlock, "attend_floats leaves room for kAttendBlock keys");
  int64_t i = 0;
  for (; i + kLanes <= group * d; i += kLanes) vstore(query + i, load_widened<kBF16>(a.q, i));
  for (; i < group * d; ++i) query[i] = widened<kBF16>(a.q, i);
  for (int64_t s0 = 0; s0 < length; s0 += kLanes) {
    const int64_t block = std::min<int64_t>(kLanes, length - s0);
    for (int64_t p = 0; p < block; ++p) {
      const int64_t row = (s0 + p) * a.d;
      prefetch_ahead<kBF16>(a, row);
      for (int64_t e = 0; e < full; e += kLanes) vstore(keys + p * d + e, load_widened<kBF16>(a.keys, row + e));
      for (int64_t e = full; e < d; ++e) keys[p * d + e] = widened<kBF16>(a.keys, row + e);
    }
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = query + g * d;
      Vec dots[kLanes];
      for (int p = 0; p < kLanes; ++p) dots[p] = vzero();
      for (int64_t e0 = 0; e0 < full; e0 += kQueryRegisters * kLanes) {
        if (e0 + kQueryRegisters * kLanes <= full)
          score_part<kQueryRegisters>(qg + e0, keys + e0, d, block, dots);
        else
          for (int64_t e = e0; e < full; e += kLanes) score_part<1>(qg + e, keys + e, d, block, dots);
      }
      alignas(64) float sums[kLanes];
      vstore(sums, lane_sums(dots));
      for (int64_t p = 0; p < block; ++p) {
        float dot = sums[p];
        for (int64_t e = full; e < d; ++e) dot += qg[e] * keys[p * d + e];
        scores[g * length + s0 + p] = dot * a.scale;
      }
    }
  }
}

#ifdef PRELOAD_BF16DOT
// score_widened for bfloat16 q and keys with d = 32 C, on AVX512-BF16's dot product: each key
// multiplied as it is stored, C dot products a position (a head's query held in C registers), no
// widening (a sixth of the instructions at d = 64). The products are exact, as widened, but for
// subnormal bfloat16 inputs, which the dot product reads as zero (as it flushes subnormal sums);
// the float32 sums run in another order (the dot product's pairs), so scores differ from the other
// variants' in their last bits.
// q . key p in lane p, for the `block` (up to kLanes) keys from `keys` on, d elements apart; the
// lanes past block are 0.
template <int C>
inline __attribute__((always_inline)) Vec dots_bf16(const __m512bh (&q)[C], const uint16_t* keys, int64_t d,
                                                    int64_t block) {
  Vec dots[kLanes];
#pragma GCC unroll 16
  for (int p = 0; p < kLanes; ++p) {
    Vec acc = vzero();
    if (p < block)
      for (int c = 0; c < C; ++c) acc = _mm512_dpbf16_ps(acc, q[c], (__m512bh)_mm512_loadu_si512(keys + p * d + 32 * c));
    dots[p] = acc;
  }
  return lane_sums(dots);
}

template <int C>
void score_bf16dot(const AttendJob& a, float* scores) {
  const uint16_t* q = static_cast<const uint16_t*>(a.q);
  const uint16_t* keys = static_cast<const uint16_t*>(a.keys);
  for (int64_t g = 0; g < a.group; ++g) {
    __m512bh qg[C];
    for (int c = 0; c < C; ++c) qg[c] = (__m512bh)_mm512_loadu_si512(q + g * a.d + 32 * c);
    for (int64_t s0 = 0; s0 < a.length; s0 += kLanes) {
      const int64_t block = std::min<int64_t>(kLanes, a.length - s0);
#ifdef PRELOAD_AMX
      if (g == 0)  // the first head's pass over the keys
        prefetch_l2(keys + s0 * a.d, block * a.d * 2, keys + a.reach * a.d);
#endif
      const Vec sums = vmul(dots_bf16<C>(qg, keys + s0 * a.d, a.d, block), vset(a.scale));  // a register at a time
      _mm512_mask_storeu_ps(scores + g * a.length + s0, static_cast<__mmask16>((1u << block) - 1), sums);
    }
  }
}
#endif

// softmax(q . K^T * scale) V for one kv head's group of query heads: the scores (on the dot product
// where AVX512-BF16 takes the head size), the probabilities by softmax_row, then the values weighed
// for several heads at once (weigh_values); or a part of it (AttendJob's partial).
template <bool kBF16>
void attend_job(const AttendJob& a) {
  const int64_t group = a.group, length = a.length, d = a.d, full = d / kLanes * kLanes;
  float* scores = a.scratch;  // [group, length]
#ifdef PRELOAD_BF16DOT
  if (kBF16 && d == 64) score_bf16dot<2>(a, scores);
  else if (kBF16 && d == 128) score_bf16dot<4>(a, scores);
  else if (kBF16 && d == 96) score_bf16dot<3>(a, scores);
  else if (kBF16 && d == 32) score_bf16dot<1>(a, scores);
  else score_widened<kBF16>(a, scores);
#else
  score_widened<kBF16>(a, scores);
#endif
  for (int64_t g = 0; g < group; ++g)  // a part: each head's largest score, then its sum (AttendJob)
    softmax_row(scores + g * length, length, a.partial ? a.partial + group * d + g : nullptr,
                a.partial ? a.partial + group * (d + 1) + g : nullptr);
  for (int64_t g0 = 0; g0 < group; g0 += kValueHeads) {
    const int64_t heads = std::min<int64_t>(kValueHeads, group - g0);
    if (heads == kValueHeads) weigh_heads<kBF16, kValueHeads>(a, scores, g0);
    else if (heads == 1) weigh_heads<kBF16, 1>(a, scores, g0);
    else if (heads == 2) weigh_heads<kBF16, 2>(a, scores, g0);
    else if constexpr (kValueHeads == 4) weigh_heads<kBF16, 3>(a, scores, g0);
  }
  for (int64_t g = 0; g < group; ++g) {
    const float* p = scores + g * length;
    for (int64_t e = full; e < d; ++e) {
      float sum = 0.0f;
      for (int64_t s = 0; s < length; ++s) sum += p[s] * widened<kBF16>(a.values, s * a.d + e);
      if (a.partial) a.partial[g * d + e] = sum;
      else store_out<kBF16>(a.out, g * d + e, sum);
    }
  }
}

#ifdef PRELOAD_BF16DOT
// A prefill's causal attention for a block of queries (PrefillJob), bfloat16, on AVX512-BF16's dot
// product for q.k and for p.v alike. Every query keeps a running softmax over the keys, kPrefillChunk
// positions at a time: its largest score so far, the sum of exps against it, and its float32
// output, scaled down when the largest grows. A chunk's scores are score_bf16dot's (dots_bf16: each
// key multiplied as stored, the dot products summed by lane_sums); its values are interleaved once for
// all the job's queries, positions 2k and 2k + 1 in each 32-bit lane, so that the probabilities,
// rounded to bfloat16 in the same pairs, weigh two positions per dot product (as torch's flash
// attention rounds them to the storage type for its p.v product). C: the head size in 32s.
// One 500-token prompt of the default model's shape (9 heads, 3 kv heads of 64), 2-core Zen 4:
// 1.9-2.2 ms a layer against 4.3-5.9 for torch's SDPA (its flash kernel), 2,000 tokens 29.7-32.3
// against 38.3-39.7.
// The same on float32 multiply-adds (keys and values widened once a chunk) took 3.0 and 38.6.
template <int C>
void prefill_job(const PrefillJob& a) {
  constexpr int kRegs = kPrefillChunk / kLanes;
  const int64_t group = a.group, d = a.d, queries = (a.q1 - a.q0) * group;
  const uint16_t* q = static_cast<const uint16_t*>(a.q);
  const uint16_t* keys = static_cast<const uint16_t*>(a.keys);
  const uint16_t* values = static_cast<const uint16_t*>(a.values);
  float* acc = a.scratch;           // [queries, d]: their outputs so far
  float* top = acc + queries * d;   // [queries]: each one's largest score so far
  float* total = top + queries;     // [queries]: its sum of exps against that
  uint32_t* pairs = reinterpret_cast<uint32_t*>(total + queries);  // [kPrefillChunk / 2, d]
  std::fill(acc, acc + queries * d, 0.0f);
  std::fill(top, top + queries, -INFINITY);
  std::fill(total, total + queries, 0.0f);
  for (int64_t s0 = 0; s0 < a.q1; s0 += kPrefillChunk) {
    const int64_t chunk = std::min<int64_t>(kPrefillChunk, a.q1 - s0);
    for (int64_t k = 0; 2 * k < chunk; ++k) {  // lane e of pair k: value e of position 2k, then of 2k + 1 (or 0)
      const uint16_t* first = values + (s0 + 2 * k) * d;
      for (int64_t e = 0; e < d; e += kLanes) {
        const __m512i low = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + e)));
        const __m512i high = 2 * k + 1 < chunk ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                                     reinterpret_cast<const __m256i*>(first + d + e))), 16)
                                               : _mm512_setzero_si512();
        _mm512_storeu_si512(pairs + k * d + e, _mm512_or_si512(low, high));
      }
    }
    for (int64_t p = std::max(a.q0, s0); p < a.q1; ++p) {
      const int64_t visible = std::min(chunk, p - s0 + 1);  // the chunk's positions up to p
      for (int64_t g = 0; g < group; ++g) {
        const int64_t i = (p - a.q0) * group + g;
        __m512bh query[C];
        for (int c = 0; c < C; ++c) query[c] = (__m512bh)_mm512_loadu_si512(q + p * a.q_stride + g * d + 32 * c);
        alignas(64) float probs[kPrefillChunk];
        for (int r = 0; r < kRegs; ++r) {
          const int64_t block = std::min<int64_t>(kLanes, visible - r * kLanes);
          if (block <= 0) break;  // set to -inf below
          vstore(probs + r * kLanes, vmul(dots_bf16<C>(query, keys + (s0 + r * kLanes) * d, d, block), vset(a.scale)));
        }
        for (int64_t s = visible; s < kPrefillChunk; ++s) probs[s] = -INFINITY;
        Vec most = vload(probs);
        for (int r = 1; r < kRegs; ++r) most = vmax(most, vload(probs + r * kLanes));
        const float largest = std::max(top[i], lane_max(most));
        Vec sum = vzero();
        for (int r = 0; r < kRegs; ++r)  // exp(-inf - largest) is clamped, not 0: zeroed below
          vstore(probs + r * kLanes, vexp_nonpositive(vadd(vload(probs + r * kLanes), vset(-largest))));
        for (int64_t s = visible; s < kPrefillChunk; ++s) probs[s] = 0.0f;
        for (int r = 0; r < kRegs; ++r) sum = vadd(sum, vload(probs + r * kLanes));
        const float factor = largest > top[i] ? std::exp(top[i] - largest) : 1.0f;  // 0 at first (top -inf)
        total[i] = total[i] * factor + vsum(sum), top[i] = largest;
        alignas(64) uint32_t weights[kPrefillChunk / 2];  // the probabilities as bfloat16, in pairs
        static_assert(kPrefillChunk == 2 * kLanes, "one conversion makes a chunk's pairs");
        _mm512_store_si512(weights, (__m512i)_mm512_cvtne2ps_pbh(vload(probs + kLanes), vload(probs)));
        float* o = acc + i * d;
        Vec out[2 * C];
        for (int r = 0; r < 2 * C; ++r) out[r] = vmul(vload(o + r * kLanes), vset(factor));
        for (int64_t k = 0; 2 * k + 1 < visible; ++k) {
          const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int>(weights[k]));
          for (int r = 0; r < 2 * C; ++r)
            out[r] = _mm512_dpbf16_ps(out[r], (__m512bh)_mm512_loadu_si512(pairs + k * d + r * kLanes), weight);
        }
        if (visible % 2) {  // the last position alone: its pair's other half (a later one) masked off, not
          const int64_t k = visible / 2;  // weighed by 0, which a non-finite value would turn into NaN
          const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int>(weights[k]));
          const __m512i low = _mm512_set1_epi32(0xFFFF);
          for (int r = 0; r < 2 * C; ++r)
            out[r] = _mm512_dpbf16_ps(
                out[r], (__m512bh)_mm512_and_si512(_mm512_loadu_si512(pairs + k * d + r * kLanes), low), weight);
        }
        for (int r = 0; r < 2 * C; ++r) vstore(o + r * kLanes, out[r]);
      }
    }
  }
  for (int64_t p = a.q0; p < a.q1; ++p)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t i = (p - a.q0) * group + g;
      const Vec inverse = vset(1.0f / total[i]);
      for (int64_t e = 0; e < d; e += kLanes)
        store_bf16(static_cast<uint16_t*>(a.out) + p * a.q_stride + g * d + e, vmul(vload(acc + i * d + e), inverse));
    }
}

void prefill(const PrefillJob& job) {
  if (job.d == 32) prefill_job<1>(job);
  else if (job.d == 64) prefill_job<2>(job);
  else if (job.d == 96) prefill_job<3>(job);
  else prefill_job<4>(job);
}
#endif

inline Vec vexp(Vec x) {  // any x: infinity above 88.7
  const Vec e = vexp_nonpositive(vmin(x, vset(88.0f)));
#ifdef PRELOAD_AVX512
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, vset(88.7f), _CMP_GT_OQ), e, vset(INFINITY));
#else
  return _mm256_blendv_ps(e, vset(INFINITY), _mm256_cmp_ps(x, vset(88.7f), _CMP_GT_OQ));
#endif
}

// out[i] = silu(gate[i]) * up[i] for i < n, as torch computes it on the storage dtype: silu(g) =
// g / (1 + exp(-g)) rounded (bfloat16), times up, rounded.
template <bool kBF16>
void silu_mul_rows(const void* gate, const void* up, void* out, int64_t n) {
  auto row = [](Vec g, Vec u) {
    Vec silu = vdiv(g, vadd(vset(1.0f), vexp(vmul(g, vset(-1.0f)))));
    if constexpr (kBF16) silu = vround_bf16(silu);
    return vmul(silu, u);
  };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec y = row(load_widened<kBF16>(gate, i), load_widened<kBF16>(up, i));
    if constexpr (kBF16) store_bf16(static_cast<uint16_t*>(out) + i, y);
    else vstore(static_cast<float*>(out) + i, y);
  }
  if (i < n) {  // the tail through the same arithmetic, in padded registers
    alignas(64) float g[kLanes] = {}, u[kLanes] = {}, y[kLanes];
    for (int64_t j = i; j < n; ++j) g[j - i] = widened<kBF16>(gate, j), u[j - i] = widened<kBF16>(up, j);
    vstore(y, row(vload(g), vload(u)));
    for (int64_t j = i; j < n; ++j) store_out<kBF16>(out, j, y[j - i]);
  }
}

void silu_mul(const void* gate, const void* up, void* out, int64_t n, bool bf16) {
  if (bf16) silu_mul_rows<true>(gate, up, out, n);
  else silu_mul_rows<false>(gate, up, out, n);
}

void attend(const AttendJob& job, bool bf16) {
  if (bf16) attend_job<true>(job);
  else attend_job<false>(job);
}
