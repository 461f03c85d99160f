"""HTTP ranking server: FastAPI on uvicorn over `models.serving.Ranker`.

    genrec serve --artifact artifacts/v1            # binds 127.0.0.1:8080 by default
    curl -s localhost:8080/v1/rank -H 'content-type: application/json' \\
         -d '{"item_ids": [11, 12, 13], "actions": [1, 0, 1], "timestamps": [100, 160, 200], "k": 100, "n": 5}'

Endpoints:
    POST /v1/rank       one request (see `RankBody`) -> ranked items with per-task probabilities
    GET  /healthz       200 with the model version once a model is loaded
    GET  /metrics       Prometheus text: request counts by endpoint and status, latency
                        histogram, dynamic batch sizes, the served model version
    POST /admin/reload  {"artifact": DIR} (optional; default: the current directory again):
                        loads the new artifact beside the old one, then swaps; requests in
                        flight finish on the old model, none fails. A bad artifact is refused
                        (400 naming the file) and the old model keeps serving.

Requests are validated by pydantic (extra='forbid', strict types): an unknown field, a wrong
type, too many candidates (k > max_k), mismatched lengths get a 4xx whose body names the
field. A history longer than the server's `max_history` keeps its most recent events (the
response says `history_truncated`). Concurrent requests are batched dynamically: the batch
worker takes what has queued, waiting at most `max_wait_ms` for up to `max_batch_size`.
CPU threads are bounded: torch uses `threads` intra-op threads, one batch worker thread, and
uvicorn's single event loop.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from genrec.models.serving.ranker import Ranker, RankRequest, RequestError, ServingConfig, load_artifact


class RankBody(BaseModel):
    """POST /v1/rank body. Lists of events are aligned: event i is (item_ids[i], actions[i],
    timestamps[i], features[f][i])."""

    model_config = ConfigDict(extra="forbid", strict=True)

    item_ids: list[int] = Field(min_length=1)
    actions: list[int]
    timestamps: list[int]
    features: dict[str, list[int]] = Field(default_factory=dict)
    context: dict[str, int] = Field(default_factory=dict)
    k: int | None = Field(default=None, ge=1)
    """Items retrieved and ranked; default min(100, the server's max_k)."""
    n: int | None = Field(default=None, ge=1)
    """Items returned; default min(10, k)."""
    exclude_seen: bool = False
    allowed_advertisers: list[int] | None = None
    request_time: int | None = None
    sort_by: str | None = None


class ReloadBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    artifact: str | None = None


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("genrec_requests", "HTTP requests", ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("genrec_request_latency_seconds", "Request latency", ["endpoint"],
                                 buckets=(0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2, 5),
                                 registry=self.registry)
        self.batch_size = Histogram("genrec_batch_size", "Requests per dynamic batch",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry)
        self.model = Gauge("genrec_model_info", "Served model version (value 1)", ["version"], registry=self.registry)
        self.reloads = Counter("genrec_reloads", "Artifact reloads", ["result"], registry=self.registry)


class Batcher:
    """One worker thread that ranks queued requests in dynamic batches."""

    def __init__(self, ranker: Ranker, *, max_batch_size: int, max_wait_ms: float, metrics: _Metrics) -> None:
        self.ranker = ranker
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000
        self.metrics = metrics
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="genrec-batcher", daemon=True)
        self.thread.start()

    async def submit(self, req: RankRequest) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.queue.put((req, fut, loop))
        return await fut

    def _loop(self) -> None:
        while True:
            batch = [self.queue.get()]
            deadline = time.monotonic() + self.max_wait_s
            while len(batch) < self.max_batch_size:
                remaining = deadline - time.monotonic()
                try:
                    batch.append(self.queue.get(timeout=remaining) if remaining > 0 else self.queue.get_nowait())
                except queue.Empty:
                    break
            # Read the model once per batch: a reload swaps `self.ranker` between batches.
            ranker = self.ranker
            self.metrics.batch_size.observe(len(batch))
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
            for (_, fut, loop), res in zip(batch, results):
                loop.call_soon_threadsafe(_resolve, fut, res)


def _resolve(fut: asyncio.Future, res: Any) -> None:
    if fut.done():
        return
    if isinstance(res, BaseException):
        fut.set_exception(res)
    else:
        fut.set_result(res)


def create_app(artifact_dir: str | Path, *, serving_cfg: ServingConfig | None = None, max_batch_size: int = 16,
               max_wait_ms: float = 2.0, max_body_bytes: int = 8 << 20) -> FastAPI:
    """The FastAPI app serving one artifact (loaded now; a bad artifact raises here)."""
    serving_cfg = serving_cfg or ServingConfig()
    metrics = _Metrics()
    ranker = load_artifact(artifact_dir, serving_cfg)
    state = {"artifact": Path(artifact_dir)}
    metrics.model.labels(ranker.version).set(1)
    batcher = Batcher(ranker, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, metrics=metrics)
    reload_lock = asyncio.Lock()
    app = FastAPI(title="genrec ranking server", version=ranker.version)
    app.state.batcher = batcher

    @app.middleware("http")
    async def observe(request: Request, call_next):
        t0 = time.perf_counter()
        endpoint = request.url.path
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            response = JSONResponse({"detail": f"body of {length} bytes exceeds {max_body_bytes}", "field": "body"},
                                    status_code=413)
        else:
            try:
                response = await call_next(request)
            except Exception as e:  # noqa: BLE001 (never let one request take the server down)
                response = JSONResponse({"detail": f"internal error: {type(e).__name__}: {e}"}, status_code=500)
        if endpoint in ("/v1/rank", "/healthz", "/metrics", "/admin/reload"):
            metrics.requests.labels(endpoint, str(response.status_code)).inc()
            metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)
        return response

    @app.post("/v1/rank")
    async def rank(body: RankBody):
        fields = body.model_dump()
        fields["k"] = fields["k"] or min(100, batcher.ranker.max_k)
        fields["n"] = fields["n"] or min(10, fields["k"])
        req = RankRequest(**fields)
        try:
            batcher.ranker.check(req)
        except RequestError as e:
            return JSONResponse({"detail": str(e), "field": e.field}, status_code=422)
        try:
            return await batcher.submit(req)
        except RequestError as e:  # a reload changed the limits between check and batch
            return JSONResponse({"detail": str(e), "field": e.field}, status_code=422)

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "model_version": batcher.ranker.version, "artifact": str(state["artifact"])}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/admin/reload")
    async def reload(body: ReloadBody | None = None):
        target = Path(body.artifact) if body is not None and body.artifact else state["artifact"]
        async with reload_lock:
            try:
                new = await asyncio.to_thread(load_artifact, target, serving_cfg)
            except (ValueError, FileNotFoundError) as e:
                metrics.reloads.labels("refused").inc()
                return JSONResponse({"detail": f"reload refused: {e}", "field": "artifact"}, status_code=400)
            old = batcher.ranker
            batcher.ranker = new
            state["artifact"] = target
            metrics.model.remove(old.version) if old.version != new.version else None
            metrics.model.labels(new.version).set(1)
            metrics.reloads.labels("ok").inc()
        return {"model_version": new.version, "previous_version": old.version, "artifact": str(target)}

    return app


def serve(artifact_dir: str | Path, host: str = "127.0.0.1", port: int = 8080, *, threads: int = 2,
          max_batch_size: int = 16, max_wait_ms: float = 2.0, serving_cfg: ServingConfig | None = None) -> None:
    """Load the artifact and serve it until interrupted (blocks)."""
    import uvicorn

    if threads < 1:
        raise ValueError(f"serve: threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set once in this process (e.g. by an earlier import)
        pass
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"genrec serve: listening on {host}, not loopback: the admin endpoint is reachable too",
              file=sys.stderr)
    app = create_app(artifact_dir, serving_cfg=serving_cfg, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms)
    cfg = app.state.batcher.ranker.cfg
    print(f"genrec serve: model {app.state.batcher.ranker.version} from {artifact_dir} on http://{host}:{port} "
          f"({threads} threads, batches <= {max_batch_size}, wait <= {max_wait_ms} ms, {asdict(cfg)})",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", workers=1, access_log=False)
