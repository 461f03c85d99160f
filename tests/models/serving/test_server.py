"""The HTTP server, started for real in a second process on a free loopback port: parity
with the library, bad requests (4xx naming the field, never a crash), body and queue limits,
Host check, reload (token, allowed directories, no failed request under load), metrics."""

from __future__ import annotations

import inspect
import json
import os
import socket
import threading
import time

import httpx
import pytest
import torch

from genrec.models.serving import server as server_module
from genrec.models.serving.bench import synthetic_request
from genrec.models.serving.ranker import ServingConfig, load_artifact
from genrec.models.serving.server import TOKEN_ENV, create_app, read_reload_token
from genrec.scripts.cli import build_parser
from serving_helpers import LOOP_THREAD, MAX_SEQ_LEN, NUM_ITEMS, TOKEN, serve_in_thread

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _metric(c: httpx.Client, prefix: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return 0.0


def test_health_and_parity_with_library(server):
    with httpx.Client(base_url=server["url"], timeout=30) as c:
        health = c.get("/healthz").json()
        assert health["status"] == "ok" and health["model_version"] == "v1" and health["dtype"] == "fp32"
        req = synthetic_request(NUM_ITEMS, 30, k=40, n=10, seed=1, item_features=server["feats"])
        r = c.post("/v1/rank", json=req)
        assert r.status_code == 200, r.text
        body = r.json()
    want = load_artifact(server["arts"]["v1"], ServingConfig(max_k=40)).rank(req)
    assert body["model_version"] == "v1"
    assert [x["item_id"] for x in body["items"]] == [x["item_id"] for x in want["items"]]
    assert max(abs(a["score"] - b["score"]) for a, b in zip(body["items"], want["items"])) < 1e-6
    assert set(body["items"][0]["probabilities"]) == {"click", "conversion"}


def test_startup_summary_is_one_readable_line(server):
    line = server["proc"].summary()
    assert line.startswith("genrec serve: model v1 (fp32) from ")
    for part in ("k <= 40", f"history {MAX_SEQ_LEN - 1} events", "queue <= 256", "hot-row caches: none", "reload on, under",
                 "Host names: 127.0.0.1, localhost, [::1], ranker.test"):
        assert part in line, line
    assert "{" not in line and "'" not in line  # no Python reprs


BASE = {"item_ids": [1, 2, 3], "actions": [1, 0, 1], "timestamps": [10, 20, 30], "k": 20, "n": 5}
INT64_MAX = (1 << 63) - 1


@pytest.mark.parametrize("body,field", [
    (dict(BASE, colour="red"), "colour"),                       # unknown field
    (dict(BASE, k="20"), "k"),                                  # wrong type (strict)
    (dict(BASE, item_ids=[1, "x", 3]), "item_ids"),             # wrong element type
    (dict(BASE, k=41), "k"),                                    # too many candidates
    (dict(BASE, actions=[1, 0]), "actions"),                    # misaligned lengths
    (dict(BASE, item_ids=[], actions=[], timestamps=[]), "item_ids"),
    (dict(BASE, features={"campaign_id": [1, 2, 3]}), "features.campaign_id"),
    ({k: v for k, v in BASE.items() if k != "timestamps"}, "timestamps"),  # missing field
    (dict(BASE, item_ids=[1, INT64_MAX + 1, 3]), "item_ids.1"),  # beyond int64: was a 500
    (dict(BASE, timestamps=[10, 20, -INT64_MAX - 2]), "timestamps.2"),
    (dict(BASE, context={"advertiser_id": 1 << 64}), "context.advertiser_id"),
    (dict(BASE, request_time=1 << 70), "request_time"),
    (dict(BASE, timestamps=[0, 10, INT64_MAX]), "timestamps.2"),  # a gap past int64's range: was a 500
    (dict(BASE, request_time=-(1 << 62) - 1), "request_time"),
    (dict(BASE, k=1 << 80), "k"),
    (dict(BASE, allowed_advertisers=[1] * 100_001), "allowed_advertisers"),  # max_length
    (dict(BASE, features={f"f{i}": [1, 2, 3] for i in range(65)}), "features"),
])
def test_bad_requests_get_4xx_naming_the_field(server, body, field):
    with httpx.Client(base_url=server["url"], timeout=30) as c:
        r = c.post("/v1/rank", json=body)
        assert 400 <= r.status_code < 500, r.text
        assert r.json()["field"].startswith(field), r.text
        assert c.get("/healthz").status_code == 200


def test_malformed_json_and_oversized_body(server):
    with httpx.Client(base_url=server["url"], timeout=30) as c:
        r = c.post("/v1/rank", content=b'{"item_ids": [1, 2', headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["field"] == "body"
        deep = b'{"item_ids": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
        r = c.post("/v1/rank", content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["field"] == "body"
        r = c.post("/v1/rank", content=b"x" * (9 << 20), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["field"] == "body"
        assert c.get("/healthz").status_code == 200


def _read_status_line(sock: socket.socket) -> str:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n", 1)[0].decode()


def test_chunked_body_is_refused_as_soon_as_it_passes_the_limit(server):
    """No Content-Length: the server counts bytes as they arrive and answers 413 while the
    client has not even finished sending."""
    port = int(server["url"].rsplit(":", 1)[1])
    chunk = b"[1," * (1 << 18)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/rank HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range((9 << 20) // len(chunk) + 1):  # 9 MiB > the 8 MiB limit, and no final chunk
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        assert _read_status_line(sock).startswith("HTTP/1.1 413 ")
    with httpx.Client(base_url=server["url"], timeout=30) as c:
        assert c.get("/healthz").status_code == 200


def test_chunked_oversized_body_does_not_grow_the_server(server):
    """60 MB of chunked JSON is refused without being held or parsed (it used to cost the
    server ~750 MB of memory)."""
    proc = server["proc"]
    before = proc.peak_rss_bytes()

    def body():
        yield b'{"item_ids": ['
        for _ in range(60):
            yield b"1," * (1 << 19)
        yield b"1]}"

    with httpx.Client(base_url=server["url"], timeout=60) as c:
        r = c.post("/v1/rank", content=body(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert c.get("/healthz").status_code == 200
    assert proc.peak_rss_bytes() - before < 48 << 20


@pytest.mark.parametrize("host,ok", [
    ("127.0.0.1", True), ("localhost:8080", True), ("[::1]:1234", True), ("LOCALHOST", True),
    ("ranker.test:80", True), ("RANKER.test", True), ("[2001:db8::1]:8080", True),  # --allowed-hosts
    ("evil.example", False), ("evil.example:8080", False), ("127.0.0.1.evil.example", False),
])
def test_only_loopback_and_allowed_host_headers_are_served(server, host, ok):
    with httpx.Client(base_url=server["url"], timeout=30, headers={"Host": host}) as c:
        statuses = [c.get("/healthz").status_code, c.post("/v1/rank", json=BASE).status_code,
                    c.post("/admin/reload", json={"artifact": str(server["arts"]["v2"])}, headers=AUTH).status_code]
    if ok:
        assert statuses[:2] == [200, 200]
        assert statuses[2] == 200
        with httpx.Client(base_url=server["url"], timeout=30) as c:
            c.post("/admin/reload", json={"artifact": str(server["arts"]["v1"])}, headers=AUTH).raise_for_status()
    else:
        assert statuses == [400, 400, 400]  # the reload was not attempted either
        with httpx.Client(base_url=server["url"], timeout=30) as c:
            assert c.get("/healthz").json()["model_version"] == "v1"


def test_reload_needs_the_token(server):
    with httpx.Client(base_url=server["url"], timeout=30) as c:
        before = _metric(c, 'genrec_reloads_total{result="unauthorized"}')
        for headers in ({}, {"Authorization": "Bearer wrong-token-wrong-token"}, {"Authorization": TOKEN}):
            r = c.post("/admin/reload", json={"artifact": str(server["arts"]["v2"])}, headers=headers)
            assert r.status_code == 401 and r.json()["field"] == "authorization"
        assert c.get("/healthz").json()["model_version"] == "v1"
        assert _metric(c, 'genrec_reloads_total{result="unauthorized"}') == before + 3


def test_reload_outside_the_reload_dirs_is_refused_without_saying_whether_it_exists(server, tmp_path):
    arts = server["arts"]
    link = arts["root"] / "link-out"
    if not link.exists():
        link.symlink_to(arts["outside"])
    targets = [str(arts["outside"]),                                 # a valid artifact, elsewhere
               str(arts["outside"].parent / "missing"),              # nothing there
               str(arts["root"] / ".." / "elsewhere" / "v3"),        # climbing out
               str(link),                                            # a link out
               os.path.expanduser("~/.ssh"), "/etc", "relative/dir", "\u0000"]
    with httpx.Client(base_url=server["url"], timeout=30) as c:
        before = _metric(c, 'genrec_reloads_total{result="forbidden"}')
        bodies = set()
        for target in targets:
            r = c.post("/admin/reload", json={"artifact": target}, headers=AUTH)
            assert r.status_code == 403, (target, r.text)
            bodies.add(r.text)
        assert len(bodies) == 1 and "elsewhere" not in bodies.pop()
        assert _metric(c, 'genrec_reloads_total{result="forbidden"}') == before + len(targets)
        assert c.get("/healthz").json()["model_version"] == "v1"


def _broken_copies(arts) -> list:
    """Artifacts under the reload dir whose manifest is malformed in ways that used to give a 500."""
    import shutil

    out = []
    for name, edit in (("no-max-seq-len", lambda m: m["tower"].pop("max_seq_len")),
                       ("no-sha256", lambda m: m["files"]["dense.safetensors"].pop("sha256")),
                       ("files-list", lambda m: m.update(files=[])),
                       ("no-features", lambda m: m["tables"]["t_item_id"].pop("features"))):
        path = arts["root"] / f"bad-{name}"
        if not path.exists():
            shutil.copytree(arts["v1"], path)
            manifest = json.loads((path / "manifest.json").read_text())
            edit(manifest)
            (path / "manifest.json").write_text(json.dumps(manifest))
        out.append(path)
    out.append(arts["root"] / "not-there")
    return out


def test_reload_failures_are_4xx_with_a_reason_and_counted(server):
    with httpx.Client(base_url=server["url"], timeout=30) as c:
        before = _metric(c, 'genrec_reloads_total{result="refused"}')
        bad = _broken_copies(server["arts"])
        for path in bad:
            r = c.post("/admin/reload", json={"artifact": str(path)}, headers=AUTH)
            assert r.status_code == 400, (path, r.text)
            assert r.json()["detail"].startswith("reload refused: ") and r.json()["field"] == "artifact"
        r = c.post("/admin/reload", json={"artifact": 5}, headers=AUTH)
        assert r.status_code == 422 and r.json()["field"] == "artifact"
        assert _metric(c, 'genrec_reloads_total{result="refused"}') == before + len(bad) + 1
        assert c.get("/healthz").json()["model_version"] == "v1"


def test_long_history_is_truncated_to_most_recent(server):
    req = synthetic_request(NUM_ITEMS, 200, k=10, n=5, seed=3, item_features=server["feats"])
    with httpx.Client(base_url=server["url"], timeout=30) as c:
        body = c.post("/v1/rank", json=req).json()
    assert body["history_truncated"] and body["history_used"] == MAX_SEQ_LEN - 1


def test_metrics_count_requests_latency_and_batches(server):
    with httpx.Client(base_url=server["url"], timeout=30) as c:
        c.post("/v1/rank", json=BASE).raise_for_status()
        c.post("/v1/rank", json=dict(BASE, bogus=1))
        text = c.get("/metrics").text
    assert 'genrec_requests_total{endpoint="/v1/rank",status="200"}' in text
    assert 'genrec_requests_total{endpoint="/v1/rank",status="422"}' in text
    assert "genrec_request_latency_seconds_bucket" in text
    assert "genrec_batch_size_count" in text
    assert 'genrec_model_info{dtype="fp32",version="v1"} 1.0' in text


def test_reload_under_load_fails_no_request(server):
    stop = threading.Event()
    statuses, versions = [], set()

    def hammer(seed):
        with httpx.Client(base_url=server["url"], timeout=60) as c:
            def send(i):
                r = c.post("/v1/rank", json=synthetic_request(NUM_ITEMS, 20, k=20, n=5, seed=seed * 100 + i))
                statuses.append(r.status_code)
                if r.status_code == 200:
                    versions.add(r.json()["model_version"])

            i = 0
            while not stop.is_set() or i < 3:
                send(i)
                i += 1
            send(i)  # stop is set only after the reload returned: this one must see v2

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    with httpx.Client(base_url=server["url"], timeout=120, headers=AUTH) as c:
        try:
            refused = c.post("/admin/reload", json={"artifact": str(server["arts"]["broken"])})
            assert refused.status_code == 400 and "dense.safetensors" in refused.text
            assert c.get("/healthz").json()["model_version"] == "v1"
            ok = c.post("/admin/reload", json={"artifact": str(server["arts"]["v2"])})
            assert ok.status_code == 200, ok.text
            assert ok.json() == {"model_version": "v2", "previous_version": "v1",
                                 "artifact": str(server["arts"]["v2"])}
        finally:  # never leave clients hammering the shared server
            stop.set()
            for t in threads:
                t.join()
        health = c.get("/healthz").json()
        assert (health["model_version"], health["dtype"]) == ("v2", "int8")
        assert 'genrec_model_info{dtype="int8",version="v2"} 1.0' in c.get("/metrics").text
        c.post("/admin/reload", json={"artifact": str(server["arts"]["v1"])}).raise_for_status()
    assert statuses and all(s == 200 for s in statuses)
    assert "v2" in versions


def _batch_totals(c: httpx.Client) -> tuple[float, float]:
    return _metric(c, "genrec_batch_size_sum"), _metric(c, "genrec_batch_size_count")


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


def test_a_lone_request_does_not_wait_for_a_batch(artifacts):
    """The batch worker waits up to max_wait_ms only while other requests are on their way
    in: with a 2 s wait, one request at a time still answers at once, and a burst of
    concurrent ones still shares batches."""
    app = create_app(artifacts["v1"], max_wait_ms=2000, serving_cfg=ServingConfig(max_k=40))
    req = synthetic_request(NUM_ITEMS, 50, k=40, n=5, seed=12)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        c.post("/v1/rank", json=req).raise_for_status()  # warm-up
        for _ in range(3):
            t0 = time.perf_counter()
            c.post("/v1/rank", json=req).raise_for_status()
            assert time.perf_counter() - t0 < 1.5  # well under the 2 s wait, with room for a busy machine
        sum0, count0 = _batch_totals(c)
        start = threading.Barrier(6, timeout=30)  # the burst leaves together, not as the threads get a core

        def post():
            start.wait()
            httpx.post(f"{url}/v1/rank", json=req, timeout=60)

        threads = [threading.Thread(target=post) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sum1, count1 = _batch_totals(c)
    assert sum1 - sum0 == 6 and count1 - count0 < 6


def test_two_workers_rank_two_batches_at_once_and_answer_as_one_does(artifacts):
    """With workers=2 two batches are ranked at the same time (each worker's first batch
    waits at a 2-party barrier inside the ranker: a single worker would never get past it),
    every answer equals the one-worker server's, and closing stops both workers. The
    thread budget (threads=2) is shared: the batch that starts first takes both threads, the
    one that starts beside it one; a batch that starts alone takes both."""
    reqs = [synthetic_request(NUM_ITEMS, 50, k=40, n=5, seed=20 + i) for i in range(8)]
    one = create_app(artifacts["v1"], serving_cfg=ServingConfig(max_k=40))
    with serve_in_thread(one) as url, httpx.Client(base_url=url, timeout=60) as c:
        expected = [c.post("/v1/rank", json=r).json() for r in reqs]
    threads_before = torch.get_num_threads()
    app = create_app(artifacts["v1"], serving_cfg=ServingConfig(max_k=40), workers=2, max_batch_size=1, threads=2)
    batcher = app.state.batcher
    ranker, barrier, first = batcher.ranker, threading.Barrier(2, timeout=10), set()
    threads_seen = {"pair": [], "lone": []}

    def rank_batch(batch):
        name = threading.current_thread().name
        if name not in first:
            first.add(name)
            barrier.wait()  # raises BrokenBarrierError unless another worker arrives
            threads_seen["pair"].append(torch.get_num_threads())
            barrier.wait()  # both read while both rank
        elif batch[0].k == 7:
            threads_seen["lone"].append(torch.get_num_threads())
        return type(ranker).rank_batch(ranker, batch)

    ranker.rank_batch = rank_batch
    got = [None] * len(reqs)

    def post(i):
        got[i] = httpx.post(f"{url}/v1/rank", json=reqs[i], timeout=60)

    try:
        with serve_in_thread(app) as url:
            threads = [threading.Thread(target=post, args=(i,)) for i in range(len(reqs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for _ in range(2):  # alone: each worker's next batch, whichever takes it
                httpx.post(f"{url}/v1/rank", json=dict(reqs[0], k=7), timeout=60).raise_for_status()
    finally:
        torch.set_num_threads(threads_before)
    assert sorted(threads_seen["pair"]) == [1, 2] and threads_seen["lone"] == [2, 2]
    assert [r.status_code for r in got] == [200] * len(reqs)
    assert len(first) == 2
    for r, want in zip(got, expected):
        body = r.json()
        assert [i["item_id"] for i in body["items"]] == [i["item_id"] for i in want["items"]]
        assert [i["score"] for i in body["items"]] == pytest.approx([i["score"] for i in want["items"]], abs=1e-6)
    assert not any(t.is_alive() for t in batcher.threads)


def test_k_and_n_default_to_the_server_limits(server):
    body = {key: v for key, v in BASE.items() if key not in ("k", "n")}
    with httpx.Client(base_url=server["url"], timeout=30) as c:
        r = c.post("/v1/rank", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["items"]) == 10


# ---------------------------------------------------------------------- in-process servers


def test_the_default_n_keeps_within_a_lower_max_n(artifacts):
    body = {key: v for key, v in BASE.items() if key not in ("k", "n")}
    app = create_app(artifacts["v1"], serving_cfg=ServingConfig(max_n=5))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        r = c.post("/v1/rank", json=body)
    assert r.status_code == 200, r.text  # not a 422 about an n the client never sent
    assert len(r.json()["items"]) == 5


def test_reload_is_off_without_a_token(artifacts):
    with serve_in_thread(create_app(artifacts["v1"])) as url, httpx.Client(base_url=url, timeout=30) as c:
        r = c.post("/admin/reload", json={"artifact": str(artifacts["v2"])}, headers=AUTH)
        assert r.status_code == 404
        assert c.get("/healthz").json()["model_version"] == "v1"


def test_a_token_with_non_ascii_characters_authorizes_as_clients_send_it(artifacts, tmp_path):
    """`curl -H "Authorization: Bearer $(cat FILE)"` sends the token file's UTF-8 bytes."""
    path = tmp_path / "token"
    path.write_text("jeton-de-rechargement-\u00e9t\u00e9-\u20ac\n", encoding="utf-8")
    path.chmod(0o600)
    token = read_reload_token(path)
    app = create_app(artifacts["v1"], reload_token=token, reload_dirs=[artifacts["root"]])
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        sent = {"Authorization": b"Bearer " + token.encode("utf-8")}
        assert c.post("/admin/reload", json={}, headers=sent).status_code == 200
        wrong = {"Authorization": b"Bearer " + token[:-1].encode("utf-8") + b"x"}
        assert c.post("/admin/reload", json={}, headers=wrong).status_code == 401


def test_reload_token_comes_from_a_file_or_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert read_reload_token(None) is None
    monkeypatch.setenv(TOKEN_ENV, " env-token-0123456789\n")
    assert read_reload_token(None) == "env-token-0123456789"
    path = tmp_path / "token"
    path.write_text("file-token-0123456789\n")
    path.chmod(0o600)
    assert read_reload_token(path) == "file-token-0123456789"  # the file wins
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_reload_token(path)


def test_serve_start_up_errors_are_one_line_naming_the_value(artifacts, tmp_path, capsys):
    from genrec.scripts.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for argv, match in ([["--port", "99999"], "--port must be in [0, 65535]"],
                            [["--reload-token-file", str(tmp_path)], f"cannot read the reload token file {tmp_path}"],
                            [["--port", str(port)], f"cannot listen on 127.0.0.1:{port}"],
                            [["--host", "no-such-host.invalid"], "cannot listen on no-such-host.invalid"]):
            assert main(["serve", "--artifact", str(artifacts["v1"]), *argv]) == 1
            err = capsys.readouterr().err
            assert f"genrec serve: error: {match}" in err and "Traceback" not in err, err
    sock = server_module.listen_socket("127.0.0.1", 0)  # port 0: the summary names the port bound
    try:
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


@pytest.mark.parametrize("kwargs,match", [
    ({"reload_token": "short"}, "at least 16"),
    ({"reload_token": TOKEN}, "reload directory"),
])
def test_reload_configuration_errors(artifacts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        create_app(artifacts["v1"], **kwargs)


def test_full_queue_answers_503_with_retry_after(artifacts):
    app = create_app(artifacts["v1"], max_queue=2, serving_cfg=ServingConfig(max_k=40))
    ranker = app.state.batcher.ranker
    release = threading.Event()

    def held_rank_batch(reqs, _inner=ranker.rank_batch):
        release.wait(30)
        return _inner(reqs)

    ranker.rank_batch = held_rank_batch
    results = []

    def call():
        with httpx.Client(base_url=url, timeout=60) as c:
            r = c.post("/v1/rank", json=BASE)
            results.append((r.status_code, r.headers.get("retry-after")))

    with serve_in_thread(app) as url:
        threads = [threading.Thread(target=call) for _ in range(5)]
        for t in threads:
            t.start()
        deadline = time.time() + 30
        while len(results) < 3 and time.time() < deadline:
            time.sleep(0.01)
        busy = list(results)
        release.set()
        for t in threads:
            t.join()
    assert busy == [(503, "1")] * 3
    assert sorted(results) == [(200, None)] * 2 + [(503, "1")] * 3


def test_a_stalled_body_gets_408_and_frees_its_queue_slot(artifacts, monkeypatch):
    """Clients that send their headers and a part of the body, then stop: their slots in
    the queue (2 here) came back only when they disconnected, so /v1/rank answered 503."""
    monkeypatch.setattr(server_module, "BODY_TIMEOUT_S", 0.5)
    app = create_app(artifacts["v1"], max_queue=2, serving_cfg=ServingConfig(max_k=40))
    with serve_in_thread(app) as url:
        host, port = url.removeprefix("http://").split(":")
        stalled = []
        for _ in range(2):
            s = socket.create_connection((host, int(port)), timeout=30)
            s.sendall(f"POST /v1/rank HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                      "Content-Length: 100\r\n\r\n{".encode())
            stalled.append(s)
        with httpx.Client(base_url=url, timeout=30) as c:
            time.sleep(0.2)
            assert c.post("/v1/rank", json=BASE).status_code == 503
            assert [_read_status_line(s) for s in stalled] == ["HTTP/1.1 408 Request Timeout"] * 2
            assert c.post("/v1/rank", json=BASE).status_code == 200
        for s in stalled:
            s.close()


def test_large_bodies_are_parsed_off_the_event_loop(artifacts, monkeypatch):
    threads = []
    real = server_module.parse_rank_request

    def spy(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(server_module, "parse_rank_request", spy)
    app = create_app(artifacts["v1"], serving_cfg=ServingConfig(max_k=40))
    big = synthetic_request(NUM_ITEMS, 20_000, k=20, n=5, seed=2)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        assert c.post("/v1/rank", json=BASE).status_code == 200
        r = c.post("/v1/rank", json=big)
        assert r.status_code == 200 and r.json()["history_truncated"]
    assert len(json.dumps(big)) > server_module.PARSE_INLINE_BYTES
    assert threads[0] == LOOP_THREAD  # a small body: parsed inline, it is cheaper than a hand-off
    assert threads[1] not in (LOOP_THREAD, "genrec-batcher")


# ---------------------------------------------------------------------- the command line


def test_serve_has_a_flag_for_every_server_option():
    serve_parser = build_parser()._subparsers._group_actions[0].choices["serve"]
    dests = {a.dest for a in serve_parser._actions}
    options = set(inspect.signature(server_module.serve).parameters) - {"artifact_dir", "serving_cfg"}
    import dataclasses

    options |= {f.name for f in dataclasses.fields(ServingConfig)}
    assert options <= dests, sorted(options - dests)
    assert {"reload_token_file", "reload_dirs", "allowed_hosts", "max_queue", "max_body_bytes"} <= dests
    assert not [d for d in dests if "token" in d and d != "reload_token_file"]  # never a token on argv


def test_serve_flags_reach_the_server(monkeypatch, tmp_path):
    from genrec.scripts.cli import main

    seen = {}
    monkeypatch.setattr(server_module, "serve", lambda artifact, **kw: seen.update(kw, artifact=artifact))
    assert main(["serve", "--artifact", "a", "--port", "9", "--max-queue", "7", "--max-body-bytes", "1000",
                 "--max-k", "50", "--max-n", "20", "--max-request-events", "300", "--micro-batch", "8",
                 "--reload-token-file", "tok", "--reload-dir", "x", "--reload-dir", "y",
                 "--allowed-hosts", "a.example, b.example"]) == 0
    assert (seen["artifact"], seen["port"], seen["max_queue"], seen["max_body_bytes"]) == ("a", 9, 7, 1000)
    assert (seen["reload_token_file"], seen["reload_dirs"], seen["allowed_hosts"]) == ("tok", ["x", "y"],
                                                                                      ["a.example", "b.example"])
    cfg = seen["serving_cfg"]
    assert (cfg.max_k, cfg.max_n, cfg.max_request_events, cfg.micro_batch) == (50, 20, 300, 8)
    assert cfg.retrieval_block_rows == ServingConfig().retrieval_block_rows  # unset flags keep the defaults


def test_every_accepted_pair_of_times_differs_within_int64():
    """The time bias takes |t_i - t_j| in int64: at the old bounds (+-2**62) the gap was 2**63,
    which wrapped to INT64_MIN and was scored as a gap of 0 (a different answer than one
    second less)."""
    from pydantic import ValidationError

    from genrec.models.serving.server import RankBody

    bounds = RankBody.model_json_schema()["properties"]["timestamps"]["items"]
    assert bounds["maximum"] - bounds["minimum"] <= INT64_MAX
    body = {"item_ids": [1, 2], "actions": [0, 0]}
    with pytest.raises(ValidationError):
        RankBody.model_validate(dict(body, timestamps=[-(1 << 62), 1 << 62]))
    with pytest.raises(ValidationError):
        RankBody.model_validate(dict(body, timestamps=[0, 1], request_time=1 << 62))
    RankBody.model_validate(dict(body, timestamps=[-(1 << 62), (1 << 62) - 1]))
