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
        row_bias(t, g, i, brow, mrow, rrow, trow);
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
#pragma omp parallel for collapse(2) schedule(static) num_threads(t->nthreads)
  for (int64_t g = 0; g < t->G; ++g)
    for (int64_t i = 0; i < N; ++i) {
      const int64_t *ts = t->ts + g * N;
      const int64_t ti = query_time(t, g, i);
      uint8_t *o = out + (g * N + i) * N;
#pragma omp simd
      for (int64_t j = 0; j < N; ++j) o[j] = (uint8_t)time_bucket(t, ti, ts[j]);
    }
}
