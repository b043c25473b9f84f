// The GEMV on AMX tiles (Intel's matrix units, Sapphire Rapids on), for the compilation of
// qgemv_kernels.cpp with -DPRELOAD_AMX (and the AVX-512 and AVX512-BF16 flags), which includes this
// inside its unnamed namespace: int8 at 3 to 16 rows runs the byte tiles of qgemv_amx_int8.h where K
// is a multiple of 64; fewer rows than amx_min_rows, and other int8 up to 4 rows, qgemv_bf16dot.h's
// GEMV (int8, and MXFP4's and NVFP4's e2m1, there on qgemv_int16.h's integers); and what none takes
// that compilation's AVX-512 `gemv`.
//
// y^T = W x^T: 16 rows of the weight are a tile of 16 x 32 bfloat16 (each row's 64 bytes, straight
// from the weight, or decoded into a scratch tile for the other formats), x^T is a tile of 16 pairs x M
// rows (the pairs of x along K side by side, as the instruction takes them: `pack_amx` lays x out so
// once per product), and one TDPBF16PS adds their product to a 16 x M float32 tile. A step of 32
// elements of 16 weight rows costs about the same for 3 rows of x as for 16: where the AVX-512
// kernels' multiply-adds grow with the rows, the tiles keep a batched GEMV at memory speed.
//
// Exactness: the unit multiplies bfloat16 exactly and sums in float32, as the AVX-512 kernels do (in
// another order), so it takes weights whose elements are bfloat16 values before their row or 128x128
// block scale, or after their MX or NVFP4 block scale (amx_takes), and activations that are bfloat16
// (when the output is). Float32 activations, K not a multiple of 32 and more than 16 rows run the
// AVX-512 kernels. The unit reads bfloat16 subnormals (below ~1e-38) as zero, and flushes float32
// ones in its sums.

constexpr int kTileRows = 16;  // weight rows per tile
constexpr int64_t kAmxMaxM = 16;
constexpr int64_t kAmxRows = 64;  // Kernels::block_unit: whole tiles, and few tile configurations a product

// Rows of x below which the dot product runs (amx_min_rows: e4m3 from 2; e2m1 takes the integers below 3):
// it streams one row's weight faster than the tiles do (a 2-core Xeon, a 1 GB bfloat16 weight: 23.5 against
// 19.6 GB/s; two rows about even), and spends no more on decoding int8 than the tiles' bfloat16 conversion
// does. From 4 rows on the tiles win, 2-3x at 8 rows (bfloat16 17.7 against 9.8 GB/s; int8 13.5 against
// 6.9). int8 runs the integer multiply-adds at 1 and 2 rows (qgemv_int16.h) and from 3 its byte tiles where
// K is a multiple of 64 (amx_int8_takes); other int8 the integers up to 4 rows, then the bfloat16 tiles.
constexpr int64_t kAmxMinM = 3;

// e4m3 weights take the tiles from 2 rows of x: two rows of dot products cost two VDPBF16PS a chunk,
// about 2.3 cycles each there, where one tile product takes all the rows (a 2-core Emerald Rapids,
// one thread, 256x4096 in L2, minima of 4 alternated runs: FP8 per channel 90 -> 57 us, FP8 blocks
// 105 -> 75, MXFP8 118 -> 82; 4096x4096 on two threads from memory about even). At one row the dot
// product stays faster from memory (FP8 per channel 0.90-1.06 against the tiles' 0.99-1.17 ms).
// MX's and NVFP4's e2m1 took them from 2 rows too, whose decoding bounded the dot product there as
// much (the same VM, one thread, minima of 2-3 alternated runs: 4096x4096 MXFP4 1.54-1.59 -> 1.03,
// NVFP4 1.60 -> 1.14-1.19 ms); now one and two rows run on the integer multiply-adds
// (qgemv_e2m1_int16.h: kE2M1IntMaxM), faster than both, and the tiles take e2m1 from 3 rows.
inline int64_t amx_min_rows(const Weight& w) {
  return w.element == kE4M3 ? 2 : w.element == kE2M1 ? kE2M1IntMaxM + 1 : kAmxMinM;
}

inline bool amx_layout(int64_t m_rows, int64_t k) { return m_rows <= kAmxMaxM && k % 32 == 0; }

