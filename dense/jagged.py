"""Jagged layout of one tower call, computed once and shared by every layer.

Worked example (B = 2, row 0 has 3 history events + 2 ranking candidates, row 1 has 1 event):

    offsets_B1     [0, 5, 6]
    num_targets_B  [2, 0]
    lengths_B      [5, 1]      history_lengths_B [3, 1]
    positions_T    [0, 1, 2, 3, 3, 0]   (both candidates sit right after the history)
    timestamps_T   [100, 160, 200, 210, 210, 50]
    query_timestamps_T  time_bias_query="own":  = timestamps_T
                        time_bias_query="next", query_time_B [300, 90]:
                   [160, 200, 300, 210, 210, 90]   (history: the next event's time, the last
                   history event: query_time_B; candidates: their own time)

Padded views used by the reference kernel put token t of row b at b * max_len + i.
Length buckets used by the fast kernels group rows of similar length (longest first) and
pad each bucket only to its own longest row, so a batch with mean length max/4 pays for
about mean-length tiles, not max-length tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LengthBucket:
    """Rows of similar length padded to `max_len`; index tensors live on the data's device."""

    num_rows: int
    max_len: int
    history_lengths_G: torch.Tensor
    """int64 [G]: tokens before the first candidate (= length when the row has none)."""
    lengths_G: torch.Tensor
    """int64 [G]: each row's own length (<= max_len); query rows past it are padding."""
    positions_GN: torch.Tensor
    """int64 [G, N]: position of each token (candidates share the post-history position)."""
    timestamps_GN: torch.Tensor
    """int64 [G, N]: key times."""
    query_timestamps_GN: torch.Tensor
    """int64 [G, N]: query times of the time bias; the very tensor `timestamps_GN` when the
    layout's query times are the tokens' own."""
    has_targets: bool
    """Any row of the bucket has ranking candidates (then the mask is not plain causal)."""


