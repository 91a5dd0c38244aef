/* The portable stream's uniform and normal fills as a CUDA kernel, compiled when first needed by
 * NVRTC (the runtime compiler that comes with torch's CUDA libraries; rng/portable_cuda.py): the
 * CUDA path that needs neither Triton nor a C++ compiler.
 *
 * Each function mirrors portable.c line for line (its comments say why each step is so), and is
 * compiled with --fmad=false: every float operation is one IEEE-754 operation rounded on its
 * own, as in the C kernel and the torch-op twin, so the bits are theirs. The square root is
 * __fsqrt_rn (correctly rounded). No header is included: NVRTC needs no CUDA toolkit here.
 *
 * The same file compiles as C on the CPU (FXINIT_ON_CPU, tests/test_portable_cuda.py), where a
 * loop over the grid runs the kernel's body: that is how CI checks its indexing and bits.
 *
 * One launch fills a table of rows (address, lo, hi, stream, scale, shift), as fxinit's Triton
 * kernel does: elements lo .. hi of the stream, each sample * scale + shift in float32 rounded
 * to the fill's dtype (dtype) and then to the output's (out_dtype), into the tensor at address
 * (elements lo .. hi at address[0 ..]); scale and shift are the bits of float32s. Block
 * (blockIdx.x, blockIdx.y) takes row blockIdx.x, its pairs from PAIRS * blockIdx.y on. */

#ifdef FXINIT_ON_CPU
#include <math.h>
#include <string.h>
#define DEVICE static inline
#define KERNEL
typedef struct { unsigned int x, y, z; } fxinit_dim3;
static __thread fxinit_dim3 blockIdx, threadIdx, blockDim; /* per thread: launches may run side by side */
static inline unsigned int __float_as_uint(float v) { unsigned int u; memcpy(&u, &v, 4); return u; }
static inline float __uint_as_float(unsigned int u) { float v; memcpy(&v, &u, 4); return v; }
static inline float __fsqrt_rn(float v) { return sqrtf(v); }
#else
#define DEVICE __device__ __forceinline__
#define KERNEL extern "C" __global__
#endif

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define THREADS 256 /* threads per block */
#define PER_THREAD 4 /* pairs per thread */
#define PAIRS (THREADS * PER_THREAD) /* pairs per block */

DEVICE u64 mix(u64 z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

DEVICE float neg2log24(int m) {
  int ix = (int)__float_as_uint((float)m) - 0x4B3504F3;
  float k = (float)(ix >> 23);
  float t = __uint_as_float(((u32)ix & 0x7FFFFFU) + 0x3F3504F3U) - 1.0f;
  float z = t * t, z2 = z * z;
  float p01 = t * 0x1.204376p-4f + -0x1.d7a370p-4f, p23 = t * 0x1.de4a34p-4f + -0x1.fcba9ep-4f;
  float p45 = t * 0x1.23d37ep-3f + -0x1.555ca0p-3f, p67 = t * 0x1.999d58p-3f + -0x1.fffff8p-3f;
  float p = ((p01 * z + p23) * z2 + (p45 * z + p67)) * t + 0x1.555554p-2f;
  float y = p * t * z;
  y = y + k * -0x1.bd0106p-13f;
  y = y + z * -0.5f;
  y = t + y;
  y = y + k * 0x1.63p-1f;
  return y * -2.0f;
}

DEVICE void cos_sin_2pi24(int j, float *cos_out, float *sin_out) {
  int t = (j + (1 << 21)) & 0xFFFFFF;
  u32 q = (u32)t >> 22;
  float x = (float)((t & 0x3FFFFF) - (1 << 21)) * 0x1.921fb6p-22f;
  float z = x * x, z2 = z * z;
  float c = ((z * 0x1.a01a02p-16f + -0x1.6c16c2p-10f) * z2 + (z * 0x1.555556p-5f + -0.5f)) * z + 1.0f;
  float s = ((z * 0x1.71de3ap-19f + -0x1.a01a02p-13f) * z2 + (z * 0x1.111112p-7f + -0x1.555556p-3f)) * z * x + x;
  u32 cb = __float_as_uint(c), sb = __float_as_uint(s), swap = (cb ^ sb) & (0U - (q & 1U));
  *cos_out = __uint_as_float(cb ^ swap ^ (((q + 1U) & 2U) << 30));
  *sin_out = __uint_as_float(sb ^ swap ^ ((q & 2U) << 30));
}

DEVICE u32 bf16_rne(float v) {
  u32 u = __float_as_uint(v);
  return (u + 0x7FFFU + ((u >> 16) & 1U)) >> 16;
}

/* v rounded to the fill's dtype (0 float32, 1 bfloat16), as a float32 */
DEVICE float rounded(int dtype, float v) { return dtype == 0 ? v : __uint_as_float(bf16_rne(v) << 16); }

DEVICE void put(char *base, int out_dtype, i64 at, float v) {
  if (out_dtype == 0) ((float *)base)[at] = v;
  else ((unsigned short *)base)[at] = (unsigned short)bf16_rne(v);
}

/* Pair `pair` of row `row` of the table (see the file's comment) */
DEVICE void fill_pair(const i64 *row, i64 pair, int kind, int dtype, int out_dtype) {
  char *base = (char *)row[0];
  i64 lo = row[1], hi = row[2], first = 2 * pair;
  if (first + 1 < lo || first >= hi) return;
  u64 w = mix((u64)(pair + 1) * GOLDEN + (u64)row[3]);
  int even = (int)((u32)w >> 8), odd = (int)(w >> 40);
  float a, b;
  if (kind == 0) {
    a = (float)even * 0x1p-24f;
    b = (float)odd * 0x1p-24f;
  } else {
    float r = __fsqrt_rn(neg2log24((1 << 24) - odd)), c, s;
    cos_sin_2pi24(even, &c, &s);
    a = r * c;
    b = r * s;
  }
  float scale = __uint_as_float((u32)row[4]), shift = __uint_as_float((u32)row[5]);
  a = rounded(dtype, a * scale + shift);
  b = rounded(dtype, b * scale + shift);
  if (first >= lo) put(base, out_dtype, first - lo, a);
  if (first + 1 < hi) put(base, out_dtype, first + 1 - lo, b);
}

KERNEL void fxinit_portable_fill_table(const i64 *table, int kind, int dtype, int out_dtype) {
  const i64 *row = table + 6 * (i64)blockIdx.x;
  i64 first = (row[1] >> 1) + (i64)blockIdx.y * PAIRS;
  for (int k = 0; k < PER_THREAD; k++)  /* neighbouring threads, neighbouring pairs */
    fill_pair(row, first + (i64)k * THREADS + threadIdx.x, kind, dtype, out_dtype);
}

#ifdef FXINIT_ON_CPU
/* The grid of a launch, block by block and thread by thread */
void fxinit_portable_fill_table_on_cpu(const i64 *table, int rows, int blocks, int kind, int dtype, int out_dtype) {
  blockDim.x = THREADS;
  for (blockIdx.x = 0; blockIdx.x < (unsigned)rows; blockIdx.x++)
    for (blockIdx.y = 0; blockIdx.y < (unsigned)blocks; blockIdx.y++)
      for (threadIdx.x = 0; threadIdx.x < THREADS; threadIdx.x++)
        fxinit_portable_fill_table(table, kind, dtype, out_dtype);
}
#endif