// The weights the tiles take: bfloat16, int8 and e4m3 with one scale per row or tensor (applied to
// the sums), FP8's 128x128 blocks (the 16 rows of a tile share each block's scale: applied to the
// sums of every 4 chunks), and MX's and NVFP4's blocks of 32 and 16, whose scales fold into the
// decoded bfloat16 exactly (a power of two, or an e4m3 scale times an e2m1 value: 6 significant bits
// at most), NVFP4's float32 global scale applied to the sums. MX rows whose scales would leave
// bfloat16's normal range run the AVX-512 kernels (amx_folds).
inline bool amx_takes(const Weight& w, int64_t m_rows, bool bf16) {
  if (!bf16 || !amx_layout(m_rows, w.k) || m_rows < amx_min_rows(w)) return false;
  return w.kind <= kPerRow ? w.element != kE2M1 : w.element != kInt8 && w.element != kBF16;
}

// The MX codes whose blocks the tiles fold: each nonzero value times its 2^(code - 127) lies within
// [2^-100, 2^128), normal bfloat16, and far enough above float32's subnormals, which the tiles flush,
// that with activations of 2^-26 and more no product is flushed, and partial sums cancelling below
// 2^-126 cost no more than float32's rounding (smaller activations lose products to the flushing on
// any weight). e4m3 (times 2^-8: 2^-17 to 1.75) from 44 to 254, e2m1 (0.5 to 6) from 28 to 252.
constexpr uint8_t kAmxFold[2][2] = {{44, 254}, {28, 252}};  // [kE4M3, kE2M1]

// Whether the 16 rows from n fold their MX scales into the decoded bfloat16 (e8m0_within).
inline bool amx_folds(const Weight& w, int64_t n) {
  const uint8_t* range = kAmxFold[w.element == kE2M1];
  for (int r = 0; r < kTileRows; ++r)
    if (!e8m0_within(w, n + r, range[0], range[1])) return false;
  return true;
}

// e2m1 on the tiles: the 16 bytes of a row's chunk (32 elements: one MX block, two of NVFP4) are read
// into every 128-bit lane, and lane q shifts both 8-byte halves (h, one NVFP4 block each) right by
// 4q, so that word j of half h holds nibble 4j + q of it, element 16h + 4j + q, in its low 4 bits:
// what VPERMW looks up in a table of 32 words (bit 4 picks half h of it). No widening shuffle, and
// x's elements come in that order (pack_amx).
constexpr int e2m1_tile_element(int t) { return 16 * (t / 4 % 2) + 4 * (t % 4) + t / 8; }

// Where x (in kE2M1Order: qgemv.cpp reorders each 16) holds the element of the chunk's word t.
struct E2M1TileFrom {
  alignas(64) int32_t at[32] = {};
  constexpr E2M1TileFrom() {
    for (int t = 0; t < 32; ++t)
      for (int p = 0; p < 32; ++p)
        if (p / 16 * 16 + kE2M1Order[p % 16] == e2m1_tile_element(t)) at[t] = p;
  }
};
constexpr E2M1TileFrom kE2M1TileFrom;

// g++ 12's tile loads tell the compiler nothing of the memory they read (LDTILECFG only of its first
// 8 bytes): stores into what a tile instruction reads next must be made before it. Without this the
// compiler dropped a tile configuration's colsb stores as dead in one instantiation (zeros: a #GP,
// SIGSEGV). An empty asm that may read anything through the address keeps them, and in order.
inline void memory_read_by_tiles(const void* p) { asm volatile("" : : "r"(p) : "memory"); }

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// `count` tiles of 16 rows: the tiles in `weights` (bit t for tile t) hold 16 weight rows (64 bytes of
// each), every other one M columns of 4 bytes (sums, or x's pairs of bfloat16 or quads of bytes).
inline void configure_tiles(int count, unsigned weights, int64_t m_rows) {
  TileConfig config;
  for (int t = 0; t < count; ++t) {
    config.rows[t] = kTileRows;
    config.colsb[t] = weights >> t & 1 ? 64 : static_cast<uint16_t>(4 * m_rows);
  }
  memory_read_by_tiles(&config);
  _tile_loadconfig(&config);
}

