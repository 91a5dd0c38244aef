/* Bit-exact reimplementations of torch's CPU random fills (uniform_, normal_), for ranges
 * of a tensor, each starting from an MT19937 state already jumped to its first word.
 *
 * What torch 2.13 computes (aten/src/ATen/native/cpu/DistributionTemplates.h,
 * core/DistributionsHelper.h, core/TransformationHelper.h), per capability:
 *  - a float uniform is (w & 0xffffff) * 2^-24 from one 32-bit word; a double uniform is
 *    the low 53 bits of (w0 << 32 | w1) * 2^-53 from two; bf16/half use the float one;
 *  - uniform_: x * (to - from) + from in the opmath type (float for bf16/half), contracted
 *    into one fused multiply-add by the compiler in the AVX2/AVX-512 builds, two roundings
 *    in the DEFAULT build; reduced types then round to nearest even, and a value equal to
 *    `to` becomes `from`;
 *  - normal_ (16 or more contiguous elements): Box-Muller on blocks of 16 uniforms
 *    (u1 = 1 - u[j], u2 = u[j + 8]); a last partial block is redrawn and written over the
 *    last 16 elements. float/bf16/half blocks use, in the AVX2 build (which AVX-512 CPUs
 *    also run for normal_), the Cephes-style log256_ps/sincos256_ps of avx_mathfun.h with
 *    the multiply-adds GCC fused there (written out below as explicit FMAs); in the
 *    DEFAULT build, and for double everywhere, scalar libm log/cos/sin and std::fma.
 * Everything here is compiled with -ffp-contract=off: every fused operation is explicit.
 */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(FXINIT_NO_CLONES)
#define FILLS_X86 1 /* the AVX2 path and the wider variants; elsewhere only the DEFAULT path */
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bits.h"
#include "mt19937.h"

enum { OP_UNIFORM = 0, OP_NORMAL = 1 };
enum { DT_F32 = 0, DT_F64 = 1, DT_BF16 = 2, DT_F16 = 3 };
enum { PATH_DEFAULT = 0, PATH_AVX2 = 1 };

#define INLINE static inline __attribute__((always_inline))

/* ------------------------------------------------------------------ MT19937 words */
typedef struct {
  uint32_t s[N];
  int pos; /* words of the current block already used; N: twist before the next */
} mt_t;

INLINE uint32_t temper(uint32_t y) {
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680U;
  y ^= (y << 15) & 0xefc60000U;
  return y ^ (y >> 18);
}

/* The next n words of g into dst. */
INLINE void mt_words(mt_t *g, uint32_t *restrict dst, int64_t n) {
  while (n > 0) {
    if (g->pos == N) {
      twist(g->s);
      g->pos = 0;
    }
    int take = N - g->pos;
    if (take > n) take = (int)n;
    const uint32_t *restrict src = g->s + g->pos;
    for (int i = 0; i < take; i++) dst[i] = temper(src[i]);
    g->pos += take;
    dst += take;
    n -= take;
  }
}

/* ------------------------------------------------------------------ conversions */
INLINE float unit24(uint32_t w) { return (float)(w & 0xffffffU) * 0x1p-24f; }
INLINE double unit53(uint32_t hi, uint32_t lo) {
  return (double)((((uint64_t)hi << 32) | lo) & ((1ULL << 53) - 1)) * 0x1p-53;
}

INLINE uint16_t to_bf16(float f) { /* round to nearest even, NaN to the canonical one */
  uint32_t u = bits_of(f);
  uint16_t r = (uint16_t)((u + 0x7fffU + ((u >> 16) & 1U)) >> 16);
  return f != f ? (uint16_t)0x7fc0 : r;
}

/* IEEE binary16, round to nearest even, without branches (so loops vectorize): scaling
 * |f| by 2^112 then 2^-110 sends what overflows binary16 to infinity; adding a power of two
 * whose ulp is the binary16 ulp of f lets the float add do the rounding, after which the
 * exponent and mantissa bits are read off the sum. NaN keeps its sign, quiet. */
