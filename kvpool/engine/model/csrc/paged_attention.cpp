// Paged attention for CPUs: reads K/V in place through the block table. q, out and the K/V
// cache are fp32 or bf16 (one storage type T for all four; bf16 is widened on load and the
// output rounded once); scores, softmax and the accumulators are always fp32.
//
// One varlen call per layer covers every sequence of the batch (decodes, prefill chunks,
// prefix-hit chunks): sequence s owns query tokens [q_start[s], q_start[s+1]) of q, its last
// query is at absolute position ctx_len[s] - 1, and a query at position p sees the keys at
// positions j <= p (causal with an offset). Keys live at
//   cache + block_table[s][j / bs] * block_stride + (j % bs) * tok_stride + kv_head * head_stride
// with head_dim contiguous. No K/V copy, no padding, no heap allocation: each work item
// (sequence, kv head, tile of query tokens) keeps its running softmax state on the stack.
//
// Built by kvpool/engine/native.py with g++ -O3 -march=native -fopenmp; called via ctypes.
// The OpenMP runtime is the one torch already loaded (same soname), so torch.set_num_threads
// governs this code too.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>
#ifdef __AVX__
#include <immintrin.h>
#endif

#include "vec8.h"

// x[j] -> lane j = sum of x[j]'s lanes.
static inline vf reduce8(const vf* x) {
#ifdef __AVX__
  const __m256 t0 = _mm256_hadd_ps((__m256)x[0], (__m256)x[1]);
  const __m256 t1 = _mm256_hadd_ps((__m256)x[2], (__m256)x[3]);
  const __m256 t2 = _mm256_hadd_ps((__m256)x[4], (__m256)x[5]);
  const __m256 t3 = _mm256_hadd_ps((__m256)x[6], (__m256)x[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return (vf)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                           _mm256_permute2f128_ps(u0, u1, 0x31));
#else
  vf r;
  for (int j = 0; j < 8; ++j) r[j] = hsum(x[j]);
  return r;
#endif
}

static inline float hsum8(vf v) {  // tree order (the attention sums are fp32 anyway)
#ifdef __AVX__
  __m128 x = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
#else
  return hsum(v);
#endif
}

static inline float hmax8(vf v) {
#ifdef __AVX__
  __m128 x = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
#else
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = v[i] > m ? v[i] : m;
  return m;
#endif
}

namespace {

const vi kIota = {0, 1, 2, 3, 4, 5, 6, 7};
constexpr int KC = 16;    // keys per inner chunk
constexpr int MAXR = 32;  // query rows (tokens x heads of one kv group) per work item

template <class T>
struct Args {
  const T* q;  // [T, H, D] rows q_row elements apart ([H, D] contiguous)
  int64_t q_row;
  T* out;      // [T, H, D]
  const T* k_cache;
  const T* v_cache;
  int64_t block_stride, tok_stride, head_stride;  // elements
  const int32_t* block_tables;                    // [S, bt_stride]
  int64_t bt_stride;
  const int32_t* q_start;  // [S + 1]
  const int32_t* ctx_len;  // [S]
  int S, H, Hkv, bs;
  float scale;
};

// Attends the rows of one work item: tokens [t0, t0 + nt) of sequence s x the query heads of
// kv heads [kvh0, kvh0 + nkv), over the keys [kbeg, kstop) (all keys: 0, INT32_MAX).
// With `partial` it writes each row's unnormalised state (m, l, acc[D]) there instead of
// the output: one part of a sequence split across threads (merged by merge_parts). Row r is (token t0 + r / (nkv g), kv head kvh0 + (r / g) % nkv,
// query head of that group r % g). An item spanning all kv heads (decode-sized sequences)
// reads each key's whole [Hkv, D] row, which is contiguous in the cache.
template <class T, int D>
void attend_tile(const Args<T>& a, int s, int kvh0, int nkv, int t0, int nt, int kbeg = 0,
                 int kstop = INT32_MAX, float* partial = nullptr) {
  constexpr int NV = D / 8;
  const int g = a.H / a.Hkv;
  const int R = nt * g * nkv;
  const int qlen = a.q_start[s + 1] - a.q_start[s];
  const int ctx = a.ctx_len[s];
  const int first_pos = ctx - qlen;  // absolute position of the sequence's first query
  alignas(32) float qb[MAXR][D];
  alignas(32) float acc[MAXR][D];
  alignas(32) float sc[MAXR][KC];
  float m[MAXR], l[MAXR];
  int qpos[MAXR];
  int64_t hoff[MAXR];  // the row's kv head offset within a key's row
  int qh[MAXR];        // the row's query head
  for (int r = 0; r < R; ++r) {
    const int t = t0 + r / (g * nkv), kvh = kvh0 + (r / g) % nkv;
    qh[r] = kvh * g + r % g;
    hoff[r] = (int64_t)kvh * a.head_stride;
    const T* src = a.q + (int64_t)(a.q_start[s] + t) * a.q_row + (int64_t)qh[r] * D;
    for (int c = 0; c < NV; ++c) vstore(qb[r] + 8 * c, load8(src + 8 * c) * splat(a.scale));
    for (int c = 0; c < NV; ++c) vstore(acc[r] + 8 * c, splat(0.f));
    m[r] = -INFINITY;
    l[r] = 0.f;
    qpos[r] = first_pos + t;
  }
  const int kend = std::min(first_pos + t0 + nt, kstop);  // keys [.., kend) visible to some row
  const int32_t* bt = a.block_tables + (int64_t)s * a.bt_stride;
  const int64_t span = (int64_t)(nkv - 1) * a.head_stride + D;  // elements read per key
  constexpr int64_t line = 64 / sizeof(T);  // elements per cache line
  const int64_t base_off = (int64_t)kvh0 * a.head_stride;
  // key addresses: block index and offset advance incrementally (no division per key)
  int blk = kbeg / a.bs, boff = kbeg % a.bs;
  auto key_off = [&]() {
    const int64_t off = (int64_t)bt[blk] * a.block_stride + (int64_t)boff * a.tok_stride;
    if (++boff == a.bs) { boff = 0; ++blk; }
    return off;
  };
  int64_t offs[KC];
  int nnext = std::max(0, std::min(KC, kend - kbeg));
  for (int j = 0; j < nnext; ++j) offs[j] = key_off();
  for (int j0 = kbeg; j0 < kend; j0 += KC) {
    const int n = nnext;
    const T* kp[KC];
    const T* vp[KC];
    for (int j = 0; j < n; ++j) {
      kp[j] = a.k_cache + offs[j];
      vp[j] = a.v_cache + offs[j];
    }
    nnext = std::min(KC, kend - j0 - KC);  // next chunk: addresses now, prefetched early
    for (int j = 0; j < nnext; ++j) {
      offs[j] = key_off();
      for (int64_t c = 0; c < span; c += line) {
        __builtin_prefetch(a.k_cache + offs[j] + base_off + c);
        __builtin_prefetch(a.v_cache + offs[j] + base_off + c);
      }
    }
    for (int j = n; j < KC; ++j) kp[j] = vp[j] = kp[0];  // padding keys, masked below
    int nvr[MAXR];
    for (int r = 0; r < R; ++r) nvr[r] = std::min(n, qpos[r] - j0 + 1);
    for (int r = 0; r < R;) {  // scores: 2 rows of one kv head x 4 keys per block of FMAs
      const bool pair = r + 1 < R && hoff[r + 1] == hoff[r];
      const int r1 = pair ? r + 1 : r;  // otherwise the row pairs with itself
      const int nv = std::max(nvr[r], nvr[r1]);
      const int64_t ho = hoff[r];
      const float* q0 = qb[r];
      const float* q1 = qb[r1];
      for (int jb = 0; jb < nv; jb += 4) {
        const T *k0 = kp[jb] + ho, *k1 = kp[jb + 1] + ho, *k2 = kp[jb + 2] + ho,
                    *k3 = kp[jb + 3] + ho;
        vf x[8];
        for (int i = 0; i < 8; ++i) x[i] = splat(0.f);
        for (int c = 0; c < D; c += 8) {
          const vf a = vload(q0 + c), b = vload(q1 + c);
          const vf u0 = load8(k0 + c), u1 = load8(k1 + c), u2 = load8(k2 + c),
                   u3 = load8(k3 + c);
          x[0] += a * u0; x[1] += a * u1; x[2] += a * u2; x[3] += a * u3;
          x[4] += b * u0; x[5] += b * u1; x[6] += b * u2; x[7] += b * u3;
        }
        const vf res = reduce8(x);  // lanes 0-3: row r, keys jb..; lanes 4-7: row r1
        for (int i = 0; i < 4; ++i) sc[r][jb + i] = res[i];
        if (r1 != r)
          for (int i = 0; i < 4; ++i) sc[r1][jb + i] = res[4 + i];
      }
      r = r1 + 1;
    }
    for (int r = 0; r < R; ++r) {  // online softmax, 8 keys per vector op
      const int nv = nvr[r];
      if (nv <= 0) continue;
      vf sv[KC / 8];
      vf mv = splat(-INFINITY);
      for (int c = 0; c < KC / 8; ++c) {
        const vi keep = kIota + (8 * c) < nv;  // keys past the row's position: masked
        sv[c] = keep ? vload(sc[r] + 8 * c) : splat(-INFINITY);
        mv = mv > sv[c] ? mv : sv[c];
      }
      const float mx = std::max(m[r], hmax8(mv));
      const float alpha = std::exp(m[r] - mx);  // 0 on the first chunk (m = -inf)
      m[r] = mx;
      vf sum = splat(0.f);
      for (int c = 0; c < KC / 8; ++c) {
        const vi keep = kIota + (8 * c) < nv;
        const vf e = keep ? vexp(sv[c] - splat(mx)) : splat(0.f);
        sum += e;
        // P is rounded to the storage type before P @ V (the sum keeps fp32), as torch's
        // CPU flash attention does for bf16: the bf16 variant then sees transformers' values.
        vstore(sc[r] + 8 * c, as8(a.v_cache, e));
      }
      l[r] = l[r] * alpha + hsum8(sum);
      vf acc_r[NV];  // P @ V with the row's accumulator in registers
      for (int c = 0; c < NV; ++c) acc_r[c] = vload(acc[r] + 8 * c) * splat(alpha);
      const int64_t ho = hoff[r];
      for (int j = 0; j < nv; ++j) {
        const vf p = splat(sc[r][j]);
        const T* vr = vp[j] + ho;
        for (int c = 0; c < NV; ++c) acc_r[c] += p * load8(vr + 8 * c);
      }
      for (int c = 0; c < NV; ++c) vstore(acc[r] + 8 * c, acc_r[c]);
    }
  }
  if (partial != nullptr) {
    for (int r = 0; r < R; ++r) {
      float* p = partial + (int64_t)r * (D + 2);
      p[0] = m[r];
      p[1] = l[r];
      for (int c = 0; c < NV; ++c) vstore(p + 2 + 8 * c, vload(acc[r] + 8 * c));
    }
    return;
  }
  for (int r = 0; r < R; ++r) {
    const int t = t0 + r / (g * nkv);
    T* dst = a.out + ((int64_t)(a.q_start[s] + t) * a.H + qh[r]) * D;
    const vf inv = splat(1.f / l[r]);
    for (int c = 0; c < NV; ++c) store8(dst + 8 * c, vload(acc[r] + 8 * c) * inv);
  }
}

// Work items of sequence s: one for all its rows when they fit (qlen x H <= MAXR: decodes
// and short chunks), else ceil(qlen / tq) token tiles x Hkv kv heads. A one-item sequence
// may instead be split into parts[s] key ranges (see attend_all).
template <class T>
inline int64_t num_items(const Args<T>& a, int s, int tq, const int* parts) {
  const int qlen = a.q_start[s + 1] - a.q_start[s];
  if (qlen <= 0) return 0;
  if ((int64_t)qlen * a.H <= MAXR) return parts ? parts[s] : 1;
  return (int64_t)((qlen + tq - 1) / tq) * a.Hkv;
}

constexpr int kMinPart = 256;  // keys per part of a split sequence, at least
constexpr int kMaxParts = 8;

// Key range [k0, k1) of part i of p over kend keys, KC-aligned boundaries.
inline void part_range(int kend, int i, int p, int* k0, int* k1) {
  const int per = ((kend + p - 1) / p + KC - 1) / KC * KC;
  *k0 = std::min(kend, i * per);
  *k1 = i == p - 1 ? INT32_MAX : std::min(kend, (i + 1) * per);
}

// The parts' states of sequence s (rows as attend_tile's over all kv heads) merged into
// its output rows: out = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i.
template <class T, int D>
void merge_parts(const Args<T>& a, int s, int p, const float* st) {
  const int g = a.H / a.Hkv;
  const int qlen = a.q_start[s + 1] - a.q_start[s];
  const int R = qlen * a.H;
  const int64_t part_stride = (int64_t)MAXR * (D + 2);
  for (int r = 0; r < R; ++r) {
    float mx = -INFINITY;
    for (int i = 0; i < p; ++i) mx = std::max(mx, st[i * part_stride + (int64_t)r * (D + 2)]);
    vf o[D / 8];
    for (int c = 0; c < D / 8; ++c) o[c] = splat(0.f);
    float lsum = 0.f;
    for (int i = 0; i < p; ++i) {
      const float* q = st + i * part_stride + (int64_t)r * (D + 2);
      if (q[1] == 0.f) continue;  // the part saw no key of this row
      const float w = std::exp(q[0] - mx);
      lsum += w * q[1];
      for (int c = 0; c < D / 8; ++c) o[c] += splat(w) * vload(q + 2 + 8 * c);
    }
    const int t = r / a.H, kvh = (r / g) % a.Hkv, qh = kvh * g + r % g;
    T* dst = a.out + ((int64_t)(a.q_start[s] + t) * a.H + qh) * D;
    const vf inv = splat(1.f / lsum);
    for (int c = 0; c < D / 8; ++c) store8(dst + 8 * c, o[c] * inv);
  }
}

template <class T, int D>
void attend_all(const Args<T>& a) {
  const int g = a.H / a.Hkv;
  const int tq = std::max(1, MAXR / g);  // query tokens per per-head work item
  int64_t total = 0;
  for (int s = 0; s < a.S; ++s) total += num_items(a, s, tq, nullptr);
  // Split-K: with fewer than 2 items per thread (one or a few decoding sequences), the
  // keys of each one-item sequence are split into parts of >= kMinPart keys that threads
  // attend separately; their softmax states are merged after. Results then differ from
  // the unsplit ones in float rounding only.
  const int nth = omp_get_max_threads();
  std::vector<int> parts;
  std::vector<int64_t> first_part;  // per sequence: its parts' index in the state buffer
  std::vector<float> states;
  std::vector<std::atomic<int>> done;  // per sequence: parts finished
  if (nth > 1 && total > 0 && total < 2 * nth) {
    const int want = (int)std::min<int64_t>(kMaxParts, (2 * nth + total - 1) / total);
    parts.assign(a.S, 1);
    first_part.assign(a.S, -1);
    int64_t nparts = 0;
    for (int s = 0; s < a.S; ++s) {
      const int qlen = a.q_start[s + 1] - a.q_start[s];
      if (qlen <= 0 || (int64_t)qlen * a.H > MAXR) continue;
      parts[s] = std::max(1, std::min(want, a.ctx_len[s] / kMinPart));
      if (parts[s] > 1) {
        first_part[s] = nparts;
        nparts += parts[s];
      }
    }
    if (nparts == 0) {
      parts.clear();
    } else {
      states.resize((size_t)nparts * MAXR * (D + 2));
      std::vector<std::atomic<int>>(a.S).swap(done);  // value-initialised: zeros
      total = 0;
      for (int s = 0; s < a.S; ++s) total += num_items(a, s, tq, parts.data());
    }
  }
  const int* pp = parts.empty() ? nullptr : parts.data();
#pragma omp parallel
  {
    int s = 0;
    int64_t base = 0;  // first item of sequence s
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < total; ++item) {
      // items arrive in increasing order per thread: advance the cursor monotonically
      if (item < base) { s = 0; base = 0; }
      for (;;) {
        const int64_t n = num_items(a, s, tq, pp);
        if (item < base + n) break;
        base += n;
        ++s;
      }
      const int qlen = a.q_start[s + 1] - a.q_start[s];
      const int64_t local = item - base;
      if ((int64_t)qlen * a.H <= MAXR) {
        if (pp == nullptr || pp[s] == 1) {
          attend_tile<T, D>(a, s, 0, a.Hkv, 0, qlen);
          continue;
        }
        int k0, k1;
        part_range(a.ctx_len[s], (int)local, pp[s], &k0, &k1);
        float* st = states.data() + (first_part[s] + local) * MAXR * (D + 2);
        attend_tile<T, D>(a, s, 0, a.Hkv, 0, qlen, k0, k1, st);
        // the thread finishing a sequence's last part merges them (no extra barrier);
        // acq_rel: the other parts' states are visible to it
        if (done[s].fetch_add(1, std::memory_order_acq_rel) + 1 == pp[s])
          merge_parts<T, D>(a, s, pp[s], states.data() + first_part[s] * MAXR * (D + 2));
        continue;
      }
      const int tile = (int)(local / a.Hkv), kvh = (int)(local % a.Hkv);
      const int t0 = tile * tq;
      attend_tile<T, D>(a, s, kvh, 1, t0, std::min(tq, qlen - t0));
    }
  }
}

template <class T>
int paged_attention(const T* q, int64_t q_row, T* out, const T* k_cache, const T* v_cache,
                    int64_t block_stride, int64_t tok_stride, int64_t head_stride,
                    const int32_t* block_tables, int64_t bt_stride, const int32_t* q_start,
                    const int32_t* ctx_len, int S, int H, int Hkv, int D, int bs, float scale) {
  Args<T> a{q, q_row, out, k_cache, v_cache, block_stride, tok_stride, head_stride,
            block_tables, bt_stride, q_start, ctx_len, S, H, Hkv, bs, scale};
  if (H % Hkv != 0 || H / Hkv > MAXR) return 1;
  switch (D) {
    case 32: attend_all<T, 32>(a); return 0;
    case 64: attend_all<T, 64>(a); return 0;
    case 128: attend_all<T, 128>(a); return 0;
    case 256: attend_all<T, 256>(a); return 0;
    default: return 1;
  }
}

}  // namespace