// 32 e2m1 elements of a row in their tile order (e2m1_tile_element), looked up in `table`: bfloat16
// words, those of the chunk's first 16 elements (NVFP4's first block) in its first 16 words. With
// kHalves the index's bit 4 is set for the second 16; an MX table holds the same 16 words twice.
template <bool kHalves>
inline __m512bh e2m1_tile_row(const uint8_t* p, __m512i table) {
  const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i shifted = _mm512_srlv_epi64(bytes, _mm512_setr_epi64(0, 0, 4, 4, 8, 8, 12, 12));
  __m512i index = shifted;
  if constexpr (kHalves)  // (shifted & 15) | 16 in the second half's words
    index = _mm512_ternarylogic_epi64(shifted, _mm512_set1_epi16(15), _mm512_setr_epi64(0, 0x10001000100010, 0,
                                      0x10001000100010, 0, 0x10001000100010, 0, 0x10001000100010), 0xEA);
  return (__m512bh)_mm512_permutexvar_epi16(index, table);
}

// Every e2m1 value times every e4m3 scale (code s, sign included), as bfloat16: exact, 6 significant
// bits at most, 2^-10 to 2688. NVFP4's tiles look a block's 16 values up in row s. The scale is
// e4m3_bf16_bits' value (times 2^-8; NaN for the NaN codes) times 2^8.
struct E2M1TimesE4M3 {
  alignas(64) uint16_t words[256][16] = {};
  constexpr E2M1TimesE4M3() {
    for (int s = 0; s < 256; ++s) {
      const float value = std::bit_cast<float>(uint32_t(e4m3_bf16_bits(s & 0x7F)) << 16);
      const float scale = value * (s & 0x80 ? -256.0f : 256.0f);
      for (int c = 0; c < 16; ++c)
        words[s][c] = static_cast<uint16_t>(std::bit_cast<uint32_t>(kE2M1Values[c] * scale) >> 16);
    }
  }
};
constexpr E2M1TimesE4M3 kE2M1TimesE4M3;
static_assert(kE2M1TimesE4M3.words[0x38][3] == 0x3FC0 && kE2M1TimesE4M3.words[0x01][1] == 0x3A80,
              "1.5 x 1 and 0.5 x 2^-9 as bfloat16");

// 16 rows of chunk c of a quantized weight as bfloat16 [16][32] (e4m3 times 2^-8, as decode32 leaves
// it), straight to bfloat16, not through float32 (but int8's): plain e4m3 (qgemv_e4m3.h; the chunk
// an odd count leaves after its pairs, decode_tile_pair for the others), MX times
// its scale as an exponent add (rows that amx_folds), NVFP4's e2m1 from a table of the 16 values
// times each block's scale (an e4m3 scale of NaN, which no quantizer writes, gives NaNs: the AVX-512
// kernels read it as 480).
template <int kElem, int kMode>
inline void decode_tile(const Weight& w, int64_t n, int64_t c, uint16_t* tile) {
  for (int r = 0; r < kTileRows; ++r) {
    const uint8_t* p = w.data + (n + r) * w.row_bytes + c * kChunkBytes<kElem>;
    __m512bh v;
    __m512i exponent = _mm512_setzero_si512();  // MX's 2^(code - 127), to add to the exponents
    if constexpr (kMode == kBlock32Scale)
      exponent = e8m0_exponent(static_cast<const uint8_t*>(w.scale)[(n + r) * w.scale_cols + c]);
    if constexpr (kElem == kE4M3 && kMode == kBlock32Scale) {
      v = e4m3_bf16<true>(p, exponent);
    } else if constexpr (kElem == kE4M3) {
      v = e4m3_bf16(p);
    } else if constexpr (kElem == kE2M1 && kMode == kBlock32Scale) {
      const __m512i table = _mm512_load_si512(kE2M1Bf16x2.words);  // the zeros (codes 0 and 8) stay zeros
      v = e2m1_tile_row<false>(p, _mm512_mask_add_epi16(table, 0xFEFEFEFE, table, exponent));
    } else if constexpr (kElem == kE2M1) {  // the chunk's two blocks: their scales' rows of kE2M1TimesE4M3
      const uint8_t* codes = static_cast<const uint8_t*>(w.scale) + (n + r) * w.scale_cols + 2 * c;
      const __m256i first = _mm256_load_si256(reinterpret_cast<const __m256i*>(kE2M1TimesE4M3.words[codes[0]]));
      const __m256i second = _mm256_load_si256(reinterpret_cast<const __m256i*>(kE2M1TimesE4M3.words[codes[1]]));
      v = e2m1_tile_row<true>(p, _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1));
    } else {
      Vec f[2];
      decode32<kElem>(p, f);
      v = _mm512_cvtne2ps_pbh(f[1], f[0]);
    }
    _mm512_store_si512(tile + r * 32, (__m512i)v);
  }
}

