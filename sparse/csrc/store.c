/* Native kernels of the tiered store: the id index, the fused training lookup, the fused
 * sparse optimizer step, CLOCK cache victims and the TTL sweep.
 *
 * Plain C with no Python or torch headers: sparse/native.py loads it through ctypes and
 * registers each entry point as a torch.library operator. Every kernel works on the
 * store's own torch tensors (the tier slabs) through a descriptor of raw pointers, so
 * nothing is copied in or out and the PyTorch reference (sparse/store.py with
 * kernels="reference") and these kernels act on the same rows. Floating point follows the
 * reference operation by operation (built with -ffp-contract=off and no fast-math), so
 * both produce the same bits.
 *
 * Tier descriptor (int64 [17], built by native.tier_view):
 *   [0:3]   slabs per tier          [3:6]   rows per slab
 *   [6:9]   address of the tier's array of row-slab addresses   (fp32 [slab_rows, W])
 *   [9:12]  same for id slabs        (int64 [slab_rows], -1 = free slot)
 *   [12:15] same for metadata slabs  (int64 [slab_rows, 3]: last access, count, last update)
 *   [15]    W (row width: values + optimizer state)   [16] D (embedding dim)
 *
 * Index. id -> loc (slot << 2 | tier) in 256 segments of open addressing with linear
 * probing. An entry is 8 bytes: 22 fingerprint bits of the id's hash and loc + 1 (0 =
 * empty). The id itself is not stored: a fingerprint match is confirmed against the tier's
 * id slab at loc, so the store keeps one invariant: an entry's slot holds the entry's id
 * whenever an index call runs (rows are removed from the index before their slot is
 * freed, and inserted after their id is written). Deletion leaves a tombstone (a
 * backward shift would have to read the id slab of every later entry of the chain to find
 * its home: measured 0.3 ms per call, a tenth of an SSD-bound step); an insertion reuses
 * the first tombstone on its path, and a segment whose live entries and tombstones pass
 * 85% is rebuilt without them (seg_rebuild). A table that only grows keeps its segments
 * 68-85% full, 8 / load = 9.4-11.8 bytes per row; one that churns stays near 60%, 13.3
 * bytes. A rebuild holds one segment (1/256 of the index) twice, never the whole table.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define NUM_META 3
#define META_LAST_ACCESS 0
#define META_FREQ 1
#define META_LAST_UPDATE 2

#define SEG_BITS 8
#define NUM_SEGS (1 << SEG_BITS)
#define LOC_BITS 42
#define LOC_MASK ((1ULL << LOC_BITS) - 1)
#define FP_MASK ((1ULL << (64 - LOC_BITS)) - 1)
#define MIN_SEG_CAP 16
#define TOMB LOC_MASK /* fingerprint 0, loc + 1 = LOC_MASK: no live entry has it (ix_insert) */

typedef struct {
    uint64_t *tab;
    int64_t cap, live, tombs;
} Seg;

typedef struct {
    Seg seg[NUM_SEGS];
    int64_t live, bytes, peak_bytes;
} Index;

typedef struct {
    const int64_t *d;
} Tiers;

static inline uint64_t mix64(uint64_t z) {
    /* splitmix64 of the id, salted so the index does not share bits with rank ownership
     * (sparse/hashing.owner_rank), which would leave some bits constant on every rank. */
    z ^= 0x2545F4914F6CDD1DULL;
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static inline int64_t seg_home(uint64_t h, int64_t cap) {
    return (int64_t)(((unsigned __int128)(h << SEG_BITS) * (uint64_t)cap) >> 64);
}

/* Address of element `slot` (of `width` items) in a tier's slabs; memory tiers have one
 * slab, so the division is skipped there. */
#define SLAB_AT(type, field, width)                                                    \
    int64_t t = loc & 3, slot = loc >> 2, per = tv.d[3 + t];                           \
    type *const *slabs = (type *const *)(intptr_t)tv.d[field + t];                     \
    return slot < per ? slabs[0] + slot * (width) : slabs[slot / per] + (slot % per) * (width)

static inline int64_t *id_ptr(Tiers tv, int64_t loc) { SLAB_AT(int64_t, 9, 1); }
static inline float *row_ptr(Tiers tv, int64_t loc) { SLAB_AT(float, 6, tv.d[15]); }
static inline int64_t *meta_ptr(Tiers tv, int64_t loc) { SLAB_AT(int64_t, 12, NUM_META); }

/* Prefetch `bytes` from p on (every cache line). */
static inline void prefetch_span(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o);
}

