// Fused element-wise passes and small GEMMs for the CPU forward pass, fp32 and bf16.
//
// Each function replaces several torch ops (and as many OpenMP fork/joins, which is what a
// busy 2-core machine punishes most) by one pass over the rows:
//   kvpool_rmsnorm        [residual += x;] out = weight * (r * rsqrt(mean(r^2) + eps))
//   kvpool_rotary         rotate_half rotary on the q and k heads of a packed qkv buffer, in place
//   kvpool_silu_mul       out = silu(gate) * up for a packed [gate | up] buffer
//   kvpool_linear_small   y = x @ W^T (+ b) for a few rows (decode of 1-4 sequences): a
//                         bandwidth-bound pass over W's rows, which MKL's sgemm does slowly here
//   kvpool_linear_bf16    y = x @ W^T (+ b), bf16 x/W/b/y, any number of rows: W is widened
//                         to fp32 in registers and products accumulate in fp32 (this CPU has
//                         no bf16 dot-product instructions; torch's bf16 GEMM is 2-6x slower
//                         than its fp32 one here)
//   kvpool_argmax         first index of each row's maximum (greedy sampling; fp32 logits)
// Pointers are rows with the given row strides (elements); the feature dim is contiguous.
// The rmsnorm/rotary/silu_mul entry points have a *_bf16 twin taking bf16 rows; those compute
// in fp32 and round to bf16 wherever transformers' bf16 modules round (after the residual
// add, before the norm weight, after each rotary product, after SiLU), so they give the same
// values as the torch expressions on bf16 tensors up to exp/rsqrt rounding. Built into the
// same library as paged_attention.cpp (see native.py).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec8.h"

namespace {

// Work (elements) below which a pass stays on the calling thread: a fork/join costs a few
// microseconds on an idle machine and up to a scheduler time slice on a busy one, more than
// one core takes for 256K elements of an element-wise pass (~0.1 ms).
constexpr int64_t kSerialElems = 1 << 18;
// GEMV-like passes read the whole weight matrix: two cores' memory bandwidth pays off sooner.
constexpr int64_t kSerialWeights = 1 << 15;

// y[m, n0:n0+R] for M rows of x; W rows n0.. are read once for all M rows.
template <int M, int R, class W>
inline void dot_block(const float* x, int64_t x_row, const W* w, int64_t K, int n0,
                      float out[M][R]) {
  vf acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = splat(0.f);
  for (int64_t k = 0; k < K; k += 8) {
    vf wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load8(w + (int64_t)(n0 + r) * K + k);
    for (int m = 0; m < M; ++m) {
      const vf xv = vload(x + m * x_row + k);
      for (int r = 0; r < R; ++r) acc[m][r] += xv * wv[r];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m][r] = hsum(acc[m][r]);
}

template <int M, int R>
void linear_small(const float* x, int64_t x_row, const float* w, const float* bias, float* y,
                  int64_t y_row, int N, int64_t K) {
  const int nb = N / R;
#pragma omp parallel for schedule(static) if ((int64_t)N * K > kSerialWeights)
  for (int b = 0; b < nb; ++b) {
    float o[M][R];
    dot_block<M, R>(x, x_row, w, K, b * R, o);
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r)
        y[m * y_row + b * R + r] = o[m][r] + (bias ? bias[b * R + r] : 0.f);
  }
  for (int n = nb * R; n < N; ++n) {  // tail rows
    float o[M][1];
    dot_block<M, 1>(x, x_row, w, K, n, o);
    for (int m = 0; m < M; ++m) y[m * y_row + n] = o[m][0] + (bias ? bias[n] : 0.f);
  }
}


// y[0:MG, 0:nrows] for the W rows [0, nrows) (bf16, or already widened to fp32), x already
// widened to fp32 (xb, K per row); bias and y point at column 0 of the block.
template <int MG, int R, class W>
inline void gemm_rows(const float* xb, int64_t K, const W* w, const bf16* bias, bf16* y,
                      int64_t y_row, int nrows) {
  float o[MG][R];
  int n = 0;
  for (; n + R <= nrows; n += R) {
    dot_block<MG, R>(xb, K, w, K, n, o);
    for (int m = 0; m < MG; ++m)
      for (int r = 0; r < R; ++r) {
        const float b = bias ? to_f32(bias[n + r]) : 0.f;
        y[m * y_row + n + r] = round1(o[m][r] + b);
      }
  }
  for (; n < nrows; ++n) {
    float o1[MG][1];
    dot_block<MG, 1>(xb, K, w, K, n, o1);
    const float b = bias ? to_f32(bias[n]) : 0.f;
    for (int m = 0; m < MG; ++m) y[m * y_row + n] = round1(o1[m][0] + b);
  }
}

// All mt rows of xb against one block of W rows.
template <class W>
void gemm_block(const float* xb, int mt, int64_t K, const W* w, const bf16* bias, bf16* y,
                int64_t y_row, int nrows) {
  int m = 0;
  for (; m + 4 <= mt; m += 4)
    gemm_rows<4, 2>(xb + m * K, K, w, bias, y + m * y_row, y_row, nrows);
  switch (mt - m) {
    case 1: gemm_rows<1, 8>(xb + m * K, K, w, bias, y + m * y_row, y_row, nrows); break;
    case 2: gemm_rows<2, 4>(xb + m * K, K, w, bias, y + m * y_row, y_row, nrows); break;
    case 3: gemm_rows<3, 4>(xb + m * K, K, w, bias, y + m * y_row, y_row, nrows); break;
    default: break;
  }
}

constexpr int kRowsPerItem = 32;  // W rows per work item (32 x K fp32: L2-resident)
constexpr int kXTile = 64;        // x rows widened at a time

}  // namespace

