// kvserve's CPU kernels (fp32): paged decode attention, and rotary embedding fused with the KV store.
//
// Built once per machine by `python -m kernels.cpu_ext` (`make setup` runs it) and loaded by
// kvserve/kernels/cpu_ext.py; kvserve/kernels/cpu_backend.py calls these ops where they apply and the plain-torch
// reference (kvserve/kernels/reference.py) everywhere else. The reference is the specification: the tests
// compare every op here with it.
//
// Threads: at::parallel_for runs on torch's own OpenMP pool, so torch.set_num_threads (and the
// engine's thread governor) governs these kernels too. Built with -ffp-contract=off: the rope must
// round exactly as the reference's separate multiply and add do (HF's formula, bit for bit).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#if defined(__AVX2__) && defined(__FMA__)
// exp of 8 floats (Cephes' expf: range reduction by ln 2, degree-5 polynomial; ~2 ulp on the
// softmax's range x <= 0). std::exp is scalar and was the decode kernel's largest cost.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}
#endif

// s[i] = exp(s[i] - m) for i < n; returns their sum.
float exp_shifted_sum(float* s, int64_t n, float m) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  const __m256 vm = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float lane : lanes) sum += lane;
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
}

void check_cache(const at::Tensor& kv_cache, int64_t head_dim) {
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.scalar_type() == at::kFloat,
              "kv_cache must be a float32 CPU tensor");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be contiguous [2, num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(kv_cache.size(4) == head_dim, "kv_cache head_dim ", kv_cache.size(4), " != ", head_dim);
}

void check_int32(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == dim && t.is_contiguous(),
              name, " must be a contiguous int32 CPU tensor of dim ", dim);
}

// NOTE: a decode step reads each layer's K/V from DRAM (the other layers and the weights evict it
// between steps), scattered over blocks: without software prefetch the loads of one token wait for
// the previous token's, and the kernel ran at a fraction of the bandwidth (measured: as slow as the
// torch path once the cache is cold, 2x faster while it is warm).
#ifndef KVSERVE_PREFETCH_AHEAD
#define KVSERVE_PREFETCH_AHEAD 8
#endif
constexpr int64_t kPrefetchAhead = KVSERVE_PREFETCH_AHEAD;

inline void prefetch_row(const float* row, int64_t head_dim) {
  for (int64_t d = 0; d < head_dim; d += 16) __builtin_prefetch(row + d, 0, 3);
}

#if defined(__AVX2__) && defined(__FMA__)
// Sums of each of 8 vectors, as the 8 lanes of one vector (lane i = sum of v[i]).
inline __m256 reduce8(const __m256 v[8]) {
  const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// scores[i] = scale * q . rows[i] for 8 rows (head_dim % 8 == 0). NOTE: eight independent FMA chains;
// one dot at a time is bound by the FMA latency (4 cycles per 8 elements), not its throughput.
inline void dot8(const float* q, const float* const rows[8], int64_t head_dim, float scale, float* scores) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8) {
    const __m256 qd = _mm256_loadu_ps(q + d);
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(rows[i] + d), acc[i]);
  }
  _mm256_storeu_ps(scores, _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(scale)));
}

// out = sum_i p[i] * rows[i] over head_dim = 8 * CHUNKS, accumulated in registers. NOTE: CHUNKS is
// a template argument so the accumulators stay in registers (a runtime count spilled them).
// Two tokens per iteration into two accumulator sets where registers allow (CHUNKS <= 6): with
// fewer than 8 independent FMA chains a single set waits on the FMA latency.
template <int CHUNKS>
inline void weighted_sum(const float* p, const float* const* rows, int64_t n, float* out) {
  constexpr int SETS = CHUNKS <= 6 ? 2 : 1;
  __m256 acc[SETS][CHUNKS];
  for (int s = 0; s < SETS; ++s)
    for (int c = 0; c < CHUNKS; ++c) acc[s][c] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + SETS <= n; i += SETS) {
    for (int s = 0; s < SETS; ++s) {
      if (i + s + kPrefetchAhead < n) prefetch_row(rows[i + s + kPrefetchAhead], 8 * CHUNKS);
      const __m256 pi = _mm256_set1_ps(p[i + s]);
      const float* v = rows[i + s];
      for (int c = 0; c < CHUNKS; ++c) acc[s][c] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(v + 8 * c), acc[s][c]);
    }
  }
  for (; i < n; ++i) {
    const __m256 pi = _mm256_set1_ps(p[i]);
    for (int c = 0; c < CHUNKS; ++c) acc[0][c] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(rows[i] + 8 * c), acc[0][c]);
  }
  for (int c = 0; c < CHUNKS; ++c) {
    __m256 sum = acc[0][c];
    for (int s = 1; s < SETS; ++s) sum = _mm256_add_ps(sum, acc[s][c]);
    _mm256_storeu_ps(out + 8 * c, sum);
  }
}

