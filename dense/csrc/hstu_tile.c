/* Fused elementwise part of one HSTU attention tile (see dense/kernels.py, _HSTUChunkedFn).
 *
 * A tile is queries [i0, i0 + bq) x keys [0, K) of G rows x H heads. The matmuls stay in
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
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

static inline float bf2f(uint16_t h) { uint32_t u = ((uint32_t)h) << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f2bf(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
  return (uint16_t)(u >> 16);
}
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
  const int64_t *qts;    /* [G, N] query times of the time bias, or NULL: the same as ts.
                          * fused.py TileArgs mirrors this struct field for field; both keep
                          * it last so earlier offsets never move. */
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
  return b;
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

/* out[j] = time_bucket(ti, ts[j]) for j in [0, n). Over a sorted prefix [0, sorted_n) |ti - ts[j]|
 * falls, then rises, so its buckets come in runs: each run's end is a binary search for the
 * next threshold instead of a logarithm per pair (a row of N keys costs O(buckets log N)). */
static void time_bucket_row(const tile_args *t, int64_t ti, const int64_t *ts, int64_t n, int64_t sorted_n,
                            int32_t *out) {
  const int64_t m = sorted_n < n ? sorted_n : n;
  const int64_t p = search_sorted(ts, 0, m, ti, 1);  /* ts[j] <= ti before p, > ti from p */
  for (int64_t j = 0; j < p;) {  /* dt = ti - ts[j] >= 0, non-increasing */
    const int b = time_bucket(t, ti, ts[j]);
    /* the run ends where dt < thr[b] (thr[b] <= dt here, so ti - thr[b] cannot overflow) */
    const int64_t e = b == 0 ? p : search_sorted(ts, j + 1, p, ti - t->thr[b], 1);
    for (int64_t k = j; k < e; ++k) out[k] = b;
    j = e;
  }
  for (int64_t j = p; j < m;) {  /* dt = ts[j] - ti > 0, non-decreasing */
    const int b = time_bucket(t, ti, ts[j]);
    const int64_t next = t->thr[b + 1];  /* INT64_MAX past the last reachable bucket */
    const int64_t e = (b == t->NB || (ti > 0 && next > INT64_MAX - ti)) ? m : search_sorted(ts, j + 1, m, ti + next, 0);
    for (int64_t k = j; k < e; ++k) out[k] = b;
    j = e;
  }
#pragma omp simd
  for (int64_t j = m; j < n; ++j) out[j] = time_bucket(t, ti, ts[j]);
}

/* Per (row, query) bias over all keys, shared by the heads: brow = rab, mrow = 0/1 mask,
 * rrow / trow = position and time bucket indices (for the bias gradients).
 * The time bucket matches the PyTorch reference exactly: logf gives a guess and the integer
 * thresholds thr[b] = smallest |dt| of bucket >= b (thr[0] = 0, thr[NB + 1] = INT64_MAX,
 * computed in Python with the reference formula) correct it by one step either way. */
static void row_bias(const tile_args *t, int64_t g, int64_t i, float *brow, float *mrow,
                     int32_t *rrow, int32_t *trow, int64_t sorted_n) {
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
    time_bucket_row(t, query_time(t, g, i), t->ts + g * N, K, sorted_n, trow);
    for (int64_t j = 0; j < K; ++j) brow[j] += t->ts_w[trow[j]];
  }
}

#define ROW_BUFFERS                                                   \
  float *brow = malloc(sizeof(float) * (size_t)(K + 1));              \
  float *mrow = malloc(sizeof(float) * (size_t)(K + 1));              \
  float *drow = malloc(sizeof(float) * (size_t)(K + 1));              \
  float *xrow = malloc(sizeof(float) * (size_t)(K + 1));              \
  int32_t *rrow = malloc(sizeof(int32_t) * (size_t)(K + 1));          \
  int32_t *trow = malloc(sizeof(int32_t) * (size_t)(K + 1));