extern "C" {

// Returns 0, or 1 if M or K is outside what it handles (1 <= M <= 4, K % 8 == 0).
int kvpool_linear_small(const float* x, int64_t x_row, const float* w, const float* bias,
                        float* y, int64_t y_row, int M, int N, int64_t K) {
  if (K % 8 != 0) return 1;
  switch (M) {
    case 1: linear_small<1, 8>(x, x_row, w, bias, y, y_row, N, K); return 0;
    case 2: linear_small<2, 4>(x, x_row, w, bias, y, y_row, N, K); return 0;
    case 3: linear_small<3, 4>(x, x_row, w, bias, y, y_row, N, K); return 0;
    case 4: linear_small<4, 2>(x, x_row, w, bias, y, y_row, N, K); return 0;
    default: return 1;
  }
}

// Returns 0, or 1 if K % 8 != 0. Any M >= 1. Up to 4 rows W is widened in registers as it
// streams by (bandwidth-bound, half the bytes of fp32); above, each block of W rows is
// widened once into a per-thread fp32 buffer and reused by every group of 4 x rows.
int kvpool_linear_bf16(const bf16* x, int64_t x_row, const bf16* w, const bf16* bias, bf16* y,
                       int64_t y_row, int M, int N, int64_t K) {
  if (K % 8 != 0) return 1;
  std::vector<float> xb((size_t)std::min(M, kXTile) * K);
  const int items = (N + kRowsPerItem - 1) / kRowsPerItem;
  for (int m0 = 0; m0 < M; m0 += kXTile) {
    const int mt = std::min(kXTile, M - m0);
    for (int m = 0; m < mt; ++m)
      for (int64_t k = 0; k < K; k += 8)
        vstore(xb.data() + m * K + k, load8(x + (int64_t)(m0 + m) * x_row + k));
    bf16* ym = y + (int64_t)m0 * y_row;
#pragma omp parallel if ((int64_t)N * K * mt > kSerialWeights)
    {
      std::vector<float> wb(mt > 4 ? (size_t)kRowsPerItem * K : 0);
#pragma omp for schedule(static)
      for (int it = 0; it < items; ++it) {
        const int n0 = it * kRowsPerItem, nr = std::min(kRowsPerItem, N - n0);
        const bf16* wr = w + (int64_t)n0 * K;
        const bf16* br = bias ? bias + n0 : nullptr;
        if (mt <= 4) {
          gemm_block(xb.data(), mt, K, wr, br, ym + n0, y_row, nr);
          continue;
        }
        for (int64_t i = 0; i < (int64_t)nr * K; i += 8) vstore(wb.data() + i, load8(wr + i));
        gemm_block(xb.data(), mt, K, wb.data(), br, ym + n0, y_row, nr);
      }
    }
  }
  return 0;
}

}  // extern "C"

