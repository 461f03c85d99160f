"""A synthetic ad event log with a planted ground truth.

The world:

    categories -> advertisers (one category each) -> campaigns -> ads
    ad popularity: Zipf over a random ranking of the ads
    latent factors: category ~ N(0, I); advertiser = its category + noise; ad = its advertiser + noise;
                    user = a mix of two favourite categories + noise

Each user is a stream of impressions in sessions (short gaps inside a session, long
gaps between). The ad served at each impression comes from one of three sources:

    retargeting  the advertiser or category of the user's last clicked ad, with a
                 probability that decays with the time since that click
    targeting    one of the user's favourite categories
    popularity   the whole catalogue, Zipf-weighted

and is clicked with

    logit = intercept + ad_bias + affinity(user, ad) + slot_bias + device_bias
            + recency * (same_category + same_advertiser + similarity(last_clicked_ad, ad))

where recency = 2 ** (-seconds since the last click / half life). The last term is the
short-term sequential signal: a model that sees the history (what was clicked, and when)
can use it; a popularity model cannot. A click converts with a probability driven by the
same affinity. One row per impression:

    user_id ts item_id action advertiser_id campaign_id category_id slot device click conversion p_click p_click_static
    int64   int64 int64 int64  int64        int64       int64       int64 int64 int8  int8       float32 float32

`action` is the deepest engagement of that impression (0 impression, 1 click, 2 conversion);
`click`/`conversion` repeat it as 0/1 labels; `p_click` is the planted click probability of
the impression and `p_click_static` the same without its sequential terms (`emit_truth`, on by
default: `genrec eval` shows the oracle they make beside the model). `synth_manifest.json` records the planted
truth measured on a sample: the click AUC of the oracle probability, of the oracle without
its sequential terms, and of popularity baselines (each ad's global CTR; its impression
count). The oracle/popularity gap is the headroom a sequence model can claim.

Generation streams: users are processed in chunks of about `events_per_file` events
(one part-file per chunk, rows in time order inside the file); memory is O(users + items +
events_per_file), never O(events). Same arguments and seed -> byte-identical files.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from genrec.data.files import claim_output_dir
from genrec.data.partwriter import PartWriter
from genrec.data.schema import ACTION_CLICK, ACTION_CONVERSION, ACTION_IMPRESSION

MANIFEST_NAME = "synth_manifest.json"
FLAGS = {"num_users": "--users", "num_items": "--items", "num_events": "--events"}
"""`genrec synth`'s flag for each size, named in the errors."""
MAX_COUNT = 1 << 62
"""Largest size any argument may take."""
COLUMNS = ["user_id", "ts", "item_id", "action", "advertiser_id", "campaign_id", "category_id",
           "slot", "device", "click", "conversion"]


