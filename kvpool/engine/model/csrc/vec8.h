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
  return y * (vf)e;
}

// bfloat16 storage: the top 16 bits of an fp32. Loads widen exactly (a shift); stores round
// to nearest even like torch's conversion (NaN stays a quiet NaN). The kernels are
// templated on the storage type T (float or bf16) and always compute in fp32.
struct bf16 {
  uint16_t bits;
};
typedef uint16_t vh __attribute__((vector_size(16)));
typedef uint16_t vhu __attribute__((vector_size(16), aligned(2), may_alias));
typedef uint32_t vu __attribute__((vector_size(32)));

static inline vf load8(const float* p) { return vload(p); }
static inline vf load8(const bf16* p) {
  const vh h = *reinterpret_cast<const vhu*>(p);
  const vu w = __builtin_convertvector(h, vu) << 16;
  return (vf)w;  // a vector cast is a bit cast
}
static inline void store8(float* p, vf v) { vstore(p, v); }
static inline vh round_bf16(vf v) {
  const vu u = (vu)v;
  vu r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const vi nan = v != v;
  r = nan ? vu{} + 0x7FC0u : r;  // a quiet NaN, as torch
  return __builtin_convertvector(r, vh);
}
static inline void store8(bf16* p, vf v) { *reinterpret_cast<vhu*>(p) = round_bf16(v); }
// v rounded to T and widened back: the value a T store followed by a load would give.
static inline vf as8(const float*, vf v) { return v; }
static inline vf as8(const bf16*, vf v) {
  const vu w = __builtin_convertvector(round_bf16(v), vu) << 16;
  return (vf)w;  // a vector cast is a bit cast
}
static inline float to_f32(float x) { return x; }
static inline float to_f32(bf16 x) {
  const uint32_t w = (uint32_t)x.bits << 16;
  float f;
  __builtin_memcpy(&f, &w, 4);
  return f;
}
static inline bf16 round1(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if (f != f) return bf16{0x7FC0};
  return bf16{(uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}
