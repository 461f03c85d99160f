"""HTTP ranking server: FastAPI on uvicorn over `models.serving.Ranker`.

    genrec serve --artifact artifacts/v1            # binds 127.0.0.1:8080 by default
    curl -s localhost:8080/v1/rank -H 'content-type: application/json' \\
         -d '{"item_ids": [11, 12, 13], "actions": [1, 0, 1], "timestamps": [100, 160, 200], "k": 100, "n": 5}'

Endpoints:
    POST /v1/rank       one request (see `rank_body_model`) -> ranked items with per-task probabilities
    GET  /healthz       200 with the model version and dtype once a model is loaded, its
                        artifact directory and the deltas applied on top of it, in order
    GET  /metrics       Prometheus text: request counts by endpoint and status, latency
                        histogram, dynamic batch sizes, the served model version, reloads,
                        the tables' hot-row cache hits and misses
    POST /admin/reload  off unless the server has a reload token (404 otherwise). With
                        `Authorization: Bearer TOKEN` and {"artifact": DIR} (optional; default:
                        the served directory again): loads the new artifact beside the old one,
                        then swaps; requests in flight finish on the old model, none fails.
                        DIR must lie under a `--reload-dir` (symlinks resolved); any other
                        target is refused (403) without saying whether it exists. A bad
                        artifact is refused (400 naming the file) and the old model keeps
                        serving. Every outcome counts in `genrec_reloads_total{result}`.
    POST /admin/apply-delta  the same protection, with {"delta": DIR} (from `genrec export
                        --delta-since`): the serving model plus the delta's rows, swapped in
                        whole; a delta made for another base version gets 409 naming both.

Limits, checked before any work is done on a request:
    Host        only loopback names (127.0.0.1, localhost, [::1], any port) plus `allowed_hosts`
                are accepted, on every endpoint: a browser tricked into sending requests to
                this port by DNS rebinding carries the attacker's name, and gets a 400.
    body        bytes are counted as they arrive (Content-Length or chunked); past
                `max_body_bytes` the answer is 413 at once and the rest is discarded unread.
    queue       at most `max_queue` rank requests are inside the server at once (reading,
                parsing, waiting for or in a batch); beyond that 503 with `Retry-After`.
    events      each list of the body is bounded (`max_length`, the server's
                `max_request_events`), every integer must fit in int64.

Requests are validated by pydantic (extra='forbid', strict types): an unknown field, a wrong
type, too many candidates (k > max_k), mismatched lengths get a 4xx whose JSON body names the
field (`{"detail": ..., "field": "item_ids.3", "errors": [...]}`). Bodies larger than
`PARSE_INLINE_BYTES` are parsed and validated in a worker thread, not on the event loop. (The
JSON and pydantic parsers hold the GIL while they run, so a maximal body still pauses the loop
for one parser call, tens of ms, not for the whole request.) A history longer than the
server's `max_history` keeps its most recent events (the response says `history_truncated`);
`exclude_seen` still filters the items of the whole history sent.
Concurrent requests are batched dynamically: the batch worker takes what has queued, waiting
at most `max_wait_ms` for up to `max_batch_size` while other requests are on their way in (a
lone request on an idle server goes at once). CPU threads are bounded: `workers` batch worker
threads (default 1) share a budget of `threads` torch intra-op threads, beside uvicorn's
single event loop: a batch that starts alone ranks with all of them, one that starts beside
another with its share. On 2 cores, `--workers 2 --threads 2` gives a lone request both
cores and a second concurrent batch one core.

Trust: the manifest's sha256 checksums catch corruption (a truncated copy, a flipped bit),
not tampering: whoever can write the artifact directory can rewrite the manifest too. What
keeps a hostile artifact from running code is that loading reads only JSON and safetensors
(the `torch.export` program is never loaded, see `artifact.py`), and what keeps strangers from
choosing the artifact is the reload token and the reload directories.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import socket
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Sequence

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from genrec.models.serving.batcher import Batcher, Overloaded
from genrec.models.serving.delta import DeltaConflict, apply_delta
from genrec.models.serving.ranker import Ranker, RankRequest, RequestError, ServingConfig, load_artifact

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
TOKEN_ENV = "GENREC_RELOAD_TOKEN"
"""Environment variable holding the reload token (the other source is `--reload-token-file`)."""
MIN_TOKEN_CHARS = 16
PARSE_INLINE_BYTES = 64 << 10
"""Bodies up to this size are parsed on the event loop (well under a millisecond)."""
MAX_NAMED_FEATURES = 64
"""Keys of `features` / `context` a request may send (models have a handful)."""
ENDPOINTS = ("/v1/rank", "/healthz", "/metrics", "/admin/reload", "/admin/apply-delta")
BUSY = {"detail": "server busy: the request queue is full, retry shortly", "field": None}
RETRY_AFTER_S = "1"
BODY_TIMEOUT_S = 10.0
"""A request's body must arrive within this (8 MB at under 1 MB/s): a client that sends its
headers and then stalls would otherwise hold a queue slot for good."""
SHUTDOWN_GRACE_S = 5
"""On SIGTERM, requests in flight get this long to finish before the server exits."""

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Time = Annotated[int, Field(ge=-(1 << 62), le=(1 << 62) - 1)]
"""A timestamp: any two differ by less than int64's range (the time bias takes |t_i - t_j|;
2**62 - -2**62 = 2**63 would wrap to INT64_MIN, whose |.| is negative: a gap of 0)."""
Count = Annotated[int, Field(ge=1, le=INT64_MAX)]
Name = Annotated[str, Field(min_length=1, max_length=128)]


def rank_body_model(max_events: int) -> type[BaseModel]:
    """The POST /v1/rank body of a server taking at most `max_events` events per request."""
    Events = Annotated[list[Int64], Field(max_length=max_events)]

    class RankBody(BaseModel):
        """Lists of events are aligned: event i is (item_ids[i], actions[i], timestamps[i],
        features[f][i])."""

        model_config = ConfigDict(extra="forbid", strict=True)

        item_ids: Annotated[list[Int64], Field(min_length=1, max_length=max_events)]
        actions: Events
        timestamps: Annotated[list[Time], Field(max_length=max_events)]
        features: dict[Name, Events] = Field(default_factory=dict, max_length=MAX_NAMED_FEATURES)
        context: dict[Name, Int64] = Field(default_factory=dict, max_length=MAX_NAMED_FEATURES)
        k: Count | None = None
        """Items retrieved and ranked; default min(100, the server's max_k)."""
        n: Count | None = None
        """Items returned; default min(10, k)."""
        exclude_seen: bool = False
        allowed_advertisers: Events | None = None
        request_time: Time | None = None
        sort_by: Name | None = None

    return RankBody


RankBody = rank_body_model(ServingConfig().max_request_events)


class ReloadBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    artifact: Annotated[str, Field(min_length=1, max_length=4096)] | None = None


class DeltaBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    delta: Annotated[str, Field(min_length=1, max_length=4096)]


class BodyError(RequestError):
    """Pydantic's errors of a body: `field` is the first one's, `errors` lists up to ten."""

    def __init__(self, e: ValidationError) -> None:
        self.errors = [{"field": ".".join(str(p) for p in x["loc"]) or "body", "message": x["msg"]}
                       for x in e.errors(include_url=False)[:10]]
        super().__init__(self.errors[0]["field"], self.errors[0]["message"])


def _error_response(e: RequestError, status: int = 422) -> JSONResponse:
    body = {"detail": str(e), "field": e.field}
    if isinstance(e, BodyError):
        body["errors"] = e.errors
    return JSONResponse(body, status_code=status)


def parse_rank_request(data: bytes, body_model: type[BaseModel], ranker: Ranker) -> RankRequest:
    """Body bytes -> a RankRequest this ranker can answer, or RequestError naming the field."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: deeply nested arrays
        raise RequestError("body", f"not valid JSON ({e})") from None
    try:
        body = body_model.model_validate(obj)
    except ValidationError as e:
        raise BodyError(e) from None
    k = body.k or min(100, ranker.max_k)
    req = RankRequest(item_ids=body.item_ids, actions=body.actions, timestamps=body.timestamps,
                      features=body.features, context=body.context, k=k, n=body.n or min(10, k, ranker.cfg.max_n),
                      exclude_seen=body.exclude_seen, allowed_advertisers=body.allowed_advertisers,
                      request_time=body.request_time, sort_by=body.sort_by)
    ranker.check(req)
    return req


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("genrec_requests", "HTTP requests", ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("genrec_request_latency_seconds", "Request latency", ["endpoint"],
                                 buckets=(0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2, 5),
                                 registry=self.registry)
        self.batch_size = Histogram("genrec_batch_size", "Requests per dynamic batch",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry)
        self.model = Gauge("genrec_model_info", "Served model (value 1)", ["version", "dtype"], registry=self.registry)
        self.reloads = Counter("genrec_reloads", "Artifact reloads by outcome", ["result"], registry=self.registry)
        self.table_cache = Gauge("genrec_table_cache_rows", "Hot-row cache lookups of the served model's tables "
                                 "since its artifact was loaded", ["table", "outcome"], registry=self.registry)


# ---------------------------------------------------------------------- the ASGI gate


def host_name(host: str) -> str:
    """The name part of a Host header, lowercased: '[::1]:8080' -> '[::1]', 'a.b:80' -> 'a.b'."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[: end + 1] if end > 0 else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _normalize_host(name: str) -> str:
    """An --allowed-hosts entry as `host_name` reads a Host header: 'A.example:8080' ->
    'a.example', '::1' or '[::1]:80' -> '[::1]' (ports are not matched, as for loopback)."""
    name = name.strip().lower()
    if name.count(":") > 1 and not name.startswith("["):  # a bare IPv6 address
        return f"[{name}]"
    return host_name(name)


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def _send_json(send, status: int, body: dict, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": payload})


class _Gate:
    """Pure ASGI middleware in front of the routes: Host check, admission (queue bound), body
    size counted on the receive stream, metrics. The body is read here, up to the limit, and
    replayed to the app, so nothing past `max_body_bytes` is ever held in memory."""

    def __init__(self, app, *, max_body_bytes: int, max_queue: int, allowed_hosts: frozenset[str] | None,
                 metrics: _Metrics) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_queue = max_queue
        self.allowed_hosts = allowed_hosts
        self.metrics = metrics
        self.admitted = 0  # touched only on the event loop: no lock

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [500]

        async def observed_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._handle(scope, receive, observed_send)
        finally:
            path = scope["path"]
            if path in ENDPOINTS:
                self.metrics.requests.labels(path, str(status[0])).inc()
                self.metrics.latency.labels(path).observe(time.perf_counter() - t0)

    async def _handle(self, scope, receive, send) -> None:
        host = _header(scope, b"host")
        if self.allowed_hosts is not None and (host is None or host_name(host) not in self.allowed_hosts):
            shown = "(none)" if host is None else repr(host[:100])
            await _send_json(send, 400, {"detail": f"Host header {shown} is not allowed (loopback names only, "
                                                   "plus the server's --allowed-hosts)", "field": "host"})
            return
        admit = scope["path"] == "/v1/rank"
        if admit and self.admitted >= self.max_queue:
            await _send_json(send, 503, BUSY, headers=[(b"retry-after", RETRY_AFTER_S.encode())])
            return
        self.admitted += admit
        try:
            try:
                body = await asyncio.wait_for(self._read_body(scope, receive), BODY_TIMEOUT_S)
            except asyncio.TimeoutError:  # a client that stops sending must not hold a slot
                await _send_json(send, 408, {"detail": f"body not received within {BODY_TIMEOUT_S:g} s",
                                             "field": "body"}, headers=[(b"connection", b"close")])
                return
            if body is None:
                await _send_json(send, 413, {"detail": f"body exceeds {self.max_body_bytes} bytes", "field": "body"})
                return
            if body is _DISCONNECTED:
                return
            replayed = False

            async def replay():
                nonlocal replayed
                if replayed:
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}

            await self.app(scope, replay, send)
        finally:
            self.admitted -= admit

    async def _read_body(self, scope, receive):
        """The whole body; None past the limit (the rest is left unread); _DISCONNECTED."""
        declared = _header(scope, b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_body_bytes:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return _DISCONNECTED
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


_DISCONNECTED = object()


# ---------------------------------------------------------------------- the app


def _real(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(path))


def _bearer_matches(header: str | None, token: str) -> bool:
    if not header:
        return False
    scheme, _, value = header.partition(" ")
    # A header's bytes arrive decoded as latin-1: compared as those bytes, a token with
    # non-ASCII characters matches what a client sends from the (UTF-8) token file.
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode("latin-1"), token.encode())


def create_app(artifact_dir: str | Path, *, serving_cfg: ServingConfig | None = None, max_batch_size: int = 16,
               max_wait_ms: float = 2.0, max_body_bytes: int = 8 << 20, max_queue: int = 256,
               reload_token: str | None = None, reload_dirs: Sequence[str | Path] = (),
               allowed_hosts: Sequence[str] | None = (), workers: int = 1, threads: int | None = None) -> FastAPI:
    """The FastAPI app serving one artifact (loaded now; a bad artifact raises here).

    reload_token: enables POST /admin/reload (None: the route does not exist); reload_dirs:
    the directories reload targets must lie under (required with a token). allowed_hosts:
    Host names accepted besides loopback ("*": any; None: no Host check at all). threads:
    the intra-op thread budget the busy batch workers share (None: torch's count as it is)."""
    serving_cfg = serving_cfg or ServingConfig()
    if max_queue < 1 or max_body_bytes < 1:
        raise ValueError(f"serve: max_queue and max_body_bytes must be >= 1, got {max_queue}, {max_body_bytes}")
    if reload_token is not None:
        if len(reload_token) < MIN_TOKEN_CHARS:
            raise ValueError(f"serve: the reload token must have at least {MIN_TOKEN_CHARS} characters")
        if not reload_dirs:
            raise ValueError("serve: a reload token needs at least one reload directory (--reload-dir) "
                             "that reload targets must lie under")
    roots = [_real(d) for d in reload_dirs]
    hosts = None
    if allowed_hosts is not None and "*" not in allowed_hosts:
        hosts = frozenset([*LOOPBACK_HOSTS, *(_normalize_host(h) for h in allowed_hosts)])
    metrics = _Metrics()
    ranker = load_artifact(artifact_dir, serving_cfg)
    body_model = rank_body_model(serving_cfg.max_request_events)
    launched = _real(artifact_dir)
    state = {"artifact": str(artifact_dir), "real": launched, "deltas": []}
    metrics.model.labels(ranker.version, ranker.dtype).set(1)
    batcher = Batcher(ranker, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, max_queue=max_queue,
                      metrics=metrics, workers=workers, threads=threads)
    reload_lock = asyncio.Lock()

    @asynccontextmanager
    async def lifespan(_app):
        yield
        batcher.close()

    app = FastAPI(title="genrec ranking server", version=ranker.version, lifespan=lifespan)
    app.state.batcher = batcher
    app.state.rank_body = body_model
    app.add_middleware(_Gate, max_body_bytes=max_body_bytes, max_queue=max_queue, allowed_hosts=hosts,
                       metrics=metrics)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        return JSONResponse({"detail": f"internal error ({type(e).__name__}); see the server log", "field": None},
                            status_code=500)

    rank_doc = {"requestBody": {"required": True,
                                "content": {"application/json": {"schema": body_model.model_json_schema()}}}}

    @app.post("/v1/rank", openapi_extra=rank_doc)
    async def rank(request: Request):
        try:
            with batcher.arriving_request():
                data = await request.body()
                ranker = batcher.ranker
                if len(data) > PARSE_INLINE_BYTES:
                    req = await asyncio.to_thread(parse_rank_request, data, body_model, ranker)
                else:
                    req = parse_rank_request(data, body_model, ranker)
            return JSONResponse(await batcher.submit(req))
        except RequestError as e:  # bad input, or a reload changed the limits between check and batch
            return _error_response(e)
        except Overloaded:
            return JSONResponse(BUSY, status_code=503, headers={"Retry-After": RETRY_AFTER_S})

    @app.get("/healthz")
    async def healthz():
        r = batcher.ranker
        return {"status": "ok", "model_version": r.version, "dtype": r.dtype, "artifact": state["artifact"],
                "deltas": list(state["deltas"])}

    @app.get("/metrics")
    async def prometheus():
        metrics.table_cache.clear()  # a reload may have other tables
        for name, stats in batcher.ranker.table_cache_stats().items():
            for outcome in ("hits", "misses"):
                metrics.table_cache.labels(name, outcome).set(stats[outcome])
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def refuse(result: str, status: int, detail: str, field: str, **headers: str) -> JSONResponse:
        metrics.reloads.labels(result).inc()
        return JSONResponse({"detail": detail, "field": field}, status_code=status, headers=headers or None)

    def reload_target(raw: str | None) -> Path | None:
        """The resolved target if it may be loaded: the directory the server started with, or
        one under a reload root."""
        if raw is None:
            return state["real"]
        try:
            target = _real(raw)
        except (ValueError, OSError):  # e.g. an embedded NUL
            return None
        if target == launched or any(target == r or r in target.parents for r in roots):
            return target
        return None

    async def admin(request: Request, body_model: type[BaseModel], field: str, build, result_key: str):
        """The shared admin path: token, body, target under a reload root, then `build` the new
        Ranker beside the serving one (in a thread) and swap it in whole."""
        if not _bearer_matches(request.headers.get("authorization"), reload_token):
            return refuse("unauthorized", 401, f"{result_key} needs 'Authorization: Bearer <token>'", "authorization",
                          **{"WWW-Authenticate": "Bearer"})
        data = await request.body()
        try:
            body = body_model.model_validate_json(data or b"{}")
        except ValidationError as e:
            err = BodyError(e)
            return refuse("refused", 422, f"{result_key} refused: {err}", err.field)
        raw = getattr(body, field)
        target = reload_target(raw)
        if target is None:
            # Same answer whether or not the path exists: the endpoint is no file-system probe.
            return refuse("forbidden", 403, f"{result_key} refused: the {field} is not under a reload directory", field)
        async with reload_lock:
            old = batcher.ranker
            try:
                new = await asyncio.to_thread(build, old, target)
            except DeltaConflict as e:
                return refuse("conflict", 409, f"{result_key} refused: {e}", field)
            except Exception as e:  # noqa: BLE001 (whatever the files do to the loader, the old model serves on)
                return refuse("refused", 400, f"{result_key} refused: {type(e).__name__}: {e}", field)
            batcher.ranker = new
            if field == "artifact":  # a reload serves the artifact alone, without earlier deltas
                state.update(artifact=raw or state["artifact"], real=target, deltas=[])
            else:
                state["deltas"].append(raw)
            if (old.version, old.dtype) != (new.version, new.dtype):
                metrics.model.remove(old.version, old.dtype)
            metrics.model.labels(new.version, new.dtype).set(1)
            metrics.reloads.labels("ok").inc()
        return {"model_version": new.version, "previous_version": old.version, field: raw or state["artifact"]}

    async def reload(request: Request):
        return await admin(request, ReloadBody, "artifact", lambda old, target: load_artifact(target, serving_cfg),
                           "reload")

    async def delta(request: Request):
        return await admin(request, DeltaBody, "delta",
                           lambda old, target: Ranker(apply_delta(old.contents, target), serving_cfg), "apply-delta")

    if reload_token is not None:
        for path, route, model in (("/admin/reload", reload, ReloadBody), ("/admin/apply-delta", delta, DeltaBody)):
            app.add_api_route(path, route, methods=["POST"], openapi_extra={"requestBody": {
                "content": {"application/json": {"schema": model.model_json_schema()}}}})
    return app


def read_reload_token(token_file: str | Path | None) -> str | None:
    """The reload token from `token_file`, else from $GENREC_RELOAD_TOKEN, else None (reload
    off). Never a command-line value: those are visible to every user in `ps`."""
    if token_file is not None:
        path = Path(token_file)
        try:
            token = path.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the reload token file {path}: {e}") from None
        if not token:
            raise ValueError(f"serve: reload token file {path} is empty")
        if path.stat().st_mode & 0o077:
            print(f"genrec serve: warning: reload token file {path} is readable by other users (chmod 600 it)",
                  file=sys.stderr)
        return token
    return os.environ.get(TOKEN_ENV, "").strip() or None


def startup_summary(ranker: Ranker, artifact_dir: str | Path, *, host: str, port: int, threads: int, workers: int,
                    max_batch_size: int, max_wait_ms: float, max_queue: int, max_body_bytes: int,
                    reload_dirs: Sequence[str | Path], reload_enabled: bool,
                    allowed_hosts: Sequence[str] | None) -> str:
    """One line saying what is served where, with which limits."""
    cfg = ranker.cfg
    url_host = f"[{host}]" if ":" in host else host
    if allowed_hosts is None or "*" in allowed_hosts:
        hosts = "any"
    else:
        hosts = ", ".join([*LOOPBACK_HOSTS, *(_normalize_host(h) for h in allowed_hosts)])
    reload = f"on, under {', '.join(str(d) for d in reload_dirs)}" if reload_enabled else "off"
    cached = ", ".join(f"{name} {s['bytes'] / 2**20:.0f} MB" for name, s in ranker.table_cache_stats().items())
    return (f"genrec serve: model {ranker.version} ({ranker.dtype}) from {artifact_dir} on http://{url_host}:{port}; "
            f"{workers} worker(s) sharing {threads} thread(s), batches <= {max_batch_size} (wait <= {max_wait_ms} ms), queue <= {max_queue}; "
            f"k <= {ranker.max_k}, n <= {cfg.max_n}, history {ranker.max_history} events, "
            f"requests <= {cfg.max_request_events} events and {max_body_bytes} bytes; "
            f"hot-row caches: {cached or 'none'}; reload {reload}; Host names: {hosts}")


def serve(artifact_dir: str | Path, host: str = "127.0.0.1", port: int = 8080, *, threads: int = 2, workers: int = 1,
          max_batch_size: int = 16, max_wait_ms: float = 2.0, max_body_bytes: int = 8 << 20, max_queue: int = 256,
          reload_token_file: str | Path | None = None, reload_dirs: Sequence[str | Path] = (),
          allowed_hosts: Sequence[str] = (), serving_cfg: ServingConfig | None = None) -> None:
    """Load the artifact and serve it until interrupted (blocks). The reload token comes from
    `reload_token_file` or $GENREC_RELOAD_TOKEN; without one, /admin/reload does not exist."""
    import uvicorn

    if threads < 1 or workers < 1:
        raise ValueError(f"serve: threads and workers must be >= 1, got {threads} and {workers}")
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535] (0: any free port), got {port}")
    token = read_reload_token(reload_token_file)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set once in this process (e.g. by an earlier import)
        pass
    if _normalize_host(host) not in LOOPBACK_HOSTS:
        print(f"genrec serve: listening on {host}, not loopback: clients must send a Host header named in "
              "--allowed-hosts (loopback names are always accepted)", file=sys.stderr)
    app = create_app(artifact_dir, serving_cfg=serving_cfg, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms,
                     max_body_bytes=max_body_bytes, max_queue=max_queue, reload_token=token,
                     reload_dirs=reload_dirs, allowed_hosts=allowed_hosts, workers=workers, threads=threads)
    sock = listen_socket(host, port)  # bound before the summary, which then names the real port
    print(startup_summary(app.state.batcher.ranker, artifact_dir, host=host, port=sock.getsockname()[1],
                          threads=threads, workers=workers, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms,
                          max_queue=max_queue, max_body_bytes=max_body_bytes, reload_dirs=reload_dirs,
                          reload_enabled=token is not None, allowed_hosts=allowed_hosts), file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (0: a free port), or a ValueError naming both (a
    name that does not resolve, an address in use or not this machine's)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e}") from None
    return sock