INLINE uint16_t to_f16(float f) {
  uint32_t u = bits_of(f);
  uint32_t twice = u << 1; /* sign dropped */
  float scaled = (fabsf(f) * 0x1p+112f) * 0x1p-110f;
  uint32_t e = twice & 0xff000000U; /* the exponent, in the top byte */
  e = e < 0x71000000U ? 0x71000000U : e; /* below 2^-14 the quantum is fixed: 2^-24 */
  float sum = float_of((e >> 1) + 0x07800000U) + scaled;
  uint32_t r = bits_of(sum);
  uint32_t mag = ((r >> 13) & 0x7c00U) + (r & 0x0fffU);
  return (uint16_t)(((u >> 16) & 0x8000U) | (twice > 0xff000000U ? 0x7e00U : mag));
}

INLINE int same16(uint16_t a, uint16_t b) { /* == on the values: +0 == -0 */
  return a == b || ((a & 0x7fffU) == 0 && (b & 0x7fffU) == 0);
}

/* ------------------------------------------------------------------ AVX2 Box-Muller */
#ifdef FILLS_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma")

#define SET(x) _mm256_set1_ps(x)
#define SETI(x) _mm256_castsi256_ps(_mm256_set1_epi32(x))

INLINE __m256 log8(__m256 x) {
  const __m256 one = SET(1.0f);
  __m256 invalid = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LE_OS);
  x = _mm256_max_ps(x, SETI(0x00800000));
  __m256i ei = _mm256_srli_epi32(_mm256_castps_si256(x), 23);
  x = _mm256_and_ps(x, SETI(~0x7f800000));
  x = _mm256_or_ps(x, SET(0.5f));
  ei = _mm256_sub_epi32(ei, _mm256_set1_epi32(0x7f));
  __m256 e = _mm256_add_ps(_mm256_cvtepi32_ps(ei), one);
  __m256 mask = _mm256_cmp_ps(x, SET(0.707106781186547524f), _CMP_LT_OS);
  __m256 tmp = _mm256_and_ps(x, mask);
  x = _mm256_sub_ps(x, one);
  e = _mm256_sub_ps(e, _mm256_and_ps(one, mask));
  x = _mm256_add_ps(x, tmp);
  __m256 z = _mm256_mul_ps(x, x);
  __m256 y = SET(7.0376836292E-2f);
  y = _mm256_fmadd_ps(y, x, SET(-1.1514610310E-1f));
  y = _mm256_fmadd_ps(y, x, SET(1.1676998740E-1f));
  y = _mm256_fmadd_ps(y, x, SET(-1.2420140846E-1f));
  y = _mm256_fmadd_ps(y, x, SET(1.4249322787E-1f));
  y = _mm256_fmadd_ps(y, x, SET(-1.6668057665E-1f));
  y = _mm256_fmadd_ps(y, x, SET(2.0000714765E-1f));
  y = _mm256_fmadd_ps(y, x, SET(-2.4999993993E-1f));
  y = _mm256_fmadd_ps(y, x, SET(3.3333331174E-1f));
  y = _mm256_mul_ps(y, x);
  y = _mm256_fmadd_ps(y, z, _mm256_mul_ps(e, SET(-2.12194440e-4f)));
  y = _mm256_fnmadd_ps(z, SET(0.5f), y);
  x = _mm256_add_ps(x, y);
  x = _mm256_fmadd_ps(e, SET(0.693359375f), x);
  return _mm256_or_ps(x, invalid);
}

