/* The portable stream's words, unit floats and fused samplers, for fxinit/rng/portable.py.
 * Element i of a stream is splitmix64(stream + (i + 1) * 0x9E3779B97F4A7C15).
 *
 * Every float operation here is one IEEE-754 operation rounded on its own (built with
 * -ffp-contract=off: no fused multiply-add), with float constants written out exactly, so
 * portable.py's torch-op path computes the same bits on any device, and so do the vector
 * clones below.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(FXINIT_NO_CLONES)
#define FXINIT_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define FXINIT_CLONES
#endif

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define BLOCK 512

static inline uint64_t word(uint64_t stream, uint64_t i) {
  uint64_t z = (i + 1) * GOLDEN + stream;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

/* out[k] = 24 bits of word(start + k), from bit `shift` up, as a float in [0, 1) */
void fxinit_portable_unit24(float *out, int64_t n, int64_t start, uint64_t stream, int shift) {
  for (int64_t k = 0; k < n; k++)
    out[k] = (float)((word(stream, (uint64_t)(start + k)) >> shift) & 0xFFFFFFULL) * (1.0f / 16777216.0f);
}

/* out[k] = the top 53 bits of word(start + k) as a double in [0, 1) */
void fxinit_portable_unit53(double *out, int64_t n, int64_t start, uint64_t stream) {
  for (int64_t k = 0; k < n; k++)
    out[k] = (double)(word(stream, (uint64_t)(start + k)) >> 11) * (1.0 / 9007199254740992.0);
}

/* -2 log(m / 2^24) for an integer m in [1, 2^24]: m = 2^e f with f in [sqrt(1/2), sqrt(2)),
 * log f = 2 atanh(s), s = (f - 1) / (f + 1), |s| < 0.172, by its series to s^9. */
static inline float neg2log24(int32_t m) {
  float fm = (float)m; /* exact */
  int32_t bits;
  memcpy(&bits, &fm, 4);
  int32_t e = (bits >> 23) - 127;
  int32_t fb = (bits & 0x7FFFFF) | 0x3F800000; /* f in [1, 2) */
  int32_t big = fb > 0x3FB504F3;               /* f > sqrt(2): halve it */
  fb -= big << 23;
  e += big;
  float f;
  memcpy(&f, &fb, 4);
  float s = (f - 1.0f) / (f + 1.0f);
  float s2 = s * s;
  float p = s2 * 0x1.c71c72p-4f + 0x1.24924ap-3f; /* 1/9, 1/7 */
  p = p * s2 + 0x1.99999ap-3f;                    /* 1/5 */
  p = p * s2 + 0x1.555556p-2f;                    /* 1/3 */
  p = p * s2 + 1.0f;
  float lf = (s + s) * p;
  float l = (float)(e - 24) * 0x1.62e430p-1f + lf; /* ln 2 */
  return l * -2.0f;
}

/* cos(2 pi j / 2^24) for an integer j in [0, 2^24): the quadrant from the top bits, the
 * rest an angle in [-pi/4, pi/4) for Taylor polynomials of cos and sin. */
static inline float cos2pi24(int32_t j) {
  int32_t t = (j + (1 << 21)) & 0xFFFFFF;
  int32_t q = t >> 22;
  float x = (float)((t & 0x3FFFFF) - (1 << 21)) * 0x1.921fb6p-22f; /* 2 pi / 2^24 */
  float x2 = x * x;
  float c = x2 * 0x1.a01a02p-16f + -0x1.6c16c2p-10f; /* 1/8!, 1/6! */
  c = c * x2 + 0x1.555556p-5f;                       /* 1/4! */
  c = c * x2 + -0.5f;
  c = c * x2 + 1.0f;
  float s = x2 * 0x1.71de3ap-19f + -0x1.a01a02p-13f; /* 1/9!, 1/7! */
  s = s * x2 + 0x1.111112p-7f;                       /* 1/5! */
  s = s * x2 + -0x1.555556p-3f;                      /* 1/3! */
  s = s * x2 + 1.0f;
  s = s * x;
  float v = (q & 1) ? s : c;
  return ((q + 1) & 2) ? -v : v;
}

static inline uint16_t bf16_rne(float v) { /* torch's float -> bfloat16 (no NaN can occur here) */
  uint32_t u;
  memcpy(&u, &v, 4);
  return (uint16_t)((u + 0x7FFFU + ((u >> 16) & 1U)) >> 16);
}

/* A block of float32 samples: kind 0 uniform, u * scale + shift with u 24 bits from bit 40;
 * kind 1 normal, Box-Muller from the two 24-bit halves of one word, times scale plus shift. */
static inline void block(float *restrict v, int kind, int64_t n, uint64_t start, uint64_t stream, float scale,
                         float shift) {
  if (kind == 0) {
    for (int64_t k = 0; k < n; k++) {
      uint64_t w = word(stream, start + (uint64_t)k);
      float u = (float)(int32_t)((w >> 40) & 0xFFFFFFULL) * (1.0f / 16777216.0f);
      v[k] = u * scale + shift;
    }
  } else {
    for (int64_t k = 0; k < n; k++) {
      uint64_t w = word(stream, start + (uint64_t)k);
      int32_t m = (1 << 24) - (int32_t)((w >> 40) & 0xFFFFFFULL);
      float z = sqrtf(neg2log24(m)) * cos2pi24((int32_t)((w >> 8) & 0xFFFFFFULL));
      v[k] = z * scale + shift;
    }
  }
}

/* Elements start .. start+n of a uniform (kind 0) or normal (kind 1) fill written straight
 * into out, float32 (dtype 0) or bfloat16 (dtype 1): one pass over memory. */
FXINIT_CLONES void fxinit_portable_fill(void *out, int kind, int dtype, int64_t n, int64_t start, uint64_t stream,
                                        double scale, double shift) {
  float a = (float)scale, b = (float)shift;
  float tmp[BLOCK];
  for (int64_t at = 0; at < n; at += BLOCK) {
    int64_t len = n - at < BLOCK ? n - at : BLOCK;
    uint64_t first = (uint64_t)(start + at);
    if (dtype == 0) {
      block((float *)out + at, kind, len, first, stream, a, b);
    } else {
      block(tmp, kind, len, first, stream, a, b);
      uint16_t *o = (uint16_t *)out + at;
      for (int64_t k = 0; k < len; k++) o[k] = bf16_rne(tmp[k]);
    }
  }
}
