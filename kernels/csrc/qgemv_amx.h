// The GEMV on AMX tiles (Intel's matrix units, Sapphire Rapids on), for the compilation of
// qgemv_kernels.cpp with -DPRELOAD_AMX (and the AVX-512 and AVX512-BF16 flags), which includes this
// inside its unnamed namespace: fewer rows than kAmxMinM run qgemv_bf16dot.h's GEMV, and what neither
// takes that compilation's AVX-512 `gemv`.
//
// y^T = W x^T: 16 rows of the weight are a tile of 16 x 32 bfloat16 (each row's 64 bytes, straight
// from the weight, or decoded into a scratch tile for int8 and e4m3), x^T is a tile of 16 pairs x M
// rows (the pairs of x along K side by side, as the instruction takes them: `pack_amx` lays x out so
// once per product), and one TDPBF16PS adds their product to a 16 x M float32 tile. A step of 32
// elements of 16 weight rows costs about the same for 3 rows of x as for 16: where the AVX-512
// kernels' multiply-adds grow with the rows, the tiles keep a batched GEMV at memory speed.
//
// Exactness: the unit multiplies bfloat16 exactly and sums in float32, as the AVX-512 kernels do (in
// another order), so it takes weights whose elements are bfloat16 values before their row scale
// (amx_takes), and activations that are bfloat16 (when the output is). Float32 activations, K not
// a multiple of 32 and more than 16 rows run the AVX-512 kernels. The unit reads bfloat16
// subnormals (below ~1e-38) as zero.

constexpr int kTileRows = 16;  // weight rows per tile
constexpr int64_t kAmxMaxM = 16;
constexpr int64_t kAmxRows = 64;  // Kernels::block_unit: whole tiles, and few tile configurations a product

// Rows of x below which the AVX-512 kernels run: they stream one row's weight faster than the tiles
// do (a 2-core Xeon, a 1 GB bfloat16 weight: 23.5 against 19.6 GB/s; two rows about even), and
// spend no more on decoding int8 or e4m3 than the tiles' bfloat16 conversion does. From 4 rows on
// the tiles win, 2-3x at 8 rows (bfloat16 17.7 against 9.8 GB/s; int8 13.5 against 6.9). int8 up to
// 4 rows runs the integer multiply-adds instead (qgemv_int16.h: a 2-core Emerald Rapids, 4096x4096
// at 3 and 4 rows, 0.54-0.85 ms against the tiles' 0.67-1.54, runs alternated; at 8 rows the tiles
// take 0.9-1.4 ms, the integers 1.9-2.4).
constexpr int64_t kAmxMinM = 3;

inline bool amx_layout(int64_t m_rows, int64_t k) { return m_rows <= kAmxMaxM && k % 32 == 0; }

// The scale kinds whose weights decode to bfloat16 exactly: per-row and per-tensor ones (applied to
// the sums), and MX's and NVFP4's blocks of 32 and 16 (a power of two, or an e4m3 scale times an
// e2m1 value: 6 significant bits at most), applied as the tile is decoded, NVFP4's float32 global
// scale to the sums. FP8's float32 block scales are not: those stay on the AVX-512 kernels.
inline bool amx_takes(const Weight& w, int64_t m_rows, bool bf16) {
  if (!bf16 || !amx_layout(m_rows, w.k) || m_rows < kAmxMinM || w.kind == kBlock128) return false;
  return w.kind <= kPerRow ? w.element != kE2M1 : w.element != kInt8 && w.element != kBF16;
}

// Block b's scale as decode_tile applies it (NVFP4's without its global scale).
inline float tile_scale(const Weight& w, int64_t n, int64_t b) {
  if (w.kind == kE4M3Per16) return e4m3_value(static_cast<const uint8_t*>(w.scale)[n * w.scale_cols + b]) * 256.0f;
  return block_scale(w, n, b);
}

// x^T as tile 2 takes it, after x: word [p][m] = x[m][2p] | x[m][2p + 1] << 16 in bfloat16 (x holds
// bfloat16 values where the GEMV takes it: rounding is then exact). Fewer rows than the tiles take
// get the dot product's layout (qgemv_bf16dot.h) instead.
void pack_amx(float* x, int64_t m_rows, const Weight& w, int64_t begin, int64_t end) {
  if (m_rows < kAmxMinM || int16_takes(w, m_rows)) return pack_bf16dot(x, m_rows, w, begin, end);
  const int64_t k = w.k;
  if (!amx_layout(m_rows, k)) return;
  uint32_t* words = reinterpret_cast<uint32_t*>(x + m_rows * k);
  for (int64_t m = begin; m < end; ++m)
    for (int64_t p = 0; p < k / 2; p += 16) {
      const float* src = x + m * k + 2 * p;
      alignas(64) uint32_t pairs[16];  // 32 elements in order: the pairs of 16 words
      _mm512_store_si512(pairs, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src)));
      for (int j = 0; j < 16; ++j) words[(p + j) * m_rows + m] = pairs[j];
    }
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile 0 accumulates y^T (16 weight rows x M float32), 1 holds 16 weight rows (32 bfloat16 each), 2 x^T.
inline void configure_tiles(int64_t m_rows) {
  TileConfig config;
  for (int t = 0; t < 3; ++t) {
    config.rows[t] = kTileRows;
    config.colsb[t] = t == 1 ? 64 : static_cast<uint16_t>(4 * m_rows);
  }
  _tile_loadconfig(&config);
}