static inline uint64_t entry_loc(uint64_t e) { return (e & LOC_MASK) - 1; }

/* ------------------------------------------------------------------------- index */

Index *ix_new(void) { return (Index *)calloc(1, sizeof(Index)); }

void ix_free(Index *ix) {
    if (!ix) return;
    for (int s = 0; s < NUM_SEGS; s++) free(ix->seg[s].tab);
    free(ix);
}

int64_t ix_len(const Index *ix) { return ix->live; }
int64_t ix_bytes(const Index *ix) { return ix->bytes; }
int64_t ix_peak_bytes(const Index *ix) { return ix->peak_bytes; }
void ix_reset_peak(Index *ix) { ix->peak_bytes = ix->bytes; }

/* Put an entry whose id is absent at the first free place of its chain: an empty slot or
 * a tombstone (the entry's later lookups stop at it or earlier). */
static void seg_put(Seg *s, uint64_t h, uint64_t e) {
    int64_t i = seg_home(h, s->cap);
    while (s->tab[i] && s->tab[i] != TOMB) i = (i + 1 == s->cap) ? 0 : i + 1;
    if (s->tab[i] == TOMB) s->tombs--;
    s->tab[i] = e;
}

/* Rebuild a segment without its tombstones, grown by 1/4 unless its live entries fill at
 * most 60% of it: a segment that churns (removals and insertions) then rebuilds only after
 * a quarter of its slots have turned over, and stays under 14 bytes per live entry. */
static int seg_rebuild(Index *ix, Seg *s, Tiers tv) {
    int64_t cap = s->cap < MIN_SEG_CAP ? MIN_SEG_CAP : s->cap;
    if ((s->live + 1) * 5 > cap * 3) cap += cap / 4;
    uint64_t *tab = (uint64_t *)calloc((size_t)cap, sizeof(uint64_t));
    if (!tab) return -1;
    int64_t held = ix->bytes + cap * 8;
    if (held > ix->peak_bytes) ix->peak_bytes = held;
    uint64_t *old = s->tab;
    int64_t old_cap = s->cap;
    s->tab = tab;
    s->cap = cap;
    for (int64_t i = 0; i < old_cap; i++)
        if (old[i] && old[i] != TOMB) seg_put(s, mix64((uint64_t)*id_ptr(tv, (int64_t)entry_loc(old[i]))), old[i]);
    free(old);
    s->tombs = 0;
    ix->bytes += (cap - old_cap) * 8;
    return 0;
}

/* Position of id in its segment, -1 if absent. */
static inline int64_t seg_find(const Seg *s, Tiers tv, int64_t id, uint64_t h) {
    if (s->cap == 0) return -1;
    uint64_t fp = h & FP_MASK;
    int64_t i = seg_home(h, s->cap);
    for (;;) {
        uint64_t e = s->tab[i];
        if (!e) return -1;
        if (e != TOMB && (e >> LOC_BITS) == fp && *id_ptr(tv, (int64_t)entry_loc(e)) == id) return i;
        i = (i + 1 == s->cap) ? 0 : i + 1;
    }
}

#define AHEAD 16

#define CHUNK 256

/* Where each id probably is, without touching the tiers: the location of its first
 * fingerprint match, or -1. A fingerprint collision can name another id's row, and the id
 * slab is not read to confirm (for an SSD-resident id that read is a disk read): for
 * read-ahead advice (slab_rows_will_need), never for reading a row. */
void ix_candidates(const Index *ix, const int64_t *ids, int64_t n, int64_t *out) {
    for (int64_t k = 0; k < n; k++) {
        uint64_t h = mix64((uint64_t)ids[k]), fp = h & FP_MASK;
        const Seg *s = &ix->seg[h >> (64 - SEG_BITS)];
        out[k] = -1;
        if (!s->cap) continue;
        for (int64_t i = seg_home(h, s->cap);; i = (i + 1 == s->cap) ? 0 : i + 1) {
            uint64_t e = s->tab[i];
            if (!e) break;
            if (e != TOMB && (e >> LOC_BITS) == fp) {
                out[k] = (int64_t)entry_loc(e);
                break;
            }
        }
    }
}

/* loc of each id, -1 where absent. Three passes over each chunk of ids, so that the
 * dependent cache misses of one id (its index slot, then the id slab entry that confirms
 * it) overlap with those of the chunk's other ids: hash and prefetch the home slots; take
 * each id's first fingerprint match and prefetch its id slab entry; confirm (a rare
 * fingerprint collision probes on the slow way). `out` holds the home position, then
 * the candidate's position, between passes. */