INLINE void sincos8(__m256 x, __m256 *s, __m256 *c) {
  __m256 sign_sin = _mm256_and_ps(x, SETI((int)0x80000000));
  x = _mm256_and_ps(x, SETI(~0x80000000));
  __m256 y = _mm256_mul_ps(x, SET(1.27323954473516f));
  __m256i j = _mm256_cvttps_epi32(y);
  j = _mm256_and_si256(_mm256_add_epi32(j, _mm256_set1_epi32(1)), _mm256_set1_epi32(~1));
  y = _mm256_cvtepi32_ps(j);
  __m256i swap = _mm256_slli_epi32(_mm256_and_si256(j, _mm256_set1_epi32(4)), 29);
  __m256 poly = _mm256_castsi256_ps(
      _mm256_cmpeq_epi32(_mm256_and_si256(j, _mm256_set1_epi32(2)), _mm256_setzero_si256()));
  x = _mm256_fmadd_ps(y, SET(-0.78515625f), x);
  x = _mm256_fmadd_ps(y, SET(-2.4187564849853515625e-4f), x);
  x = _mm256_fmadd_ps(y, SET(-3.77489497744594108e-8f), x);
  __m256i jc = _mm256_sub_epi32(j, _mm256_set1_epi32(2));
  jc = _mm256_slli_epi32(_mm256_andnot_si256(jc, _mm256_set1_epi32(4)), 29);
  __m256 sign_cos = _mm256_castsi256_ps(jc);
  sign_sin = _mm256_xor_ps(sign_sin, _mm256_castsi256_ps(swap));
  __m256 z = _mm256_mul_ps(x, x);
  __m256 yc = SET(2.443315711809948E-005f);
  yc = _mm256_fmadd_ps(yc, z, SET(-1.388731625493765E-003f));
  yc = _mm256_fmadd_ps(yc, z, SET(4.166664568298827E-002f));
  yc = _mm256_mul_ps(yc, z);
  yc = _mm256_fmsub_ps(yc, z, _mm256_mul_ps(z, SET(0.5f)));
  yc = _mm256_add_ps(yc, SET(1.0f));
  __m256 ys = SET(-1.9515295891E-4f);
  ys = _mm256_fmadd_ps(ys, z, SET(8.3321608736E-3f));
  ys = _mm256_fmadd_ps(ys, z, SET(-1.6666654611E-1f));
  ys = _mm256_mul_ps(ys, z);
  ys = _mm256_fmadd_ps(ys, x, x);
  __m256 s2 = _mm256_and_ps(poly, ys), s1 = _mm256_andnot_ps(poly, yc);
  ys = _mm256_sub_ps(ys, s2);
  yc = _mm256_sub_ps(yc, s1);
  *s = _mm256_xor_ps(_mm256_add_ps(s1, s2), sign_sin);
  *c = _mm256_xor_ps(_mm256_add_ps(yc, ys), sign_cos);
}

/* 16 float uniforms in place to 16 normals, as torch's NormalFill16<float> for AVX2. */
INLINE void box_muller16_avx2(float *d, float mean, float std) {
  __m256 u1 = _mm256_sub_ps(SET(1.0f), _mm256_loadu_ps(d));
  __m256 u2 = _mm256_loadu_ps(d + 8);
  __m256 r = _mm256_sqrt_ps(_mm256_mul_ps(SET(-2.0f), log8(u1)));
  __m256 th = _mm256_mul_ps(SET((float)(2.0 * 3.14159265358979323846)), u2);
  __m256 s, c;
  sincos8(th, &s, &c);
  _mm256_storeu_ps(d, _mm256_fmadd_ps(_mm256_mul_ps(r, c), SET(std), SET(mean)));
  _mm256_storeu_ps(d + 8, _mm256_fmadd_ps(_mm256_mul_ps(r, s), SET(std), SET(mean)));
}

/* k (a multiple of 16) uniforms in place; not inlined, so generic code may call it */
__attribute__((noinline)) static void box_muller_avx2(float *d, int64_t k, float mean, float std) {
  for (int64_t b = 0; b < k; b += 16) box_muller16_avx2(d + b, mean, std);
}

/* The same operations on 16 lanes (two blocks at once) for AVX-512 CPUs: every lane does
 * exactly the IEEE operations of the AVX2 code, so the results are the same bits. */
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,fma")
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
#define F16(x) ((v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x})
#define I16(x) ((v16i){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x})
#define FMA16(a, b, c) ((v16f)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#define AS_I(x) ((v16i)(x))
#define AS_F(x) ((v16f)(x))