// Chunks c and c + 1 (a pair) of 16 rows of e4m3 as bfloat16, the pair's two tiles (e4m3_bf16_pair:
// pack_amx lays x out to match), MX's scales added to the exponents as decode_tile adds them. A
// 2-core Emerald Rapids, one thread, 256x4096 in L2, minima of 4 alternated runs at 8 rows of x:
// FP8 per channel 84 -> 79 us, FP8 blocks 97 -> 91, MXFP8 104 -> 99; at 4 rows FP8 79 -> 66.
template <int kMode>
inline void decode_tile_pair(const Weight& w, int64_t n, int64_t c, uint16_t* first, uint16_t* second) {
  for (int r = 0; r < kTileRows; ++r) {
    const uint8_t* p = w.data + (n + r) * w.row_bytes + c * kChunk;
    __m512bh a, b;
    if constexpr (kMode == kBlock32Scale)
      e4m3_bf16_pair<true>(p, a, b, e8m0_exponents(static_cast<const uint8_t*>(w.scale) + (n + r) * w.scale_cols + c));
    else
      e4m3_bf16_pair(p, a, b);
    _mm512_store_si512(first + r * 32, (__m512i)a);
    _mm512_store_si512(second + r * 32, (__m512i)b);
  }
}

// e4m3 chunks of rows [n, n + 16) decoded into decoded[chunk % 4] from `next` on until `until` is:
// pairs two at a time (then up to 4 are in flight), the last chunk of an odd count alone.
template <int kMode>
inline void decode_e4m3_ahead(const Weight& w, int64_t n, int64_t until, int64_t& next,
                              uint16_t (*decoded)[kTileRows * 32]) {
  for (const int64_t stop = std::min(until, w.k / 32); next < stop;) {
    if (next < e4m3_paired_chunks(w)) {
      decode_tile_pair<kMode>(w, n, next, decoded[next % 4], decoded[(next + 1) % 4]);
      next += 2;
    } else {
      decode_tile<kE4M3, kMode>(w, n, next, decoded[next % 4]);
      ++next;
    }
  }
}

// The 16 weight rows after [n, n + 16), one contiguous run of the weight, prefetched a share at each
// of a product's `steps`, front to back, so that memory is read in order while the tiles read across
// the current rows (64 bytes of each a step): prefetching the same bytes of the next 16 rows instead
// streamed at ~17 GB/s, not ~20. Into L2, not L1: 16 rows of FP8 (64 KB at K 4096) or bfloat16 already
// outgrow L1 (a 2-core Emerald Rapids, 4096x4096 at 8 rows of x from memory, 5 runs alternated,
// medians: bfloat16 1.90 -> 1.72 ms, FP8 1.21 -> 0.97, int8 1.06 -> 0.92, MXFP4 0.85 -> 0.82).
struct NextRun {
  const char* next;
  int64_t run, share;
  NextRun(const Weight& w, int64_t n, int64_t steps)
      : next(reinterpret_cast<const char*>(w.data + (n + kTileRows) * w.row_bytes)), run(kTileRows * w.row_bytes),
        share((run / steps + 63) / 64 * 64) {}
  void fetch(int64_t step) const {
    for (int64_t at = step * share; at < std::min(run, (step + 1) * share); at += 64)
      _mm_prefetch(next + at, _MM_HINT_T1);
  }
};

#include "qgemv_amx_int8.h"  // in this namespace: int8 on the byte tiles

// 8 floats from a, then 8 from b.
inline __m512 eights(const float* a, const float* b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a))),
                                             _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}

