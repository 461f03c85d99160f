"""A bounded load test of `genrec serve` on loopback: 8 clients for ~10 s, an authenticated
reload in the middle, one chunked oversized body. No request fails; p50 / p99 are printed."""

from __future__ import annotations

import threading
import time

import httpx

from genrec.models.serving.bench import synthetic_request
from serving_helpers import NUM_ITEMS, TOKEN

NUM_CLIENTS = 8
SECONDS = 10.0


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def test_eight_clients_through_a_reload_and_an_oversized_body(server, capsys):
    url, arts = server["url"], server["arts"]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    stop = threading.Event()
    latencies, failures, versions, oversized = [], [], set(), []

    def client(seed: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            i = 0
            while not stop.is_set():
                if seed == 0 and i == 5:  # one chunked body past the 8 MiB limit, no Content-Length
                    chunks = (b"[1," * 100_000 for _ in range(30))
                    oversized.append(c.post("/v1/rank", content=chunks,
                                            headers={"content-type": "application/json"}).status_code)
                req = synthetic_request(NUM_ITEMS, 10 + (seed * 7 + i) % 60, k=40, n=5, seed=seed * 10_000 + i)
                t0 = time.perf_counter()
                try:
                    r = c.post("/v1/rank", json=req)
                except httpx.HTTPError as e:
                    failures.append(repr(e))
                else:
                    latencies.append(time.perf_counter() - t0)
                    if r.status_code != 200:
                        failures.append(f"{r.status_code}: {r.text[:200]}")
                    else:
                        versions.add(r.json()["model_version"])
                i += 1

    start = time.monotonic()
    threads = [threading.Thread(target=client, args=(s,)) for s in range(NUM_CLIENTS)]
    for t in threads:
        t.start()
    with httpx.Client(base_url=url, timeout=60) as admin:
        try:
            time.sleep(SECONDS / 2)
            unauthorized = admin.post("/admin/reload", json={"artifact": str(arts["v2"])}).status_code
            reload = admin.post("/admin/reload", json={"artifact": str(arts["v2"])}, headers=auth)
            time.sleep(max(0.0, SECONDS - (time.monotonic() - start)))
            deadline = time.monotonic() + 60  # a slow reload still leaves answers from v2 to see
            while "v2" not in versions and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:  # never leave clients hammering the shared server
            stop.set()
            for t in threads:
                t.join()
        elapsed = time.monotonic() - start
        health = admin.get("/healthz").json()
        admin.post("/admin/reload", json={"artifact": str(arts["v1"])}, headers=auth).raise_for_status()
    assert unauthorized == 401 and reload.status_code == 200, reload.text
    assert server["proc"].proc.poll() is None
    with capsys.disabled():
        print(f"\n[load] {NUM_CLIENTS} clients, {len(latencies)} requests in {elapsed:.1f} s "
              f"({len(latencies) / elapsed:.0f}/s): p50 {_percentile(latencies, 50) * 1e3:.1f} ms, "
              f"p99 {_percentile(latencies, 99) * 1e3:.1f} ms; {len(failures)} errors")
    assert not failures, failures[:5]
    assert oversized == [413]
    assert len(latencies) > 10 * NUM_CLIENTS
    assert versions == {"v1", "v2"} and (health["model_version"], health["dtype"]) == ("v2", "int8")
