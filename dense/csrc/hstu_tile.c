/* Fused elementwise part of one HSTU attention tile (see dense/kernels.py, _HSTUChunkedFn).
 *
 * A tile is queries [i0, i0 + bq) x keys [0, K) of G rows x H heads. The matmuls stay in
 * ATen (bf16 AMX / fp32 BLAS); this file does, in one pass over the tile,
 *   forward:  a = vis(i, j) ? SiLU(alpha s + ts_w[tidx] + pos_w[rel]) : 0
 *   backward: a as above, ds = vis ? da * SiLU'(x) : 0, and d ts_w / d pos_w sums.
 * Plain C + OpenMP, no torch headers, loaded through ctypes (compiles in about a second).
 * dtype flags: 0 = float32, 1 = bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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
  const uint8_t *tidx;   /* [G, N, N] or NULL */
  const float *ts_w;     /* [NB + 1] or NULL */
  const float *pos_w;    /* [P] or NULL */
  const int64_t *pos;    /* [G, N] */
  const int64_t *hist;   /* [G] */
  float alpha;
} tile_args;

static inline float bias_of(const tile_args *t, int64_t g, int64_t i, int64_t j, int *vis, int64_t *rel, int *tb) {
  int64_t h = t->hist[g];
  *vis = (j <= i) && (j < h || j == i);
  float b = 0.f;
  if (t->pos_w) {
    int64_t r = t->pos[g * t->N + i] - t->pos[g * t->N + j];
    r = r < 0 ? 0 : (r > t->P - 1 ? t->P - 1 : r);
    *rel = r; b += t->pos_w[r];
  }
  if (t->tidx) { *tb = t->tidx[(g * t->N + i) * t->N + j]; b += t->ts_w[*tb]; }
  return b;
}

void hstu_tile_fwd(const tile_args *t, const void *s, int s_bf, void *a, int a_bf) {
  const int64_t K = t->K;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t g = 0; g < t->G; ++g)
    for (int64_t r = 0; r < t->bq; ++r) {
      int64_t i = t->i0 + r;
      float brow[K > 0 ? K : 1]; unsigned char vrow[K > 0 ? K : 1];
      for (int64_t j = 0; j < K; ++j) { int vis; int64_t rel; int tb; brow[j] = bias_of(t, g, i, j, &vis, &rel, &tb); vrow[j] = (unsigned char)vis; }
      for (int64_t hh = 0; hh < t->H; ++hh) {
        int64_t base = ((g * t->H + hh) * t->bq + r) * K;
        for (int64_t j = 0; j < K; ++j) {
          float x = t->alpha * ld(s, base + j, s_bf) + brow[j];
          float y = vrow[j] ? x / (1.f + expf(-x)) : 0.f;
          st(a, base + j, y, a_bf);
        }
      }
    }
}

/* d_ts / d_pos: float64 accumulators [NB + 1] / [P], added to (not overwritten). */
void hstu_tile_bwd(const tile_args *t, const void *s, int s_bf, const void *da, int da_bf,
                   void *a, int a_bf, void *ds, int ds_bf, double *d_ts, double *d_pos) {
  const int64_t K = t->K;
#pragma omp parallel
  {
    double *lts = t->tidx ? calloc(t->NB + 1, sizeof(double)) : NULL;
    double *lpos = t->pos_w ? calloc(t->P, sizeof(double)) : NULL;
#pragma omp for collapse(2) schedule(static)
    for (int64_t g = 0; g < t->G; ++g)
      for (int64_t r = 0; r < t->bq; ++r) {
        int64_t i = t->i0 + r;
        float brow[K > 0 ? K : 1], drow[K > 0 ? K : 1]; unsigned char vrow[K > 0 ? K : 1];
        int64_t rrow[K > 0 ? K : 1]; int trow[K > 0 ? K : 1];
        for (int64_t j = 0; j < K; ++j) {
          int vis; int64_t rel = 0; int tb = 0;
          brow[j] = bias_of(t, g, i, j, &vis, &rel, &tb);
          vrow[j] = (unsigned char)vis; rrow[j] = rel; trow[j] = tb; drow[j] = 0.f;
        }
        for (int64_t hh = 0; hh < t->H; ++hh) {
          int64_t base = ((g * t->H + hh) * t->bq + r) * K;
          for (int64_t j = 0; j < K; ++j) {
            float x = t->alpha * ld(s, base + j, s_bf) + brow[j];
            float sg = 1.f / (1.f + expf(-x));
            float y = vrow[j] ? x * sg : 0.f;
            float d = vrow[j] ? ld(da, base + j, da_bf) * sg * (1.f + x * (1.f - sg)) : 0.f;
            st(a, base + j, y, a_bf);
            st(ds, base + j, d, ds_bf);
            drow[j] += d;
          }
        }
        if (lts) for (int64_t j = 0; j < K; ++j) lts[trow[j]] += drow[j];
        if (lpos) for (int64_t j = 0; j < K; ++j) lpos[rrow[j]] += drow[j];
      }
#pragma omp critical
    {
      if (lts) for (int64_t b = 0; b <= t->NB; ++b) d_ts[b] += lts[b];
      if (lpos) for (int64_t b = 0; b < t->P; ++b) d_pos[b] += lpos[b];
    }
    free(lts); free(lpos);
  }
}
