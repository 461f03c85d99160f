/* Exact top-k inner-product retrieval over an item index, in one pass: scores a block of
 * rows at a time into a small buffer and keeps only those above the running k-th best, so
 * neither the [N] score vector nor a separate top-k over it is ever written (serving's
 * retrieve step; see genrec.dense.fused.scan_top_k). Rows are int8 with a scale per row
 * (the int8 artifact: score = scale[n] * (q . rows[n]), the query in fp32) or fp32.
 * Order: higher score first, then lower row index, so the result is one well-defined list.
 * Built into the same libraries as hstu_tile.c (setup.py). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_status.h"
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* q . row for one row of D values, int8 (i8 = 1: widened to fp32) or fp32: a vector of
 * partial sums over the row, added up once at the end. One row is one or a few cache
 * lines: the scan is bound by reading the index, and a row costs a handful of vector
 * instructions. */
static inline __attribute__((always_inline)) float dot_row(const float *q, const void *row, int64_t D, const int i8) {
  const int8_t *r8 = (const int8_t *)row;
  const float *rf = (const float *)row;
  int64_t c = 0;
  float tail = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; c + 16 <= D; c += 16) {
    const __m512 x = i8 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(r8 + c))))
                        : _mm512_loadu_ps(rf + c);
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), x, acc);
  }
  for (; c < D; ++c) tail += q[c] * (i8 ? (float)r8[c] : rf[c]);
  return _mm512_reduce_add_ps(acc) + tail;
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; c + 8 <= D; c += 8) {
    const __m256 x = i8 ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(r8 + c))))
                        : _mm256_loadu_ps(rf + c);
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), x, acc);
  }
  for (; c < D; ++c) tail += q[c] * (i8 ? (float)r8[c] : rf[c]);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h) + tail;
#else
  for (; c < D; ++c) tail += q[c] * (i8 ? (float)r8[c] : rf[c]);
  return tail;
#endif
}

#if defined(__AVX512F__)
/* out[r] = q . row r for 16 rows of D values (D a multiple of 16), int8 or fp32 as dot_row.
 * A row's products go into its own vector exactly as in dot_row, and its 16 partial sums are
 * added in _mm512_reduce_add_ps's tree (lanes i + i+8, then + 4, + 2, + 1), four steps done for
 * all 16 rows at once on shuffled vectors: each row scores bit for bit as dot_row scores it,
 * whatever rows it is scanned with, where one horizontal sum per row cost as many
 * instructions as the products of a 64-wide row. */
static inline __attribute__((always_inline)) void dot_rows16(const float *q, const void *rows, int64_t D,
                                                             const int i8, float *out) {
  const int8_t *r8 = (const int8_t *)rows;
  const float *rf = (const float *)rows;
  __m512 a[16], z[8], w[4], v[2];
  for (int r = 0; r < 16; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += 16) {
    const __m512 qc = _mm512_loadu_ps(q + c);
    for (int r = 0; r < 16; ++r) {
      const __m512 x = i8 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(r8 + r * D + c))))
                          : _mm512_loadu_ps(rf + r * D + c);
      a[r] = _mm512_fmadd_ps(qc, x, a[r]);
    }
  }
  for (int p = 0; p < 8; ++p)  /* lanes i + i+8: row 2p in the low half, row 2p + 1 in the high */
    z[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int m = 0; m < 4; ++m)  /* + 4: rows 4m .. 4m + 3 in the four 128-bit blocks */
    w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * m], z[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z[2 * m], z[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int h = 0; h < 2; ++h)  /* + 2: block j holds rows 8h + j and 8h + 4 + j, two sums each */
    v[h] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * h], w[2 * h + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * h], w[2 * h + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  /* + 1: lane 4j + l holds row 4l + j; the permutation puts row r in lane r. The + 0 is
   * dot_row's (its tail). */
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i lane = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_permutexvar_ps(lane, s), _mm512_setzero_ps()));
}
#elif defined(__AVX2__) && defined(__FMA__)
/* dot_rows16 for AVX2: out[r] = q . row r for 8 rows of D values (D a multiple of 8), each
 * row's 8 partial sums added in dot_row's order (lanes i + i+4, then + 2, then + 1) for all 8
 * rows at once, so a row scores bit for bit as dot_row scores it. Besides the horizontal
 * sums, it takes dot_row's single chain of dependent FMAs off the critical path: eight rows'
 * chains run side by side. */
