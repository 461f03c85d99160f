"""The server's dynamic batcher: worker threads rank queued requests in batches (see
models/serving/server.py for how requests reach it)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from typing import Any

import torch

from genrec.models.serving.ranker import Ranker, RankRequest


class Overloaded(Exception):
    """The batch queue is full: the caller should retry later (503)."""


class Batcher:
    """`workers` threads that rank queued requests in dynamic batches, each its own batch at a
    time (torch's kernels release the GIL, so W workers rank on W cores); `metrics.batch_size`
    (a prometheus Histogram) observes each batch's size.

    `threads` is the intra-op thread budget that the busy workers share: a batch that starts
    alone ranks with all of them (a lone request's latency), one that starts beside another
    with its share (no more threads than cores under steady load, where OpenMP
    oversubscription collapses). Torch's count is per calling thread, so a batch keeps the
    count it started with; None leaves torch's count alone."""

    def __init__(self, ranker: Ranker, *, max_batch_size: int, max_wait_ms: float, max_queue: int,
                 metrics: Any, workers: int = 1, threads: int | None = None) -> None:
        for key, v in (("workers", workers), ("threads", threads), ("max_batch_size", max_batch_size),
                       ("max_queue", max_queue)):
            if v is not None and v < 1:
                raise ValueError(f"serve: {key} must be >= 1, got {v}")
        if not 0 <= max_wait_ms < float("inf"):
            raise ValueError(f"serve: max_wait_ms must be a finite number >= 0, got {max_wait_ms}")
        self.ranker = ranker
        self.thread_budget = threads
        self.busy = 0  # workers ranking a batch now
        self.busy_lock = threading.Lock()
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000
        self.metrics = metrics
        self.queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.arriving = 0  # requests being read or parsed (counted on the event loop)
        self.threads = [threading.Thread(target=self._loop, name=f"genrec-batcher-{i}", daemon=True)
                        for i in range(workers)]
        for t in self.threads:
            t.start()

    @contextlib.contextmanager
    def arriving_request(self):
        """Counts a request while it is read and parsed: the worker waits for it."""
        self.arriving += 1
        try:
            yield
        finally:
            self.arriving -= 1

    async def submit(self, req: RankRequest) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        try:
            self.queue.put_nowait((req, fut, loop))
        except queue.Full:
            raise Overloaded from None
        return await fut

    def close(self) -> None:
        self.queue.put(None)  # each worker puts it back for the next one as it stops
        for t in self.threads:
            t.join(timeout=30)

    def _loop(self) -> None:
        while True:
            first = self.queue.get()
            if first is None:
                self.queue.put(None)
                return
            batch = [first]
            deadline = time.monotonic() + self.max_wait_s
            while len(batch) < self.max_batch_size:
                remaining = deadline - time.monotonic() if self.arriving > 0 else 0
                try:
                    item = self.queue.get(timeout=remaining) if remaining > 0 else self.queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self.queue.put(None)  # finish this batch, then stop
                    break
                batch.append(item)
            # Read the model once per batch: a reload swaps `self.ranker` between batches.
            ranker = self.ranker
            self.metrics.batch_size.observe(len(batch))
            self._share_threads(+1)
            try:
                results = ranker.rank_batch([r for r, _, _ in batch])
            except Exception:
                # Isolate the request that failed; the others still get their answers.
                results = []
                for r, _, _ in batch:
                    try:
                        results.append(ranker.rank_batch([r])[0])
                    except Exception as e:  # noqa: BLE001 (reported to that request's caller)
                        results.append(e)
            finally:
                self._share_threads(-1)
            for (_, fut, loop), res in zip(batch, results):
                loop.call_soon_threadsafe(_resolve, fut, res)

    def _share_threads(self, change: int) -> None:
        with self.busy_lock:
            self.busy += change
            if self.thread_budget is not None and change > 0:
                n = max(1, self.thread_budget // self.busy)
                if torch.get_num_threads() != n:
                    torch.set_num_threads(n)


def _resolve(fut: asyncio.Future, res: Any) -> None:
    if fut.done():
        return
    if isinstance(res, BaseException):
        fut.set_exception(res)
    else:
        fut.set_result(res)