void ix_find(const Index *ix, const int64_t *tvd, const int64_t *ids, int64_t n, int64_t *out) {
    Tiers tv = {tvd};
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        int64_t c1 = n - c0 < CHUNK ? n : c0 + CHUNK;
        for (int64_t k = c0; k < c1; k++) {
            uint64_t h = mix64((uint64_t)ids[k]);
            const Seg *s = &ix->seg[h >> (64 - SEG_BITS)];
            out[k] = s->cap ? seg_home(h, s->cap) : -1;
            if (s->cap) __builtin_prefetch(&s->tab[out[k]]);
        }
        for (int64_t k = c0; k < c1; k++) {
            if (out[k] < 0) continue;
            uint64_t h = mix64((uint64_t)ids[k]), fp = h & FP_MASK;
            const Seg *s = &ix->seg[h >> (64 - SEG_BITS)];
            int64_t i = out[k];
            for (;;) {
                uint64_t e = s->tab[i];
                if (!e) {
                    out[k] = -1;
                    break;
                }
                if (e != TOMB && (e >> LOC_BITS) == fp) {
                    out[k] = i;
                    __builtin_prefetch(id_ptr(tv, (int64_t)entry_loc(e)));
                    break;
                }
                i = (i + 1 == s->cap) ? 0 : i + 1;
            }
        }
        for (int64_t k = c0; k < c1; k++) {
            if (out[k] < 0) continue;
            uint64_t h = mix64((uint64_t)ids[k]);
            const Seg *s = &ix->seg[h >> (64 - SEG_BITS)];
            int64_t loc = (int64_t)entry_loc(s->tab[out[k]]);
            if (*id_ptr(tv, loc) == ids[k]) {
                out[k] = loc;
                continue;
            }
            int64_t i = seg_find(s, tv, ids[k], h);
            out[k] = i < 0 ? -1 : (int64_t)entry_loc(s->tab[i]);
        }
    }
}

/* Insert ids known to be absent; the id slab at each loc must already hold the id.
 * Returns 0, -1 when memory ran out, -2 for a loc past LOC_BITS (the ids before the
 * failing one are inserted). */
int64_t ix_insert(Index *ix, const int64_t *tvd, const int64_t *ids, const int64_t *locs, int64_t n) {
    Tiers tv = {tvd};
    for (int64_t k = 0; k < n; k++) {
        uint64_t h = mix64((uint64_t)ids[k]);
        Seg *s = &ix->seg[h >> (64 - SEG_BITS)];
        if ((uint64_t)locs[k] >= LOC_MASK - 1) return -2;
        if ((s->live + s->tombs + 1) * 20 > s->cap * 17 && seg_rebuild(ix, s, tv)) return -1;
        seg_put(s, h, ((h & FP_MASK) << LOC_BITS) | ((uint64_t)locs[k] + 1));
        s->live++;
        ix->live++;
    }
    return 0;
}

/* Remove ids (absent ones are skipped) while their slots still hold them; returns how
 * many were removed. Each leaves a tombstone (see the index notes at the top). */
int64_t ix_remove(Index *ix, const int64_t *tvd, const int64_t *ids, int64_t n) {
    Tiers tv = {tvd};
    int64_t removed = 0;
    for (int64_t k = 0; k < n; k++) {
        uint64_t h = mix64((uint64_t)ids[k]);
        Seg *s = &ix->seg[h >> (64 - SEG_BITS)];
        int64_t i = seg_find(s, tv, ids[k], h);
        if (i < 0) continue;
        s->tab[i] = TOMB;
        s->tombs++;
        s->live--;
        ix->live--;
        removed++;
    }
    return removed;
}

/* Every (id, loc) in the index, in segment order; out arrays hold ix_len entries. */
void ix_items(const Index *ix, const int64_t *tvd, int64_t *ids, int64_t *locs) {
    Tiers tv = {tvd};
    int64_t m = 0;
    for (int s = 0; s < NUM_SEGS; s++)
        for (int64_t i = 0; i < ix->seg[s].cap; i++) {
            uint64_t e = ix->seg[s].tab[i];
            if (!e || e == TOMB) continue;
            locs[m] = (int64_t)entry_loc(e);
            ids[m] = *id_ptr(tv, locs[m]);
            m++;
        }
}

