/* The portable stream's words turned into unit floats, for fxinit/rng/portable.py.
 * Element i of a stream is splitmix64(stream + (i + 1) * 0x9E3779B97F4A7C15). Only
 * integer work happens here, so the results equal the torch-op path bit for bit; the
 * distributions' float math stays in torch ops, shared by both paths.
 */
#include <stdint.h>

#define GOLDEN 0x9E3779B97F4A7C15ULL

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

/* Both 24-bit halves used by the float32 normal sampler, from one hash per element. */
void fxinit_portable_unit24x2(float *hi, float *lo, int64_t n, int64_t start, uint64_t stream) {
  for (int64_t k = 0; k < n; k++) {
    uint64_t w = word(stream, (uint64_t)(start + k));
    hi[k] = (float)((w >> 40) & 0xFFFFFFULL) * (1.0f / 16777216.0f);
    lo[k] = (float)((w >> 8) & 0xFFFFFFULL) * (1.0f / 16777216.0f);
  }
}