// 16 rows of chunk c of a quantized weight as bfloat16 [16][32] (e4m3 times 2^-8, as decode32 leaves it).
template <int kElem>
inline void decode_tile(const Weight& w, int64_t n, int64_t c, uint16_t* tile) {
  for (int r = 0; r < kTileRows; ++r) {
    Vec v[2];
    decode32<kElem>(w.data + (n + r) * w.row_bytes + c * kChunkBytes<kElem>, v);
    if (w.kind == kE8M0Per32) {
      const Vec scale = vset(tile_scale(w, n + r, c));
      v[0] = vmul(v[0], scale), v[1] = vmul(v[1], scale);
    } else if (w.kind == kE4M3Per16) {  // the chunk's two blocks of 16, each in its register
      v[0] = vmul(v[0], vset(tile_scale(w, n + r, 2 * c)));
      v[1] = vmul(v[1], vset(tile_scale(w, n + r, 2 * c + 1)));
    }
    _mm512_store_si512(tile + r * 32, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
  }
}

// Weight rows [n, n + 16) times x: sums[r][m] (float32, before the row scale and kFactor). The 16
// rows are one contiguous run of the weight, which the tiles read across (64 bytes of each row a
// step): each step also prefetches its share of the next run, front to back, so that memory is read
// in order (prefetching the same bytes of the next 16 rows instead streamed at ~17 GB/s, not ~20).
// One accumulator tile: a step's product (~14 cycles) is not what bounds it.
template <int kElem>
inline void amx_rows(const Weight& w, const uint32_t* xt, int64_t m_rows, int64_t n, float (*sums)[16]) {
  alignas(64) uint16_t decoded[kTileRows * 32];
  const int64_t chunks = w.k / 32, stride = w.row_bytes, bytes = kChunkBytes<kElem>;
  const int64_t run = kTileRows * stride, share = (run / chunks + 63) / 64 * 64;
  const char* next = reinterpret_cast<const char*>(w.data + (n + kTileRows) * stride);
  _tile_zero(0);
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t at = c * share; at < std::min(run, (c + 1) * share); at += 64) _mm_prefetch(next + at, _MM_HINT_T0);
    _tile_loadd(2, xt + c * 16 * m_rows, 4 * m_rows);
    if constexpr (kElem == kBF16) {
      _tile_loadd(1, w.data + n * stride + c * bytes, stride);
    } else {
      decode_tile<kElem>(w, n, c, decoded);
      _tile_loadd(1, decoded, 64);
    }
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, sums, 64);
}

template <int kElem>
void amx_gemv(const Weight& w, const float* x, int64_t m_rows, int64_t begin, int64_t end, void* y, int64_t y_stride,
              bool bf16) {
  const uint32_t* xt = reinterpret_cast<const uint32_t*>(x + m_rows * w.k);
  alignas(64) float sums[kTileRows][16];
  configure_tiles(m_rows);
  int64_t n = begin;
  for (; n + kTileRows <= end; n += kTileRows) {
    amx_rows<kElem>(w, xt, m_rows, n, sums);
    for (int r = 0; r < kTileRows; ++r) {
      const float scale = row_scale(w, n + r) * kFactor<kElem> * (w.kind == kE4M3Per16 ? w.global : 1.0f);
      for (int64_t m = 0; m < m_rows; ++m) put_output(y, y_stride, m, n + r, sums[r][m] * scale, bf16);
    }
  }
  _tile_release();
  if (n < end) gemv(w, x, m_rows, n, end, y, y_stride, bf16);  // fewer than 16 rows left
}

void gemv_amx(const Weight& w, const float* x, int64_t m_rows, int64_t begin, int64_t end, void* y, int64_t y_stride,
              bool bf16) {
  if (m_rows < kAmxMinM || int16_takes(w, m_rows)) return gemv_bf16dot(w, x, m_rows, begin, end, y, y_stride, bf16);
  if (!amx_takes(w, m_rows, bf16)) return gemv(w, x, m_rows, begin, end, y, y_stride, bf16);
  if (w.element == kBF16) amx_gemv<kBF16>(w, x, m_rows, begin, end, y, y_stride, bf16);
  else if (w.element == kInt8) amx_gemv<kInt8>(w, x, m_rows, begin, end, y, y_stride, bf16);
  else if (w.element == kE2M1) amx_gemv<kE2M1>(w, x, m_rows, begin, end, y, y_stride, bf16);
  else amx_gemv<kE4M3>(w, x, m_rows, begin, end, y, y_stride, bf16);
}