namespace {

// With res != nullptr: res[t] += x[t] first and the norm reads res (the residual stream);
// otherwise it reads x. D % 8 == 0.
template <class T>
void rmsnorm(const T* x, int64_t x_row, T* res, int64_t res_row, const T* w, T* out,
             int64_t out_row, int T_, int D, float eps) {
  T* const tag = nullptr;
#pragma omp parallel for schedule(static) if ((int64_t)T_ * D > kSerialElems)
  for (int t = 0; t < T_; ++t) {
    const T* src = x + (int64_t)t * x_row;
    if (res != nullptr) {
      T* r = res + (int64_t)t * res_row;
      for (int c = 0; c < D; c += 8) store8(r + c, load8(r + c) + load8(src + c));
      src = r;
    }
    vf ss = splat(0.f);
    for (int c = 0; c < D; c += 8) {
      const vf v = load8(src + c);
      ss += v * v;
    }
    const float inv = 1.f / std::sqrt(hsum(ss) / (float)D + eps);
    T* dst = out + (int64_t)t * out_row;
    for (int c = 0; c < D; c += 8)
      store8(dst + c, load8(w + c) * as8(tag, load8(src + c) * splat(inv)));
  }
}

// qkv rows [T, row]: heads [0, nq) then (at k_off) [0, nk), each D wide; cos/sin tables
// [*, D] indexed by positions[t]. Non-interleaved rotary:
//   out[i] = x[i] cos[i] - x[i + D/2] sin[i];  out[i + D/2] = x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2]
template <class T>
void rotary(T* qkv, int64_t row, int64_t k_off, int nq, int nk, int D,
            const int64_t* positions, const T* cos_t, const T* sin_t, int T_) {
  T* const tag = nullptr;
  const int half = D / 2;
#pragma omp parallel for schedule(static) if ((int64_t)T_ * (nq + nk) * D > kSerialElems)
  for (int t = 0; t < T_; ++t) {
    const T* c = cos_t + positions[t] * D;
    const T* s = sin_t + positions[t] * D;
    T* base = qkv + (int64_t)t * row;
    for (int h = 0; h < nq + nk; ++h) {
      T* x = base + (h < nq ? (int64_t)h * D : k_off + (int64_t)(h - nq) * D);
      for (int i = 0; i < half; i += 8) {
        const vf a = load8(x + i), b = load8(x + half + i);
        store8(x + i, as8(tag, a * load8(c + i)) - as8(tag, b * load8(s + i)));
        store8(x + half + i,
               as8(tag, b * load8(c + half + i)) + as8(tag, a * load8(s + half + i)));
      }
    }
  }
}

// gu rows [T, gu_row] = [gate (I) | up (I)]; out [T, out_row]. I % 8 == 0.
template <class T>
void silu_mul(const T* gu, int64_t gu_row, T* out, int64_t out_row, int T_, int I) {
  T* const tag = nullptr;
#pragma omp parallel for schedule(static) if ((int64_t)T_ * I > kSerialElems)
  for (int t = 0; t < T_; ++t) {
    const T* g = gu + (int64_t)t * gu_row;
    const T* u = g + I;
    T* o = out + (int64_t)t * out_row;
    for (int i = 0; i < I; i += 8) {
      const vf x = load8(g + i);
      store8(o + i, as8(tag, x / (splat(1.f) + vexp(-x))) * load8(u + i));
    }
  }
}

}  // namespace

extern "C" {

void kvpool_rmsnorm(const float* x, int64_t x_row, float* res, int64_t res_row,
                    const float* w, float* out, int64_t out_row, int T, int D, float eps) {
  rmsnorm(x, x_row, res, res_row, w, out, out_row, T, D, eps);
}
void kvpool_rmsnorm_bf16(const bf16* x, int64_t x_row, bf16* res, int64_t res_row,
                         const bf16* w, bf16* out, int64_t out_row, int T, int D, float eps) {
  rmsnorm(x, x_row, res, res_row, w, out, out_row, T, D, eps);
}
void kvpool_rotary(float* qkv, int64_t row, int64_t k_off, int nq, int nk, int D,
                   const int64_t* positions, const float* cos_t, const float* sin_t, int T) {
  rotary(qkv, row, k_off, nq, nk, D, positions, cos_t, sin_t, T);
}
void kvpool_rotary_bf16(bf16* qkv, int64_t row, int64_t k_off, int nq, int nk, int D,
                        const int64_t* positions, const bf16* cos_t, const bf16* sin_t, int T) {
  rotary(qkv, row, k_off, nq, nk, D, positions, cos_t, sin_t, T);
}
void kvpool_silu_mul(const float* gu, int64_t gu_row, float* out, int64_t out_row, int T,
                     int I) {
  silu_mul(gu, gu_row, out, out_row, T, I);
}
void kvpool_silu_mul_bf16(const bf16* gu, int64_t gu_row, bf16* out, int64_t out_row, int T,
                          int I) {
  silu_mul(gu, gu_row, out, out_row, T, I);
}

// idx[s] = the first j with x[s, j] == max_j x[s, j] (NaN-free rows).
void kvpool_argmax(const float* x, int64_t row, int S, int V, int64_t* idx) {
#pragma omp parallel for schedule(static) if ((int64_t)S * V > kSerialElems)
  for (int s = 0; s < S; ++s) {
    const float* r = x + (int64_t)s * row;
    // pass 1: the maximum (8 lanes); pass 2: its first position (the row is in cache)
    float best = r[0];
    int j = 0;
    if (V >= 8) {
      vf m = vload(r);
      for (j = 8; j + 8 <= V; j += 8) {
        const vf v = vload(r + j);
        m = v > m ? v : m;
      }
      for (int i = 0; i < 8; ++i) best = m[i] > best ? m[i] : best;
    }
    for (; j < V; ++j) best = r[j] > best ? r[j] : best;
    int64_t at = 0;
    while (r[at] != best) ++at;
    idx[s] = at;
  }
}

}  // extern "C"