#define FREE_ROW_BUFFERS free(brow); free(mrow); free(drow); free(xrow); free(rrow); free(trow);

static inline void load_row(const void *p, int64_t base, int bf, float *out, int64_t K) {
  if (bf) { const uint16_t *q = (const uint16_t *)p + base; for (int64_t j = 0; j < K; ++j) out[j] = bf2f(q[j]); }
  else memcpy(out, (const float *)p + base, sizeof(float) * (size_t)K);
}
static inline void store_row(void *p, int64_t base, int bf, const float *in, int64_t K) {
  if (bf) { uint16_t *q = (uint16_t *)p + base; for (int64_t j = 0; j < K; ++j) q[j] = f2bf(in[j]); }
  else memcpy((float *)p + base, in, sizeof(float) * (size_t)K);
}

void hstu_tile_fwd(const tile_args *t, const void *s, int s_bf, void *a, int a_bf) {
  const int64_t K = t->K;
  const float alpha = t->alpha;
#pragma omp parallel num_threads(t->nthreads)
  {
    ROW_BUFFERS
#pragma omp for collapse(2) schedule(static)
    for (int64_t g = 0; g < t->G; ++g)
      for (int64_t r = 0; r < t->bq; ++r) {
        const int64_t i = t->i0 + r, Kc = K < i + 1 ? K : i + 1;
        row_bias(t, g, i, brow, mrow, rrow, trow, 0);
        for (int64_t j = Kc; j < K; ++j) xrow[j] = 0.f;
        for (int64_t hh = 0; hh < t->H; ++hh) {
          int64_t base = ((g * t->H + hh) * t->bq + r) * K;
          load_row(s, base, s_bf, xrow, Kc);
#pragma omp simd
          for (int64_t j = 0; j < Kc; ++j) {
            float x = alpha * xrow[j] + brow[j];
            xrow[j] = mrow[j] * (x / (1.f + expf(fminf(-x, 80.f))));  /* finite under fast-math */
          }
          store_row(a, base, a_bf, xrow, K);
        }
      }
    FREE_ROW_BUFFERS
  }
}

