/* HSTU attention on the CPU (see dense/kernels.py, _HSTUChunkedFn).
 *
 * fp32: hstu_attn_fwd / hstu_attn_bwd, the whole forward and the whole backward in one pass
 * over the query rows each, in blocks of rows that share each load of keys and values, no
 * [N, N] tile; they find time buckets themselves (runs over sorted histories,
 * visible_bias) and never read a precomputed index.
 * bf16: the fused elementwise part of one tile of the chunked path. A tile is queries [i0, i0 + bq) x keys [0, K) of G rows x H heads. The matmuls stay in
 * ATen (bf16 AMX / fp32 BLAS); this file does, in one pass over the tile,
 *   forward:  a = vis(i, j) ? SiLU(alpha s + ts_w[tidx] + pos_w[rel]) : 0
 *             (tidx = bucket of |qts[i] - ts[j]|: query time vs key time)
 *   backward: a as above, ds = vis ? da * SiLU'(x) : 0, and d ts_w / d pos_w sums.
 * Plain C + OpenMP, no torch headers, loaded through ctypes (compiles in about a second).
 * dtype flags: 0 = float32, 1 = bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#include <string.h>

#include "kernel_status.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* One vector of VW floats: 16 with AVX-512 (the build from hstu_tile_avx512.c, chosen at
 * load time on CPUs that have it), 8 with AVX2 + FMA. Keys are laid out in blocks of KB = VW
 * (fused.key_blocks asks hstu_key_block() for it), so KB scores are one vector of fused
 * multiply-adds over contiguous memory. VMASK(n) enables the first n < VW lanes of a tail. */
#if defined(__AVX512F__)
#define VEC 1
#define VW 16
typedef __m512 vf;
typedef __mmask16 vmask;
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, x) _mm512_storeu_ps((p), (x))
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VSET1(x) _mm512_set1_ps(x)
#define VADD(a, b) _mm512_add_ps((a), (b))
#define VZERO() _mm512_setzero_ps()
#define VMASK(n) ((__mmask16)((1u << (n)) - 1u))
#define VLOADM(p, m) _mm512_maskz_loadu_ps((m), (p))
#define VSTOREM(p, m, x) _mm512_mask_storeu_ps((p), (m), (x))
#elif defined(__AVX2__) && defined(__FMA__)
#define VEC 1
#define VW 8
typedef __m256 vf;
typedef __m256i vmask;
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, x) _mm256_storeu_ps((p), (x))
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VSET1(x) _mm256_set1_ps(x)
#define VADD(a, b) _mm256_add_ps((a), (b))
#define VZERO() _mm256_setzero_ps()
#define VMASK(n) _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
#define VLOADM(p, m) _mm256_maskload_ps((p), (m))
#define VSTOREM(p, m, x) _mm256_maskstore_ps((p), (m), (x))
#else
#define VEC 0
#define VW 8
#endif
#define KB VW

/* The key block width this library was built for (fused.key_blocks). */
int64_t hstu_key_block(void) { return KB; }

static inline float bf2f(uint16_t h) { uint32_t u = ((uint32_t)h) << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f2bf(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
  return (uint16_t)(u >> 16);
}
/* e^x for x in [-87, 80] (smaller x gives e^-87), inline so `omp simd` loops vectorize it
 * (libm's vector expf is a call per vector): x = n ln 2 + f with |f| <= ln 2 / 2 (ln 2 in two
 * parts), e^f by Cephes' polynomial (about 1 ulp), times 2^n built in the exponent bits. */
static inline float exp_small(float x) {
  x = fmaxf(x, -87.f);
  const float n = floorf(x * 1.44269504088896341f + 0.5f);
  const float f = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  const float e = p * f * f + f + 1.f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, 4);
  return e * scale;
}

/* The logistic sigmoid 1 / (1 + e^-x), finite for every x under fast-math. */
static inline float sigmoid(float x) { return 1.f / (1.f + exp_small(fminf(-x, 80.f))); }

static inline float ld(const void *p, int64_t k, int bf) { return bf ? bf2f(((const uint16_t *)p)[k]) : ((const float *)p)[k]; }
static inline void st(void *p, int64_t k, float v, int bf) { if (bf) ((uint16_t *)p)[k] = f2bf(v); else ((float *)p)[k] = v; }

typedef struct {
  int64_t G, H, bq, K, N, i0, P, NB;
  const int64_t *ts;     /* [G, N] timestamps, or NULL when there is no time bias */
  const int64_t *thr;    /* [NB]: thr[b - 1] = smallest |dt| whose bucket is >= b */
  const float *ts_w;     /* [NB + 1] or NULL */
  const float *pos_w;    /* [P] or NULL */
  const int64_t *pos;    /* [G, N] */
  const int64_t *hist;   /* [G] */
  float alpha;
  float inv_divisor;
  const uint8_t *tidx;   /* [G, N, N] precomputed time buckets (hstu_time_index), or NULL */
  int64_t nthreads;      /* torch.get_num_threads(): respect the process's thread budget */
  const int64_t *qts;    /* [G, N] query times of the time bias, or NULL: the same as ts. */
  const int64_t *len;    /* [G] row lengths, or NULL (all N): the one-pass kernels skip query
                          * rows past them (padding). fused.py TileArgs mirrors this struct
                          * field for field; new fields go last so earlier offsets never move. */
} tile_args;

static inline int64_t query_time(const tile_args *t, int64_t g, int64_t i) {
  return t->qts ? t->qts[g * t->N + i] : t->ts[g * t->N + i];
}

/* Time bucket of |ti - tj|: logf gives a guess, the integer thresholds correct it by one
 * step either way so the result equals the PyTorch reference exactly (see row_bias). */
static inline int time_bucket(const tile_args *t, int64_t ti, int64_t tj) {
  int64_t x = ti - tj;
  x = x < 0 ? -x : x;
  x = x < 1 ? 1 : x;
  int b = (int)(logf((float)x) * t->inv_divisor);
  b = b < 0 ? 0 : (b > t->NB ? (int)t->NB : b);
  b += (x >= t->thr[b + 1]);
  b -= (x < t->thr[b]);
  return b > t->NB ? (int)t->NB : b; /* |dt| = INT64_MAX reaches the sentinel thr[NB + 1] */
}

/* Length of the non-decreasing prefix of ts[0, n) (histories are sorted by time). */
static int64_t sorted_prefix(const int64_t *ts, int64_t n) {
  int64_t j = 1;
  while (j < n && ts[j] >= ts[j - 1]) ++j;
  return n < j ? n : j;
}

/* First j in [lo, hi) with ts[j] > x (strict = 1) or ts[j] >= x (strict = 0); ts sorted. */
static int64_t search_sorted(const int64_t *ts, int64_t lo, int64_t hi, int64_t x, int strict) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (strict ? ts[mid] <= x : ts[mid] < x) lo = mid + 1; else hi = mid;
  }
  return lo;
}

/* search_sorted's answer found from lo upwards in steps of 1, 2, 4, ... and then by
 * bisection of the last step: O(log d) for an answer d past lo, so the many short runs of
 * buckets near a row's diagonal cost a compare or two each instead of a search of the
 * whole row. */
static int64_t gallop(const int64_t *ts, int64_t lo, int64_t hi, int64_t x, int strict) {
  int64_t a = lo, d = 1;  /* every j < a fails the test */
  while (a + d - 1 < hi) {
    const int64_t j = a + d - 1;
    if (strict ? ts[j] > x : ts[j] >= x) return search_sorted(ts, a, j + 1, x, strict);
    a = j + 1;
    d <<= 1;
  }
  return search_sorted(ts, a, hi, x, strict);
}