// weighted_sum for head_dim in {32, 64, 96, 128}; false for any other size.
inline bool weighted_sum_for(int64_t head_dim, const float* p, const float* const* rows, int64_t n, float* out) {
  switch (head_dim) {
    case 32: weighted_sum<4>(p, rows, n, out); return true;
    case 64: weighted_sum<8>(p, rows, n, out); return true;
    case 96: weighted_sum<12>(p, rows, n, out); return true;
    case 128: weighted_sum<16>(p, rows, n, out); return true;
    default: return false;
  }
}
constexpr bool kVectorized = true;
#else
constexpr bool kVectorized = false;
#endif

// Per-thread buffers of attend_one.
struct AttendScratch {
  std::vector<float> scores;         // [group, n]
  std::vector<const float*> k_rows;  // [n]
  std::vector<const float*> v_rows;  // [n]
  std::vector<float> acc;            // [group, head_dim]
};

// Softmax-weighted sum over the visible tokens of one (sequence, KV head) for its `group` query
// heads. Two passes over the keys' scores (max, then exp and sum) as the reference's softmax does.
void attend_one(const float* q, int64_t q_head_stride, const float* k_cache, const float* v_cache,
                const int32_t* table, int64_t first, int64_t ctx, int64_t block_size, int64_t row_stride,
                int64_t kv_head, int64_t group, int64_t head_dim, float scale, AttendScratch& w, float* out,
                int64_t out_head_stride) {
  const int64_t n = ctx - first;
  w.scores.resize(group * n);
  w.k_rows.resize(n);
  w.v_rows.resize(n);
  // NOTE: block and offset advance incrementally: a division per token (block_size is not a
  // compile-time constant) showed up in the profile.
  int64_t block = first / block_size, offset_in_block = first % block_size;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t offset =
        (static_cast<int64_t>(table[block]) * block_size + offset_in_block) * row_stride + kv_head * head_dim;
    w.k_rows[t] = k_cache + offset;
    w.v_rows[t] = v_cache + offset;
    if (++offset_in_block == block_size) {
      offset_in_block = 0;
      ++block;
    }
  }
  const bool vectorized = kVectorized && (head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128);
  float* scores = w.scores.data();
  // Scores: tokens eight at a time where the vector path applies, one at a time for the rest.
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (vectorized) {
    for (; i + 8 <= n; i += 8) {
      for (int64_t a = i + kPrefetchAhead; a < std::min(i + kPrefetchAhead + 8, n); ++a) prefetch_row(w.k_rows[a], head_dim);
      for (int64_t g = 0; g < group; ++g) dot8(q + g * q_head_stride, &w.k_rows[i], head_dim, scale, scores + g * n + i);
    }
  }
#endif
  for (; i < n; ++i) {
    if (i + kPrefetchAhead < n) prefetch_row(w.k_rows[i + kPrefetchAhead], head_dim);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * q_head_stride;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * w.k_rows[i][d];
      scores[g * n + i] = dot * scale;
    }
  }
  float inv_sum[64];
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * n;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
    inv_sum[g] = 1.f / exp_shifted_sum(s, n, m);
  }
  // Values: the weighted sum of the V rows per query head (normalised at the end).
  w.acc.assign(group * head_dim, 0.f);
  for (int64_t j = 0; j < std::min(kPrefetchAhead, n); ++j) prefetch_row(w.v_rows[j], head_dim);
#if defined(__AVX2__) && defined(__FMA__)
  if (vectorized) {
    for (int64_t g = 0; g < group; ++g) weighted_sum_for(head_dim, scores + g * n, w.v_rows.data(), n, &w.acc[g * head_dim]);
  }
#endif
  if (!vectorized) {
    for (int64_t j = 0; j < n; ++j) {
      if (j + kPrefetchAhead < n) prefetch_row(w.v_rows[j + kPrefetchAhead], head_dim);
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * n + j];
        float* a = w.acc.data() + g * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] += p * w.v_rows[j][d];
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* o = out + g * out_head_stride;
    const float* a = w.acc.data() + g * head_dim;
    const float inv = inv_sum[g];
    for (int64_t d = 0; d < head_dim; ++d) o[d] = a[d] * inv;
  }
}