/* d_ts / d_pos: float64 accumulators [NB + 1] / [P], added to (not overwritten). */
void hstu_tile_bwd(const tile_args *t, const void *s, int s_bf, const void *da, int da_bf,
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
#pragma omp parallel num_threads(nthreads)
  {
    ROW_BUFFERS
    float *grow = malloc(sizeof(float) * (size_t)(K + 1));
    const int tid = omp_get_thread_num();
    double *lts = all_ts ? all_ts + nts * (size_t)tid : NULL;
    double *lpos = all_pos ? all_pos + npos * (size_t)tid : NULL;
#pragma omp for collapse(2) schedule(static)
    for (int64_t g = 0; g < t->G; ++g)
      for (int64_t r = 0; r < t->bq; ++r) {
        const int64_t i = t->i0 + r, Kc = K < i + 1 ? K : i + 1;
        row_bias(t, g, i, brow, mrow, rrow, trow, 0);
        for (int64_t j = 0; j < K; ++j) drow[j] = 0.f;
        for (int64_t hh = 0; hh < t->H; ++hh) {
          int64_t base = ((g * t->H + hh) * t->bq + r) * K;
          load_row(s, base, s_bf, xrow, Kc);
          load_row(da, base, da_bf, grow, Kc);
          for (int64_t j = Kc; j < K; ++j) xrow[j] = grow[j] = 0.f;
#pragma omp simd
          for (int64_t j = 0; j < Kc; ++j) {
            float x = alpha * xrow[j] + brow[j];
            float sg = 1.f / (1.f + expf(fminf(-x, 80.f)));
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
  for (int th = 0; th < nthreads; ++th) {
    if (all_ts) for (size_t b = 0; b < nts; ++b) d_ts[b] += all_ts[nts * (size_t)th + b];
    if (all_pos) for (size_t b = 0; b < npos; ++b) d_pos[b] += all_pos[npos * (size_t)th + b];
  }
  free(all_ts); free(all_pos);
}

/* Time bucket of every (query, key) pair of G rows of N tokens, computed once per tower call
 * and shared by all layers and by forward and backward (1 byte per pair). */
void hstu_time_index(const tile_args *t, uint8_t *out) {
  const int64_t N = t->N;
#pragma omp parallel num_threads(t->nthreads)
  {
    int32_t *row = malloc(sizeof(int32_t) * (size_t)(N + 1));
#pragma omp for schedule(static)
    for (int64_t g = 0; g < t->G; ++g) {
      const int64_t *ts = t->ts + g * N;
      const int64_t sorted_n = sorted_prefix(ts, N);
      for (int64_t i = 0; i < N; ++i) {
        time_bucket_row(t, query_time(t, g, i), ts, N, sorted_n, row);
        uint8_t *o = out + (g * N + i) * N;
        for (int64_t j = 0; j < N; ++j) o[j] = (uint8_t)row[j];
      }
    }
    free(row);
  }
}

/* Bias of one visible (query i, key j) pair, for the one key outside a row's visible prefix
 * (a candidate's own key): the same sums as row_bias. */
static float pair_bias(const tile_args *t, int64_t g, int64_t i, int64_t j) {
  const int64_t N = t->N;
  float b = 0.f;
  if (t->pos_w) {
    int64_t r = t->pos[g * N + i] - t->pos[g * N + j];
    r = r < 0 ? 0 : (r > t->P - 1 ? t->P - 1 : r);
    b += t->pos_w[r];
  }
  if (t->ts && t->tidx) b += t->ts_w[t->tidx[(g * N + i) * N + j]];
  else if (t->ts) b += t->ts_w[time_bucket(t, query_time(t, g, i), t->ts[g * N + j])];
  return b;
}

/* s[j] = b[j] + sum_c qa[c] k[j][c] for j < n8 (a multiple of 8), keys in blocks of 8:
 * kb[(j / 8) * 8 * dq + c * 8 + j % 8]. */
static inline void scores_8(const float *kb, const float *qa, const float *b, float *s, int64_t n8,
                            int64_t dq) {
#if defined(__AVX2__) && defined(__FMA__)
  /* four blocks of 8 keys at a time, two partial sums each: 8 independent FMA chains */
  int64_t jb = 0;
  for (; jb + 32 <= n8; jb += 32) {
    const float *k0 = kb + jb * dq, *k1 = k0 + 8 * dq, *k2 = k1 + 8 * dq, *k3 = k2 + 8 * dq;
    __m256 a0 = _mm256_loadu_ps(b + jb), a1 = _mm256_loadu_ps(b + jb + 8);
    __m256 a2 = _mm256_loadu_ps(b + jb + 16), a3 = _mm256_loadu_ps(b + jb + 24);
    __m256 e0 = _mm256_setzero_ps(), e1 = e0, e2 = e0, e3 = e0;
    int64_t c = 0;
    for (; c + 2 <= dq; c += 2) {
      const __m256 x = _mm256_set1_ps(qa[c]), y = _mm256_set1_ps(qa[c + 1]);
      a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + c * 8), a0);
      a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k1 + c * 8), a1);
      a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k2 + c * 8), a2);
      a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k3 + c * 8), a3);
      e0 = _mm256_fmadd_ps(y, _mm256_loadu_ps(k0 + c * 8 + 8), e0);
      e1 = _mm256_fmadd_ps(y, _mm256_loadu_ps(k1 + c * 8 + 8), e1);
      e2 = _mm256_fmadd_ps(y, _mm256_loadu_ps(k2 + c * 8 + 8), e2);
      e3 = _mm256_fmadd_ps(y, _mm256_loadu_ps(k3 + c * 8 + 8), e3);
    }
    if (c < dq) {
      const __m256 x = _mm256_set1_ps(qa[c]);
      a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + c * 8), a0);
      a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k1 + c * 8), a1);
      a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k2 + c * 8), a2);
      a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k3 + c * 8), a3);
    }
    _mm256_storeu_ps(s + jb, _mm256_add_ps(a0, e0));
    _mm256_storeu_ps(s + jb + 8, _mm256_add_ps(a1, e1));
    _mm256_storeu_ps(s + jb + 16, _mm256_add_ps(a2, e2));
    _mm256_storeu_ps(s + jb + 24, _mm256_add_ps(a3, e3));
  }
  for (; jb < n8; jb += 8) {
    const float *blk = kb + jb * dq;
    __m256 acc = _mm256_loadu_ps(b + jb), e = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 2 <= dq; c += 2) {
      acc = _mm256_fmadd_ps(_mm256_set1_ps(qa[c]), _mm256_loadu_ps(blk + c * 8), acc);
      e = _mm256_fmadd_ps(_mm256_set1_ps(qa[c + 1]), _mm256_loadu_ps(blk + c * 8 + 8), e);
    }
    if (c < dq) acc = _mm256_fmadd_ps(_mm256_set1_ps(qa[c]), _mm256_loadu_ps(blk + c * 8), acc);
    _mm256_storeu_ps(s + jb, _mm256_add_ps(acc, e));
  }