INLINE v16f log16(v16f x) {
  v16i invalid = x <= F16(0.0f);
  x = (v16f)_mm512_max_ps((__m512)x, (__m512)AS_F(I16(0x00800000)));
  v16i ei = (v16i)((__v16su)AS_I(x) >> 23);
  x = AS_F((AS_I(x) & I16(~0x7f800000)) | AS_I(F16(0.5f)));
  ei = ei - I16(0x7f);
  v16f e = __builtin_convertvector(ei, v16f) + F16(1.0f);
  v16i mask = x < F16(0.707106781186547524f);
  v16f tmp = AS_F(AS_I(x) & mask);
  x = x - F16(1.0f);
  e = e - AS_F(AS_I(F16(1.0f)) & mask);
  x = x + tmp;
  v16f z = x * x;
  v16f y = F16(7.0376836292E-2f);
  y = FMA16(y, x, F16(-1.1514610310E-1f));
  y = FMA16(y, x, F16(1.1676998740E-1f));
  y = FMA16(y, x, F16(-1.2420140846E-1f));
  y = FMA16(y, x, F16(1.4249322787E-1f));
  y = FMA16(y, x, F16(-1.6668057665E-1f));
  y = FMA16(y, x, F16(2.0000714765E-1f));
  y = FMA16(y, x, F16(-2.4999993993E-1f));
  y = FMA16(y, x, F16(3.3333331174E-1f));
  y = y * x;
  y = FMA16(y, z, e * F16(-2.12194440e-4f));
  y = (v16f)_mm512_fnmadd_ps((__m512)z, (__m512)F16(0.5f), (__m512)y);
  x = x + y;
  x = FMA16(e, F16(0.693359375f), x);
  return AS_F(AS_I(x) | invalid);
}

INLINE void sincos16(v16f x, v16f *s, v16f *c) {
  v16i sign_sin = AS_I(x) & I16((int32_t)0x80000000);
  x = AS_F(AS_I(x) & I16(0x7fffffff));
  v16f y = x * F16(1.27323954473516f);
  v16i j = __builtin_convertvector(y, v16i); /* truncates, as cvttps */
  j = (j + I16(1)) & I16(~1);
  y = __builtin_convertvector(j, v16f);
  v16i swap = (j & I16(4)) << 29;
  v16i poly = (j & I16(2)) == I16(0);
  x = FMA16(y, F16(-0.78515625f), x);
  x = FMA16(y, F16(-2.4187564849853515625e-4f), x);
  x = FMA16(y, F16(-3.77489497744594108e-8f), x);
  v16i sign_cos = (~(j - I16(2)) & I16(4)) << 29;
  sign_sin = sign_sin ^ swap;
  v16f z = x * x;
  v16f yc = F16(2.443315711809948E-005f);
  yc = FMA16(yc, z, F16(-1.388731625493765E-003f));
  yc = FMA16(yc, z, F16(4.166664568298827E-002f));
  yc = yc * z;
  yc = (v16f)_mm512_fmsub_ps((__m512)yc, (__m512)z, (__m512)(z * F16(0.5f)));
  yc = yc + F16(1.0f);
  v16f ys = F16(-1.9515295891E-4f);
  ys = FMA16(ys, z, F16(8.3321608736E-3f));
  ys = FMA16(ys, z, F16(-1.6666654611E-1f));
  ys = ys * z;
  ys = FMA16(ys, x, x);
  v16f s2 = AS_F(poly & AS_I(ys)), s1 = AS_F(~poly & AS_I(yc));
  ys = ys - s2;
  yc = yc - s1;
  *s = AS_F(AS_I(s1 + s2) ^ sign_sin);
  *c = AS_F(AS_I(yc + ys) ^ sign_cos);
}