// query [num_seqs, num_heads, head_dim] (last dim contiguous), kv_cache fp32
// [2, num_blocks, block_size, num_kv_heads, head_dim], block_tables int32 [num_seqs, width],
// context_lens int32 [num_seqs] (>= 1, the query's own token included), sliding_window <= 0: none.
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, int64_t sliding_window) {
  TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == at::kFloat && query.dim() == 3 && query.stride(2) == 1,
              "query must be float32 CPU [num_seqs, num_heads, head_dim] with a contiguous last dim");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  check_cache(kv_cache, head_dim);
  check_int32(block_tables, 2, "block_tables");
  check_int32(context_lens, 1, "context_lens");
  TORCH_CHECK(block_tables.size(0) == num_seqs && context_lens.size(0) == num_seqs, "one table row and length per query");
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(num_heads / num_kv_heads <= 64, "at most 64 query heads per KV head");
  const int64_t group = num_heads / num_kv_heads, width = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  // Every block a query reads must exist: a bad table is an error, never a wild read.
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t ctx = lens[s];
    TORCH_CHECK(ctx >= 1 && ctx <= width * block_size, "context length ", ctx, " of sequence ", s,
                " outside [1, ", width * block_size, "]");
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, ctx - sliding_window) : 0;
    for (int64_t b = first / block_size; b <= (ctx - 1) / block_size; ++b) {
      const int32_t block = tables[s * width + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " out of range [0, ", num_blocks, ")");
    }
  }
  auto out = at::empty({num_seqs, num_heads, head_dim}, query.options());
  const float* q = query.data_ptr<float>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const float* k_cache = kv_cache.data_ptr<float>();
  const float* v_cache = k_cache + num_blocks * block_size * num_kv_heads * head_dim;
  float* o = out.data_ptr<float>();
  const int64_t row_stride = num_kv_heads * head_dim;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    AttendScratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t ctx = lens[s];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, ctx - sliding_window) : 0;
      attend_one(q + s * qs0 + h * group * qs1, qs1, k_cache, v_cache, tables + s * width, first, ctx, block_size,
                 row_stride, h, group, head_dim, static_cast<float>(scale), scratch,
                 o + (s * num_heads + h * group) * head_dim, head_dim);
    }
  });
  return out;
}

// In place on qkv [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] (rows contiguous): rotate
// the q and k heads (neox style: x * cos + roll(x, head_dim / 2) * signed_sin, the reference's exact
// roundings), then copy each token's k and v heads into its slot of kv_cache (negative slot: skip).
// cos and signed_sin are [num_tokens, head_dim], already gathered for the tokens' positions.
void rope_store_kv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin, at::Tensor& kv_cache,
                   const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.dim() == 2 && qkv.stride(1) == 1,
              "qkv must be float32 CPU [num_tokens, width] with contiguous rows");
  const int64_t num_tokens = qkv.size(0);
  const int64_t head_dim = kv_cache.size(4);
  check_cache(kv_cache, head_dim);
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK(kv_cache.size(3) == num_kv_heads, "kv_cache has ", kv_cache.size(3), " KV heads, not ", num_kv_heads);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "qkv width does not match the heads");
  for (const at::Tensor* t : {&cos, &signed_sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == num_tokens * head_dim,
                "cos / signed_sin must be contiguous float32 [num_tokens, head_dim]");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == num_tokens,
              "slot_mapping must be a contiguous int64 [num_tokens]");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " out of range (", num_slots, " slots)");
  }
  float* base = qkv.data_ptr<float>();
  const int64_t row = qkv.stride(0), half = head_dim / 2, kv_width = num_kv_heads * head_dim;
  const float* cos_p = cos.data_ptr<float>();
  const float* sin_p = signed_sin.data_ptr<float>();
  float* k_cache = kv_cache.data_ptr<float>();
  float* v_cache = k_cache + num_slots * kv_width;
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      float* x_row = base + t * row;
      const float* c = cos_p + t * head_dim;
      const float* s = sin_p + t * head_dim;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        float* x = x_row + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) {
          const float a = x[d] * c[d];
          const float b = x[d < half ? d + half : d - half] * s[d];
          tmp[d] = a + b;
        }
        std::memcpy(x, tmp.data(), head_dim * sizeof(float));
      }
      if (slots[t] >= 0) {
        const float* k = x_row + num_heads * head_dim;
        std::memcpy(k_cache + slots[t] * kv_width, k, kv_width * sizeof(float));
        std::memcpy(v_cache + slots[t] * kv_width, k + kv_width, kv_width * sizeof(float));
      }
    }
  });
}

