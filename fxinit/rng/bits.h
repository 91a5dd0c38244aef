/* The bits of a float and the float of bits, shared by fills.c and portable.c (memcpy: no
 * aliasing rules broken, and compilers turn it into a register move). */
#ifndef FXINIT_BITS_H
#define FXINIT_BITS_H
#include <stdint.h>
#include <string.h>

static inline __attribute__((always_inline)) uint32_t bits_of(float v) {
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}

static inline __attribute__((always_inline)) float float_of(uint32_t u) {
  float v;
  memcpy(&v, &u, 4);
  return v;
}
#endif
