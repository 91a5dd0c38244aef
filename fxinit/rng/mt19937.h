/* The MT19937 recurrence of torch's CPU generator, shared by mt19937.c (skipping ahead)
 * and fills.c (drawing): the state is 624 words, each block of draws twists it once. */
#ifndef FXINIT_MT19937_H
#define FXINIT_MT19937_H
#include <stdint.h>

#define N 624
#define M 397

static inline __attribute__((always_inline)) uint32_t mix(uint32_t u, uint32_t v) {
  uint32_t y = (u & 0x80000000U) | (v & 0x7fffffffU);
  return (y >> 1) ^ ((v & 1U) ? 0x9908b0dfU : 0U);
}

static inline __attribute__((always_inline)) void twist(uint32_t *restrict s) {
  int i;
  for (i = 0; i < N - M; i++) s[i] = s[i + M] ^ mix(s[i], s[i + 1]);
  for (; i < N - 1; i++) s[i] = s[i + M - N] ^ mix(s[i], s[i + 1]);
  s[N - 1] = s[M - 1] ^ mix(s[N - 1], s[0]);
}
#endif
