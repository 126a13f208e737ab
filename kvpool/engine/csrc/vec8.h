// 8-lane fp32 vectors (GCC vector extensions) shared by the native CPU kernels:
// unaligned load/store, broadcast, horizontal sum and a Cephes-style expf.
#pragma once

#include <cstdint>

typedef float vf __attribute__((vector_size(32)));
typedef float vfu __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi __attribute__((vector_size(32)));

static inline vf vload(const float* p) { return *reinterpret_cast<const vfu*>(p); }
static inline void vstore(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }
static inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x}; }
static inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// Cephes-style expf on 8 lanes (relative error ~1e-7 over the clamped range).
static inline vf vexp(vf x) {
  const vf hi = splat(88.3762626647949f), lo = splat(-87.3365447504019f);
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  vf fx = x * splat(1.44269504088896341f) + splat(0.5f);
  vi t = __builtin_convertvector(fx, vi);
  vf tf = __builtin_convertvector(t, vf);
  tf = tf > fx ? tf - splat(1.f) : tf;  // floor
  x = x - tf * splat(0.693359375f) - tf * splat(-2.12194440e-4f);
  vf y = splat(1.9875691500E-4f);
  y = y * x + splat(1.3981999507E-3f);
  y = y * x + splat(8.3334519073E-3f);
  y = y * x + splat(4.1665795894E-2f);
  y = y * x + splat(1.6666665459E-1f);
  y = y * x + splat(5.0000001201E-1f);
  y = y * x * x + x + splat(1.f);
  vi e = (__builtin_convertvector(tf, vi) + 127) << 23;
  return y * reinterpret_cast<vf&>(e);
}