/* ------------------------------------------------------------------------- lookup */

/* fwd_lookup's dedup table: the unique position of each id (-1 = empty), 4 bytes per
 * slot, checked against the unique id array: at 2n slots it stays in L2, where 16-byte
 * (id, position) slots spilled to L3 (their probe was a fifth of the lookup's samples).
 * Reused per thread across calls up to DEDUP_KEEP slots (a fresh table per call costs
 * its page faults every step); larger ones are freed after. */
#define DEDUP_KEEP (1 << 22) /* 16 MB */
static _Thread_local int32_t *dedup_kept = NULL;
static _Thread_local int64_t dedup_kept_cap = 0;

static int32_t *dedup_table(int64_t cap) {
    if (cap > DEDUP_KEEP) return (int32_t *)malloc((size_t)cap * sizeof(int32_t));
    if (cap > dedup_kept_cap) {
        free(dedup_kept);
        dedup_kept = (int32_t *)malloc((size_t)cap * sizeof(int32_t));
        dedup_kept_cap = dedup_kept ? cap : 0;
    }
    return dedup_kept;
}

static void dedup_release(int32_t *tab) {
    if (tab != dedup_kept) free(tab);
}

/* The fused training lookup. Deduplicates ids (first-occurrence order: inv[i] is the
 * unique position of ids[i], uniq / cnt the unique ids and their sighting counts;
 * `counts` = NULL counts each occurrence once) and locates each unique id (loc, -1 if
 * absent). When every unique row is present, sits in a tier of `serve_mask` (bit t =
 * tier t is read in place), and is live (last update >= expire_before, or looked up at
 * or after open_from), it also commits: last access = step, count += sightings, CLOCK
 * count += sightings (at most ref_max), out [n, D] = each id's row values, and hits [t] +=
 * the unique ids served from tier t (hits may be NULL). Returns the number of unique ids U,
 * or -(U + 1) when it did not commit (nothing was written then but inv, uniq, cnt, loc).
 * A negative return below -n means memory ran out (or n >= 2^31, which the caller refuses). */
int64_t fwd_lookup(const Index *ix, const int64_t *tvd, const int64_t *ids, const int64_t *counts, int64_t n,
                   int64_t serve_mask, int64_t expire_before, int64_t open_from, int64_t step,
                   int64_t *inv, int64_t *uniq, int64_t *cnt, int64_t *loc, float *out,
                   uint8_t *ref0, uint8_t *ref1, int64_t ref_max, int64_t *hits) {
    Tiers tv = {tvd};
    int64_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    if (n >= INT32_MAX) return -n - 2;
    int32_t *tab = dedup_table(cap);
    if (!tab) return -n - 2;
    memset(tab, 0xff, (size_t)cap * sizeof(int32_t)); /* -1: empty */
    int64_t U = 0, mask = cap - 1;
    for (int64_t i = 0; i < n; i++) {
        int64_t id = ids[i];
        int64_t c = counts ? counts[i] : 1;
        int64_t j = (int64_t)(mix64((uint64_t)id) & (uint64_t)mask);
        while (tab[j] >= 0 && uniq[tab[j]] != id) j = (j + 1) & mask;
        if (tab[j] < 0) {
            tab[j] = (int32_t)U;
            uniq[U] = id;
            cnt[U++] = c;
        } else {
            cnt[tab[j]] += c;
        }
        inv[i] = tab[j];
    }
    dedup_release(tab);
    ix_find(ix, tvd, uniq, U, loc);
    int64_t D = tv.d[16];
    int ok = 1;
    for (int64_t u = 0; u < U && ok; u++) {
        if (loc[u] < 0 || !((serve_mask >> (loc[u] & 3)) & 1)) ok = 0;
    }
    if (ok && expire_before != INT64_MIN) {
        for (int64_t u = 0; u < U && ok; u++) {
            if (u + AHEAD < U) __builtin_prefetch(meta_ptr(tv, loc[u + AHEAD]));
            const int64_t *m = meta_ptr(tv, loc[u]);
            if (m[META_LAST_UPDATE] < expire_before && m[META_LAST_ACCESS] < open_from) ok = 0;
        }
    }
    if (!ok || !out) return -(U + 1);
    for (int64_t u = 0; u < U; u++) {
        if (u + AHEAD < U) {
            int64_t ahead = loc[u + AHEAD];
            __builtin_prefetch(meta_ptr(tv, ahead));
            uint8_t *ref = (ahead & 3) == 0 ? ref0 : ref1;
            if (ref) __builtin_prefetch(&ref[ahead >> 2]);
        }
        int64_t *m = meta_ptr(tv, loc[u]);
        if (hits) hits[loc[u] & 3]++;
        m[META_LAST_ACCESS] = step;
        m[META_FREQ] += cnt[u];
        uint8_t *ref = (loc[u] & 3) == 0 ? ref0 : ref1;
        if (ref) {
            int64_t r = ref[loc[u] >> 2] + cnt[u];
            ref[loc[u] >> 2] = (uint8_t)(r > ref_max ? ref_max : r);
        }
    }
    /* Rows are prefetched at their id's first sighting only: a repeated id's row was read
     * by its first copy and is still in cache (the ids are mostly repeats of hot rows). */
    int64_t first_ahead = 0; /* uniques numbered by first sighting: the next one not yet met */
    for (int64_t i = 0; i < n && i < AHEAD; i++) {
        if (inv[i] == first_ahead) {
            first_ahead++;
            prefetch_span(row_ptr(tv, loc[inv[i]]), D * (int64_t)sizeof(float));
        }
    }
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n && inv[i + AHEAD] == first_ahead) {
            first_ahead++;
            prefetch_span(row_ptr(tv, loc[inv[i + AHEAD]]), D * (int64_t)sizeof(float));
        }
        const float *r = row_ptr(tv, loc[inv[i]]);
        float *o = out + i * D;
        for (int64_t d = 0; d < D; d++) o[d] = r[d]; /* inlined and vectorized, unlike memcpy of a runtime size */
    }
    return U;
}

