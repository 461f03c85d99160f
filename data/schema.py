"""The canonical event-log schema and the stable hash for string ids.

An event log is one or more parquet files, one row per event:

    user_id   int64 | string   the user key
    ts        int64            unix seconds of the event
    item_id   int64 | string   the ad / creative (or movie, product, ...)
    action    int64            0 impression, 1 click, 2 conversion; or a rating (MovieLens: in half
                               stars, 1..10)
    <sparse>  int64 | string   any number of declared id features (advertiser_id, campaign_id, ...)
    <label>   int8 / int64     any number of declared 0/1 label columns (click, conversion, ...)

Which column plays which role is declared in the config's feature spec
(`data.features`), never in code. Ids are raw int64 from an unbounded space:
there is no vocabulary pass. String ids are mapped to int64 by `hash_string_ids`.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa

ACTION_IMPRESSION = 0
ACTION_CLICK = 1
ACTION_CONVERSION = 2

# 2**63 - 1: hashed ids are non-negative int64, so a hashed id never collides with the
# negative sentinel values some tables reserve.
_ID_MASK = (1 << 63) - 1


def hash_string_id(value: str) -> int:
    """Stable 63-bit id of a string: the first 8 bytes of BLAKE2b(utf-8, digest_size=8),
    read little-endian, with the top bit cleared.

    Stable across processes, machines and Python versions (unlike `hash()`), so a
    string id maps to the same row in training, export and serving.
    """
    digest = hashlib.blake2b(value.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _ID_MASK


def hash_string_ids(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Map a string (or large_string) arrow array to int64 with `hash_string_id`.
    Nulls stay null; integer arrays pass through unchanged (cast to int64)."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if pa.types.is_integer(values.type):
        return values.cast(pa.int64())
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        raise TypeError(f"ids must be integer or string, got {values.type}")
    # A Python loop: no arrow or numpy kernel exposes a stable cryptographic-quality
    # hash; BLAKE2b runs at ~1M ids/s here, well above parquet scan rates of string ids.
    out = np.fromiter(
        (hash_string_id(v) if v is not None else 0 for v in values.to_pylist()),
        dtype=np.int64,
        count=len(values),
    )
    return pa.array(out, type=pa.int64(), mask=values.is_null().to_numpy(zero_copy_only=False))