extern "C" {

// Returns 0 on success, 1 if head_dim is not supported (the caller falls back). Strides are
// in elements. kvpool_paged_attention_bf16: the same with bf16 q, out and caches.
int kvpool_paged_attention(const float* q, int64_t q_row, float* out, const float* k_cache,
                           const float* v_cache, int64_t block_stride, int64_t tok_stride,
                           int64_t head_stride, const int32_t* block_tables, int64_t bt_stride,
                           const int32_t* q_start, const int32_t* ctx_len, int S, int H,
                           int Hkv, int D, int bs, float scale) {
  return paged_attention(q, q_row, out, k_cache, v_cache, block_stride, tok_stride,
                         head_stride, block_tables, bt_stride, q_start, ctx_len, S, H, Hkv, D,
                         bs, scale);
}

int kvpool_paged_attention_bf16(const bf16* q, int64_t q_row, bf16* out, const bf16* k_cache,
                                const bf16* v_cache, int64_t block_stride, int64_t tok_stride,
                                int64_t head_stride, const int32_t* block_tables,
                                int64_t bt_stride, const int32_t* q_start,
                                const int32_t* ctx_len, int S, int H, int Hkv, int D, int bs,
                                float scale) {
  return paged_attention(q, q_row, out, k_cache, v_cache, block_stride, tok_stride,
                         head_stride, block_tables, bt_stride, q_start, ctx_len, S, H, Hkv, D,
                         bs, scale);
}

// Writes k/v [T, Hkv, D] ([Hkv, D] contiguous per token; k_row/v_row elements between
// tokens) into the caches at slots[t] = block * bs + offset; rows of Hkv * D elements of
// elem_size bytes each (4: fp32, 2: bf16; a byte copy, any dtype).
void kvpool_store_kv(const char* k, const char* v, char* k_cache, char* v_cache,
                     int64_t block_stride, int64_t tok_stride, const int64_t* slots, int T,
                     int64_t k_row, int64_t v_row, int bs, int elem_size) {
  const size_t nbytes = (size_t)tok_stride * elem_size;
  for (int t = 0; t < T; ++t) {
    const int64_t off = ((slots[t] / bs) * block_stride + (slots[t] % bs) * tok_stride) *
                        elem_size;
    std::memcpy(k_cache + off, k + (int64_t)t * k_row * elem_size, nbytes);
    std::memcpy(v_cache + off, v + (int64_t)t * v_row * elem_size, nbytes);
  }
}

int kvpool_abi_version() { return 3; }

}  // extern "C"