// ---- Packed fp32 GEMM (decode-sized projections, the LM head) and the LM head's argmax ---------
//
// The weight [N, K] is packed once ([panels, K, 16]: 16 output rows interleaved per k, zero-padded to
// a whole panel) so a 6 x 16 register tile streams it with two aligned-free loads per k. Each panel is
// read from memory once and reused by every row block of the hidden states, which stay in L2.
constexpr int64_t kPanel = 16;
constexpr int kTileRows = 6;

// A panel's weights are fp32, or bf16 (the opt-in `cpu_weights=bf16`: half the bytes streamed per decode
// step, where the step is bound by that stream). A bf16 weight widens to the fp32 it stands for exactly
// (its bits are an fp32's top half), so the FMA chain over k is the fp32 one on the rounded weight: the
// bf16 GEMM equals the fp32 GEMM of the bf16-rounded weight bit for bit.
using bf16_t = uint16_t;

inline float widen(float w) { return w; }
inline float widen(bf16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

#if defined(__AVX2__) && defined(__FMA__)
// The 16 weights of one k of a panel as two fp32 vectors.
inline void load_panel_row(const float* b, __m256& b0, __m256& b1) {
  b0 = _mm256_loadu_ps(b);
  b1 = _mm256_loadu_ps(b + 8);
}
inline void load_panel_row(const bf16_t* b, __m256& b0, __m256& b1) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  b0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(w)), 16));
  b1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(w, 1)), 16));
}

template <int ROWS, typename W>
inline void lm_tile(const float* a, int64_t lda, const W* b, int64_t k_size, float* out) {
  __m256 c0[ROWS], c1[ROWS];
  for (int r = 0; r < ROWS; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    __m256 b0, b1;
    load_panel_row(b + k * kPanel, b0, b1);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 ar = _mm256_broadcast_ss(a + r * lda + k);
      c0[r] = _mm256_fmadd_ps(ar, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(ar, b1, c1[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    _mm256_storeu_ps(out + r * kPanel, c0[r]);
    _mm256_storeu_ps(out + r * kPanel + 8, c1[r]);
  }
}
#endif

template <int ROWS, typename W>
inline void lm_tile_any(const float* a, int64_t lda, const W* b, int64_t k_size, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  lm_tile<ROWS>(a, lda, b, k_size, out);
#else
  for (int r = 0; r < ROWS; ++r)
    for (int64_t c = 0; c < kPanel; ++c) {
      float acc = 0.f;
      for (int64_t k = 0; k < k_size; ++k) acc += a[r * lda + k] * widen(b[k * kPanel + c]);
      out[r * kPanel + c] = acc;
    }
#endif
}

// out [rows, 16] = a[rows, K] . panel^T for rows <= 6.
template <typename W>
inline void lm_rows(int64_t rows, const float* a, int64_t lda, const W* b, int64_t k_size, float* out) {
  switch (rows) {
    case 6: lm_tile_any<6>(a, lda, b, k_size, out); break;
    case 5: lm_tile_any<5>(a, lda, b, k_size, out); break;
    case 4: lm_tile_any<4>(a, lda, b, k_size, out); break;
    case 3: lm_tile_any<3>(a, lda, b, k_size, out); break;
    case 2: lm_tile_any<2>(a, lda, b, k_size, out); break;
    default: lm_tile_any<1>(a, lda, b, k_size, out); break;
  }
}

// Largest of 16 floats (NaN-free rows; a NaN makes the caller scan the row, which skips it).
inline float tile_max(const float* v) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 m = _mm256_max_ps(_mm256_loadu_ps(v), _mm256_loadu_ps(v + 8));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
#else
  float m = v[0];
  for (int64_t c = 1; c < kPanel; ++c) m = std::max(m, v[c]);
  return m;
#endif
}

void check_lm_head(const at::Tensor& hidden, const at::Tensor& packed, int64_t vocab) {
  TORCH_CHECK(hidden.device().is_cpu() && hidden.scalar_type() == at::kFloat && hidden.dim() == 2 && hidden.is_contiguous(),
              "hidden must be a contiguous float32 CPU [n, hidden_size]");
  TORCH_CHECK((packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16) && packed.dim() == 3 &&
                  packed.is_contiguous() && packed.size(2) == kPanel,
              "packed must be a contiguous float32 or bfloat16 [panels, hidden_size, 16] (kernels.cpu_backend.pack_weight)");
  TORCH_CHECK(packed.size(1) == hidden.size(1), "hidden size ", hidden.size(1), " != the head's ", packed.size(1));
  TORCH_CHECK(vocab > 0 && vocab <= packed.size(0) * kPanel, "vocab ", vocab, " does not fit the packed head");
}

// Runs the packed GEMM hidden [n, K] . weight^T tile by tile (threads split the panels) and hands
// each finished 6 x 16 tile to `epilogue(thread, panel, first_row, rows, columns, tile)`.
template <typename W, typename Epilogue>
void for_each_tile_of(const at::Tensor& hidden, const W* w, int64_t vocab, const Epilogue& epilogue) {
  const int64_t n = hidden.size(0), k_size = hidden.size(1), panels = (vocab + kPanel - 1) / kPanel;
  const float* a = hidden.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    const int64_t thread = at::get_thread_num();
    float tile[kTileRows * kPanel];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t columns = std::min(kPanel, vocab - p * kPanel);
      for (int64_t r0 = 0; r0 < n; r0 += kTileRows) {
        const int64_t rows = std::min<int64_t>(kTileRows, n - r0);
        lm_rows(rows, a + r0 * k_size, k_size, w + p * k_size * kPanel, k_size, tile);
        epilogue(thread, p, r0, rows, columns, tile);
      }
    }
  });
}