@dataclass(kw_only=True)
class SynthConfig:
    """Knobs of the synthetic world. Defaults give a ~4% CTR log with a clear sequential signal."""

    num_categories: int = 0
    """Ad categories; 0 picks clamp(num_items // 100, 4, 1000) (never more than advertisers)."""
    ads_per_campaign: float = 5.0
    """Mean ads per campaign (sets the number of campaigns)."""
    campaigns_per_advertiser: float = 4.0
    """Mean campaigns per advertiser (sets the number of advertisers)."""
    popularity_exponent: float = 1.05
    """Zipf exponent of ad popularity (serving weight of the ad at rank r is r ** -exponent)."""
    latent_dim: int = 16
    """Dimension of the planted user/ad factors."""
    affinity_std: float = 1.0
    """Std (in logits) of the user-ad affinity over popularity-served impressions."""
    ad_bias_std: float = 0.5
    """Std of the per-ad click logit bias."""
    base_ctr: float = 0.04
    """Mean click rate before sequential effects (the intercept is calibrated to it; the log's CTR
    comes out higher because retargeted impressions after a click convert better)."""
    conversion_rate: float = 0.1
    """Mean conversion probability of a click (before affinity)."""
    num_slots: int = 4
    """Ad slots on a page; slot 0 gets the best position bias."""
    num_devices: int = 3
    """Device types; each user has a primary device used 90% of the time."""
    same_category_boost: float = 0.6
    """Click logit boost when the ad shares the category of the last clicked ad (times recency)."""
    same_advertiser_boost: float = 0.4
    """Click logit boost when the ad shares the advertiser of the last clicked ad (times recency)."""
    last_click_similarity: float = 0.6
    """Click logit weight of cos(last clicked ad, ad) (times recency)."""
    recency_half_life_s: float = 1800.0
    """Half life of the sequential effects, in seconds since the last click."""
    retarget_prob: float = 0.4
    """Probability (times recency) that an impression retargets the last click's advertiser/category."""
    retarget_same_advertiser: float = 0.4
    """Share of retargeted impressions drawn from the same advertiser (else the same category)."""
    interest_targeting_prob: float = 0.3
    """Probability that an impression is drawn from one of the user's favourite categories."""
    session_break_prob: float = 0.08
    """Probability that the next event starts a new session."""
    mean_gap_in_session_s: float = 45.0
    """Mean seconds between events of a session (exponential)."""
    mean_gap_between_sessions_s: float = 129600.0
    """Mean seconds between sessions (exponential); 1.5 days."""
    start_ts: int = 1_700_000_000
    """Earliest event time (unix seconds)."""
    start_span_s: int = 30 * 86400
    """Users' first events are spread uniformly over this many seconds after `start_ts`."""
    user_length_sigma: float = 1.0
    """Log-normal sigma of per-user event counts (heavier tail when larger)."""
    truth_sample_size: int = 200_000
    """Events sampled for the planted-truth AUCs in the manifest."""
    sparse_ids: bool = False
    """Draw user/ad/campaign/advertiser ids as random 62-bit ints instead of shuffled 1..N."""


