/* Advance an MT19937 state (the CPU generator of PyTorch) without producing output.
 *
 * Skipping draws only needs the recurrence, not the tempering. Two ways:
 *  - fxinit_mt_twist: t block twists; the loops vectorize, a fraction of a ns per draw;
 *  - fxinit_mt_jump: jump-ahead by polynomial arithmetic over GF(2), for skips of
 *    billions of draws: the state after m more words is q(T) applied to the state,
 *    where q = x^m mod p, p the characteristic polynomial of the generator (written
 *    below; Berlekamp-Massey on the generator's own output finds it again, which the
 *    tests check) and T the one-word step.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Wider vectors for the state XORs and twists where the CPU has them (chosen at load time). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(FXINIT_NO_CLONES)
#define FXINIT_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define FXINIT_CLONES
#endif

#include "mt19937.h"

#define DEG 19937
#define PW ((2 * DEG) / 64 + 2) /* words of a polynomial of degree < 2*DEG */

/* Apply t twists to the 624-word state s in place. */
FXINIT_CLONES void fxinit_mt_twist(uint32_t *s, uint64_t t) {
  while (t--) twist(s);
}

/* ---------------------------------------------------------------- polynomials over GF(2) */
static inline int getbit(const uint64_t *a, long i) { return (a[i >> 6] >> (i & 63)) & 1; }
static inline void flipbit(uint64_t *a, long i) { a[i >> 6] ^= (uint64_t)1 << (i & 63); }

static inline uint64_t bits_at(const uint64_t *a, long off) { /* 64 bits starting at bit off */
  long w = off >> 6;
  int r = off & 63;
  return r ? (a[w] >> r) | (a[w + 1] << (64 - r)) : a[w];
}

/* The characteristic polynomial of MT19937 is x^DEG plus these terms. It is a property of
 * the recurrence, the same for every seed: written here, as Berlekamp-Massey takes ~20 ms
 * (fxinit_mt_charpoly_matches recomputes it; the tests check that it agrees). */
static const int KNOWN_TERMS[] = {
    0, 1189, 1416, 1585, 1643, 1870, 2493, 2773, 3000, 3227, 3454, 3681,
    3908, 4135, 4362, 4753, 5661, 6337, 6569, 7129, 7477, 7525, 7583, 7752,
    7979, 8206, 9505, 9901, 9969, 10128, 10693, 10761, 10920, 11089, 11147, 11157,
    11215, 11321, 11374, 11384, 11485, 11611, 11712, 11717, 11838, 11881, 11944, 11997,
    12277, 12335, 12393, 12504, 12509, 12620, 12673, 12731, 12736, 12789, 12905, 12958,
    12963, 13137, 13185, 13190, 13243, 13301, 13412, 13528, 13533, 13639, 13697, 13760,
    13813, 13866, 14093, 14151, 14209, 14320, 14325, 14436, 14547, 14552, 14605, 14721,
    14774, 14779, 14953, 15001, 15006, 15059, 15117, 15228, 15344, 15349, 15455, 15513,
    15576, 15629, 15682, 15909, 15967, 16025, 16136, 16141, 16252, 16363, 16368, 16421,
    16537, 16590, 16595, 16817, 16822, 16875, 16933, 17044, 17160, 17271, 17329, 17445,
    17498, 17725, 17783, 17841, 17952, 18068, 18179, 18237, 18406, 18633, 18691, 18860,
    19087, 19314,
};
#define NKNOWN ((int)(sizeof KNOWN_TERMS / sizeof KNOWN_TERMS[0]))
/* reduce() needs every low term below DEG - 64: the largest is 19314. */

/* Berlekamp-Massey on the low bits of 2*DEG consecutive words: the minimal polynomial of
 * the sequence, which for MT19937 is its degree-19937 characteristic polynomial. Writes
 * its exponents below DEG to out (room for DEG) and returns how many, or -1. */
