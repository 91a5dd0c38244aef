/* The portable stream's fused samplers and float64 units, for fxinit/rng/portable.py, which
 * defines the stream; its torch-op twin computes the same bits on any device.
 *
 * Word k of a stream is splitmix64(stream + (k + 1) * 0x9E3779B97F4A7C15). Float32 and
 * bfloat16 samples take 24 bits per element, two elements per word: element i takes bits
 * 8..31 of word i/2 when i is even, bits 40..63 when i is odd. A uniform sample is that
 * unit; normal samples come in Box-Muller pairs: elements 2k and 2k+1 are r cos(theta) and
 * r sin(theta), r from the odd element's unit, theta from the even one's. Float64 units take
 * the top 53 bits of word i.
 *
 * Every float operation is one IEEE-754 operation (+, -, *, sqrt) rounded on its own (built
 * with -ffp-contract=off: no fused multiply-add; no division, which GPU compilers approximate),
 * with float constants written out exactly, and selections are made on bits: the scalar code,
 * the vector loops of every clone (AVX-512, AVX2, SSE2) and the torch-op twin agree bit for bit.
 *
 * Speed: a block of pairs goes through short loops (words; log and square root; cos and
 * sin; scale, shift, interleave and cast) that GCC vectorizes and that each fit the vector
 * registers. A float conditional would keep a loop scalar on AVX2 (without AVX-512's masks
 * GCC cannot if-convert it), and one long loop spills.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

#include "bits.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(FXINIT_NO_CLONES)
#define FXINIT_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define FXINIT_CLONES
#endif

#if defined(__GNUC__)
#define INLINE static inline __attribute__((always_inline)) /* inside each clone, built for its target */
#else
#define INLINE static inline
#endif

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define BLOCK 512 /* pairs per pass through the stack buffers */

INLINE uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

INLINE uint64_t word(uint64_t stream, uint64_t k) { return mix((k + 1) * GOLDEN + stream); }

/* -2 log(m / 2^24) for an integer m in [1, 2^24]: m / 2^24 = 2^k f with f in [sqrt(1/2), sqrt(2))
 * read off the bits of m (as musl's logf does), log f = t - t^2/2 + t^3 P(t) with t = f - 1
 * (exact), P of degree 8 (Cephes' logf coefficients, rounded to float) by Estrin's scheme, and
 * k log 2 in two parts, the first exact for any k. */
INLINE float neg2log24(int32_t m) {
  int32_t ix = (int32_t)bits_of((float)m) - 0x4B3504F3; /* the bits of 2^24 sqrt(1/2) */
  float k = (float)(ix >> 23);
  float t = float_of(((uint32_t)ix & 0x7FFFFFU) + 0x3F3504F3U) - 1.0f;
  float z = t * t, z2 = z * z;
  float p01 = t * 0x1.204376p-4f + -0x1.d7a370p-4f, p23 = t * 0x1.de4a34p-4f + -0x1.fcba9ep-4f;
  float p45 = t * 0x1.23d37ep-3f + -0x1.555ca0p-3f, p67 = t * 0x1.999d58p-3f + -0x1.fffff8p-3f;
  float p = ((p01 * z + p23) * z2 + (p45 * z + p67)) * t + 0x1.555554p-2f;
  float y = p * t * z;
  y = y + k * -0x1.bd0106p-13f; /* log 2 - 0.693359375 */
  y = y + z * -0.5f;
  y = t + y;
  y = y + k * 0x1.63p-1f; /* 0.693359375 */
  return y * -2.0f;
}

/* cos and sin of 2 pi j / 2^24 for an integer j in [0, 2^24): the quadrant q from the top
 * bits, the rest an angle x in [-pi/4, pi/4) for Taylor polynomials of cos x (to x^8) and
 * sin x (to x^9), by Estrin's scheme. */
INLINE void cos_sin_2pi24(int32_t j, float *cos_out, float *sin_out) {
  int32_t t = (j + (1 << 21)) & 0xFFFFFF;
  uint32_t q = (uint32_t)t >> 22;
  float x = (float)((t & 0x3FFFFF) - (1 << 21)) * 0x1.921fb6p-22f; /* 2 pi / 2^24 */
  float z = x * x, z2 = z * z;
  float c = ((z * 0x1.a01a02p-16f + -0x1.6c16c2p-10f) * z2 + (z * 0x1.555556p-5f + -0.5f)) * z + 1.0f;
  float s = ((z * 0x1.71de3ap-19f + -0x1.a01a02p-13f) * z2 + (z * 0x1.111112p-7f + -0x1.555556p-3f)) * z * x + x;
  /* in quadrant q, cos = c, -s, -c, s and sin = s, c, -s, -c */
  uint32_t cb = bits_of(c), sb = bits_of(s), swap = (cb ^ sb) & (0U - (q & 1U));
  *cos_out = float_of(cb ^ swap ^ (((q + 1U) & 2U) << 30));
  *sin_out = float_of(sb ^ swap ^ ((q & 2U) << 30));
}

/* A word's two 24-bit units: its even element's (bits 8..31) and its odd element's (40..63) */
INLINE int32_t even_unit(uint64_t w) { return (int32_t)((uint32_t)w >> 8); }
INLINE int32_t odd_unit(uint64_t w) { return (int32_t)(w >> 40); }

INLINE float uniform(int32_t unit) { return (float)unit * 0x1p-24f; }