/* acc [U, D] = sum of grad [n, D] rows by inv, in the order of i: the same sums as
 * torch's index_add_ into zeros. inv must number unique ids by first occurrence (as
 * fwd_lookup does), so a row's first gradient is copied (0 + g is g) and acc needs no
 * zeroing. */
void grad_accumulate(const int64_t *inv, int64_t n, const float *grad, int64_t D, float *acc) {
    int64_t next = 0;
    for (int64_t i = 0; i < n; i++) {
        float *a = acc + inv[i] * D;
        const float *g = grad + i * D;
        if (inv[i] == next) {
            next++;
            for (int64_t d = 0; d < D; d++) a[d] = 0.0f + g[d];
        } else {
            for (int64_t d = 0; d < D; d++) a[d] = a[d] + g[d];
        }
    }
}

/* ------------------------------------------------------------------------- optimizer */

/* n floats on a cache-line boundary (free() releases them). malloc aligns to 16 bytes, so
 * the 32-byte vectors of the loops below would straddle cache lines in half the processes:
 * apply_rows measured 0.18 ms or 0.31 ms for the same 6.8K rows, by where malloc put its
 * scratch. */
static float *alloc_floats(int64_t n) {
    size_t bytes = ((size_t)n * sizeof(float) + 63) & ~(size_t)63; /* aligned_alloc wants a multiple */
    return (float *)aligned_alloc(64, bytes);
}

enum { OPT_ROWWISE_ADAGRAD = 0, OPT_SGD = 1 };

/* sq[0] after sq[d] = sq[d] + sq[d + h] for h = P/2, P/4, .., 1 (P a power of two): the
 * reference's pairwise sum (optim.sum_squares), in its order. With AVX2 the levels down to
 * 8 run 8 lanes at a time and the last three in one register, the same additions: the
 * scalar loops made each level wait on the stores of the one before (a cached 64-wide
 * row's step measured 77 ns with them, 59 ns without). */
static inline float halving_sum(float *sq, int64_t P) {
#ifdef __AVX2__
    if (P >= 8) {
        for (int64_t h = P / 2; h >= 8; h /= 2)
            for (int64_t d = 0; d < h; d += 8)
                _mm256_storeu_ps(sq + d, _mm256_add_ps(_mm256_loadu_ps(sq + d), _mm256_loadu_ps(sq + d + h)));
        __m256 v = _mm256_loadu_ps(sq);
        __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* h = 4 */
        x = _mm_add_ps(x, _mm_movehl_ps(x, x));                                       /* h = 2 */
        x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));                                   /* h = 1 */
        return _mm_cvtss_f32(x);
    }
#endif
    for (int64_t h = P / 2; h >= 1; h /= 2)
        for (int64_t d = 0; d < h; d++) sq[d] = sq[d] + sq[d + h];
    return sq[0];
}