/* Two blocks of 16 (32 floats) in place. */
INLINE void box_muller32_avx512(float *d, float mean, float std) {
  __m512 a = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(d)), _mm256_loadu_ps(d + 16), 1);
  __m512 b = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(d + 8)), _mm256_loadu_ps(d + 24), 1);
  v16f u1 = F16(1.0f) - (v16f)a, u2 = (v16f)b;
  v16f r = (v16f)_mm512_sqrt_ps((__m512)(F16(-2.0f) * log16(u1)));
  v16f th = F16((float)(2.0 * 3.14159265358979323846)) * u2;
  v16f sn, cs;
  sincos16(th, &sn, &cs);
  __m512 n1 = (__m512)FMA16(r * cs, F16(std), F16(mean)), n2 = (__m512)FMA16(r * sn, F16(std), F16(mean));
  _mm256_storeu_ps(d, _mm512_castps512_ps256(n1));
  _mm256_storeu_ps(d + 16, _mm512_extractf32x8_ps(n1, 1));
  _mm256_storeu_ps(d + 8, _mm512_castps512_ps256(n2));
  _mm256_storeu_ps(d + 24, _mm512_extractf32x8_ps(n2, 1));
}

__attribute__((noinline)) static void box_muller_avx512(float *d, int64_t k, float mean, float std) {
  int64_t b = 0;
  for (; b + 32 <= k; b += 32) box_muller32_avx512(d + b, mean, std);
  if (b < k) box_muller_avx2(d + b, k - b, mean, std);
}
#pragma GCC pop_options
#endif

/* The scalar NormalFill16: float (DEFAULT build) and double (every build). */
INLINE void box_muller16_f32(float *d, float mean, float std) {
  for (int j = 0; j < 8; j++) {
    float u1 = 1.0f - d[j], u2 = d[j + 8];
    float r = sqrtf(-2.0f * logf(u1));
    float th = (float)(2.0 * 3.14159265358979323846 * (double)u2);
    d[j] = fmaf(r * cosf(th), std, mean);
    d[j + 8] = fmaf(r * sinf(th), std, mean);
  }
}

INLINE void box_muller16_f64(double *d, double mean, double std) {
  for (int j = 0; j < 8; j++) {
    double u1 = 1.0 - d[j], u2 = d[j + 8];
    double r = sqrt(-2.0 * log(u1));
    double th = 2.0 * 3.14159265358979323846 * u2;
    d[j] = fma(r * cos(th), std, mean);
    d[j + 8] = fma(r * sin(th), std, mean);
  }
}

/* ------------------------------------------------------------------ jobs */
#ifdef FILLS_X86
static int has_avx512(void);
#endif
static int use_avx512(void) {
#ifdef FILLS_X86
  static int known = -1; /* a benign race: every thread finds the same answer */
  if (known < 0) known = has_avx512() && !getenv("FXINIT_FILLS_ISA"); /* tests: "avx2", "generic" */
  return known;
#else
  return 0;
#endif
}

#define CHUNK 4096 /* elements per batch of words (a multiple of 16) */

/* Uniform elements [0, n) of out, from the state at their first word. */
INLINE void uniform_job(mt_t *g, int dtype, int fused, void *out, int64_t n, double from_, double to_) {
  uint32_t w[2 * CHUNK];
  if (dtype == DT_F64) {
    const double from = from_, range = to_ - from_;
    double *o = out;
    for (int64_t i0 = 0; i0 < n; i0 += CHUNK) {
      int k = n - i0 < CHUNK ? (int)(n - i0) : CHUNK;
      mt_words(g, w, 2 * (int64_t)k);
      if (fused)
        for (int i = 0; i < k; i++) o[i0 + i] = fma(unit53(w[2 * i], w[2 * i + 1]), range, from);
      else
        for (int i = 0; i < k; i++) o[i0 + i] = unit53(w[2 * i], w[2 * i + 1]) * range + from;
    }
    return;
  }
  const float from = (float)from_, to = (float)to_, range = to - from;
  float v[CHUNK];
  uint16_t to_s = 0, from_s = 0;
  if (dtype == DT_BF16) to_s = to_bf16(to), from_s = to_bf16(from);
  if (dtype == DT_F16) to_s = to_f16(to), from_s = to_f16(from);
  for (int64_t i0 = 0; i0 < n; i0 += CHUNK) {
    int k = n - i0 < CHUNK ? (int)(n - i0) : CHUNK;
    mt_words(g, w, k);
    if (fused)
      for (int i = 0; i < k; i++) v[i] = fmaf(unit24(w[i]), range, from);
    else
      for (int i = 0; i < k; i++) v[i] = unit24(w[i]) * range + from;
    if (dtype == DT_F32) {
      memcpy((float *)out + i0, v, sizeof(float) * k);
    } else {
      uint16_t *o = (uint16_t *)out + i0;
      if (dtype == DT_BF16)
        for (int i = 0; i < k; i++) {
          uint16_t h = to_bf16(v[i]);
          o[i] = same16(h, to_s) ? from_s : h;
        }
      else
        for (int i = 0; i < k; i++) {
          uint16_t h = to_f16(v[i]);
          o[i] = same16(h, to_s) ? from_s : h;
        }
    }
  }
}