@dataclass
class JaggedLayout:
    offsets_B1: torch.Tensor
    lengths_B: torch.Tensor
    history_lengths_B: torch.Tensor
    positions_T: torch.Tensor
    timestamps_T: torch.Tensor
    """int64 [T]: each token's own time; the key time of the time bias."""
    query_timestamps_T: torch.Tensor
    """int64 [T]: the query time of the time bias; the very tensor `timestamps_T` under
    time_bias_query="own" (the C tile is then given no second timestamp array)."""
    max_len: int
    has_targets: bool
    # Built lazily by `padded_index` / `buckets`.
    _dense_index_T: torch.Tensor | None = None
    _buckets: list[LengthBucket] | None = None
    _gather_index: torch.Tensor | None = None
    _scatter_index_T: torch.Tensor | None = None
    _pad_positions: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.lengths_B.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.positions_T.numel())

    def padded_index(self) -> torch.Tensor:
        """int64 [T]: flat index b * max_len + i of every token in a [B, max_len] padding."""
        if self._dense_index_T is None:
            row_T = torch.repeat_interleave(
                torch.arange(self.batch_size, device=self.lengths_B.device), self.lengths_B,
                output_size=self.num_tokens)
            in_row_T = torch.arange(self.num_tokens, device=row_T.device) - self.offsets_B1[row_T]
            self._dense_index_T = row_T * self.max_len + in_row_T
        return self._dense_index_T

    def buckets(self, min_fill: float) -> list[LengthBucket]:
        if self._buckets is None:
            self._build_buckets(min_fill)
        return self._buckets

    def gather_to_buckets(self, x_TC: torch.Tensor, min_fill: float) -> list[torch.Tensor]:
        """Jagged [T, C] -> one padded [G, N, C] tensor per bucket (padding is zeros).

        2-D on purpose: `index_select` over dim 0 of a 3-D tensor runs a per-element loop
        (measured 5-10x slower than the same bytes as rows of a 2-D tensor). Its backward
        is the inverse gather (`_Padded`), not a zero fill plus a scatter-add."""
        buckets = self.buckets(min_fill)
        flat = x_TC if self._gather_index is None else \
            _Padded.apply(x_TC, self._gather_index, self._scatter_index_T, self._pad_positions, True)
        if len(buckets) == 1:  # no split: its backward would copy the gradient (a cat of one part)
            return [flat.reshape(buckets[0].num_rows, buckets[0].max_len, x_TC.shape[1])]
        sizes = [b.num_rows * b.max_len for b in buckets]
        return [part.reshape(b.num_rows, b.max_len, x_TC.shape[1]) for part, b in zip(flat.split(sizes), buckets)]

    def scatter_from_buckets(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of `gather_to_buckets`: padded [G, N, C] per bucket -> jagged [T, C]."""
        flat = parts[0].reshape(-1, parts[0].shape[-1]) if len(parts) == 1 else \
            torch.cat([p.reshape(-1, p.shape[-1]) for p in parts])
        if self._gather_index is None:
            return flat
        return _Padded.apply(flat, self._gather_index, self._scatter_index_T, self._pad_positions, False)

    def _build_buckets(self, min_fill: float) -> None:
        device = self.lengths_B.device
        lengths = self.lengths_B.tolist()  # host sync, once per tower call
        order = sorted((b for b in range(len(lengths)) if lengths[b] > 0), key=lambda b: -lengths[b])
        groups: list[list[int]] = []
        for b in order:
            if groups and lengths[b] >= min_fill * lengths[groups[-1][0]]:
                groups[-1].append(b)
            else:
                groups.append([b])
        T = self.num_tokens
        pad_pos = torch.cat([self.positions_T, self.positions_T.new_zeros(1)])
        pad_ts = torch.cat([self.timestamps_T, self.timestamps_T.new_zeros(1)])
        own_query_ts = self.query_timestamps_T is self.timestamps_T
        pad_qts = pad_ts if own_query_ts else \
            torch.cat([self.query_timestamps_T, self.query_timestamps_T.new_zeros(1)])
        buckets, gathers = [], []
        for rows in groups:
            rows_G = torch.tensor(rows, device=device, dtype=torch.long)
            N = lengths[rows[0]]
            ar_N = torch.arange(N, device=device)
            idx_GN = self.offsets_B1[rows_G][:, None] + ar_N[None, :]
            valid_GN = ar_N[None, :] < self.lengths_B[rows_G][:, None]
            idx_GN = torch.where(valid_GN, idx_GN, torch.full_like(idx_GN, T))
            hist_G, len_G = self.history_lengths_B[rows_G], self.lengths_B[rows_G]
            ts_GN = pad_ts[idx_GN]
            buckets.append(LengthBucket(
                num_rows=len(rows), max_len=N, history_lengths_G=hist_G,
                lengths_G=len_G,
                positions_GN=pad_pos[idx_GN], timestamps_GN=ts_GN,
                query_timestamps_GN=ts_GN if own_query_ts else pad_qts[idx_GN],
                has_targets=bool((hist_G < len_G).any())))
            gathers.append(idx_GN.reshape(-1))
        gather = torch.cat(gathers) if gathers else torch.zeros(0, dtype=torch.long, device=device)
        scatter = torch.empty(T, dtype=torch.long, device=device)
        valid = gather < T
        scatter[gather[valid]] = torch.nonzero(valid).squeeze(1)
        identity = gather.numel() == T and bool((gather == torch.arange(T, device=device)).all())
        self._buckets, self._scatter_index_T = buckets, scatter
        # None: the padded order is the jagged order (one bucket of equal rows), nothing to move
        self._gather_index = None if identity else gather.clamp(max=max(T - 1, 0))
        self._pad_positions = torch.nonzero(~valid).squeeze(1)


def make_layout(offsets_B1: torch.Tensor, timestamps_T: torch.Tensor,
                num_targets_B: torch.Tensor | None, max_seq_len: int, *,
                time_bias_query: str = "own", query_time_B: torch.Tensor | None = None) -> JaggedLayout:
    """Validates the jagged input and derives lengths, history lengths, positions and the
    query times of the time bias (see `TowerConfig.time_bias_query`; `query_time_B` is the
    query time of each row's last history event under "next", ignored under "own")."""
    if offsets_B1.dim() != 1 or offsets_B1.numel() < 1:
        raise ValueError(f"offsets_B1 must be 1-D [B+1], got shape {tuple(offsets_B1.shape)}")
    offsets_B1 = offsets_B1.long()
    lengths_B = offsets_B1[1:] - offsets_B1[:-1]
    T = int(offsets_B1[-1])
    if int(offsets_B1[0]) != 0 or (lengths_B < 0).any():
        raise ValueError("offsets_B1 must start at 0 and be non-decreasing")
    if timestamps_T.shape != (T,):
        raise ValueError(f"timestamps_T must have shape [{T}] (offsets_B1[-1]), got {tuple(timestamps_T.shape)}")
    max_len = int(lengths_B.max()) if lengths_B.numel() else 0
    if max_len > max_seq_len:
        raise ValueError(f"a row has {max_len} tokens, more than TowerConfig.max_seq_len={max_seq_len}")
    if num_targets_B is None:
        history_lengths_B = lengths_B
    else:
        num_targets_B = num_targets_B.long()
        if num_targets_B.shape != lengths_B.shape or (num_targets_B < 0).any() or (num_targets_B > lengths_B).any():
            raise ValueError("num_targets_B must be int64 [B] with 0 <= num_targets_B[b] <= row length")
        history_lengths_B = lengths_B - num_targets_B
    row_T = torch.repeat_interleave(torch.arange(lengths_B.numel(), device=offsets_B1.device),
                                    lengths_B, output_size=T)
    in_row_T = torch.arange(T, device=offsets_B1.device) - offsets_B1[row_T]
    hist_T = history_lengths_B[row_T]
    positions_T = torch.minimum(in_row_T, hist_T)
    timestamps_T = timestamps_T.long()
    if query_time_B is not None and query_time_B.shape != lengths_B.shape:
        raise ValueError(f"query_time_B must be int64 [{lengths_B.numel()}] (one time per row, "
                         f"B = len(offsets_B1) - 1), got shape {tuple(query_time_B.shape)}")
    assert time_bias_query in ("own", "next"), time_bias_query
    query_timestamps_T = timestamps_T
    if time_bias_query == "next":
        # History event i is scored at the time of event i + 1 of its row; the last history
        # event at the caller's query time (or its own); candidates at their own time.
        next_T = torch.cat([timestamps_T[1:], timestamps_T[-1:]])
        query_timestamps_T = torch.where(in_row_T < hist_T - 1, next_T, timestamps_T)
        if query_time_B is not None:
            query_timestamps_T = torch.where(in_row_T == hist_T - 1, query_time_B.long()[row_T],
                                             query_timestamps_T)
    return JaggedLayout(
        offsets_B1=offsets_B1, lengths_B=lengths_B, history_lengths_B=history_lengths_B,
        positions_T=positions_T, timestamps_T=timestamps_T,
        query_timestamps_T=query_timestamps_T, max_len=max_len,
        has_targets=num_targets_B is not None and bool((num_targets_B > 0).any()))


class _Padded(torch.autograd.Function):
    """Jagged rows [T, C] <-> bucket-padded rows [P, C] (`to_padded`), each direction's
    backward the other direction: every jagged row has exactly one padded row, and padding
    rows are zeros that take no gradient."""

    @staticmethod
    def forward(ctx, x, gather_P, scatter_T, pad_P, to_padded: bool):
        ctx.save_for_backward(gather_P, scatter_T, pad_P)
        ctx.to_padded = to_padded
        return _move(x, gather_P, scatter_T, pad_P, to_padded)

    @staticmethod
    def backward(ctx, g):
        gather_P, scatter_T, pad_P = ctx.saved_tensors
        return _move(g, gather_P, scatter_T, pad_P, not ctx.to_padded), None, None, None, None


def _move(x: torch.Tensor, gather_P, scatter_T, pad_P, to_padded: bool) -> torch.Tensor:
    if not to_padded:
        return x.index_select(0, scatter_T)
    out = x.index_select(0, gather_P)
    if pad_P.numel():
        out.index_fill_(0, pad_P, 0)
    return out