#else
  for (int64_t jb = 0; jb < n8; jb += 8) {
    const float *blk = kb + jb * dq;
    for (int l = 0; l < 8; ++l) s[jb + l] = b[jb + l];
    for (int64_t c = 0; c < dq; ++c)
      for (int l = 0; l < 8; ++l) s[jb + l] += qa[c] * blk[c * 8 + l];
  }
#endif
}

/* o[c] = sum_{j < n} a[j] v[j][c], v [n, dv] row-major; the sum over j in a fixed order. */
static inline void weighted_sum(const float *a, const float *v, int64_t n, int64_t dv, float *o) {
  int64_t c0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; c0 + 8 <= dv; c0 += 8) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {  /* 8 independent FMA chains */
      const float *vj = v + j * dv + c0;
      s0 = _mm256_fmadd_ps(_mm256_set1_ps(a[j]), _mm256_loadu_ps(vj), s0);
      s1 = _mm256_fmadd_ps(_mm256_set1_ps(a[j + 1]), _mm256_loadu_ps(vj + dv), s1);
      s2 = _mm256_fmadd_ps(_mm256_set1_ps(a[j + 2]), _mm256_loadu_ps(vj + 2 * dv), s2);
      s3 = _mm256_fmadd_ps(_mm256_set1_ps(a[j + 3]), _mm256_loadu_ps(vj + 3 * dv), s3);
      s4 = _mm256_fmadd_ps(_mm256_set1_ps(a[j + 4]), _mm256_loadu_ps(vj + 4 * dv), s4);
      s5 = _mm256_fmadd_ps(_mm256_set1_ps(a[j + 5]), _mm256_loadu_ps(vj + 5 * dv), s5);
      s6 = _mm256_fmadd_ps(_mm256_set1_ps(a[j + 6]), _mm256_loadu_ps(vj + 6 * dv), s6);
      s7 = _mm256_fmadd_ps(_mm256_set1_ps(a[j + 7]), _mm256_loadu_ps(vj + 7 * dv), s7);
    }
    s0 = _mm256_add_ps(s0, s4); s1 = _mm256_add_ps(s1, s5); s2 = _mm256_add_ps(s2, s6); s3 = _mm256_add_ps(s3, s7);
    for (; j < n; ++j) s0 = _mm256_fmadd_ps(_mm256_set1_ps(a[j]), _mm256_loadu_ps(v + j * dv + c0), s0);
    _mm256_storeu_ps(o + c0, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  }
#endif
  for (int64_t c = c0; c < dv; ++c) {
    float acc = 0.f;
    for (int64_t j = 0; j < n; ++j) acc += a[j] * v[j * dv + c];
    o[c] = acc;
  }
}