static int find_charpoly(int *out) {
  const long len = 2L * DEG;
  uint32_t s[N];
  uint32_t x = 5489U;
  for (int i = 0; i < N; i++) { s[i] = x; x = 1812433253U * (x ^ (x >> 30)) + (uint32_t)(i + 1); }
  /* seq reversed: bit j of rev holds s_{len-1-j} */
  uint64_t *rev = calloc(len / 64 + 4, 8), *C = calloc(PW + 2, 8), *B = calloc(PW + 2, 8), *T = calloc(PW + 2, 8);
  if (!rev || !C || !B || !T) return -1;
  long k = 0;
  while (k < len) {
    twist(s);
    for (int i = 0; i < N && k < len; i++, k++)
      if (s[i] & 1U) flipbit(rev, len - 1 - k);
  }
  C[0] = B[0] = 1;
  long L = 0, m = 1;
  for (long n = 0; n < len; n++) {
    long off = len - 1 - n; /* rev bits off.. hold s_n, s_{n-1}, ... */
    uint64_t acc = 0;
    for (long w = 0; w * 64 <= L; w++) {
      uint64_t c = C[w];
      if ((w + 1) * 64 > L + 1) c &= (L + 1 - w * 64) >= 64 ? ~0ULL : (((uint64_t)1 << ((L + 1) - w * 64)) - 1);
      acc ^= c & bits_at(rev, off + w * 64);
    }
    int d = __builtin_parityll(acc);
    if (!d) { m++; continue; }
    if (2 * L <= n) memcpy(T, C, (PW + 2) * 8);
    /* C ^= B << m */
    long ws = m >> 6; int bs = m & 63;
    for (long w = PW + 1; w >= ws; w--) {
      uint64_t v = B[w - ws] << bs;
      if (bs && w - ws - 1 >= 0) v |= B[w - ws - 1] >> (64 - bs);
      C[w] ^= v;
    }
    if (2 * L <= n) { L = n + 1 - L; memcpy(B, T, (PW + 2) * 8); m = 1; } else m++;
  }
  int n = 0;
  if (L == DEG) /* p(x) = x^L C(1/x) */
    for (long i = 0; i < DEG; i++)
      if (getbit(C, L - i)) out[n++] = (int)i;
  free(rev); free(C); free(B); free(T);
  return L == DEG ? n : -1;
}

/* 1 if Berlekamp-Massey on the generator's own output finds KNOWN_TERMS, else 0. */
int fxinit_mt_charpoly_matches(void) {
  int *found = malloc(sizeof(int) * DEG);
  if (!found) return 0;
  int n = find_charpoly(found);
  int same = n == NKNOWN && memcmp(found, KNOWN_TERMS, sizeof KNOWN_TERMS) == 0;
  free(found);
  return same;
}

static inline void xor_bits_at(uint64_t *a, long off, uint64_t v) { /* a[off .. off+64) ^= v */
  long w = off >> 6;
  int r = off & 63;
  a[w] ^= v << r;
  if (r) a[w + 1] ^= v >> (64 - r);
}

/* a (degree < 2*DEG-1) mod charpoly, in place, 64 coefficients at a time from the top:
 * x^i = x^(i-DEG) * (sum of the low terms), and every low term is below DEG - 64, so a
 * block of 64 high coefficients only lands strictly below itself. */
static void reduce(uint64_t *a) {
  for (long hi = 2L * DEG - 1; hi > DEG; ) {
    long lo = hi - 64 < DEG ? DEG : hi - 64; /* block [lo, hi) */
    int width = (int)(hi - lo);
    uint64_t block = bits_at(a, lo);
    if (width < 64) block &= ((uint64_t)1 << width) - 1;
    hi = lo;
    if (!block) continue;
    xor_bits_at(a, lo, block);
    for (int t = 0; t < NKNOWN; t++) xor_bits_at(a, lo - DEG + KNOWN_TERMS[t], block);
  }
}

static uint16_t spread8[256]; /* bit b of the byte moved to bit 2b */

static void square(uint64_t *a) { /* a = a^2 (spread the bits), unreduced */
  if (!spread8[255])
    for (int v = 0; v < 256; v++) {
      uint16_t r = 0;
      for (int b = 0; b < 8; b++) r |= (uint16_t)(((v >> b) & 1) << (2 * b));
      spread8[v] = r;
    }
  for (long w = PW / 2; w >= 0; w--) {
    uint64_t v = a[w], lo = 0, hi = 0;
    for (int k = 0; k < 4; k++) {
      lo |= (uint64_t)spread8[(v >> (8 * k)) & 255] << (16 * k);
      hi |= (uint64_t)spread8[(v >> (32 + 8 * k)) & 255] << (16 * k);
    }
    if (2 * w + 1 < PW) a[2 * w + 1] = hi;
    a[2 * w] = lo;
  }
}

/* out (DEG/64+1 words) = x^m mod charpoly. Returns 0. */
int fxinit_mt_xpow(uint64_t m, uint64_t *out) {
  uint64_t a[PW];
  memset(a, 0, sizeof a);
  a[0] = 1;
  for (int b = m ? 63 - __builtin_clzll(m) : -1; b >= 0; b--) {
    square(a);
    reduce(a);
    if ((m >> b) & 1) { /* a *= x */
      for (long w = PW - 1; w > 0; w--) a[w] = (a[w] << 1) | (a[w - 1] >> 63);
      a[0] <<= 1;
      reduce(a);
    }
  }
  memcpy(out, a, (DEG / 64 + 1) * 8);
  return 0;
}