template <typename Epilogue>
void for_each_tile(const at::Tensor& hidden, const at::Tensor& packed, int64_t vocab, const Epilogue& epilogue) {
  if (packed.scalar_type() == at::kBFloat16)
    for_each_tile_of(hidden, reinterpret_cast<const bf16_t*>(packed.data_ptr()), vocab, epilogue);
  else
    for_each_tile_of(hidden, packed.data_ptr<float>(), vocab, epilogue);
}

// Token ids of each row's largest logit (lowest id on ties; NaN logits are never chosen).
at::Tensor lm_head_argmax(const at::Tensor& hidden, const at::Tensor& packed, int64_t vocab) {
  check_lm_head(hidden, packed, vocab);
  const int64_t n = hidden.size(0);
  const int64_t threads = at::get_num_threads();
  std::vector<float> best(threads * n, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> best_id(threads * n, vocab);
  for_each_tile(hidden, packed, vocab, [&](int64_t thread, int64_t p, int64_t r0, int64_t rows, int64_t columns,
                                           const float* tile) {
    float* my_best = best.data() + std::min(thread, threads - 1) * n;
    int64_t* my_id = best_id.data() + std::min(thread, threads - 1) * n;
    for (int64_t r = 0; r < rows; ++r) {
      if (columns == kPanel && tile_max(tile + r * kPanel) <= my_best[r0 + r]) continue;
      // Strictly greater: panels ascend within a thread, so the first (lowest) id of a tie stays.
      for (int64_t c = 0; c < columns; ++c) {
        if (tile[r * kPanel + c] > my_best[r0 + r]) {
          my_best[r0 + r] = tile[r * kPanel + c];
          my_id[r0 + r] = p * kPanel + c;
        }
      }
    }
  });
  auto out = at::empty({n}, hidden.options().dtype(at::kLong));
  int64_t* ids = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    float v = best[r];
    int64_t id = best_id[r];
    for (int64_t t = 1; t < threads; ++t) {
      const float u = best[t * n + r];
      const int64_t j = best_id[t * n + r];
      if (u > v || (u == v && j < id)) v = u, id = j;
    }
    ids[r] = id < vocab ? id : 0;  // all-NaN row: id 0, as no logit can be chosen
  }
  return out;
}

// out [n, vocab] = hidden [n, K] . weight^T: the logits of rows to sample from, or any projection of
// a few rows (NOTE: each output is one sequential FMA chain over k: a row's result does not depend on
// the other rows of the batch).
at::Tensor packed_linear(const at::Tensor& hidden, const at::Tensor& packed, int64_t vocab) {
  check_lm_head(hidden, packed, vocab);
  auto out = at::empty({hidden.size(0), vocab}, hidden.options());
  float* o = out.data_ptr<float>();
  for_each_tile(hidden, packed, vocab, [&](int64_t, int64_t p, int64_t r0, int64_t rows, int64_t columns,
                                           const float* tile) {
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(o + (r0 + r) * vocab + p * kPanel, tile + r * kPanel, columns * sizeof(float));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvserve_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor context_lens, "
        "float scale, int sliding_window) -> Tensor");
  m.def("rope_store_kv(Tensor(a!) qkv, Tensor cos, Tensor signed_sin, Tensor(b!) kv_cache, Tensor slot_mapping, "
        "int num_heads, int num_kv_heads) -> ()");
  m.def("lm_head_argmax(Tensor hidden, Tensor packed, int vocab) -> Tensor");
  m.def("packed_linear(Tensor hidden, Tensor packed, int vocab) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("rope_store_kv", &rope_store_kv);
  m.impl("lm_head_argmax", &lm_head_argmax);
  m.impl("packed_linear", &packed_linear);
}