/* One optimizer step on each row at loc[u] from its summed gradient grad [U, D], in
 * place, with the reference's operations in the reference's order (sparse/optim.py):
 *   g = grad (+ wd * w)
 *   rowwise_adagrad: mom = mom + sum_squares(g) / D; m = 1 / (sqrt(mom) + eps) * -lr;
 *                    w = w + g * m
 *   sgd:             w = w - g * lr
 * sum_squares adds g*g over the columns zero-padded to a power of two, halving.
 * set_update: also stamp each row's last-update time with `now`. Returns -1 on an
 * unknown optimizer or a failed allocation, else 0. */
int64_t apply_rows(const int64_t *tvd, const int64_t *loc, int64_t U, const float *grad, int64_t opt,
                   float lr, float eps, float wd, int64_t set_update, int64_t now) {
    Tiers tv = {tvd};
    int64_t D = tv.d[16], P = 1;
    while (P < D) P <<= 1;
    float *g = alloc_floats(D + P);
    if (!g || (opt != OPT_ROWWISE_ADAGRAD && opt != OPT_SGD)) {
        free(g);
        return -1;
    }
    float *sq = g + D;
    int64_t W = tv.d[15];
    for (int64_t u = 0; u < U; u++) {
        if (u + AHEAD < U) {
            prefetch_span(row_ptr(tv, loc[u + AHEAD]), W * (int64_t)sizeof(float));
            if (set_update) __builtin_prefetch(meta_ptr(tv, loc[u + AHEAD]));
        }
        float *w = row_ptr(tv, loc[u]);
        const float *gu = grad + u * D;
        for (int64_t d = 0; d < D; d++) g[d] = wd != 0.0f ? gu[d] + wd * w[d] : gu[d];
        if (opt == OPT_ROWWISE_ADAGRAD) {
            for (int64_t d = 0; d < D; d++) sq[d] = g[d] * g[d];
            for (int64_t d = D; d < P; d++) sq[d] = 0.0f;
            float mom = w[D] + halving_sum(sq, P) / (float)D;
            w[D] = mom;
            float mult = (1.0f / (sqrtf(mom) + eps)) * -lr;
            for (int64_t d = 0; d < D; d++) w[d] = w[d] + g[d] * mult;
        } else {
            for (int64_t d = 0; d < D; d++) w[d] = w[d] - g[d] * lr;
        }
        if (set_update) meta_ptr(tv, loc[u])[META_LAST_UPDATE] = now;
    }
    free(g);
    return 0;
}

/* A committed lookup's backward in one call: grad_accumulate into scratch rows, then
 * apply_rows on them (loc: the lookup's locations, still valid). The same sums and steps
 * as the two calls in turn. Returns apply_rows's result, -1 also when the scratch could
 * not be allocated. */
int64_t bwd_apply(const int64_t *tvd, const int64_t *inv, int64_t n, const float *grad, const int64_t *loc,
                  int64_t U, int64_t opt, float lr, float eps, float wd, int64_t set_update, int64_t now) {
    int64_t D = tvd[16];
    float *acc = alloc_floats((U > 0 ? U : 1) * D);
    if (!acc) return -1;
    grad_accumulate(inv, n, grad, D, acc);
    int64_t r = apply_rows(tvd, loc, U, acc, opt, lr, eps, wd, set_update, now);
    free(acc);
    return r;
}

/* ------------------------------------------------------------------------- policies */

/* Up to k CLOCK victims of a one-slab memory tier: the hand sweeps the slots; a used slot
 * not looked up by the current lookup (last access < step) with a nonzero count loses one,
 * one at zero is a victim (its count becomes CHOSEN, so a later turn does not choose it
 * again; the caller frees every victim). With counts capped at 1 this is CLOCK (recency);
 * capped higher, generalized CLOCK (frequency). At most ref_max + 1 turns. */
#define CHOSEN 255
int64_t clock_victims(const int64_t *ids, const int64_t *meta, uint8_t *ref, int64_t cap, int64_t *hand,
                      int64_t k, int64_t step, int64_t ref_max, int64_t *out) {
    int64_t m = 0, h = *hand;
    for (int64_t visits = 0; visits < (ref_max + 1) * cap && m < k; visits++) {
        int64_t s = h;
        h = (h + 1 == cap) ? 0 : h + 1;
        if (ids[s] < 0 || ref[s] == CHOSEN || meta[s * NUM_META + META_LAST_ACCESS] >= step) continue;
        if (ref[s]) {
            ref[s]--;
            continue;
        }
        ref[s] = CHOSEN;
        out[m++] = s;
    }
    *hand = h;
    return m;
}