def click_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC of `scores` for 0/1 `labels` (Mann-Whitney, ties get average ranks)."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(bool)
    num_pos = int(labels.sum())
    num_neg = labels.size - num_pos
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    is_start = np.r_[True, sorted_scores[1:] != sorted_scores[:-1]]
    group = np.cumsum(is_start) - 1
    starts = np.flatnonzero(is_start)
    ends = np.r_[starts[1:], scores.size]
    ranks = np.empty(scores.size)
    ranks[order] = ((starts + ends + 1) / 2.0)[group]
    return float((ranks[labels].sum() - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _solve_intercept(logits: np.ndarray, weights: np.ndarray, target: float) -> float:
    """The intercept b with weighted mean sigmoid(b + logits) == target (bisection)."""
    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if np.average(_sigmoid(mid + logits), weights=weights) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _ids(rng: np.random.Generator, n: int, sparse: bool) -> np.ndarray:
    """External ids for internal indices 0..n-1: a shuffle of 1..n, or unique random 62-bit ints."""
    if not sparse:
        return rng.permutation(n).astype(np.int64) + 1
    while True:
        ids = rng.integers(1, 1 << 62, size=n, dtype=np.int64)
        if np.unique(ids).size == n:
            return ids


class _World:
    """The catalogue and the click model, shared by all user chunks.

    Internal ad indices are ordered by campaign, campaigns by advertiser and advertisers by
    category, so every category and advertiser owns a contiguous index range; sampling an
    ad of a category by popularity is one searchsorted into the popularity CDF.
    """

    def __init__(self, rng: np.random.Generator, num_items: int, cfg: SynthConfig) -> None:
        n = num_items
        num_campaigns = int(np.clip(round(n / cfg.ads_per_campaign), 1, n))
        num_advertisers = int(np.clip(round(num_campaigns / cfg.campaigns_per_advertiser), 1, num_campaigns))
        num_categories = cfg.num_categories or int(np.clip(n // 100, 4, 1000))
        num_categories = min(num_categories, num_advertisers)
        # Every level gets at least one child, the rest assigned at random; sorting makes ranges.
        cat_weight = 1.0 / np.arange(1, num_categories + 1) ** 0.7
        adv_cat = np.sort(np.r_[np.arange(num_categories),
                                rng.choice(num_categories, num_advertisers - num_categories, p=cat_weight / cat_weight.sum())])
        camp_adv = np.sort(np.r_[np.arange(num_advertisers), rng.integers(0, num_advertisers, num_campaigns - num_advertisers)])
        ad_camp = np.sort(np.r_[np.arange(num_campaigns), rng.integers(0, num_campaigns, n - num_campaigns)])
        self.ad_campaign = ad_camp
        self.ad_advertiser = camp_adv[ad_camp]
        self.ad_category = adv_cat[self.ad_advertiser]
        self.num_campaigns, self.num_advertisers, self.num_categories = num_campaigns, num_advertisers, num_categories
        idx = np.arange(num_categories)
        self.cat_lo = np.searchsorted(self.ad_category, idx, "left")
        self.cat_hi = np.searchsorted(self.ad_category, idx, "right")
        idx = np.arange(num_advertisers)
        self.adv_lo = np.searchsorted(self.ad_advertiser, idx, "left")
        self.adv_hi = np.searchsorted(self.ad_advertiser, idx, "right")

        popularity = 1.0 / (rng.permutation(n) + 1.0) ** cfg.popularity_exponent
        self.pop_cdf = np.cumsum(popularity / popularity.sum())
        self.pop_cdf[-1] = 1.0
        self.pop_cdf0 = np.r_[0.0, self.pop_cdf]  # pop_cdf0[i] = mass of ads < i
        self.cat_popularity = np.bincount(self.ad_category, weights=popularity, minlength=num_categories)
        self.cat_popularity /= self.cat_popularity.sum()

        d = cfg.latent_dim
        cat_f = rng.standard_normal((num_categories, d))
        adv_f = cat_f[adv_cat] + 0.6 * rng.standard_normal((num_advertisers, d))
        ad_f = adv_f[self.ad_advertiser] + 0.6 * rng.standard_normal((n, d))
        self.cat_f = cat_f
        self.ad_f = (ad_f / np.linalg.norm(ad_f, axis=1, keepdims=True)).astype(np.float32)
        self.ad_bias = (cfg.ad_bias_std * rng.standard_normal(n)).astype(np.float32)
        self.conv_bias = (0.5 * rng.standard_normal(n)).astype(np.float32)
        self.slot_bias = np.linspace(0.3, -0.6, cfg.num_slots) if cfg.num_slots > 1 else np.zeros(1)
        self.device_bias = 0.2 * rng.standard_normal(cfg.num_devices)
        self.device_p = 1.0 / np.arange(1, cfg.num_devices + 1) ** 1.5
        self.device_p /= self.device_p.sum()

        self.item_ids = _ids(rng, n, cfg.sparse_ids)
        self.campaign_ids = _ids(rng, num_campaigns, cfg.sparse_ids)
        self.advertiser_ids = _ids(rng, num_advertisers, cfg.sparse_ids)
        self.category_ids = np.arange(1, num_categories + 1, dtype=np.int64)

        # Calibrate on a sample of impressions of fresh users served by popularity and by
        # interest targeting (retargeting needs the sequence, so it is left out): the affinity
        # scale, then the click intercept, then the conversion intercept on click-weighted rows,
        # so the knobs mean what they say whatever the catalogue size.
        num = 20_000
        users = self.new_users(rng, num, cfg)
        interest = rng.random(num) < cfg.interest_targeting_prob
        fav_cat = users.fav[:, 0]
        lo = np.where(interest, self.cat_lo[fav_cat], 0)
        hi = np.where(interest, self.cat_hi[fav_cat], n)
        ads = self.sample_ads(rng, lo, hi)
        raw = np.einsum("ij,ij->i", users.factors, self.ad_f[ads])
        popular = ~interest
        self.affinity_scale = cfg.affinity_std / max(float(raw[popular].std()), 1e-6)
        affinity = self.affinity_scale * raw
        static = self.ad_bias[ads] + affinity
        self.intercept = _solve_intercept(static, np.ones(num), cfg.base_ctr)
        conv = self.conv_bias[ads] + 0.8 * affinity
        self.conv_intercept = _solve_intercept(conv, _sigmoid(self.intercept + static), cfg.conversion_rate)

    def sample_ads(self, rng: np.random.Generator, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """One popularity-weighted ad index per row from the index range [lo, hi)."""
        base = self.pop_cdf0[lo]
        u = base + rng.random(lo.size) * (self.pop_cdf0[hi] - base)
        return np.clip(np.searchsorted(self.pop_cdf, u, "right"), lo, hi - 1)

    def new_users(self, rng: np.random.Generator, num: int, cfg: SynthConfig) -> "_Users":
        fav = rng.choice(self.num_categories, size=(num, 2), p=self.cat_popularity)
        factors = self.cat_f[fav[:, 0]] + 0.5 * self.cat_f[fav[:, 1]] + 0.7 * rng.standard_normal((num, cfg.latent_dim))
        factors = (factors / np.linalg.norm(factors, axis=1, keepdims=True)).astype(np.float32)
        device = rng.choice(cfg.num_devices, size=num, p=self.device_p)
        return _Users(fav=fav, factors=factors, device=device)


@dataclass
class _Users:
    fav: np.ndarray
    factors: np.ndarray
    device: np.ndarray


@dataclass
class _Chunk:
    """Events of one user chunk, in user-major layout (then sorted by time for the file)."""

    user: np.ndarray
    ts: np.ndarray
    ad: np.ndarray
    slot: np.ndarray
    device: np.ndarray
    click: np.ndarray
    conversion: np.ndarray
    p_click: np.ndarray
    p_static: np.ndarray


def _generate_chunk(world: _World, cfg: SynthConfig, rng: np.random.Generator,
                    lengths_U: np.ndarray) -> _Chunk:
    """Simulate the users of one chunk. The loop runs over event positions, vectorized over
    the users still active at that position (users sorted longest first, so the active set
    is a prefix)."""
    num_users = lengths_U.size
    users = world.new_users(rng, num_users, cfg)
    order = np.argsort(-lengths_U, kind="stable")  # position in loop -> chunk-local user
    sorted_len = lengths_U[order]
    offsets = np.r_[0, np.cumsum(lengths_U)]
    base_U = offsets[:-1][order]  # where each loop user's events start in the output
    total = int(offsets[-1])
    factors = users.factors[order]
    fav = users.fav[order]
    primary_device = users.device[order]

    out = _Chunk(user=np.repeat(np.arange(num_users), lengths_U), ts=np.empty(total, np.int64),
                 ad=np.empty(total, np.int64), slot=np.empty(total, np.int64),
                 device=np.empty(total, np.int64), click=np.empty(total, np.int8),
                 conversion=np.empty(total, np.int8), p_click=np.empty(total, np.float32),
                 p_static=np.empty(total, np.float32))
    now = cfg.start_ts + rng.integers(0, max(cfg.start_span_s, 1), num_users)
    last_ad = np.full(num_users, -1, np.int64)
    last_click_ts = np.zeros(num_users, np.int64)
    num_items = world.ad_f.shape[0]
    decay_per_s = math.log(2) / cfg.recency_half_life_s
    # Active users at position t are the prefix [0, active[t]).
    max_len = int(sorted_len[0]) if num_users else 0
    active = num_users - np.searchsorted(sorted_len[::-1], np.arange(max_len), "right")

    for t in range(max_len):
        m = int(active[t])
        if t > 0:
            new_session = rng.random(m) < cfg.session_break_prob
            mean_gap = np.where(new_session, cfg.mean_gap_between_sessions_s, cfg.mean_gap_in_session_s)
            now[:m] += 1 + (rng.exponential(1.0, m) * mean_gap).astype(np.int64)
        ts = now[:m]
        prev = last_ad[:m]
        has_click = prev >= 0
        recency = np.where(has_click, np.exp(-(ts - last_click_ts[:m]) * decay_per_s), 0.0)

        # Which range of the catalogue serves this impression.
        r = rng.random(m)
        retarget = r < cfg.retarget_prob * recency
        interest = ~retarget & (r < cfg.retarget_prob * recency + cfg.interest_targeting_prob)
        lo = np.zeros(m, np.int64)
        hi = np.full(m, num_items, np.int64)
        prev_safe = np.where(has_click, prev, 0)
        same_adv = retarget & (rng.random(m) < cfg.retarget_same_advertiser)
        same_cat = retarget & ~same_adv
        adv = world.ad_advertiser[prev_safe]
        cat = world.ad_category[prev_safe]
        lo = np.where(same_adv, world.adv_lo[adv], lo)
        hi = np.where(same_adv, world.adv_hi[adv], hi)
        lo = np.where(same_cat, world.cat_lo[cat], lo)
        hi = np.where(same_cat, world.cat_hi[cat], hi)
        fav_cat = np.where(rng.random(m) < 0.7, fav[:m, 0], fav[:m, 1])
        lo = np.where(interest, world.cat_lo[fav_cat], lo)
        hi = np.where(interest, world.cat_hi[fav_cat], hi)
        ad = world.sample_ads(rng, lo, hi)

        slot = rng.integers(0, cfg.num_slots, m)
        device = np.where(rng.random(m) < 0.9, primary_device[:m], rng.integers(0, cfg.num_devices, m))
        ad_f = world.ad_f[ad]
        affinity = world.affinity_scale * np.einsum("ij,ij->i", factors[:m], ad_f)
        static = (world.intercept + world.ad_bias[ad] + affinity + world.slot_bias[slot]
                  + world.device_bias[device])
        sequential = recency * (
            cfg.same_category_boost * (world.ad_category[ad] == cat)
            + cfg.same_advertiser_boost * (world.ad_advertiser[ad] == adv)
            + cfg.last_click_similarity * np.einsum("ij,ij->i", world.ad_f[prev_safe], ad_f))
        p_click = _sigmoid(static + sequential)
        click = rng.random(m) < p_click
        p_conv = _sigmoid(world.conv_intercept + world.conv_bias[ad] + 0.8 * affinity)
        conversion = click & (rng.random(m) < p_conv)

        last_ad[:m] = np.where(click, ad, prev)
        last_click_ts[:m] = np.where(click, ts, last_click_ts[:m])

        pos = base_U[:m] + t
        out.ts[pos] = ts
        out.ad[pos] = ad
        out.slot[pos] = slot
        out.device[pos] = device
        out.click[pos] = click
        out.conversion[pos] = conversion
        out.p_click[pos] = p_click
        out.p_static[pos] = _sigmoid(static)
    return out


def _validate(num_users: int, num_items: int, num_events: int, events_per_file: int, seed: int,
              cfg: SynthConfig) -> None:
    for name, value in (("num_users", num_users), ("num_items", num_items), ("num_events", num_events),
                        ("events_per_file", events_per_file)):
        flag = f" ({FLAGS[name]})" if name in FLAGS else ""
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"synthesize: {name}{flag} must be a positive integer, got {value!r}")
        if value > MAX_COUNT:  # numpy's counts are int64: larger ones fail deep inside with an OverflowError
            raise ValueError(f"synthesize: {name}{flag} must be at most 2**62, got {value!r}")
    if num_events < num_users:
        raise ValueError(f"synthesize: num_events ({num_events}) must be >= num_users ({num_users}); "
                         "every user gets at least one event (--events, --users)")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"synthesize: seed must be a non-negative integer, got {seed!r}")
    if not 0 < cfg.base_ctr < 1 or not 0 < cfg.conversion_rate < 1:
        raise ValueError("synthesize: base_ctr and conversion_rate must be in (0, 1)")
    if cfg.num_slots < 1 or cfg.num_devices < 1 or cfg.latent_dim < 1 or cfg.num_categories < 0:
        raise ValueError("synthesize: num_slots, num_devices, latent_dim must be >= 1 and num_categories >= 0")
    if cfg.truth_sample_size < 1:
        raise ValueError(f"synthesize: truth_sample_size must be >= 1, got {cfg.truth_sample_size}")


def synthesize(out_dir: str | os.PathLike, *, num_users: int, num_items: int, num_events: int, seed: int,
               events_per_file: int = 1_000_000, overwrite: bool = False, config: SynthConfig | None = None,
               emit_truth: bool = True, progress: bool = True) -> dict:
    """Write a synthetic ad log of exactly `num_events` impressions by `num_users` users over
    `num_items` ads as `out_dir/part-NNNNN.parquet` plus `out_dir/synth_manifest.json`.

    Each part holds whole users (about `events_per_file` events), rows sorted by time.
    `emit_truth` (default) adds float32 columns `p_click` (the oracle click probability) and
    `p_click_static` (the oracle without its sequential terms); prepare ignores them, the
    evaluation's oracle baseline reads them. Raises ValueError on
    non-positive counts or a non-empty `out_dir` without `overwrite`. Returns the manifest
    plus `seconds` and `events_per_s`.
    """
    cfg = config or SynthConfig()
    _validate(num_users, num_items, num_events, events_per_file, seed, cfg)
    claim_output_dir(out_dir, overwrite=overwrite, manifest=MANIFEST_NAME)
    started = time.perf_counter()
    world_rng = np.random.default_rng(np.random.SeedSequence([seed, 0]))
    try:
        world = _World(world_rng, num_items, cfg)
        # Per-user event counts: 1 each plus a log-normal-weighted multinomial share of the rest.
        weights = world_rng.lognormal(0.0, cfg.user_length_sigma, num_users)
        lengths_U = 1 + world_rng.multinomial(num_events - num_users, weights / weights.sum())
        user_ids = _ids(world_rng, num_users, cfg.sparse_ids)
        cum = np.cumsum(lengths_U)
        # Chunk c holds users [bounds[c], bounds[c+1]): cut after each user whose events reach a multiple of
        # events_per_file (O(users): a list of the multiples would be O(events / events_per_file)).
        cuts = np.flatnonzero(np.diff(np.r_[0, cum // events_per_file]) > 0) + 1
        bounds = np.unique(np.r_[0, cuts, num_users])
    except MemoryError as e:
        raise _too_large(e, num_users, num_items, num_events) from None

    impressions_N = np.zeros(num_items, np.int64)
    clicks_N = np.zeros(num_items, np.int64)
    sample_size = min(cfg.truth_sample_size, num_events)
    sample: dict[str, list[np.ndarray]] = {k: [] for k in ("ad", "click", "p_click", "p_static", "same_cat", "after_click")}
    sampled = 0
    totals = {"clicks": 0, "conversions": 0}
    bar = tqdm(total=num_events, unit="ev", unit_scale=True, desc="synth", file=sys.stderr,
               disable=not progress, mininterval=1.0)
    with PartWriter(out_dir, manifest_name=MANIFEST_NAME, overwrite=overwrite) as writer:
        for c in range(bounds.size - 1):
            u0, u1 = int(bounds[c]), int(bounds[c + 1])
            rng = np.random.default_rng(np.random.SeedSequence([seed, 1, c]))
            try:
                chunk = _generate_chunk(world, cfg, rng, lengths_U[u0:u1])
            except MemoryError as e:  # a few users with very many events each
                raise _too_large(e, num_users, num_items, num_events) from None
            n = chunk.ts.size
            impressions_N += np.bincount(chunk.ad, minlength=num_items)
            clicks_N += np.bincount(chunk.ad, weights=chunk.click, minlength=num_items).astype(np.int64)
            totals["clicks"] += int(chunk.click.sum())
            totals["conversions"] += int(chunk.conversion.sum())
            if sampled < sample_size:
                take = np.sort(rng.choice(n, min(sample_size - sampled, n), replace=False))
                same_cat, after_click = _last_click_category_match(chunk, world)
                for key, arr in (("ad", chunk.ad), ("click", chunk.click), ("p_click", chunk.p_click),
                                 ("p_static", chunk.p_static), ("same_cat", same_cat), ("after_click", after_click)):
                    sample[key].append(arr[take])
                sampled += take.size
            writer.write(_to_table(chunk, world, user_ids[u0:u1], emit_truth))
            bar.update(n)
        bar.close()
        manifest = _manifest(world, cfg, seed, num_users, num_items, num_events, events_per_file,
                             impressions_N, clicks_N, totals, {k: np.concatenate(v) for k, v in sample.items()},
                             emit_truth)
        writer.commit(manifest)
        manifest = {**manifest, "files": list(writer.files), "complete": True}
    seconds = time.perf_counter() - started
    return {**manifest, "out_dir": str(out_dir), "seconds": seconds, "events_per_s": num_events / seconds}


def _too_large(e: MemoryError, num_users: int, num_items: int, num_events: int) -> ValueError:
    """numpy's MemoryError names an array shape, not the argument that asked for it."""
    return ValueError(f"synthesize: not enough memory for --users {num_users:,} --items {num_items:,} --events "
                      f"{num_events:,} (memory grows with the users, the items and the events of the longest "
                      f"user): {e}")


def _last_click_category_match(chunk: _Chunk, world: _World) -> tuple[np.ndarray, np.ndarray]:
    """Per event (user-major layout): does the ad share the category of the user's previous
    clicked ad, and has the user clicked anything before. Observable from the log alone."""
    clicked_ad = np.where(chunk.click.astype(bool), chunk.ad, -1)
    n = chunk.ad.size
    idx = np.where(clicked_ad >= 0, np.arange(n), -1)
    # Running index of the latest click at or before each event, reset at user boundaries.
    starts = np.r_[0, np.flatnonzero(np.diff(chunk.user)) + 1]
    idx_user_start = np.repeat(starts, np.diff(np.r_[starts, n]))
    latest = np.maximum.accumulate(idx)
    prev_latest = np.r_[-1, latest[:-1]]
    after_click = prev_latest >= idx_user_start
    prev_cat = world.ad_category[chunk.ad[np.maximum(prev_latest, 0)]]
    same_cat = after_click & (prev_cat == world.ad_category[chunk.ad])
    return same_cat, after_click


def _to_table(chunk: _Chunk, world: _World, user_ids: np.ndarray, emit_truth: bool) -> pa.Table:
    order = np.lexsort((chunk.user, chunk.ts))  # time order, ties by user: deterministic
    ad = chunk.ad[order]
    click = chunk.click[order]
    conversion = chunk.conversion[order]
    action = np.where(conversion == 1, ACTION_CONVERSION, np.where(click == 1, ACTION_CLICK, ACTION_IMPRESSION))
    cols = {
        "user_id": user_ids[chunk.user[order]],
        "ts": chunk.ts[order],
        "item_id": world.item_ids[ad],
        "action": action.astype(np.int64),
        "advertiser_id": world.advertiser_ids[world.ad_advertiser[ad]],
        "campaign_id": world.campaign_ids[world.ad_campaign[ad]],
        "category_id": world.category_ids[world.ad_category[ad]],
        "slot": chunk.slot[order],
        "device": chunk.device[order],
        "click": click,
        "conversion": conversion,
    }
    if emit_truth:
        cols["p_click"] = chunk.p_click[order]
        cols["p_click_static"] = chunk.p_static[order]
    return pa.table(cols)


def _manifest(world: _World, cfg: SynthConfig, seed: int, num_users: int, num_items: int, num_events: int,
              events_per_file: int, impressions_N: np.ndarray, clicks_N: np.ndarray, totals: dict,
              sample: dict, emit_truth: bool) -> dict:
    # Popularity baselines see the whole log (in-sample, so slightly optimistic for them).
    item_ctr = (clicks_N + 1.0) / (impressions_N + 1.0 / cfg.base_ctr)
    ad, click = sample["ad"], sample["click"]
    after, same = sample["after_click"], sample["same_cat"]
    other = after & ~same

    def rate(mask: np.ndarray) -> float | None:
        return float(click[mask].mean()) if mask.any() else None

    def auc(scores: np.ndarray) -> float | None:  # None, not NaN, without both classes: strict JSON
        value = click_auc(scores, click)
        return None if np.isnan(value) else value

    return {
        "kind": "genrec-synth",
        "seed": seed,
        "num_users": num_users,
        "num_items": num_items,
        "num_events": num_events,
        "events_per_file": events_per_file,
        "num_items_seen": int((impressions_N > 0).sum()),
        "num_advertisers": world.num_advertisers,
        "num_campaigns": world.num_campaigns,
        "num_categories": world.num_categories,
        "columns": COLUMNS + (["p_click", "p_click_static"] if emit_truth else []),
        "ctr": totals["clicks"] / num_events,
        "conversions_per_click": totals["conversions"] / max(totals["clicks"], 1),
        "config": asdict(cfg),
        "truth": {
            "sample_size": int(ad.size),
            "oracle_click_auc": auc(sample["p_click"]),
            "oracle_static_click_auc": auc(sample["p_static"]),
            "item_ctr_click_auc": auc(item_ctr[ad]),
            "item_popularity_click_auc": auc(impressions_N[ad]),
            "ctr_after_click_same_category": rate(same),
            "ctr_after_click_other_category": rate(other),
            "ctr_before_first_click": rate(~after),
            "share_after_click_same_category": float(same.sum() / max(after.sum(), 1)),
            "note": ("oracle = the planted click probability; oracle_static drops the sequential terms; "
                     "item_ctr / item_popularity score each ad by its global CTR / impression count over the log"),
        },
    }