/* Normal elements: blocks of 16 starting at element `first` (relative to out), the state
 * at the block's first word; writes only elements [lo, hi) of out. */
INLINE void normal_job(mt_t *g, int dtype, int avx2, void *out, int64_t first, int64_t lo, int64_t hi,
                       double mean_, double std_) {
  (void)avx2;
  const int wide = use_avx512();
  (void)wide;
  uint32_t w[2 * CHUNK];
  if (dtype == DT_F64) {
    double v[CHUNK];
    for (int64_t e0 = first; e0 < hi; e0 += CHUNK) {
      int64_t k = (hi - e0 + 15) / 16 * 16;
      if (k > CHUNK) k = CHUNK;
      mt_words(g, w, 2 * k);
      for (int i = 0; i < k; i++) v[i] = unit53(w[2 * i], w[2 * i + 1]);
      for (int b = 0; b < k; b += 16) box_muller16_f64(v + b, mean_, std_);
      int64_t a = e0 < lo ? lo : e0, z = e0 + k < hi ? e0 + k : hi;
      if (a < z) memcpy((double *)out + a, v + (a - e0), sizeof(double) * (size_t)(z - a));
    }
    return;
  }
  const float mean = (float)mean_, std = (float)std_;
  float v[CHUNK];
  for (int64_t e0 = first; e0 < hi; e0 += CHUNK) {
    int64_t k = (hi - e0 + 15) / 16 * 16;
    if (k > CHUNK) k = CHUNK;
    mt_words(g, w, k);
    for (int i = 0; i < k; i++) v[i] = unit24(w[i]);
#ifdef FILLS_X86
    if (avx2 && wide)
      box_muller_avx512(v, k, mean, std);
    else if (avx2)
      box_muller_avx2(v, k, mean, std);
    else
#endif
      for (int b = 0; b < k; b += 16) box_muller16_f32(v + b, mean, std);
    int64_t a = e0 < lo ? lo : e0, z = e0 + k < hi ? e0 + k : hi;
    if (a >= z) continue;
    const float *src = v + (a - e0);
    int64_t cnt = z - a;
    if (dtype == DT_F32) {
      memcpy((float *)out + a, src, sizeof(float) * (size_t)cnt);
    } else if (dtype == DT_BF16) {
      uint16_t *o = (uint16_t *)out + a;
      for (int64_t i = 0; i < cnt; i++) o[i] = to_bf16(src[i]);
    } else {
      uint16_t *o = (uint16_t *)out + a;
      for (int64_t i = 0; i < cnt; i++) o[i] = to_f16(src[i]);
    }
  }
}

INLINE void run(int op, int dtype, int path, void *out, int64_t first, int64_t lo, int64_t hi,
                const uint32_t *words, int consumed, double p0, double p1) {
  mt_t g;
  memcpy(g.s, words, sizeof g.s);
  g.pos = consumed;
  if (op == OP_UNIFORM)
    uniform_job(&g, dtype, path == PATH_AVX2, (char *)out + lo * (dtype == DT_F64 ? 8 : dtype == DT_F32 ? 4 : 2),
                hi - lo, p0, p1);
  else
    normal_job(&g, dtype, path == PATH_AVX2, out, first, lo, hi, p0, p1);
}

/* Skip n words of g. */
INLINE void mt_skip(mt_t *g, int64_t n) {
  while (n > 0) {
    if (g->pos == N) {
      twist(g->s);
      g->pos = 0;
    }
    int64_t take = N - g->pos;
    if (take > n) take = n;
    g->pos += (int)take;
    n -= take;
  }
}