/* Box-Muller's radius sqrt(-2 log(1 - u)) for the unit u = unit / 2^24 */
INLINE float radius(int32_t unit) { return sqrtf(neg2log24((1 << 24) - unit)); }

/* The samples of elements 2k and 2k+1 from word k (before scale and shift): uniform (kind 0)
 * or normal (kind 1). The vector loops of `block` compute the same, loop by loop. */
INLINE void pair_of(int kind, uint64_t w, float *v) {
  if (kind == 0) {
    v[0] = uniform(even_unit(w));
    v[1] = uniform(odd_unit(w));
  } else {
    float r = radius(odd_unit(w)), c, s;
    cos_sin_2pi24(even_unit(w), &c, &s);
    v[0] = r * c;
    v[1] = r * s;
  }
}

INLINE uint16_t bf16_rne(float v) { /* torch's float -> bfloat16 (no NaN can occur here) */
  uint32_t u = bits_of(v);
  return (uint16_t)((u + 0x7FFFU + ((u >> 16) & 1U)) >> 16);
}

/* Element `at` of out (float32: dtype 0, bfloat16: dtype 1) = v */
INLINE void put(void *out, int dtype, int64_t at, float v) {
  if (dtype == 0) ((float *)out)[at] = v;
  else ((uint16_t *)out)[at] = bf16_rne(v);
}

/* Elements 2*first .. 2*(first+count) of a fill (count <= BLOCK) into out from element at:
 * pair_of's samples times scale plus shift, cast, in loops that each vectorize. */
INLINE void block(void *out, int64_t at, int kind, int dtype, int64_t count, uint64_t first, uint64_t stream,
                  float scale, float shift) {
  int32_t e[BLOCK], o[BLOCK];
  float a[BLOCK], b[BLOCK];
  uint64_t z = (first + 1) * GOLDEN + stream;
  for (int64_t k = 0; k < count; k++, z += GOLDEN) {
    uint64_t w = mix(z);
    e[k] = even_unit(w);
    o[k] = odd_unit(w);
  }
  if (kind == 0) {
    for (int64_t k = 0; k < count; k++) {
      a[k] = uniform(e[k]);
      b[k] = uniform(o[k]);
    }
  } else {
    for (int64_t k = 0; k < count; k++) b[k] = radius(o[k]);
    for (int64_t k = 0; k < count; k++) {
      float c, s;
      cos_sin_2pi24(e[k], &c, &s);
      a[k] = b[k] * c;
      b[k] = b[k] * s;
    }
  }
  if (dtype == 0) {
    float *v = (float *)out + at;
    for (int64_t k = 0; k < count; k++) {
      v[2 * k] = a[k] * scale + shift;
      v[2 * k + 1] = b[k] * scale + shift;
    }
  } else {
    uint16_t *v = (uint16_t *)out + at;
    for (int64_t k = 0; k < count; k++) {
      v[2 * k] = bf16_rne(a[k] * scale + shift);
      v[2 * k + 1] = bf16_rne(b[k] * scale + shift);
    }
  }
}

/* Elements start .. start+n of a uniform (kind 0) or normal (kind 1) fill written straight
 * into out, float32 (dtype 0) or bfloat16 (dtype 1), each sample * scale + shift in float32:
 * one pass over memory. */
FXINIT_CLONES void fxinit_portable_fill(void *out, int kind, int dtype, int64_t n, int64_t start, uint64_t stream,
                                        double scale, double shift) {
  float sc = (float)scale, sh = (float)shift, v[2];
  int64_t at = 0;
  if (n > 0 && (start & 1)) { /* an odd first element: the second of its pair */
    pair_of(kind, word(stream, (uint64_t)start >> 1), v);
    put(out, dtype, 0, v[1] * sc + sh);
    at = 1;
  }
  for (int64_t count; (count = (n - at) / 2) > 0; at += 2 * count) {
    count = count < BLOCK ? count : BLOCK;
    block(out, at, kind, dtype, count, (uint64_t)(start + at) >> 1, stream, sc, sh);
  }
  if (at < n) { /* an odd last element: the first of its pair */
    pair_of(kind, word(stream, (uint64_t)(start + at) >> 1), v);
    put(out, dtype, at, v[0] * sc + sh);
  }
}

/* out[k] = the top 53 bits of word(start + k) as a double in [0, 1) */
void fxinit_portable_unit53(double *out, int64_t n, int64_t start, uint64_t stream) {
  for (int64_t k = 0; k < n; k++)
    out[k] = (double)(word(stream, (uint64_t)(start + k)) >> 11) * (1.0 / 9007199254740992.0);
}

/* fxinit_portable_fill(out, kind, dtype, n, 0, stream, scale, shift) of each of `count` whole
 * fills, in one call: jobs[5k .. 5k+4] = the address of out, kind, dtype, n, stream; params[2k],
 * params[2k+1] = scale, shift. A model's hundreds of small fills without a call each. */
void fxinit_portable_fill_batch(int64_t count, const int64_t *jobs, const double *params) {
  for (int64_t k = 0; k < count; k++) {
    const int64_t *job = jobs + 5 * k;
    fxinit_portable_fill((void *)(intptr_t)job[0], (int)job[1], (int)job[2], job[3], 0, (uint64_t)job[4],
                         params[2 * k], params[2 * k + 1]);
  }
}