/* Buckets of |ti - ts[j]| over a sorted ts[0, m) as runs: run k is [start[k], start[k + 1])
 * with bucket[k]; returns the number of runs (start[runs] = m). |ti - ts[j]| falls, then
 * rises, so each run's end is a binary search for the next threshold instead of a logarithm
 * per pair: a row of N keys costs O(buckets log N). At most 2 (NB + 1) runs. */
static int64_t time_runs(const tile_args *t, int64_t ti, const int64_t *ts, int64_t m, int64_t *start,
                         int32_t *bucket) {
  int64_t runs = 0;
  /* ts[j] <= ti before p, > ti from p; a causal row's keys all come before its query */
  const int64_t p = m == 0 || ts[m - 1] <= ti ? m : search_sorted(ts, 0, m, ti, 1);
  for (int64_t j = 0; j < p;) {  /* dt = ti - ts[j] >= 0, non-increasing */
    const int b = time_bucket(t, ti, ts[j]);
    /* the run ends where dt < thr[b] (thr[b] <= dt here, so ti - thr[b] cannot overflow) */
    const int64_t e = b == 0 ? p : gallop(ts, j + 1, p, ti - t->thr[b], 1);
    start[runs] = j; bucket[runs++] = b;
    j = e;
  }
  for (int64_t j = p; j < m;) {  /* dt = ts[j] - ti > 0, non-decreasing */
    const int b = time_bucket(t, ti, ts[j]);
    const int64_t next = t->thr[b + 1];  /* INT64_MAX past the last reachable bucket */
    const int64_t e = (b == t->NB || (ti > 0 && next > INT64_MAX - ti)) ? m : gallop(ts, j + 1, m, ti + next, 0);
    start[runs] = j; bucket[runs++] = b;
    j = e;
  }
  start[runs] = m;
  return runs;
}

/* out[j] = time_bucket(ti, ts[j]) for j in [0, n), ts sorted over [0, sorted_n) (runs there). */
static void time_bucket_row(const tile_args *t, int64_t ti, const int64_t *ts, int64_t n, int64_t sorted_n,
                            int32_t *out, int64_t *start, int32_t *bucket) {
  const int64_t m = sorted_n < n ? sorted_n : n;
  const int64_t runs = time_runs(t, ti, ts, m, start, bucket);
  for (int64_t k = 0; k < runs; ++k)
    for (int64_t j = start[k]; j < start[k + 1]; ++j) out[j] = bucket[k];
#pragma omp simd
  for (int64_t j = m; j < n; ++j) out[j] = time_bucket(t, ti, ts[j]);
}

/* Per-thread scratch of the bias of one query row's visible keys [j0, j0 + n) (see
 * visible_bias); indices of keys in it (run starts, trow, rrow) are relative to j0. */
typedef struct {
  int64_t j0, n, m, runs, pi, linear;
  int64_t *start;   /* [2 NB + 3] run starts */
  int32_t *bucket;  /* [2 NB + 2] run buckets */
  int32_t *trow;    /* time bucket per key past the sorted prefix */
  int32_t *rrow;    /* position index per key where positions are not 0, 1, 2, ... */
} row_plan;

static row_plan plan_alloc(const tile_args *t, int64_t K) {
  row_plan rp = {0};
  rp.start = malloc(sizeof(int64_t) * (size_t)(2 * t->NB + 4));
  rp.bucket = malloc(sizeof(int32_t) * (size_t)(2 * t->NB + 4));
  rp.trow = malloc(sizeof(int32_t) * (size_t)(K + KB));
  rp.rrow = malloc(sizeof(int32_t) * (size_t)(K + KB));
  return rp;
}
static int plan_ok(const row_plan *rp) { return rp->start && rp->bucket && rp->trow && rp->rrow; }
static void plan_free(row_plan *rp) { free(rp->start); free(rp->bucket); free(rp->trow); free(rp->rrow); }

/* Keys j in [j0, j1) of a row whose positions are 0, 1, 2, ...: r = pi - j clamped to
 * [0, P - 1] is P - 1 for j < lo, pi - j for lo <= j < hi and 0 from hi on. */
static inline void linear_span(int64_t pi, int64_t P, int64_t j0, int64_t j1, int64_t *lo, int64_t *hi) {
  int64_t a = pi - P + 1, b = pi + 1;
  a = a < j0 ? j0 : (a > j1 ? j1 : a);
  b = b < a ? a : (b > j1 ? j1 : b);
  *lo = a, *hi = b;
}

/* brow[j - j0] = rab of (query i, key j) for the visible keys j in [j0, j1) of row g, shared
 * by the heads. Where the keys' positions are 0, 1, 2, ... (lin_n: how many of row g's are)
 * the position bias is a reversed slice of pos_w; where its times are sorted (sorted_n) the
 * time bias is a run of equal values per bucket: no gather per pair in either case. */
static void visible_bias(const tile_args *t, int64_t g, int64_t i, int64_t j0, int64_t j1, int64_t sorted_n,
                         int64_t lin_n, float *brow, row_plan *rp) {
  const int64_t N = t->N, P = t->P, n = j1 - j0;
  rp->j0 = j0;
  rp->n = n;
  rp->linear = j1 <= lin_n;
  rp->pi = t->pos[g * N + i];
  if (!t->pos_w) {
    for (int64_t j = 0; j < n; ++j) brow[j] = 0.f;
  } else if (rp->linear) {
    const int64_t pi = rp->pi;
    int64_t lo, hi;
    linear_span(pi, P, j0, j1, &lo, &hi);
    for (int64_t j = j0; j < lo; ++j) brow[j - j0] = t->pos_w[P - 1];
    for (int64_t j = lo; j < hi; ++j) brow[j - j0] = t->pos_w[pi - j];
    for (int64_t j = hi; j < j1; ++j) brow[j - j0] = t->pos_w[0];
  } else {
    const int64_t *pos = t->pos + g * N;
    for (int64_t j = j0; j < j1; ++j) {
      int64_t r = rp->pi - pos[j];
      r = r < 0 ? 0 : (r > P - 1 ? P - 1 : r);
      rp->rrow[j - j0] = (int32_t)r;
      brow[j - j0] = t->pos_w[r];
    }
  }
  rp->m = rp->runs = 0;
  if (!t->ts) return;
  if (t->tidx) {  /* buckets found once per tower call (hstu_time_index): a gather per key */
    const uint8_t *tb = t->tidx + (g * N + i) * N;
    for (int64_t j = j0; j < j1; ++j) {
      rp->trow[j - j0] = tb[j];
      brow[j - j0] += t->ts_w[tb[j]];
    }
    return;
  }
  const int64_t *ts = t->ts + g * N, ti = query_time(t, g, i);
  rp->m = sorted_n < j1 ? sorted_n - j0 : n;
  rp->m = rp->m < 0 ? 0 : rp->m;
  rp->runs = time_runs(t, ti, ts + j0, rp->m, rp->start, rp->bucket);
  for (int64_t k = 0; k < rp->runs; ++k) {
    const float w = t->ts_w[rp->bucket[k]];
    for (int64_t j = rp->start[k]; j < rp->start[k + 1]; ++j) brow[j] += w;
  }
  for (int64_t j = rp->m; j < n; ++j) {
    const int b = time_bucket(t, ti, ts[j0 + j]);
    rp->trow[j] = b;
    brow[j] += t->ts_w[b];
  }
}

/* The bias gradients of one row's keys in rp: lts[bucket] / lpos[r] += sum of drow over
 * their pairs (drow indexed like brow, relative to rp->j0). */