/* The whole HSTU attention forward of queries [i0, i0 + bq) in one pass, without an [N, N]
 * tile in memory: per query row, the scores against its visible keys (a prefix [0, n) and,
 * for a candidate, its own key), bias + SiLU, then the weighted sum of values.
 *   q [G, H, bq, dq]; kb [G, H, K8 / 8, dq, 8]: keys in blocks of 8 (K8 = K rounded up to 8,
 *   zero padded), so 8 scores are one vector of fused multiply-adds over contiguous memory;
 *   v [G, H, K, dv]; out [G, H, bq, dv], fp32, unscaled by 1/n.
 * Visibility is the tile's: j <= i and (j < hist or j == i). Each output row is summed by
 * one thread in a fixed order, so results do not depend on the thread count. */
void hstu_attn_fwd(const tile_args *t, int64_t dq, int64_t dv, const float *q, const float *kb,
                   const float *v, float *out) {
  const int64_t K = t->K, K8 = (K + 7) / 8 * 8, H = t->H, bq = t->bq;
  const float alpha = t->alpha;
  int64_t *sorted_n = calloc((size_t)t->G, sizeof(int64_t));
  for (int64_t g = 0; g < t->G && t->ts; ++g) sorted_n[g] = sorted_prefix(t->ts + g * t->N, K);
#pragma omp parallel num_threads(t->nthreads)
  {
    float *brow = malloc(sizeof(float) * (size_t)(K8 + 8));
    float *srow = malloc(sizeof(float) * (size_t)(K8 + 8));
    float *mrow = malloc(sizeof(float) * (size_t)(K8 + 8));
    int32_t *rrow = malloc(sizeof(int32_t) * (size_t)(K8 + 8));
    int32_t *trow = malloc(sizeof(int32_t) * (size_t)(K8 + 8));
    float *qa = malloc(sizeof(float) * (size_t)dq);
    float *o = malloc(sizeof(float) * (size_t)dv);
#pragma omp for collapse(2) schedule(dynamic, 16)
    for (int64_t g = 0; g < t->G; ++g)
      for (int64_t r = 0; r < bq; ++r) {
        const int64_t i = t->i0 + r, h = t->hist[g];
        int64_t n = i < h ? i + 1 : h;
        n = n < K ? n : K;
        const int64_t n8 = (n + 7) / 8 * 8;
        const int self = i >= h && i < K;
        if (n > 0) {
          /* row_bias over the prefix: every pair in it is visible */
          tile_args tp = *t;
          tp.K = n;
          row_bias(&tp, g, i, brow, mrow, rrow, trow, t->ts ? sorted_n[g] : 0);
        }
        for (int64_t j = n; j < n8; ++j) brow[j] = 0.f;
        const float bself = self ? pair_bias(t, g, i, i) : 0.f;
        for (int64_t hh = 0; hh < H; ++hh) {
          const int64_t gh = g * H + hh;
          const float *qr = q + (gh * bq + r) * dq;
          const float *kg = kb + gh * dq * K8, *vg = v + gh * K * dv;
          for (int64_t c = 0; c < dq; ++c) qa[c] = alpha * qr[c];
          scores_8(kg, qa, brow, srow, n8, dq);
#pragma omp simd
          for (int64_t j = 0; j < n8; ++j) srow[j] = srow[j] / (1.f + expf(fminf(-srow[j], 80.f)));
          float aself = 0.f;
          if (self) {
            const float *blk = kg + (i / 8) * 8 * dq;
            float x = bself;
            for (int64_t c = 0; c < dq; ++c) x += qa[c] * blk[c * 8 + i % 8];
            aself = x / (1.f + expf(fminf(-x, 80.f)));
          }
          weighted_sum(srow, vg, n, dv, o);
          if (self)
            for (int64_t c = 0; c < dv; ++c) o[c] += aself * vg[i * dv + c];
          memcpy(out + (gh * bq + r) * dv, o, sizeof(float) * (size_t)dv);
        }
      }
    free(brow); free(srow); free(mrow); free(rrow); free(trow); free(qa); free(o);
  }
  free(sorted_n);
}