/* The TTL sweep of one slab, resumable: from slot `start`, the slots of used rows whose
 * last update is before expire_before and whose last access is before open_from, at most
 * max_out of them; *next = where the sweep stops (slab_rows when done). */
int64_t expired_slots(const int64_t *ids, const int64_t *meta, int64_t slab_rows, int64_t start,
                      int64_t expire_before, int64_t open_from, int64_t *out, int64_t max_out, int64_t *next) {
    int64_t m = 0, s = start;
    for (; s < slab_rows && m < max_out; s++) {
        const int64_t *r = meta + s * NUM_META;
        if (ids[s] >= 0 && r[META_LAST_UPDATE] < expire_before && r[META_LAST_ACCESS] < open_from) out[m++] = s;
    }
    *next = s;
    return m;
}

/* ------------------------------------------------------------------------- max_rows */

typedef struct {
    int64_t score, id, loc;
} Cand;

static inline int cand_less(const Cand *a, const Cand *b) {
    return a->score < b->score || (a->score == b->score && a->id < b->id);
}

static void heap_sift_down(Cand *h, int64_t n, int64_t i) { /* a max-heap on (score, id) */
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && cand_less(&h[m], &h[l])) m = l;
        if (r < n && cand_less(&h[m], &h[r])) m = r;
        if (m == i) return;
        Cand t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

static int cand_cmp(const void *a, const void *b) {
    return cand_less((const Cand *)a, (const Cand *)b) ? -1 : cand_less((const Cand *)b, (const Cand *)a) ? 1 : 0;
}

/* LFU's score: the count, saturated at 2^LFU_FREQ_BITS - 1, above the last access,
 * saturated at 2^(63 - LFU_FREQ_BITS) - 1, so that the sum never wraps (as TableStore._score). */
#define LFU_FREQ_BITS 22
static inline int64_t lfu_score(int64_t freq, int64_t last) {
    const int64_t freq_max = (1LL << LFU_FREQ_BITS) - 1, last_max = (1LL << (63 - LFU_FREQ_BITS)) - 1;
    return (freq < freq_max ? freq : freq_max) * (1LL << (63 - LFU_FREQ_BITS)) + (last < last_max ? last : last_max);
}

/* The k rows of every tier with the lowest (score, id), lowest first, skipping rows looked
 * up at or after open_from (the open step's): score = last access (lfu = 0), or
 * lfu_score (lfu = 1), as the reference's _score. One scan of the tiers' id and
 * metadata slabs with a k-entry heap: no temporary the size of the table. out_loc /
 * out_ids get the rows; returns how many (fewer than k when fewer rows qualify). */
int64_t lowest_rows(const int64_t *tvd, int64_t k, int64_t lfu, int64_t open_from, int64_t *out_loc,
                    int64_t *out_ids) {
    Tiers tv = {tvd};
    if (k <= 0) return 0;
    Cand *h = (Cand *)malloc((size_t)k * sizeof(Cand));
    if (!h) return -1;
    int64_t n = 0;
    for (int64_t t = 0; t < 3; t++) {
        int64_t per = tv.d[3 + t];
        int64_t *const *ids = (int64_t *const *)(intptr_t)tv.d[9 + t];
        int64_t *const *meta = (int64_t *const *)(intptr_t)tv.d[12 + t];
        for (int64_t sl = 0; sl < tv.d[t]; sl++) {
            const int64_t *is = ids[sl], *ms = meta[sl];
            for (int64_t i = 0; i < per; i++) {
                if (is[i] < 0) continue;
                const int64_t *m = ms + i * NUM_META;
                if (m[META_LAST_ACCESS] >= open_from) continue;
                Cand c = {lfu ? lfu_score(m[META_FREQ], m[META_LAST_ACCESS]) : m[META_LAST_ACCESS], is[i],
                          ((sl * per + i) << 2) | t};
                if (n < k) {
                    h[n++] = c;
                    if (n == k)
                        for (int64_t j = k / 2; j >= 0; j--) heap_sift_down(h, n, j);
                } else if (cand_less(&c, &h[0])) {
                    h[0] = c;
                    heap_sift_down(h, n, 0);
                }
            }
        }
    }
    qsort(h, (size_t)n, sizeof(Cand), cand_cmp);
    for (int64_t j = 0; j < n; j++) {
        out_loc[j] = h[j].loc;
        out_ids[j] = h[j].id;
    }
    free(h);
    return n;
}