static void visible_bias_grad(const tile_args *t, const row_plan *rp, const float *drow, double *lts,
                              double *lpos) {
  const int64_t n = rp->n, P = t->P, j0 = rp->j0, j1 = j0 + n;
  if (lts) {
    for (int64_t k = 0; k < rp->runs; ++k) {
      double acc = 0.0;
      for (int64_t j = rp->start[k]; j < rp->start[k + 1]; ++j) acc += drow[j];
      lts[rp->bucket[k]] += acc;
    }
    for (int64_t j = rp->m; j < n; ++j) lts[rp->trow[j]] += drow[j];
  }
  if (!lpos) return;
  if (rp->linear) {
    const int64_t pi = rp->pi;
    int64_t lo, hi;
    linear_span(pi, P, j0, j1, &lo, &hi);
    double far = 0.0, ahead = 0.0;
    for (int64_t j = j0; j < lo; ++j) far += drow[j - j0];
    for (int64_t j = lo; j < hi; ++j) lpos[pi - j] += drow[j - j0];
    for (int64_t j = hi; j < j1; ++j) ahead += drow[j - j0];
    lpos[P - 1] += far;
    lpos[0] += ahead;
  } else {
    for (int64_t j = 0; j < n; ++j) lpos[rp->rrow[j]] += drow[j];
  }
}

/* Per (row, query) bias over all keys, shared by the heads: brow = rab, mrow = 0/1 mask,
 * rrow / trow = position and time bucket indices (for the bias gradients).
 * The time bucket matches the PyTorch reference exactly: logf gives a guess and the integer
 * thresholds thr[b] = smallest |dt| of bucket >= b (thr[0] = 0, thr[NB + 1] = INT64_MAX,
 * computed in Python with the reference formula) correct it by one step either way. */
static void row_bias(const tile_args *t, int64_t g, int64_t i, float *brow, float *mrow,
                     int32_t *rrow, int32_t *trow) {
  /* keys after the query are always masked (causal): only j <= i is looked at */
  const int64_t K = t->K < i + 1 ? t->K : i + 1, N = t->N, h = t->hist[g];
  const int64_t *pos = t->pos + g * N;
  for (int64_t j = 0; j < K; ++j) {
    int vis = (j <= i) & ((j < h) | (j == i));
    mrow[j] = vis ? 1.f : 0.f;
    brow[j] = 0.f;
  }
  if (t->pos_w) {
    const int64_t pi = pos[i];
#pragma omp simd
    for (int64_t j = 0; j < K; ++j) {
      int64_t r = pi - pos[j];
      r = r < 0 ? 0 : (r > t->P - 1 ? t->P - 1 : r);
      rrow[j] = (int32_t)r;
      brow[j] += t->pos_w[r];
    }
  }
  if (t->ts && t->tidx) {
    const uint8_t *tb = t->tidx + (g * N + i) * N;
#pragma omp simd
    for (int64_t j = 0; j < K; ++j) {
      trow[j] = tb[j];
      brow[j] += t->ts_w[tb[j]];
    }
  } else if (t->ts) {
    const int64_t *ts = t->ts + g * N;
    const int64_t ti = query_time(t, g, i);
#pragma omp simd
    for (int64_t j = 0; j < K; ++j) {
      const int b = time_bucket(t, ti, ts[j]);
      trow[j] = b;
      brow[j] += t->ts_w[b];
    }
  }
}

#define ROW_BUFFERS                                                   \
  float *brow = malloc(sizeof(float) * (size_t)(K + 1));              \
  float *mrow = malloc(sizeof(float) * (size_t)(K + 1));              \
  float *drow = malloc(sizeof(float) * (size_t)(K + 1));              \
  float *xrow = malloc(sizeof(float) * (size_t)(K + 1));              \
  int32_t *rrow = malloc(sizeof(int32_t) * (size_t)(K + 1));          \
  int32_t *trow = malloc(sizeof(int32_t) * (size_t)(K + 1));          \
  const int rows_ok = brow && mrow && drow && xrow && rrow && trow;
#define FREE_ROW_BUFFERS free(brow); free(mrow); free(drow); free(xrow); free(rrow); free(trow);

static inline void load_row(const void *p, int64_t base, int bf, float *out, int64_t K) {
  if (bf) { const uint16_t *q = (const uint16_t *)p + base; for (int64_t j = 0; j < K; ++j) out[j] = bf2f(q[j]); }
  else memcpy(out, (const float *)p + base, sizeof(float) * (size_t)K);
}
static inline void store_row(void *p, int64_t base, int bf, const float *in, int64_t K) {
  if (bf) { uint16_t *q = (uint16_t *)p + base; for (int64_t j = 0; j < K; ++j) q[j] = f2bf(in[j]); }
  else memcpy((float *)p + base, in, sizeof(float) * (size_t)K);
}

int hstu_tile_fwd(const tile_args *t, const void *s, int s_bf, void *a, int a_bf) {
  const int64_t K = t->K;
  const float alpha = t->alpha;
  int oom = 0;
#pragma omp parallel num_threads(t->nthreads)
  {
    ROW_BUFFERS
    FLAG_NO_MEMORY(rows_ok)
#pragma omp for collapse(2) schedule(static)
    for (int64_t g = 0; g < t->G; ++g)
      for (int64_t r = 0; r < t->bq; ++r) {
        if (!rows_ok) continue;
        const int64_t i = t->i0 + r, Kc = K < i + 1 ? K : i + 1;
        row_bias(t, g, i, brow, mrow, rrow, trow);
        for (int64_t j = Kc; j < K; ++j) xrow[j] = 0.f;
        for (int64_t hh = 0; hh < t->H; ++hh) {
          int64_t base = ((g * t->H + hh) * t->bq + r) * K;
          load_row(s, base, s_bf, xrow, Kc);
#pragma omp simd
          for (int64_t j = 0; j < Kc; ++j) {
            float x = alpha * xrow[j] + brow[j];
            xrow[j] = mrow[j] * (x * sigmoid(x));
          }
          store_row(a, base, a_bf, xrow, K);
        }
      }
    FREE_ROW_BUFFERS
  }
  return oom ? NO_MEMORY : 0;
}

/* Candidate scoring against a cached history (dense/tower.py, _score_micro_batch): scores
 * s [R, L] (fp32 or bf16) become SiLU(s + bias) in place, row r adding bias row
 * r / rows_per_bias of bias [R / rows_per_bias, L] (fp32), or nothing when bias is NULL.
 * One pass instead of ATen's add and SiLU (two passes; bf16 ones convert every element twice). */
void hstu_bias_silu(int64_t R, int64_t L, int64_t rows_per_bias, void *s, int s_bf, const float *bias,
                    int64_t nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
  for (int64_t r = 0; r < R; ++r) {
    const float *b = bias ? bias + (r / rows_per_bias) * L : NULL;
    if (s_bf) {
      uint16_t *row = (uint16_t *)s + r * L;
      if (b) {
#pragma omp simd
        for (int64_t j = 0; j < L; ++j) { const float x = bf2f(row[j]) + b[j]; row[j] = f2bf(x * sigmoid(x)); }
      } else {
#pragma omp simd
        for (int64_t j = 0; j < L; ++j) { const float x = bf2f(row[j]); row[j] = f2bf(x * sigmoid(x)); }
      }
    } else {
      float *row = (float *)s + r * L;
      if (b) {
#pragma omp simd
        for (int64_t j = 0; j < L; ++j) { const float x = row[j] + b[j]; row[j] = x * sigmoid(x); }
      } else {
#pragma omp simd
        for (int64_t j = 0; j < L; ++j) { const float x = row[j]; row[j] = x * sigmoid(x); }
      }
    }
  }
}