/* Runs of one fill into scattered places: run r draws the fill's elements [lo, hi) =
 * runs[3r], runs[3r+1] into element runs[3r+2] on of out. The state is at the first word of
 * element `start`; runs are sorted, and no run starts in a block of 16 (normal) that an
 * earlier one reached. Returns 0, or -1 - r for a run that breaks this. */
INLINE int64_t run_runs(int op, int dtype, int path, char *out, const int64_t *runs, int64_t k, const uint32_t *words,
                        int consumed, int64_t start, double p0, double p1) {
  mt_t g;
  memcpy(g.s, words, sizeof g.s);
  g.pos = consumed;
  const int64_t a = dtype == DT_F64 ? 2 : 1, size = dtype == DT_F64 ? 8 : dtype == DT_F32 ? 4 : 2;
  const int64_t block = op == OP_NORMAL ? 16 : 1;
  int64_t at = start;
  for (int64_t r = 0; r < k; r++) {
    const int64_t lo = runs[3 * r], hi = runs[3 * r + 1], dst = runs[3 * r + 2];
    const int64_t first = lo - lo % block;
    if (lo < 0 || hi < lo || first < at || dst < 0) return -1 - r;
    mt_skip(&g, a * (first - at));
    if (op == OP_UNIFORM) {
      uniform_job(&g, dtype, path == PATH_AVX2, out + dst * size, hi - lo, p0, p1);
      at = hi;
    } else {
      /* element `first` of the job's coordinates sits lo - first elements before out[dst] */
      void *base = (void *)((uintptr_t)out + (uintptr_t)((dst - (lo - first)) * size));
      normal_job(&g, dtype, path == PATH_AVX2, base, 0, lo - first, hi - first, p0, p1);
      at = first + (hi - first + 15) / 16 * 16;
    }
  }
  return 0;
}

static int64_t runs_generic(int op, int dtype, int path, char *out, const int64_t *runs, int64_t k,
                            const uint32_t *words, int consumed, int64_t start, double p0, double p1) {
  return run_runs(op, dtype, path, out, runs, k, words, consumed, start, p0, p1);
}

#ifdef FILLS_X86
__attribute__((target("avx2,fma"))) static int64_t runs_avx2(int op, int dtype, int path, char *out,
                                                             const int64_t *runs, int64_t k, const uint32_t *words,
                                                             int consumed, int64_t start, double p0, double p1) {
  return run_runs(op, dtype, path, out, runs, k, words, consumed, start, p0, p1);
}

__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,fma,prefer-vector-width=512"))) static int64_t
runs_avx512(int op, int dtype, int path, char *out, const int64_t *runs, int64_t k, const uint32_t *words,
            int consumed, int64_t start, double p0, double p1) {
  return run_runs(op, dtype, path, out, runs, k, words, consumed, start, p0, p1);
}
#endif

static void run_generic(int op, int dtype, int path, void *out, int64_t first, int64_t lo, int64_t hi,
                        const uint32_t *words, int consumed, double p0, double p1) {
  run(op, dtype, path, out, first, lo, hi, words, consumed, p0, p1);
}

#ifdef FILLS_X86
__attribute__((target("avx2,fma"))) static void run_avx2(int op, int dtype, int path, void *out, int64_t first,
                                                         int64_t lo, int64_t hi, const uint32_t *words,
                                                         int consumed, double p0, double p1) {
  run(op, dtype, path, out, first, lo, hi, words, consumed, p0, p1);
}

__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,fma,prefer-vector-width=512"))) static void
run_avx512(int op, int dtype, int path, void *out, int64_t first, int64_t lo, int64_t hi, const uint32_t *words,
           int consumed, double p0, double p1) {
  run(op, dtype, path, out, first, lo, hi, words, consumed, p0, p1);
}

static int has_avx512(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
#else
  return 0;
#endif
}
#endif