static inline __attribute__((always_inline)) void dot_rows8(const float *q, const void *rows, int64_t D,
                                                            const int i8, float *out) {
  const int8_t *r8 = (const int8_t *)rows;
  const float *rf = (const float *)rows;
  __m256 a[8], z[4], v[2];
  for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) {
    const __m256 qc = _mm256_loadu_ps(q + c);
    for (int r = 0; r < 8; ++r) {
      const __m256 x = i8 ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(r8 + r * D + c))))
                          : _mm256_loadu_ps(rf + r * D + c);
      a[r] = _mm256_fmadd_ps(qc, x, a[r]);
    }
  }
  for (int p = 0; p < 4; ++p)  /* lanes i + i+4: row 2p in the low half, row 2p + 1 in the high */
    z[p] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x31));
  for (int h = 0; h < 2; ++h)  /* + 2: half j holds rows 4h + j and 4h + 2 + j, two sums each */
    v[h] = _mm256_add_ps(_mm256_shuffle_ps(z[2 * h], z[2 * h + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(z[2 * h], z[2 * h + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  /* + 1: lane 4j + l holds row 2l + j; the permutation puts row r in lane r. The + 0 is
   * dot_row's (its tail). */
  const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m256i lane = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permutevar8x32_ps(s, lane), _mm256_setzero_ps()));
}
#endif

/* SCAN_W rows at a time (the vector width in floats, which D must be a multiple of): their
 * dot products, then buf[r] *= scale[r] for the SCAN_W rows. */
#if defined(__AVX512F__)
#define SCAN_W 16
#define DOT_ROWS dot_rows16
#define SCALE_ROWS(b, sc) _mm512_storeu_ps((b), _mm512_mul_ps(_mm512_loadu_ps(b), _mm512_loadu_ps(sc)))
#elif defined(__AVX2__) && defined(__FMA__)
#define SCAN_W 8
#define DOT_ROWS dot_rows8
#define SCALE_ROWS(b, sc) _mm256_storeu_ps((b), _mm256_mul_ps(_mm256_loadu_ps(b), _mm256_loadu_ps(sc)))
#endif

typedef struct { float s; int64_t i; } scored;

static inline int ahead(scored a, scored b) { return a.s > b.s || (a.s == b.s && a.i < b.i); }

/* Reorders c[0, n) so that its best k (by `ahead`) are c[0, k) and c[k - 1] is the k-th. */
static void select_best(scored *c, int64_t n, int64_t k) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const scored pivot = c[lo + (hi - lo) / 2];
    int64_t i = lo, j = hi;
    while (i <= j) {
      while (ahead(c[i], pivot)) ++i;
      while (ahead(pivot, c[j])) --j;
      if (i <= j) { const scored t = c[i]; c[i] = c[j]; c[j] = t; ++i; --j; }
    }
    if (k - 1 <= j) hi = j;
    else if (k - 1 >= i) lo = i;
    else break;
  }
}

static int by_rank(const void *a, const void *b) {
  const scored x = *(const scored *)a, y = *(const scored *)b;
  return ahead(x, y) ? -1 : (ahead(y, x) ? 1 : 0);
}

#define SCAN_BLOCK 2048
#define SCAN_AHEAD_BYTES 8192  /* prefetched ahead: the hardware prefetcher alone left the scan at half the memory's speed */

/* The best k rows n in [n0, n1) of one query qb (mask row mb, or NULL) into cand[0, nc),
 * returns nc <= k, unsorted. cand holds cap + SCAN_BLOCK entries, buf SCAN_BLOCK. */
static int64_t scan_range(const float *qb, int64_t D, const void *rows, int rows_int8, const float *scale,
                          const uint8_t *mb, int64_t n0, int64_t n1, int64_t k, int64_t cap,
                          scored *cand, float *buf) {
  int64_t nc = 0;
  int full = 0;   /* once k candidates are kept, only rows scoring above thr can enter */
  float thr = 0.f;
  for (int64_t b0 = n0; b0 < n1; b0 += SCAN_BLOCK) {
    const int64_t b1 = b0 + SCAN_BLOCK < n1 ? b0 + SCAN_BLOCK : n1;
    int64_t r = b0;  /* the next row to score */
    const int64_t row_bytes = rows_int8 ? D : D * (int64_t)sizeof(float);
    const char *base = (const char *)rows;
#if defined(SCAN_W)
    if (D % SCAN_W == 0)
      for (; r + SCAN_W <= b1; r += SCAN_W) {
        for (int64_t p = 0; p < SCAN_W * row_bytes; p += 64) __builtin_prefetch(base + r * row_bytes + SCAN_AHEAD_BYTES + p);
        DOT_ROWS(qb, base + r * row_bytes, D, rows_int8, buf + (r - b0));
        if (rows_int8) SCALE_ROWS(buf + (r - b0), scale + r);
      }
#endif
    for (; r < b1; ++r) {
      __builtin_prefetch(base + r * row_bytes + SCAN_AHEAD_BYTES);  /* past the end is harmless: a hint */
      buf[r - b0] = rows_int8 ? dot_row(qb, base + r * row_bytes, D, 1) * scale[r] : dot_row(qb, base + r * row_bytes, D, 0);
    }
    for (int64_t n = b0; n < b1; ++n) {
      const float s = buf[n - b0];
      if ((!full || s > thr) && (!mb || mb[n])) cand[nc++] = (scored){s, n};
    }
    if (nc >= cap) {  /* keep the best k; the k-th best is the new bar */
      select_best(cand, nc, k);
      nc = k;
      thr = cand[k - 1].s;
      full = 1;
    }
  }
  if (nc > k) select_best(cand, nc, k), nc = k;
  return nc;
}