/* d_ts / d_pos: float64 accumulators [NB + 1] / [P], added to (not overwritten). */
int hstu_tile_bwd(const tile_args *t, const void *s, int s_bf, const void *da, int da_bf,
                   void *a, int a_bf, void *ds, int ds_bf, double *d_ts, double *d_pos) {
  const int64_t K = t->K;
  const float alpha = t->alpha;
  /* Per-thread partial sums of the bias gradients, added up in thread order after the
   * parallel region: a reduction in arrival order (omp critical) would make the result
   * depend on thread timing, and resumed runs must repeat the same bits. */
  const int nthreads = t->nthreads;
  const size_t nts = (size_t)t->NB + 1, npos = (size_t)t->P;
  double *all_ts = t->ts ? calloc(nts * (size_t)nthreads, sizeof(double)) : NULL;
  double *all_pos = t->pos_w ? calloc(npos * (size_t)nthreads, sizeof(double)) : NULL;
  if ((t->ts && !all_ts) || (t->pos_w && !all_pos)) {
    free(all_ts); free(all_pos);
    return NO_MEMORY;
  }
  int oom = 0;
#pragma omp parallel num_threads(nthreads)
  {
    ROW_BUFFERS
    float *grow = malloc(sizeof(float) * (size_t)(K + 1));
    const int ok = rows_ok && grow;
    FLAG_NO_MEMORY(ok)
    const int tid = omp_get_thread_num();
    double *lts = all_ts ? all_ts + nts * (size_t)tid : NULL;
    double *lpos = all_pos ? all_pos + npos * (size_t)tid : NULL;
#pragma omp for collapse(2) schedule(static)
    for (int64_t g = 0; g < t->G; ++g)
      for (int64_t r = 0; r < t->bq; ++r) {
        if (!ok) continue;
        const int64_t i = t->i0 + r, Kc = K < i + 1 ? K : i + 1;
        row_bias(t, g, i, brow, mrow, rrow, trow);
        for (int64_t j = 0; j < K; ++j) drow[j] = 0.f;
        for (int64_t hh = 0; hh < t->H; ++hh) {
          int64_t base = ((g * t->H + hh) * t->bq + r) * K;
          load_row(s, base, s_bf, xrow, Kc);
          load_row(da, base, da_bf, grow, Kc);
          for (int64_t j = Kc; j < K; ++j) xrow[j] = grow[j] = 0.f;
#pragma omp simd
          for (int64_t j = 0; j < Kc; ++j) {
            float x = alpha * xrow[j] + brow[j];
            float sg = sigmoid(x);
            float m = mrow[j];
            float d = m * grow[j] * sg * (1.f + x * (1.f - sg));
            xrow[j] = m * x * sg;
            grow[j] = d;
            drow[j] += d;
          }
          store_row(a, base, a_bf, xrow, K);
          store_row(ds, base, ds_bf, grow, K);
        }
        if (lts) for (int64_t j = 0; j < Kc; ++j) lts[trow[j]] += drow[j];
        if (lpos) for (int64_t j = 0; j < Kc; ++j) lpos[rrow[j]] += drow[j];
      }
    free(grow);
    FREE_ROW_BUFFERS
  }
  if (!oom)
    for (int th = 0; th < nthreads; ++th) {
      if (all_ts) for (size_t b = 0; b < nts; ++b) d_ts[b] += all_ts[nts * (size_t)th + b];
      if (all_pos) for (size_t b = 0; b < npos; ++b) d_pos[b] += all_pos[npos * (size_t)th + b];
    }
  free(all_ts); free(all_pos);
  return oom ? NO_MEMORY : 0;
}

/* Time bucket of every (query, key) pair of G rows of N tokens, computed once per tower call
 * and shared by all layers and by forward and backward (1 byte per pair). */
int hstu_time_index(const tile_args *t, uint8_t *out) {
  const int64_t N = t->N;
  int oom = 0;
#pragma omp parallel num_threads(t->nthreads)
  {
    int32_t *row = malloc(sizeof(int32_t) * (size_t)(N + 1));
    int64_t *start = malloc(sizeof(int64_t) * (size_t)(2 * t->NB + 4));
    int32_t *bucket = malloc(sizeof(int32_t) * (size_t)(2 * t->NB + 4));
    const int ok = row && start && bucket;
    FLAG_NO_MEMORY(ok)
#pragma omp for schedule(static)
    for (int64_t g = 0; g < t->G; ++g) {
      if (!ok) continue;
      const int64_t *ts = t->ts + g * N;
      const int64_t sorted_n = sorted_prefix(ts, N);
      for (int64_t i = 0; i < N; ++i) {
        time_bucket_row(t, query_time(t, g, i), ts, N, sorted_n, row, start, bucket);
        uint8_t *o = out + (g * N + i) * N;
        for (int64_t j = 0; j < N; ++j) o[j] = (uint8_t)row[j];
      }
    }
    free(row); free(start); free(bucket);
  }
  return oom ? NO_MEMORY : 0;
}

/* Bias of one visible (query i, key j) pair, for the one key outside a row's visible prefix
 * (a candidate's own key): the same sums as visible_bias. */
static float pair_bias(const tile_args *t, int64_t g, int64_t i, int64_t j) {
  const int64_t N = t->N;
  float b = 0.f;
  if (t->pos_w) {
    int64_t r = t->pos[g * N + i] - t->pos[g * N + j];
    r = r < 0 ? 0 : (r > t->P - 1 ? t->P - 1 : r);
    b += t->pos_w[r];
  }
  if (t->ts) b += t->ts_w[time_bucket(t, query_time(t, g, i), t->ts[g * N + j])];
  return b;
}

/* Per row g, over its first K keys: how many have sorted times (sorted_n) and how many have
 * positions 0, 1, 2, ... (lin_n); visible_bias takes its fast paths within them. */
static void row_extents(const tile_args *t, int64_t K, int64_t *sorted_n, int64_t *lin_n) {
  for (int64_t g = 0; g < t->G; ++g) {
    sorted_n[g] = t->ts ? sorted_prefix(t->ts + g * t->N, K) : 0;
    const int64_t *pos = t->pos + g * t->N;
    int64_t j = 0;
    while (j < K && pos[j] == j) ++j;
    lin_n[g] = j;
  }
}

/* s[r][j] = b[r][j] + sum_c qa[r][c] k[j][c] for r < R <= ROWS query rows (qa rows `qs`
 * apart, b / s rows `bs` apart) and j < nb (a multiple of KB), keys in blocks of KB:
 * kb[(j / KB) * KB * dq + c * KB + j % KB]. A block of keys is loaded once for all R rows, so
 * keys stream from cache R times less often than row by row (that stream bounds the
 * one-row loop at long lengths). Each (row, key) sum runs over c in order from b, the same
 * whatever R is: a row's scores do not depend on the rows beside it. */
