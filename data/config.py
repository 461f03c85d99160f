"""Configuration of the data side: the feature spec and the loader settings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class FeatureSpec:
    """Which event-log column plays which role. Column names, never code, decide this."""

    user_key: str = "user_id"
    """User key column (int64 or string)."""
    timestamp: str = "ts"
    """Event time column, int64 unix seconds."""
    item: str = "item_id"
    """The item (ad / creative) id column; the retrieval head predicts it."""
    action: str = "action"
    """Action type column (0 impression, 1 click, 2 conversion, or a rating)."""
    sparse: list[str] = field(
        default_factory=lambda: ["item_id", "action", "advertiser_id", "campaign_id", "category_id"]
    )
    """Per-event id features, in KeyedJaggedTensor key order. Must include `item`."""
    labels: list[str] = field(default_factory=lambda: ["click", "conversion"])
    """0/1 label columns, one ranking task each."""

