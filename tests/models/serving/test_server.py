"""The HTTP server, started for real in a second process on a free loopback port: parity
with the library, bad requests (4xx naming the field, never a crash), metrics, and reload
under load with no failed request."""

from __future__ import annotations

import shutil
import socket
import threading

import httpx
import pytest

from genrec.models.serving.artifact import export_artifact
from genrec.models.serving.bench import build_synthetic_model, start_server_process, synthetic_request
from genrec.models.serving.ranker import ServingConfig, load_artifact

NUM_ITEMS = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    model, item_ids, feats = build_synthetic_model(num_items=NUM_ITEMS, dim=16, max_seq_len=96, seed=5)
    arts = {}
    for version, dtype in (("v1", "fp32"), ("v2", "int8")):
        arts[version] = export_artifact(model, {}, root / version, dtype=dtype, item_ids=item_ids,
                                        item_features=feats, version=version, export_program=False)
    broken = root / "broken"
    shutil.copytree(arts["v2"], broken)
    (broken / "dense.safetensors").write_bytes((broken / "dense.safetensors").read_bytes()[:-10])
    arts["broken"] = broken
    port = _free_port()
    proc = start_server_process(arts["v1"], port, threads=1, extra=["--max-k", "40", "--max-wait-ms", "5"])
    try:
        yield {"url": f"http://127.0.0.1:{port}", "arts": arts, "feats": feats}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_health_and_parity_with_library(server):
    with httpx.Client(base_url=server["url"], timeout=30) as c:
        health = c.get("/healthz").json()
        assert health["status"] == "ok" and health["model_version"] == "v1"
        req = synthetic_request(NUM_ITEMS, 30, k=40, n=10, seed=1, item_features=server["feats"])
        r = c.post("/v1/rank", json=req)
        assert r.status_code == 200, r.text
        body = r.json()
    want = load_artifact(server["arts"]["v1"], ServingConfig(max_k=40)).rank(req)
    assert body["model_version"] == "v1"
    assert [x["item_id"] for x in body["items"]] == [x["item_id"] for x in want["items"]]
    assert max(abs(a["score"] - b["score"]) for a, b in zip(body["items"], want["items"])) < 1e-6
    assert set(body["items"][0]["probabilities"]) == {"click", "conversion"}


BASE = {"item_ids": [1, 2, 3], "actions": [1, 0, 1], "timestamps": [10, 20, 30], "k": 20, "n": 5}


@pytest.mark.parametrize("body,field", [
    (dict(BASE, colour="red"), "colour"),                       # unknown field
    (dict(BASE, k="20"), "k"),                                  # wrong type (strict)
    (dict(BASE, item_ids=[1, "x", 3]), "item_ids"),             # wrong element type
    (dict(BASE, k=41), "k"),                                    # too many candidates
    (dict(BASE, actions=[1, 0]), "actions"),                    # misaligned lengths
    (dict(BASE, item_ids=[], actions=[], timestamps=[]), "item_ids"),
    (dict(BASE, features={"campaign_id": [1, 2, 3]}), "features.campaign_id"),
    ({k: v for k, v in BASE.items() if k != "timestamps"}, "timestamps"),  # missing field
])
def test_bad_requests_get_4xx_naming_the_field(server, body, field):
    with httpx.Client(base_url=server["url"], timeout=30) as c:
        r = c.post("/v1/rank", json=body)
        assert 400 <= r.status_code < 500, r.text
        assert field in r.text
        assert c.get("/healthz").status_code == 200


def test_malformed_json_and_oversized_body(server):
    with httpx.Client(base_url=server["url"], timeout=30) as c:
        r = c.post("/v1/rank", content=b'{"item_ids": [1, 2', headers={"content-type": "application/json"})
        assert r.status_code == 422
        r = c.post("/v1/rank", content=b"x" * (9 << 20), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert c.get("/healthz").status_code == 200


def test_long_history_is_truncated_to_most_recent(server):
    req = synthetic_request(NUM_ITEMS, 200, k=10, n=5, seed=3, item_features=server["feats"])
    with httpx.Client(base_url=server["url"], timeout=30) as c:
        body = c.post("/v1/rank", json=req).json()
    assert body["history_truncated"] and body["history_used"] == 96 - 1


def test_metrics_count_requests_latency_and_batches(server):
    with httpx.Client(base_url=server["url"], timeout=30) as c:
        c.post("/v1/rank", json=BASE).raise_for_status()
        c.post("/v1/rank", json=dict(BASE, bogus=1))
        text = c.get("/metrics").text
    assert 'genrec_requests_total{endpoint="/v1/rank",status="200"}' in text
    assert 'genrec_requests_total{endpoint="/v1/rank",status="422"}' in text
    assert "genrec_request_latency_seconds_bucket" in text
    assert "genrec_batch_size_count" in text
    assert "genrec_model_info" in text


def test_reload_under_load_fails_no_request(server):
    stop = threading.Event()
    statuses, versions = [], set()

    def hammer(seed):
        with httpx.Client(base_url=server["url"], timeout=60) as c:
            i = 0
            while not stop.is_set() or i < 3:
                r = c.post("/v1/rank", json=synthetic_request(NUM_ITEMS, 20, k=20, n=5, seed=seed * 100 + i))
                statuses.append(r.status_code)
                if r.status_code == 200:
                    versions.add(r.json()["model_version"])
                i += 1

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    with httpx.Client(base_url=server["url"], timeout=120) as c:
        refused = c.post("/admin/reload", json={"artifact": str(server["arts"]["broken"])})
        assert refused.status_code == 400 and "dense.safetensors" in refused.text
        assert c.get("/healthz").json()["model_version"] == "v1"
        ok = c.post("/admin/reload", json={"artifact": str(server["arts"]["v2"])})
        assert ok.status_code == 200, ok.text
        assert ok.json() == {"model_version": "v2", "previous_version": "v1", "artifact": str(server["arts"]["v2"])}
        stop.set()
        for t in threads:
            t.join()
        assert c.get("/healthz").json()["model_version"] == "v2"
        c.post("/admin/reload", json={"artifact": str(server["arts"]["v1"])}).raise_for_status()
    assert statuses and all(s == 200 for s in statuses)
    assert "v2" in versions


def _batch_totals(c: httpx.Client) -> tuple[float, float]:
    total = count = 0.0
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("genrec_batch_size_sum"):
            total = float(line.split()[-1])
        elif line.startswith("genrec_batch_size_count"):
            count = float(line.split()[-1])
    return total, count


def test_concurrent_requests_are_batched(server):
    req = synthetic_request(NUM_ITEMS, 50, k=40, n=5, seed=11)
    with httpx.Client(base_url=server["url"], timeout=60) as c:
        sum0, count0 = _batch_totals(c)
        statuses = []

        def burst():
            with httpx.Client(base_url=server["url"], timeout=60) as cl:
                statuses.extend(cl.post("/v1/rank", json=req).status_code for _ in range(3))

        threads = [threading.Thread(target=burst) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sum1, count1 = _batch_totals(c)
    assert statuses == [200] * 18
    assert sum1 - sum0 == 18  # every request went through the batcher once
    assert count1 - count0 < 18  # ... and some shared a batch


def test_k_and_n_default_to_the_server_limits(server):
    body = {key: v for key, v in BASE.items() if key not in ("k", "n")}
    with httpx.Client(base_url=server["url"], timeout=30) as c:
        r = c.post("/v1/rank", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["items"]) == 10