#if VEC && VW == 16
#define ROWS 8  /* 2 ROWS accumulators + 2 key vectors of the 32 registers */
#else
#define ROWS 4  /* of 16 */
#endif
static inline __attribute__((always_inline)) void scores_rows_r(const float *kb, const float *qa, int64_t qs,
                                                                const float *b, float *s, int64_t bs, int64_t nb,
                                                                int64_t dq, const int R) {
  int64_t jb = 0;
#if VEC
  for (; jb + 2 * KB <= nb; jb += 2 * KB) {  /* two key blocks x R rows: 2 R independent FMA chains */
    const float *k0 = kb + jb * dq, *k1 = k0 + KB * dq;
    vf a[ROWS], e[ROWS];
    for (int r = 0; r < R; ++r) a[r] = VLOAD(b + r * bs + jb), e[r] = VLOAD(b + r * bs + jb + KB);
    for (int64_t c = 0; c < dq; ++c) {
      const vf x0 = VLOAD(k0 + c * KB), x1 = VLOAD(k1 + c * KB);
      for (int r = 0; r < R; ++r) {
        const vf w = VSET1(qa[r * qs + c]);
        a[r] = VFMA(w, x0, a[r]);
        e[r] = VFMA(w, x1, e[r]);
      }
    }
    for (int r = 0; r < R; ++r) VSTORE(s + r * bs + jb, a[r]), VSTORE(s + r * bs + jb + KB, e[r]);
  }
  for (; jb < nb; jb += KB) {
    const float *k0 = kb + jb * dq;
    vf a[ROWS];
    for (int r = 0; r < R; ++r) a[r] = VLOAD(b + r * bs + jb);
    for (int64_t c = 0; c < dq; ++c) {
      const vf x0 = VLOAD(k0 + c * KB);
      for (int r = 0; r < R; ++r) a[r] = VFMA(VSET1(qa[r * qs + c]), x0, a[r]);
    }
    for (int r = 0; r < R; ++r) VSTORE(s + r * bs + jb, a[r]);
  }
#else
  for (; jb < nb; jb += KB)
    for (int r = 0; r < R; ++r) {
      const float *blk = kb + jb * dq;
      float *sr = s + r * bs + jb;
      for (int l = 0; l < KB; ++l) sr[l] = b[r * bs + jb + l];
      for (int64_t c = 0; c < dq; ++c)
        for (int l = 0; l < KB; ++l) sr[l] = fmaf(qa[r * qs + c], blk[c * KB + l], sr[l]);
    }
#endif
}

static inline void scores_rows(const float *kb, const float *qa, int64_t qs, const float *b, float *s,
                               int64_t bs, int64_t nb, int64_t dq, int64_t R) {
  if (R == ROWS) scores_rows_r(kb, qa, qs, b, s, bs, nb, dq, ROWS);  /* unrolled for the common case */
  else scores_rows_r(kb, qa, qs, b, s, bs, nb, dq, (int)R);
}

#if VEC
/* o[r][c0 + c] = sum_{j < n} a[r][j] v[j][c0 + c] for c < CH VW (CH = 1 or 2 vectors of
 * columns; masked: one vector, its lanes from m) and r < R <= ROWS rows: each value row is
 * loaded once for all R rows, and the R CH sums are independent chains. */
