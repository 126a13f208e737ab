// Fused fp32 element-wise passes and a small-M GEMM for the CPU forward pass.
//
// Each function replaces several torch ops (and as many OpenMP fork/joins, which is what a
// busy 2-core machine punishes most) by one pass over the rows:
//   kvpool_rmsnorm        [residual += x;] out = weight * (r * rsqrt(mean(r^2) + eps))
//   kvpool_rotary         rotate_half rotary on the q and k heads of a packed qkv buffer, in place
//   kvpool_silu_mul       out = silu(gate) * up for a packed [gate | up] buffer
//   kvpool_linear_small   y = x @ W^T (+ b) for a few rows (decode of 1-4 sequences): a
//                         bandwidth-bound pass over W's rows, which MKL's sgemm does slowly here
//   kvpool_argmax         first index of each row's maximum (greedy sampling)
// All pointers are fp32 rows with the given row strides (elements); the feature dim is
// contiguous. Built into the same library as paged_attention.cpp (see native.py).

#include <cmath>
#include <cstdint>

#include "vec8.h"

namespace {

// Work (elements) below which a pass stays on the calling thread: a fork/join costs a few
// microseconds on an idle machine and up to a scheduler time slice on a busy one, more than
// one core takes for 256K elements of an element-wise pass (~0.1 ms).
constexpr int64_t kSerialElems = 1 << 18;
// GEMV-like passes read the whole weight matrix: two cores' memory bandwidth pays off sooner.
constexpr int64_t kSerialWeights = 1 << 15;

// y[m, n0:n0+R] for M rows of x; W rows n0.. are read once for all M rows.
template <int M, int R>
inline void dot_block(const float* x, int64_t x_row, const float* w, int64_t K, int n0,
                      float out[M][R]) {
  vf acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = splat(0.f);
  for (int64_t k = 0; k < K; k += 8) {
    vf wv[R];
    for (int r = 0; r < R; ++r) wv[r] = vload(w + (int64_t)(n0 + r) * K + k);
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

// With res != nullptr: res[t] += x[t] first and the norm reads res (the residual stream);
// otherwise it reads x. D % 8 == 0.
void kvpool_rmsnorm(const float* x, int64_t x_row, float* res, int64_t res_row,
                    const float* w, float* out, int64_t out_row, int T, int D, float eps) {
#pragma omp parallel for schedule(static) if ((int64_t)T * D > kSerialElems)
  for (int t = 0; t < T; ++t) {
    const float* src = x + (int64_t)t * x_row;
    if (res != nullptr) {
      float* r = res + (int64_t)t * res_row;
      for (int c = 0; c < D; c += 8) vstore(r + c, vload(r + c) + vload(src + c));
      src = r;
    }
    vf ss = splat(0.f);
    for (int c = 0; c < D; c += 8) {
      const vf v = vload(src + c);
      ss += v * v;
    }
    const float inv = 1.f / std::sqrt(hsum(ss) / (float)D + eps);
    float* dst = out + (int64_t)t * out_row;
    for (int c = 0; c < D; c += 8) vstore(dst + c, vload(w + c) * (vload(src + c) * splat(inv)));
  }
}

// qkv rows [T, row]: heads [0, nq) then (at k_off) [0, nk), each D wide; cos/sin tables
// [*, D] indexed by positions[t]. Non-interleaved rotary:
//   out[i] = x[i] cos[i] - x[i + D/2] sin[i];  out[i + D/2] = x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2]
void kvpool_rotary(float* qkv, int64_t row, int64_t k_off, int nq, int nk, int D,
                   const int64_t* positions, const float* cos_t, const float* sin_t, int T) {
  const int half = D / 2;
#pragma omp parallel for schedule(static) if ((int64_t)T * (nq + nk) * D > kSerialElems)
  for (int t = 0; t < T; ++t) {
    const float* c = cos_t + positions[t] * D;
    const float* s = sin_t + positions[t] * D;
    float* base = qkv + (int64_t)t * row;
    for (int h = 0; h < nq + nk; ++h) {
      float* x = base + (h < nq ? (int64_t)h * D : k_off + (int64_t)(h - nq) * D);
      for (int i = 0; i < half; i += 8) {
        const vf a = vload(x + i), b = vload(x + half + i);
        vstore(x + i, a * vload(c + i) - b * vload(s + i));
        vstore(x + half + i, b * vload(c + half + i) + a * vload(s + half + i));
      }
    }
  }
}

// gu rows [T, gu_row] = [gate (I) | up (I)]; out [T, out_row]. I % 8 == 0.
void kvpool_silu_mul(const float* gu, int64_t gu_row, float* out, int64_t out_row, int T,
                     int I) {
#pragma omp parallel for schedule(static) if ((int64_t)T * I > kSerialElems)
  for (int t = 0; t < T; ++t) {
    const float* g = gu + (int64_t)t * gu_row;
    const float* u = g + I;
    float* o = out + (int64_t)t * out_row;
    for (int i = 0; i < I; i += 8) {
      const vf x = vload(g + i);
      vstore(o + i, x / (splat(1.f) + vexp(-x)) * vload(u + i));
    }
  }
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