/* ------------------------------------------------------------------------- slab rows */

/* Gather (dir = 0: out[i] = slab row at slots[i]) or scatter (dir = 1: the slab row at
 * slots[i] = buf[i]) rows of `row_bytes` bytes across a slab array: `slabs` holds the
 * address of each slab of `slab_rows` rows. One call for any number of slabs, where a
 * per-slab loop in Python cost about 12 us per slab touched. */
void slab_rows_copy(const int64_t *slabs, int64_t slab_rows, int64_t row_bytes, const int64_t *slots, int64_t n,
                    char *buf, int64_t dir) {
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            int64_t s = slots[i + AHEAD];
            __builtin_prefetch((const char *)(intptr_t)slabs[s / slab_rows] + (s % slab_rows) * row_bytes);
        }
        int64_t s = slots[i];
        char *row = (char *)(intptr_t)slabs[s / slab_rows] + (s % slab_rows) * row_bytes;
        if (dir)
            memcpy(row, buf + i * row_bytes, (size_t)row_bytes);
        else
            memcpy(buf + i * row_bytes, row, (size_t)row_bytes);
    }
}

typedef struct {
    const int64_t *slabs, *slots;
    int64_t slab_rows, row_bytes, n, dir;
    char *buf;
} CopyShare;

static void *copy_share(void *arg) {
    CopyShare *c = (CopyShare *)arg;
    slab_rows_copy(c->slabs, c->slab_rows, c->row_bytes, c->slots, c->n, c->buf, c->dir);
    return NULL;
}

#define MAX_COPY_THREADS 64

/* slab_rows_copy on up to `threads` threads, a contiguous share of the rows each. Meant
 * for memory-mapped SSD slabs: a cold row is a page fault that its thread waits out
 * alone, so `threads` threads keep that many reads in flight (the disk's queue depth)
 * where one thread issues them one at a time. A thread that cannot start leaves its share
 * to the calling thread. */
void slab_rows_copy_mt(const int64_t *slabs, int64_t slab_rows, int64_t row_bytes, const int64_t *slots, int64_t n,
                       char *buf, int64_t dir, int64_t threads) {
    if (threads > MAX_COPY_THREADS) threads = MAX_COPY_THREADS;
    if (threads < 1) threads = 1;
    pthread_t tid[MAX_COPY_THREADS];
    CopyShare share[MAX_COPY_THREADS];
    int started[MAX_COPY_THREADS] = {0};
    int64_t per = (n + threads - 1) / threads;
    for (int64_t t = 0; t < threads; t++) {
        int64_t lo = t * per, m = n - lo < per ? n - lo : per;
        share[t] = (CopyShare){slabs, slots + lo, slab_rows, row_bytes, m > 0 ? m : 0, dir, buf + lo * row_bytes};
        if (t > 0 && share[t].n > 0) started[t] = pthread_create(&tid[t], NULL, copy_share, &share[t]) == 0;
    }
    copy_share(&share[0]);
    for (int64_t t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(tid[t], NULL);
        else if (share[t].n > 0)
            copy_share(&share[t]);
    }
}

/* Ask the kernel to start reading the pages that hold the rows at `slots` of a multi-slab
 * array of memory-mapped files (madvise MADV_WILLNEED: the reads are queued and the call
 * returns without waiting for them), so that a later copy of those rows finds them in the
 * page cache. One call puts every row's read in flight at once: the disk's whole queue
 * depth, where a copy that faults row by row keeps one read in flight per thread. Advice
 * only: it changes no byte, so a row that moved since its slot was found costs a wasted
 * read, never a wrong value. Consecutive rows on one page are advised once. Returns the
 * number of page ranges advised. */
int64_t slab_rows_will_need(const int64_t *slabs, int64_t slab_rows, int64_t row_bytes, const int64_t *slots,
                            int64_t n) {
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t last = 0;
    int64_t advised = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t s = slots[i];
        if (s < 0) continue;
        uintptr_t row = (uintptr_t)slabs[s / slab_rows] + (uintptr_t)((s % slab_rows) * row_bytes);
        uintptr_t lo = row & ~(page - 1), hi = (row + (uintptr_t)row_bytes + page - 1) & ~(page - 1);
        if (lo == last && hi == lo + page) continue;
        madvise((void *)lo, hi - lo, MADV_WILLNEED);
        last = lo;
        advised++;
    }
    return advised;
}