static inline __attribute__((always_inline)) void wsum_cols(const float *a, int64_t as, const float *v, int64_t n,
                                                            int64_t dv, float *o, int64_t os, const int R,
                                                            int64_t c0, const int CH, const int masked, vmask m) {
  vf s0[ROWS], s1[ROWS];
  for (int r = 0; r < R; ++r) s0[r] = s1[r] = VZERO();
  for (int64_t j = 0; j < n; ++j) {
    const float *vj = v + j * dv + c0;
    const vf v0 = masked ? VLOADM(vj, m) : VLOAD(vj), v1 = CH == 2 ? VLOAD(vj + VW) : VZERO();
    for (int r = 0; r < R; ++r) {
      const vf w = VSET1(a[r * as + j]);
      s0[r] = VFMA(w, v0, s0[r]);
      if (CH == 2) s1[r] = VFMA(w, v1, s1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (masked) VSTOREM(o + r * os + c0, m, s0[r]);
    else VSTORE(o + r * os + c0, s0[r]);
    if (CH == 2) VSTORE(o + r * os + c0 + VW, s1[r]);
  }
}

#endif

/* o[r][c] = sum_{j < n} a[r][j] v[j][c] for r < R <= ROWS rows (a rows `as` apart, o rows
 * `os` apart; a[r][j] = 0 where row r does not see key j, which adds exact zeros), v [n, dv]
 * row-major, two vectors of columns per pass over the values. Each sum runs over j in
 * order, the same whatever R, n and the column chunking are. */
static inline __attribute__((always_inline)) void wsum_rows_r(const float *a, int64_t as, const float *v, int64_t n,
                                                              int64_t dv, float *o, int64_t os, const int R) {
#if VEC
  int64_t c0 = 0;
  const vmask none = VMASK(0);
  for (; c0 + 2 * VW <= dv; c0 += 2 * VW) wsum_cols(a, as, v, n, dv, o, os, R, c0, 2, 0, none);
  for (; c0 + VW <= dv; c0 += VW) wsum_cols(a, as, v, n, dv, o, os, R, c0, 1, 0, none);
  if (c0 < dv) wsum_cols(a, as, v, n, dv, o, os, R, c0, 1, 1, VMASK((int)(dv - c0)));
#else
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < dv; ++c) {
      float e = 0.f;
      for (int64_t j = 0; j < n; ++j) e = fmaf(a[r * as + j], v[j * dv + c], e);
      o[r * os + c] = e;
    }
#endif
}

static inline void weighted_sum_rows(const float *a, int64_t as, const float *v, int64_t n, int64_t dv, float *o,
                                     int64_t os, int64_t R) {
  if (R == ROWS) wsum_rows_r(a, as, v, n, dv, o, os, ROWS);
  else wsum_rows_r(a, as, v, n, dv, o, os, (int)R);
}

#define KEY_CHUNK 256  /* keys per chunk in both kernels: a multiple of KB */

/* The whole HSTU attention forward of queries [i0, i0 + bq) in one pass, without an [N, N]
 * tile in memory: per block of ROWS query rows, the keys a chunk of KEY_CHUNK at a time (the
 * chunk's scores stay in cache between the passes over them): the bias of each row's visible
 * keys in the chunk (a prefix [0, n) of the row and, for a candidate, its own key), the
 * scores, bias + SiLU, and the weighted sum of the chunk's values added to the row's output.
 *   q [G, H, bq, dq]; kb [G, H, KP / KB, dq, KB]: keys in blocks of KB (KP = K rounded up to
 *   KB, zero padded), so KB scores are one vector of fused multiply-adds over contiguous memory;
 *   v [G, H, K, dv]; out [G, H, bq, dv], fp32, unscaled by 1/n.
 * Visibility is the tile's: j <= i and (j < hist or j == i). Each output row is summed by
 * one thread in a fixed order (chunk by chunk, each in key order), so results do not depend
 * on the thread count. */
int hstu_attn_fwd(const tile_args *t, int64_t dq, int64_t dv, const float *q, const float *kb,
                   const float *v, float *out) {
  const int64_t K = t->K, KP = (K + KB - 1) / KB * KB, H = t->H, bq = t->bq, CW = KEY_CHUNK + KB;
  const int64_t NBLK = (bq + ROWS - 1) / ROWS;
  const float alpha = t->alpha;
  int64_t *sorted_n = calloc((size_t)t->G, sizeof(int64_t)), *lin_n = calloc((size_t)t->G, sizeof(int64_t));
  if (!sorted_n || !lin_n) {
    free(sorted_n); free(lin_n);
    return NO_MEMORY;
  }
  row_extents(t, K, sorted_n, lin_n);
  int oom = 0;
#pragma omp parallel num_threads(t->nthreads)
  {
    float *brow = malloc(sizeof(float) * (size_t)(CW * ROWS));
    float *srow = malloc(sizeof(float) * (size_t)(CW * ROWS));
    row_plan rp = plan_alloc(t, KEY_CHUNK);
    float *qa = malloc(sizeof(float) * (size_t)(H * dq * ROWS));
    float *o = malloc(sizeof(float) * (size_t)(dv * ROWS));
    float *oacc = malloc(sizeof(float) * (size_t)(H * dv * ROWS));
    const int ok = brow && srow && plan_ok(&rp) && qa && o && oacc;
    FLAG_NO_MEMORY(ok)
    int64_t nr[ROWS], ir[ROWS];
    float bself[ROWS];
#pragma omp for collapse(2) schedule(dynamic, 4)
    for (int64_t g = 0; g < t->G; ++g)
      for (int64_t blk = 0; blk < NBLK; ++blk) {
        if (!ok) continue;
        const int64_t h = t->hist[g], len = t->len ? t->len[g] : t->N;
        int64_t R = 0, nmax = 0;
        for (int64_t r = blk * ROWS; r < bq && r < (blk + 1) * ROWS; ++r) {
          const int64_t i = t->i0 + r;
          if (i >= len) {  /* padding: no keys, a zero row */
            for (int64_t hh = 0; hh < H; ++hh) memset(out + ((g * H + hh) * bq + r) * dv, 0, sizeof(float) * (size_t)dv);
            continue;
          }
          int64_t n = i < h ? i + 1 : h;
          n = n < K ? n : K;
          bself[R] = i >= h && i < K ? pair_bias(t, g, i, i) : 0.f;
          ir[R] = i, nr[R] = n, nmax = n > nmax ? n : nmax;
          ++R;
        }
        if (!R) continue;
        for (int64_t hh = 0; hh < H; ++hh)
          for (int64_t r = 0; r < R; ++r)
            for (int64_t c = 0; c < dq; ++c)
              qa[(hh * ROWS + r) * dq + c] = alpha * q[((g * H + hh) * bq + ir[r] - t->i0) * dq + c];
        memset(oacc, 0, sizeof(float) * (size_t)(H * dv * ROWS));
        for (int64_t j0 = 0; j0 < nmax; j0 += KEY_CHUNK) {
          const int64_t j1 = j0 + KEY_CHUNK < nmax ? j0 + KEY_CHUNK : nmax;
          const int64_t nc = j1 - j0, nbc = (nc + KB - 1) / KB * KB;
          int64_t e[ROWS];
          for (int64_t r = 0; r < R; ++r) {
            const int64_t i = ir[r];
            e[r] = nr[r] < j1 ? (nr[r] < j0 ? j0 : nr[r]) : j1;  /* the row's keys here: [j0, e) */
            float *br = brow + r * CW;
            /* candidates of one row share position and query time: their bias rows are equal */
            const int same = r > 0 && e[r] == e[r - 1] && t->pos[g * t->N + i] == t->pos[g * t->N + ir[r - 1]] &&
                             (!t->ts || query_time(t, g, i) == query_time(t, g, ir[r - 1]));
            if (same) memcpy(br, br - CW, sizeof(float) * (size_t)(e[r] - j0));
            else visible_bias(t, g, i, j0, e[r], sorted_n[g], lin_n[g], br, &rp);
            for (int64_t j = e[r] - j0; j < nbc; ++j) br[j] = 0.f;
          }
          for (int64_t hh = 0; hh < H; ++hh) {
            const int64_t gh = g * H + hh;
            const float *kg = kb + gh * dq * KP + j0 * dq, *vg = v + (gh * K + j0) * dv;
            scores_rows(kg, qa + hh * ROWS * dq, dq, brow, srow, CW, nbc, dq, R);
            for (int64_t r = 0; r < R; ++r) {
              float *sr = srow + r * CW;
              const int64_t n = e[r] - j0;
#pragma omp simd
              for (int64_t j = 0; j < n; ++j) sr[j] = sr[j] * sigmoid(sr[j]);
              for (int64_t j = n; j < nc; ++j) sr[j] = 0.f;  /* keys this row does not see */
            }
            weighted_sum_rows(srow, CW, vg, nc, dv, o, dv, R);
            float *oh = oacc + hh * ROWS * dv;
            for (int64_t x = 0; x < R * dv; ++x) oh[x] += o[x];
          }
        }
        for (int64_t hh = 0; hh < H; ++hh) {
          const int64_t gh = g * H + hh;
          const float *kg = kb + gh * dq * KP, *vg = v + gh * K * dv;
          for (int64_t r = 0; r < R; ++r) {
            const int64_t i = ir[r];
            float *orow = oacc + (hh * ROWS + r) * dv;
            if (i >= h && i < K) {  /* a candidate's own key */
              const float *blk = kg + (i / KB) * KB * dq, *qar = qa + (hh * ROWS + r) * dq;
              float x = bself[r];
              for (int64_t c = 0; c < dq; ++c) x += qar[c] * blk[c * KB + i % KB];
              const float aself = x * sigmoid(x);
              for (int64_t c = 0; c < dv; ++c) orow[c] += aself * vg[i * dv + c];
            }
            memcpy(out + (gh * bq + i - t->i0) * dv, orow, sizeof(float) * (size_t)dv);
          }
        }
      }
    free(brow); free(srow); free(qa); free(o); free(oacc);
    plan_free(&rp);
  }
  free(sorted_n); free(lin_n);
  return oom ? NO_MEMORY : 0;
}

#define BWD_ROWS 8

/* y[j][c] += sum_{r < R} s[r][j] x[r][c] for j < n, c < d, R <= BWD_ROWS (y row-major
 * [n, d]; s rows `ss` apart, x rows `xs` apart): the R rows of x stay in registers, a
 * chunk of columns at a time, while each row of y is read and written once for R updates.
 * Each y[j][c] adds its R terms in order r = 0, 1, ..., whatever the chunking. */
static inline __attribute__((always_inline)) void rank_rows_r(const float *s, int64_t ss, const float *x, int64_t xs,
                                                              float *y, int64_t n, int64_t d, const int R) {
#if VEC
  int64_t c = 0;
#if VW == 16
  for (; c + 2 * VW <= d; c += 2 * VW) {  /* 2 R of the 32 vector registers */
    vf x0[BWD_ROWS], x1[BWD_ROWS];
    for (int r = 0; r < R; ++r) x0[r] = VLOAD(x + r * xs + c), x1[r] = VLOAD(x + r * xs + c + VW);
    for (int64_t j = 0; j < n; ++j) {
      float *yj = y + j * d + c;
      vf a0 = VLOAD(yj), a1 = VLOAD(yj + VW);
      for (int r = 0; r < R; ++r) {
        const vf w = VSET1(s[r * ss + j]);
        a0 = VFMA(w, x0[r], a0);
        a1 = VFMA(w, x1[r], a1);
      }
      VSTORE(yj, a0), VSTORE(yj + VW, a1);
    }
  }
#endif
  for (; c < d; c += VW) {
    vf x0[BWD_ROWS];
    if (c + VW <= d) {
      for (int r = 0; r < R; ++r) x0[r] = VLOAD(x + r * xs + c);
      for (int64_t j = 0; j < n; ++j) {
        vf a = VLOAD(y + j * d + c);
        for (int r = 0; r < R; ++r) a = VFMA(VSET1(s[r * ss + j]), x0[r], a);
        VSTORE(y + j * d + c, a);
      }
    } else {
      const vmask m = VMASK((int)(d - c));
      for (int r = 0; r < R; ++r) x0[r] = VLOADM(x + r * xs + c, m);
      for (int64_t j = 0; j < n; ++j) {
        vf a = VLOADM(y + j * d + c, m);
        for (int r = 0; r < R; ++r) a = VFMA(VSET1(s[r * ss + j]), x0[r], a);
        VSTOREM(y + j * d + c, m, a);
      }
    }
  }
#else
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < d; ++c) {
      float acc = y[j * d + c];
      for (int r = 0; r < R; ++r) acc = fmaf(s[r * ss + j], x[r * xs + c], acc);
      y[j * d + c] = acc;
    }
#endif
}