// x^T as tiles 2 and 5 take it, after x: word [p][m] = x[m][2p] | x[m][2p + 1] << 16 in bfloat16 (x holds
// bfloat16 values where the GEMV takes it: rounding is then exact), e2m1's elements in their tile
// order (e2m1_tile_element), e4m3's paired chunks in e4m3_bf16_pair's (each chunk of a pair 8
// elements from each quarter of its group of 64). Fewer rows than the tiles take get the dot
// product's layout (qgemv_bf16dot.h) instead.
void pack_amx(float* x, int64_t m_rows, const Weight& w, int part, int parts) {
  if (amx_int8_takes(w, m_rows, true)) return pack_amx_int8(x, m_rows, w, part, parts);
  if (m_rows < amx_min_rows(w) || int16_takes(w, m_rows)) return pack_bf16dot(x, m_rows, w, part, parts);
  const int64_t k = w.k;
  if (!amx_layout(m_rows, k)) return;
  const __m512i from[2] = {_mm512_load_si512(kE2M1TileFrom.at), _mm512_load_si512(kE2M1TileFrom.at + 16)};
  uint32_t* words = reinterpret_cast<uint32_t*>(x + m_rows * k);
  const int64_t paired = e4m3_paired_chunks(w);
  const auto [first, end] = pack_share(k, part, parts);
  for (int64_t m = 0; m < m_rows; ++m)
    for (int64_t p = first / 2; p < end / 2; p += 16) {
      const float* src = x + m * k + 2 * p;
      __m512 lo = _mm512_loadu_ps(src), hi = _mm512_loadu_ps(src + 16);
      if (w.element == kE2M1) {
        const __m512 first = lo;
        lo = _mm512_permutex2var_ps(first, from[0], hi), hi = _mm512_permutex2var_ps(first, from[1], hi);
      } else if (p / 16 < paired) {  // chunk p / 16 of a pair: e4m3_bf16_pair's elements of its group of 64
        const float* group = x + m * k + 2 * p / 64 * 64 + p / 16 % 2 * 8;
        lo = eights(group, group + 16), hi = eights(group + 32, group + 48);
      }
      alignas(64) uint32_t pairs[16];  // the chunk's 32 elements: the pairs of 16 words
      _mm512_store_si512(pairs, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      for (int j = 0; j < 16; ++j) words[(p + j) * m_rows + m] = pairs[j];
    }
}

// Chunk c of rows [n, n + 16) times x^T into accumulator tile 0 (tiles 1 and 2 for the weight and
// x^T) or, kOdd, tile 3 (4 and 5). g++'s tile intrinsics take their tile numbers as literals.
template <int kElem, int kMode, bool kOdd>
inline void amx_step(const Weight& w, const uint32_t* xt, int64_t m_rows, int64_t n, int64_t c,
                     uint16_t (*decoded)[kTileRows * 32], int64_t& next, const NextRun& ahead) {
  ahead.fetch(c);
  const void* weight = w.data + n * w.row_bytes + c * 64;
  int64_t stride = w.row_bytes;
  if constexpr (kElem == kE4M3) {
    decode_e4m3_ahead<kMode>(w, n, c + 2, next, decoded);
    weight = decoded[c % 4], stride = 64;
  } else if constexpr (kElem != kBF16) {
    if (c + 1 < w.k / 32) decode_tile<kElem, kMode>(w, n, c + 1, decoded[(c + 1) % 2]);
    weight = decoded[c % 2], stride = 64;
  }
  if constexpr (kElem != kBF16) memory_read_by_tiles(weight);
  if constexpr (kOdd) {
    _tile_loadd(5, xt + c * 16 * m_rows, 4 * m_rows);
    _tile_loadd(4, weight, stride);
    _tile_dpbf16ps(3, 4, 5);
  } else {
    _tile_loadd(2, xt + c * 16 * m_rows, 4 * m_rows);
    _tile_loadd(1, weight, stride);
    _tile_dpbf16ps(0, 1, 2);
  }
}

// Weight rows [n, n + 16) times x: sums[r][m] (float32, before the row scale and kFactor), the next
// 16 rows prefetched as they go. Even and odd chunks go to two accumulator tiles, summed at the end
// (one took 0.80-0.92 ms for MXFP4 at 4-8 rows, two 0.64-0.76; 4096x4096 from memory, a 2-core Emerald
// Rapids, runs alternated). FP8's 128x128 blocks: the sums of each 4 chunks times their block's
// scale. A quantized weight's next chunk is decoded before the tile loads this one, decoded a step
// ago: a tile load right after the 16 stores of its rows waited for them (MXFP4 at 8 rows 0.93-0.98
// -> 0.71-0.81 ms, FP8 blocks 1.11-1.56 -> 0.91-0.97). e4m3 decodes a pair ahead (decode_e4m3_ahead);
// the others keep two buffers (four slowed MXFP4 at 8 rows by 2-5%).
template <int kElem, int kMode>
inline void amx_rows(const Weight& w, const uint32_t* xt, int64_t m_rows, int64_t n, float (*sums)[16]) {
  alignas(64) uint16_t decoded[kElem == kE4M3 ? 4 : 2][kTileRows * 32];  // chunks decoded ahead
  alignas(64) float even[kTileRows][16] = {}, odd[kTileRows][16] = {};  // m_rows columns stored: the rest stay 0
  const int64_t chunks = w.k / 32;
  const int64_t segment = kMode == kBlock128Scale ? 128 / 32 : chunks;
  const NextRun ahead(w, n, chunks);
  int64_t next = 0;  // the first chunk not decoded yet
  if constexpr (kElem == kE4M3) decode_e4m3_ahead<kMode>(w, n, 1, next, decoded);
  else if constexpr (kElem != kBF16) decode_tile<kElem, kMode>(w, n, 0, decoded[0]);
  for (int64_t c0 = 0; c0 < chunks; c0 += segment) {
    const int64_t stop = std::min(chunks, c0 + segment);
    _tile_zero(0);
    _tile_zero(3);
    for (int64_t c = c0; c < stop; c += 2) {
      amx_step<kElem, kMode, false>(w, xt, m_rows, n, c, decoded, next, ahead);
      if (c + 1 < stop) amx_step<kElem, kMode, true>(w, xt, m_rows, n, c + 1, decoded, next, ahead);
    }
    _tile_stored(0, even, 64);
    _tile_stored(3, odd, 64);
    const __m512 scale = _mm512_set1_ps(kMode == kBlock128Scale ? block_scale(w, n, c0 / segment) : 1.0f);
    for (int r = 0; r < kTileRows; ++r) {  // FP8 blocks: rows [n, n + 16) lie in one block of 128 (amx_gemv)
      const __m512 both = _mm512_add_ps(_mm512_load_ps(even[r]), _mm512_load_ps(odd[r]));
      _mm512_store_ps(sums[r], _mm512_fmadd_ps(both, scale, c0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(sums[r])));
    }
  }
}


template <int kElem, int kMode>
void amx_gemv(const Weight& w, const float* x, int64_t m_rows, int64_t begin, int64_t end, void* y, int64_t y_stride,
              bool bf16) {
  const uint32_t* xt = reinterpret_cast<const uint32_t*>(x + m_rows * w.k);
  alignas(64) float sums[kTileRows][16];
  configure_tiles(6, 1 << 1 | 1 << 4, m_rows);  // y^T (float32) in 0 and 3, 16 weight rows in 1 and 4, x^T in 2 and 5
  int64_t n = begin;
  for (; n + kTileRows <= end; n += kTileRows) {
    if (kMode == kBlock32Scale && !amx_folds(w, n)) {  // as the AVX-512 variant runs them: the same bits
      gemv(w, x, m_rows, n, n + kTileRows, y, y_stride, bf16);
      continue;
    }
    amx_rows<kElem, kMode>(w, xt, m_rows, n, sums);
    for (int r = 0; r < kTileRows; ++r) {
      const float scale = row_scale(w, n + r) * kFactor<kElem> * (kMode == kBlock16Scale ? w.global : 1.0f);
      for (int64_t m = 0; m < m_rows; ++m) put_output(y, y_stride, m, n + r, sums[r][m] * scale, bf16);
    }
  }
  _tile_release();
  if (n < end) gemv(w, x, m_rows, n, end, y, y_stride, bf16);  // fewer than 16 rows left
}

void gemv_amx(const Weight& w, const float* x, int64_t m_rows, int64_t begin, int64_t end, void* y, int64_t y_stride,
              bool bf16) {
  if (amx_int8_takes(w, m_rows, bf16)) return amx_int8_gemv(w, x, m_rows, begin, end, y, y_stride);
  if (m_rows < amx_min_rows(w) || int16_takes(w, m_rows))
    return gemv_bf16dot(w, x, m_rows, begin, end, y, y_stride, bf16);
  // FP8 blocks: 16 rows a tile within one block of 128 rows (callers split N in multiples of kAmxRows).
  if (!amx_takes(w, m_rows, bf16) || (w.kind == kBlock128 && begin % kTileRows != 0))
    return gemv(w, x, m_rows, begin, end, y, y_stride, bf16);
  with_format(w, [&]<int kElem, int kMode>() { amx_gemv<kElem, kMode>(w, x, m_rows, begin, end, y, y_stride, bf16); });
}