/* 1 if this CPU can run `path` (AVX2 and FMA for PATH_AVX2). */
int fxinit_fill_supported(int path) {
  if (path == PATH_DEFAULT) return 1;
#ifdef FILLS_X86
  __builtin_cpu_init();
  return path == PATH_AVX2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return 0;
#endif
}

/* Fill one range. `out` points at element 0 of the range's coordinates; the state (624
 * words, `consumed` of them used) is at the first word of the element `first` (uniform:
 * first == lo). Writes out[lo .. hi). Returns 0, or -1 for arguments it does not know. */
int fxinit_fill(int op, int dtype, int path, void *out, int64_t first, int64_t lo, int64_t hi,
                const uint32_t *words, int consumed, double p0, double p1) {
  if (op < 0 || op > 1 || dtype < 0 || dtype > 3 || consumed < 0 || consumed > N) return -1;
  if (lo < first || hi < lo || (op == OP_UNIFORM && first != lo)) return -1;
  if (!fxinit_fill_supported(path)) return -1;
#ifdef FILLS_X86
  if (use_avx512()) {
    run_avx512(op, dtype, path, out, first, lo, hi, words, consumed, p0, p1);
    return 0;
  }
  const char *isa = getenv("FXINIT_FILLS_ISA");
  if (fxinit_fill_supported(PATH_AVX2) && !(isa && strcmp(isa, "generic") == 0)) {
    run_avx2(op, dtype, path, out, first, lo, hi, words, consumed, p0, p1);
    return 0;
  }
#endif
  run_generic(op, dtype, path, out, first, lo, hi, words, consumed, p0, p1);
  return 0;
}

/* Fill runs (see run_runs) of one fill, from the state at the first word of element `start`. */
int64_t fxinit_fill_runs(int op, int dtype, int path, void *out, const int64_t *runs, int64_t k,
                         const uint32_t *words, int consumed, int64_t start, double p0, double p1) {
  if (op < 0 || op > 1 || dtype < 0 || dtype > 3 || consumed < 0 || consumed > N || k < 0) return -1;
  if (!fxinit_fill_supported(path)) return -1;
#ifdef FILLS_X86
  if (use_avx512()) return runs_avx512(op, dtype, path, out, runs, k, words, consumed, start, p0, p1);
  const char *isa = getenv("FXINIT_FILLS_ISA");
  if (fxinit_fill_supported(PATH_AVX2) && !(isa && strcmp(isa, "generic") == 0))
    return runs_avx2(op, dtype, path, out, runs, k, words, consumed, start, p0, p1);
#endif
  return runs_generic(op, dtype, path, out, runs, k, words, consumed, start, p0, p1);
}

/* Fill `count` whole tensors, one call for many small fills (a launch-bound model has
 * hundreds). Fill i is jobs[6i .. 6i+6) = {op, dtype, path, out, n, state} with `state` a
 * torch CPU generator state (get_state(): 32-bit words in 64-bit slots from byte 24, `left`
 * at byte 8) and params[2i], params[2i+1] its parameters; each must be one job of
 * fxinit_fill from element 0 (uniform, or normal of a multiple of 16 elements). Returns
 * how many it filled, in order: the first it could not fill stops it. */
int64_t fxinit_fill_batch(int64_t count, const int64_t *jobs, const double *params) {
  uint32_t words[N];
  for (int64_t i = 0; i < count; i++) {
    const int64_t *job = jobs + 6 * i;
    const uint8_t *raw = (const uint8_t *)(intptr_t)job[5];
    int32_t left;
    uint64_t slots[N];
    memcpy(&left, raw + 8, 4);
    memcpy(slots, raw + 24, sizeof slots);
    for (int w = 0; w < N; w++) words[w] = (uint32_t)slots[w];
    if ((job[0] == OP_NORMAL && (job[4] % 16 || job[4] < 16)) || job[4] < 0) return i;
    if (fxinit_fill((int)job[0], (int)job[1], (int)job[2], (void *)(intptr_t)job[3], 0, 0, job[4], words,
                    N + 1 - left, params[2 * i], params[2 * i + 1]) != 0)
      return i;
  }
  return count;
}