static inline void rank_r_rows(const float *s, int64_t ss, const float *x, int64_t xs, int64_t R, float *y,
                               int64_t n, int64_t d) {
  if (R == BWD_ROWS) rank_rows_r(s, ss, x, xs, y, n, d, BWD_ROWS);  /* unrolled for the common case */
  else rank_rows_r(s, ss, x, xs, y, n, d, (int)R);
}

/* The whole HSTU attention backward in one pass over the query rows, no [N, N] tile. Rows
 * go in super blocks of SUPER_ROWS that take the keys a chunk of KEY_CHUNK at a time, and
 * within a chunk in blocks of BWD_ROWS: per row the scores and da = do . v again, a =
 * SiLU(x) and ds = da SiLU'(x) on its visible keys, dq_i += alpha sum_j ds_j k_j; per block
 * dk_j += alpha sum_i ds_ij q_i and dv_j += sum_i a_ij do_i over its rows at once (a key's row
 * of dk / dv is read and written once per block); and the bias gradients. With at least 4
 * rows per thread, each thread takes whole rows and adds their dk / dv straight into the
 * outputs (a row's sums in one order whatever the thread count); with fewer, a long row's
 * super blocks are split among the threads into per-thread partial sums, added up in
 * thread order at the end. A chunk's keys, values, dk and dv (five
 * rows of KEY_CHUNK) stay in cache while the super block's rows use them: at long lengths
 * streaming them per block of rows bounded the kernel.
 *   q [G, H, N, dq]; kb, vb: keys / values in blocks of KB as in hstu_attn_fwd; k [G, H, N, dq];
 *   dout [G, H, N, dv] (already scaled by 1/n); dq_out, dk_out [G, H, N, dq], dv_out
 *   [G, H, N, dv] (written); d_ts / d_pos: float64, added to.
 * Super blocks are dealt to threads in a fixed pattern and every partial sum is added in a
 * fixed order (dq_i: chunk by chunk, each in key order), so a run repeats its bits for a
 * given thread count (and dq, dk, dv for any thread count when rows are whole). */