/* Sorts c[0, nc) best first into out_s / out_i (one query's k slots), found = nc. */
static void emit(scored *c, int64_t nc, float *out_s, int64_t *out_i, int64_t *found) {
  qsort(c, (size_t)nc, sizeof(scored), by_rank);
  for (int64_t j = 0; j < nc; ++j) out_s[j] = c[j].s, out_i[j] = c[j].i;
  *found = nc;
}

/* For each of B queries q [B, D]: the best k rows n < N with mask[b * mask_stride + n] != 0
 * (mask NULL: every row) into out_s / out_i [B, k], best first; returns 0, or NO_MEMORY
 * when its scratch could not be allocated (the outputs are then undefined); writes
 * found[b] = how many (fewer than k only when fewer rows pass the mask). rows: int8 [N, D]
 * with scale [N] (rows_int8 = 1) or fp32 [N, D] (scale NULL).
 * With at least as many queries as threads, each thread takes whole queries; with fewer (a
 * lone request), the threads split each query's rows, keep their own best k, and one thread
 * merges them: `ahead` is a total order, so the result is the same either way. */
int scan_top_k(const float *q, int64_t B, int64_t D, const void *rows, int rows_int8, const float *scale,
                int64_t N, const uint8_t *mask, int64_t mask_stride, int64_t k, float *out_s, int64_t *out_i,
                int64_t *found, int64_t nthreads) {
  const int64_t cap = 4 * k > 4096 ? 4 * k : 4096;
  const int split = B < nthreads && N >= nthreads * (int64_t)SCAN_BLOCK;
  const int64_t T = split ? nthreads : 1;
  scored *merged = split ? malloc(sizeof(scored) * (size_t)(T * k)) : NULL;
  int64_t *kept = split ? calloc((size_t)T, sizeof(int64_t)) : NULL;
  if (split && (!merged || !kept)) {
    free(merged); free(kept);
    return NO_MEMORY;
  }
  int oom = 0;
#pragma omp parallel num_threads(nthreads)
  {
    scored *cand = malloc(sizeof(scored) * (size_t)(cap + SCAN_BLOCK));
    float *buf = malloc(sizeof(float) * SCAN_BLOCK);
    const int ok = cand && buf;
    FLAG_NO_MEMORY(ok)
    if (split) {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      for (int64_t b = 0; b < B; ++b) {
        const uint8_t *mb = mask ? mask + b * mask_stride : NULL;
        const int64_t per = (N + nt - 1) / nt, lo = t * per < N ? t * per : N, hi = lo + per < N ? lo + per : N;
        /* a thread without scratch keeps nothing but still meets both barriers */
        kept[t] = ok ? scan_range(q + b * D, D, rows, rows_int8, scale, mb, lo, hi, k, cap, cand, buf) : 0;
        if (kept[t]) memcpy(merged + t * k, cand, sizeof(scored) * (size_t)kept[t]);
#pragma omp barrier
#pragma omp single
        {
          int64_t nc = 0;
          for (int64_t u = 0; u < nt; ++u) {
            memmove(merged + nc, merged + u * k, sizeof(scored) * (size_t)kept[u]);
            nc += kept[u];
          }
          if (nc > k) select_best(merged, nc, k), nc = k;
          emit(merged, nc, out_s + b * k, out_i + b * k, found + b);
        }  /* the single's implicit barrier: merged is free for the next query */
      }
    } else {
#pragma omp for schedule(static)
      for (int64_t b = 0; b < B; ++b) {
        if (!ok) continue;
        const int64_t nc = scan_range(q + b * D, D, rows, rows_int8, scale, mask ? mask + b * mask_stride : NULL,
                                      0, N, k, cap, cand, buf);
        emit(cand, nc, out_s + b * k, out_i + b * k, found + b);
      }
    }
    free(cand); free(buf);
  }
  free(merged); free(kept);
  return oom ? NO_MEMORY : 0;
}