/* The window s (624 consecutive words, first one first) moved m words ahead, where q =
 * x^m mod charpoly (from fxinit_mt_xpow). Only the low 31 bits of the first word of the
 * result may differ from the true words: the recurrence never reads them, so the next
 * twist of the result is exact.
 *
 * Horner's rule over q(T) s, WIN coefficients at a time (the sliding-window method of
 * Haramoto et al., 2008): a table of the 2^WIN states g(T) s for every g of degree < WIN
 * turns about DEG/2 XORs of a whole state into DEG/WIN of them plus 2^WIN to build it. */
#define WIN 6

FXINIT_CLONES void fxinit_mt_jump(uint32_t *s, const uint64_t *q) {
  uint32_t (*table)[N] = malloc(sizeof(uint32_t[N]) << WIN);
  uint32_t acc[N];
  if (!table) { /* plain Horner, one coefficient at a time */
    memset(acc, 0, sizeof acc);
    int idx = 0, i1 = 1, im = M;
    for (long j = DEG - 1; j >= 0; j--) {
      acc[idx] = acc[im] ^ mix(acc[idx], acc[i1]);
      idx = i1;
      i1 = i1 + 1 == N ? 0 : i1 + 1;
      im = im + 1 == N ? 0 : im + 1;
      if (getbit(q, j)) {
        int head = N - idx;
        for (int i = 0; i < head; i++) acc[idx + i] ^= s[i];
        for (int i = head; i < N; i++) acc[i - head] ^= s[i];
      }
    }
    for (int i = 0; i < N; i++) s[i] = acc[(idx + i) % N];
    return;
  }
  /* powers[b] = T^b s, the window moved b words ahead, first word first */
  uint32_t powers[WIN][N];
  memcpy(powers[0], s, sizeof powers[0]);
  for (int b = 1; b < WIN; b++) {
    memcpy(powers[b], powers[b - 1] + 1, sizeof(uint32_t) * (N - 1));
    powers[b][N - 1] = powers[b - 1][M] ^ mix(powers[b - 1][0], powers[b - 1][1]);
  }
  memset(table[0], 0, sizeof table[0]);
  for (int v = 1; v < (1 << WIN); v++) {
    int top = 31 - __builtin_clz((unsigned)v);
    const uint32_t *a = table[v ^ (1 << top)], *b = powers[top];
    for (int i = 0; i < N; i++) table[v][i] = a[i] ^ b[i];
  }
  memset(acc, 0, sizeof acc);
  int idx = 0, i1 = 1, im = M;
  const long chunks = (DEG + WIN - 1) / WIN;
  for (long k = chunks - 1; k >= 0; k--) {
    for (int step = 0; step < WIN; step++) { /* acc = T^WIN acc */
      acc[idx] = acc[im] ^ mix(acc[idx], acc[i1]);
      idx = i1;
      i1 = i1 + 1 == N ? 0 : i1 + 1;
      im = im + 1 == N ? 0 : im + 1;
    }
    unsigned v = 0;
    for (int b = 0; b < WIN; b++) {
      long j = k * WIN + b;
      if (j < DEG && getbit(q, j)) v |= 1U << b;
    }
    if (v) {
      const uint32_t *t = table[v];
      int head = N - idx;
      for (int i = 0; i < head; i++) acc[idx + i] ^= t[i];
      for (int i = head; i < N; i++) acc[i - head] ^= t[i];
    }
  }
  free(table);
  for (int i = 0; i < N; i++) s[i] = acc[(idx + i) % N];
}

/* Advance, in place, a torch CPU generator state (the bytes of get_state()) by `draws`
 * words, as fxinit/rng/mt19937.py's advance() does: the words are uint64 slots at byte 24,
 * `left` an int32 at byte 8, `next` a uint64 at byte 16. Returns the number of twists. */
uint64_t fxinit_mt_state_advance(uint8_t *raw, uint64_t draws) {
  int32_t left;
  memcpy(&left, raw + 8, 4);
  uint64_t consumed = (uint64_t)(N + 1 - left), total = consumed + draws, twists = 0;
  if (total > N) {
    uint64_t slots[N];
    uint32_t s[N];
    twists = (total - 1) / N;
    memcpy(slots, raw + 24, sizeof slots);
    for (int i = 0; i < N; i++) s[i] = (uint32_t)slots[i];
    fxinit_mt_twist(s, twists);
    for (int i = 0; i < N; i++) slots[i] = s[i];
    memcpy(raw + 24, slots, sizeof slots);
    consumed = total - twists * N;
  } else {
    consumed = total;
  }
  left = (int32_t)(N + 1 - consumed);
  uint64_t next = consumed % (N + 1);
  int32_t seeded = 1;
  memcpy(raw + 8, &left, 4);
  memcpy(raw + 12, &seeded, 4);
  memcpy(raw + 16, &next, 8);
  return twists;
}