#define SUPER_ROWS (8 * BWD_ROWS)
int hstu_attn_bwd(const tile_args *t, int64_t dq, int64_t dv, const float *q, const float *kb,
                   const float *vb, const float *k, const float *dout, float *dq_out, float *dk_out,
                   float *dv_out, double *d_ts, double *d_pos) {
  const int64_t K = t->N, KP = (K + KB - 1) / KB * KB, H = t->H, G = t->G, CW = KEY_CHUNK + KB;
  const int64_t NSB = (K + SUPER_ROWS - 1) / SUPER_ROWS;
  const float alpha = t->alpha;
  const int nthreads = t->nthreads;
  const size_t nts = (size_t)t->NB + 1, npos = (size_t)t->P;
  const size_t nk = (size_t)(G * H * K * dq), nv = (size_t)(G * H * K * dv);
  /* With enough rows, each thread takes whole rows (their super blocks in order) and adds
   * their dk / dv straight into the outputs; otherwise super blocks are dealt one at a time
   * (a long row split among the threads) into per-thread partial sums added up at the end. */
  const int owned = G >= 4 * (int64_t)nthreads;
  double *all_ts = t->ts ? calloc(nts * (size_t)nthreads, sizeof(double)) : NULL;
  double *all_pos = t->pos_w ? calloc(npos * (size_t)nthreads, sizeof(double)) : NULL;
  float *all_dk = owned ? NULL : calloc(nk * (size_t)nthreads, sizeof(float));
  float *all_dv = owned ? NULL : calloc(nv * (size_t)nthreads, sizeof(float));
  int64_t *sorted_n = calloc((size_t)G, sizeof(int64_t)), *lin_n = calloc((size_t)G, sizeof(int64_t));
  row_extents(t, K, sorted_n, lin_n);
  float *zeros = calloc((size_t)(CW * ROWS), sizeof(float));
  int oom = (t->ts && !all_ts) || (t->pos_w && !all_pos) || (!owned && (!all_dk || !all_dv)) || !sorted_n || !lin_n || !zeros;
  if (oom) goto done;
#pragma omp parallel num_threads(nthreads)
  {
    float *brow = malloc(sizeof(float) * (size_t)(CW * BWD_ROWS));  /* per row of the block */
    float *drow = malloc(sizeof(float) * (size_t)(CW * BWD_ROWS));
    float *arow = malloc(sizeof(float) * (size_t)(CW * BWD_ROWS));
    float *srow = malloc(sizeof(float) * (size_t)(CW * BWD_ROWS));
    float *xrow = malloc(sizeof(float) * (size_t)(CW * ROWS)), *grow = malloc(sizeof(float) * (size_t)(CW * ROWS));
    float *qa = malloc(sizeof(float) * (size_t)(dq * BWD_ROWS));
    float *o = malloc(sizeof(float) * (size_t)(dq * ROWS));
    float *qacc = malloc(sizeof(float) * (size_t)(H * SUPER_ROWS * dq));  /* dq sums per head and row */
    double dself[SUPER_ROWS];
    int64_t nr[SUPER_ROWS];
    int self[SUPER_ROWS];
    row_plan rp[BWD_ROWS];
    int ok = brow && drow && arow && srow && xrow && grow && qa && o && qacc;
    for (int r = 0; r < BWD_ROWS; ++r) rp[r] = plan_alloc(t, KEY_CHUNK), ok = ok && plan_ok(&rp[r]);
    FLAG_NO_MEMORY(ok)
    const int tid = omp_get_thread_num();
    double *lts = all_ts ? all_ts + nts * (size_t)tid : NULL;
    double *lpos = all_pos ? all_pos + npos * (size_t)tid : NULL;
    float *ldk = owned ? dk_out : all_dk + nk * (size_t)tid, *ldv = owned ? dv_out : all_dv + nv * (size_t)tid;
    /* work item w = (row g, super block sb): NSB consecutive items (a whole row) per thread
     * at a time when owned, else one */
#pragma omp for schedule(static, owned ? NSB : 1)
    for (int64_t w = 0; w < G * NSB; ++w) {
        const int64_t g = w / NSB, sb = w % NSB;
        if (!ok) continue;
        if (owned && sb == 0)  /* this thread's row: its dk / dv rows start at zero */
          for (int64_t hh = 0; hh < H; ++hh) {
            memset(dk_out + (g * H + hh) * K * dq, 0, sizeof(float) * (size_t)(K * dq));
            memset(dv_out + (g * H + hh) * K * dv, 0, sizeof(float) * (size_t)(K * dv));
          }
        const int64_t h = t->hist[g], s0 = sb * SUPER_ROWS;
        const int64_t len = t->len ? t->len[g] : K;
        int64_t s1 = s0 + SUPER_ROWS < K ? s0 + SUPER_ROWS : K;
        for (int64_t i = (s0 < len ? len : s0); i < s1; ++i)  /* padding: zero dq rows, nothing else */
          for (int64_t hh = 0; hh < H; ++hh) memset(dq_out + ((g * H + hh) * K + i) * dq, 0, sizeof(float) * (size_t)dq);
        if (s1 > len) s1 = len;
        const int64_t S = s1 - s0;
        if (S <= 0) continue;
        int64_t nsup = 0;
        for (int64_t r = 0; r < S; ++r) {
          const int64_t i = s0 + r;
          nr[r] = i < h ? i + 1 : h;
          self[r] = i >= h;
          dself[r] = 0.0;
          if (nr[r] > nsup) nsup = nr[r];
        }
        memset(qacc, 0, sizeof(float) * (size_t)(H * SUPER_ROWS * dq));
        for (int64_t j0 = 0; j0 < nsup; j0 += KEY_CHUNK) {
          const int64_t j1 = j0 + KEY_CHUNK < nsup ? j0 + KEY_CHUNK : nsup;
          for (int64_t b0 = 0; b0 < S; b0 += BWD_ROWS) {
            const int64_t R = S - b0 < BWD_ROWS ? S - b0 : BWD_ROWS;
            int64_t nmax = j0;  /* the block's keys in this chunk: [j0, nmax) */
            for (int64_t r = 0; r < R; ++r) {
              const int64_t e = nr[b0 + r] < j1 ? nr[b0 + r] : j1;
              if (e > nmax) nmax = e;
            }
            if (nmax <= j0) continue;  /* no row of the block sees a key of this chunk */
            const int64_t nc = nmax - j0, nbc = (nc + KB - 1) / KB * KB;
            for (int64_t r = 0; r < R; ++r) {
              int64_t e = nr[b0 + r] < j1 ? nr[b0 + r] : j1;
              e = e < j0 ? j0 : e;
              float *br = brow + r * CW;
              visible_bias(t, g, s0 + b0 + r, j0, e, sorted_n[g], lin_n[g], br, &rp[r]);
              for (int64_t j = e - j0; j < nbc; ++j) br[j] = 0.f;
              for (int64_t j = 0; j < e - j0; ++j) drow[r * CW + j] = 0.f;
            }
            for (int64_t hh = 0; hh < H; ++hh) {
              const int64_t gh = g * H + hh, i0 = s0 + b0;
              const float *kg = kb + gh * dq * KP + j0 * dq, *vg = vb + gh * dv * KP + j0 * dv;
              const float *kr = k + (gh * K + j0) * dq;
              float *dkg = ldk + (gh * K + j0) * dq, *dvg = ldv + (gh * K + j0) * dv;
              for (int64_t r = 0; r < R; ++r)
                for (int64_t c = 0; c < dq; ++c) qa[r * dq + c] = alpha * q[(gh * K + i0 + r) * dq + c];
              for (int64_t r0 = 0; r0 < R; r0 += ROWS) {  /* scores of ROWS rows per pass over the keys */
                const int64_t m = R - r0 < ROWS ? R - r0 : ROWS;
                scores_rows(kg, qa + r0 * dq, dq, brow + r0 * CW, xrow, CW, nbc, dq, m);
                scores_rows(vg, dout + (gh * K + i0 + r0) * dv, dv, zeros, grow, CW, nbc, dv, m);
                for (int64_t r = r0; r < r0 + m; ++r) {
                  const int64_t n = rp[r].n;
                  const float *xr = xrow + (r - r0) * CW, *gr = grow + (r - r0) * CW;
                  float *ar = arow + r * CW, *sr = srow + r * CW, *dr = drow + r * CW;
#pragma omp simd
                  for (int64_t j = 0; j < n; ++j) {
                    const float x = xr[j], sg = sigmoid(x);
                    ar[j] = x * sg;
                    sr[j] = gr[j] * sg * (1.f + x * (1.f - sg));
                    dr[j] += sr[j];
                  }
                  for (int64_t j = n; j < nc; ++j) ar[j] = sr[j] = 0.f;  /* keys this row does not see */
                }
                weighted_sum_rows(srow + r0 * CW, CW, kr, nc, dq, o, dq, m);
                for (int64_t r = r0; r < r0 + m; ++r) {
                  float *acc = qacc + (hh * SUPER_ROWS + b0 + r) * dq;
                  for (int64_t c = 0; c < dq; ++c) acc[c] += o[(r - r0) * dq + c];
                }
              }
              rank_r_rows(srow, CW, qa, dq, R, dkg, nc, dq);  /* dk_j += sum_i ds_ij (alpha q_i) */
              rank_r_rows(arow, CW, dout + (gh * K + i0) * dv, dv, R, dvg, nc, dv);
            }
            for (int64_t r = 0; r < R; ++r) visible_bias_grad(t, &rp[r], drow + r * CW, lts, lpos);
          }
        }
        for (int64_t hh = 0; hh < H; ++hh) {
          const int64_t gh = g * H + hh;
          const float *vg = vb + gh * dv * KP, *kr = k + gh * K * dq;
          float *dkg = ldk + gh * K * dq, *dvg = ldv + gh * K * dv;
          for (int64_t r = 0; r < S; ++r) {
            const int64_t i = s0 + r;
            float *acc = qacc + (hh * SUPER_ROWS + r) * dq;
            if (self[r]) {  /* the candidate's own key: relative position 0 */
              const float *qi = q + (gh * K + i) * dq, *dor = dout + (gh * K + i) * dv;
              float x = pair_bias(t, g, i, i), da = 0.f;
              for (int64_t c = 0; c < dq; ++c) x += alpha * qi[c] * kr[i * dq + c];
              for (int64_t c = 0; c < dv; ++c) da += dor[c] * vg[(i / KB) * KB * dv + c * KB + i % KB];
              const float sg = sigmoid(x);
              const float dsi = da * sg * (1.f + x * (1.f - sg)), ai = x * sg;
              dself[r] += dsi;
              for (int64_t c = 0; c < dq; ++c) acc[c] += dsi * kr[i * dq + c];
              for (int64_t c = 0; c < dq; ++c) dkg[i * dq + c] += dsi * (alpha * qi[c]);
              for (int64_t c = 0; c < dv; ++c) dvg[i * dv + c] += ai * dor[c];
            }
            float *dqr = dq_out + (gh * K + i) * dq;
            for (int64_t c = 0; c < dq; ++c) dqr[c] = alpha * acc[c];
          }
        }
        for (int64_t r = 0; r < S; ++r)
          if (self[r]) {
            const int64_t i = s0 + r;
            if (lts) lts[time_bucket(t, query_time(t, g, i), t->ts[g * t->N + i])] += dself[r];
            if (lpos) lpos[0] += dself[r];
          }
      }
    free(brow); free(drow); free(arow); free(srow); free(xrow); free(grow); free(qa); free(o); free(qacc);
    for (int r = 0; r < BWD_ROWS; ++r) plan_free(&rp[r]);
  }
  if (oom) goto done;
  if (!owned) {  /* the per-thread partial sums, in thread order */
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t e = 0; e < (int64_t)nk; ++e) {
      float acc = 0.f;
      for (int th = 0; th < nthreads; ++th) acc += all_dk[nk * (size_t)th + (size_t)e];
      dk_out[e] = acc;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t e = 0; e < (int64_t)nv; ++e) {
      float acc = 0.f;
      for (int th = 0; th < nthreads; ++th) acc += all_dv[nv * (size_t)th + (size_t)e];
      dv_out[e] = acc;
    }
  }
  for (int th = 0; th < nthreads; ++th) {
    if (all_ts) for (size_t b = 0; b < nts; ++b) d_ts[b] += all_ts[nts * (size_t)th + b];
    if (all_pos) for (size_t b = 0; b < npos; ++b) d_pos[b] += all_pos[npos * (size_t)th + b];
  }
done:
  free(all_ts); free(all_pos); free(all_dk); free(all_dv); free(sorted_n); free(lin_n); free(zeros);
  return oom ? NO_MEMORY : 0;
}
