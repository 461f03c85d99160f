"""Property-based fuzz of POST /v1/rank on a real loopback server: bodies drawn from the
request model's JSON schema (in range, at and past every bound, of the wrong type, unknown
fields, missing fields) and aligned histories with extreme ids and times. No answer may be a
5xx, and every 4xx names the offending field."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from genrec.models.serving.ranker import ServingConfig
from genrec.models.serving.server import INT64_MAX, INT64_MIN, create_app
from serving_helpers import NUM_ITEMS, serve_in_thread

MAX_K = 40
MAX_EVENTS = 500
SIDE_FEATURES = ("advertiser_id", "category_id")

# allow_subnormal=False: genrec.dense's fast-math kernel library, once loaded, flushes
# subnormals to zero in this process, and hypothesis refuses to draw them then.
any_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5)
    | st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6)
int64 = st.one_of(st.integers(-3, NUM_ITEMS + 3), st.integers(INT64_MIN, INT64_MAX),
                  st.sampled_from([INT64_MIN, INT64_MAX, 0, -1]))


def from_schema(schema: dict, defs: dict) -> st.SearchStrategy:
    """Values for one JSON-schema node: mostly valid, often at or just past a bound, sometimes
    of any JSON type at all."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        edges = sorted({v for b in (lo, hi) if b is not None for v in (b - 1, b, b + 1)})
        valid = st.integers(-3, NUM_ITEMS + 3).filter(lambda v: (lo is None or v >= lo) and (hi is None or v <= hi))
        return st.one_of(valid, st.integers(lo, hi), st.sampled_from(edges)) if edges else st.integers()
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "string":
        names = st.sampled_from([*SIDE_FEATURES, "click", "conversion", "retrieval", "campaign_id", ""])
        return names | st.text(max_size=schema.get("maxLength", 8) + 1)
    if kind == "array":
        items = from_schema(schema["items"], defs)
        longest = schema.get("maxItems")
        at_bounds = [st.just([0] * n) for n in (longest, longest + 1)] if longest else []
        return st.one_of(st.lists(items, min_size=schema.get("minItems", 0), max_size=6), st.lists(items, max_size=2),
                         *at_bounds)
    if kind == "object":
        keys = st.sampled_from([*SIDE_FEATURES, "slot", "campaign_id"]) | st.text(max_size=4)
        return st.dictionaries(keys, from_schema(schema.get("additionalProperties", {}), defs), max_size=3)
    return any_json


def schema_bodies(schema: dict) -> st.SearchStrategy:
    defs = schema.get("$defs", {})
    props = schema["properties"]
    field = {name: from_schema(p, defs) | any_json for name, p in props.items()}
    required = [n for n in schema.get("required", [])]
    optional = [n for n in props if n not in required]

    @st.composite
    def body(draw):
        out = {n: draw(field[n]) for n in required if draw(st.integers(0, 9)) > 0}
        for n in draw(st.lists(st.sampled_from(optional), unique=True, max_size=len(optional))):
            out[n] = draw(field[n])
        if draw(st.integers(0, 9)) == 0:
            out[draw(st.text(min_size=1, max_size=6).filter(lambda k: k not in props))] = draw(any_json)
        return out

    return body()


@st.composite
def aligned_bodies(draw):
    """Well-formed histories (so the ranker runs) with ids, times and options from the whole range."""
    n = draw(st.integers(1, 30))
    events = st.lists(int64, min_size=n, max_size=n)
    body = {"item_ids": draw(events), "actions": draw(st.lists(st.integers(-1, 4) | int64, min_size=n, max_size=n)),
            "timestamps": draw(events)}
    for f in draw(st.lists(st.sampled_from(SIDE_FEATURES), unique=True)):
        body.setdefault("features", {})[f] = draw(events)
    options = {"k": st.integers(1, MAX_K + 2), "n": st.integers(1, 12), "exclude_seen": st.booleans(),
               "allowed_advertisers": st.lists(int64, max_size=4), "request_time": int64,
               "sort_by": st.sampled_from(["click", "conversion", "retrieval", "ctr"]),
               "context": st.dictionaries(st.sampled_from(SIDE_FEATURES), int64, max_size=2)}
    for name in draw(st.lists(st.sampled_from(sorted(options)), unique=True)):
        body[name] = draw(options[name])
    return body


@pytest.fixture(scope="module")
def fuzz_server(artifacts, tmp_path_factory):
    # Hypothesis keeps caches in ./.hypothesis by default; not in the working tree.
    set_hypothesis_home_dir(tmp_path_factory.mktemp("hypothesis"))
    app = create_app(artifacts["v1"], serving_cfg=ServingConfig(max_k=MAX_K, max_request_events=MAX_EVENTS))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        schema = app.state.rank_body.model_json_schema()
        # The server documents the schema it enforces (FastAPI writes the int64 bounds as floats).
        doc = client.get("/openapi.json").json()["paths"]["/v1/rank"]["post"]["requestBody"]
        documented = doc["content"]["application/json"]["schema"]
        assert set(documented["properties"]) == set(schema["properties"])
        assert documented["required"] == schema["required"]
        assert documented["properties"]["item_ids"]["maxItems"] == MAX_EVENTS
        yield client, schema
    set_hypothesis_home_dir(None)


def test_no_body_gets_a_5xx_and_every_4xx_names_its_field(fuzz_server):
    client, schema = fuzz_server
    props = set(schema["properties"])

    @settings(max_examples=100, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    @given(body=st.one_of(schema_bodies(schema), aligned_bodies()))
    def check(body):
        r = client.post("/v1/rank", json=body)
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            field = r.json()["field"]
            top = field.split(".", 1)[0]
            assert top == "body" or top in body or (top in props and top in schema["required"]), (body, r.text)
        else:
            assert r.status_code == 200
            # "n" absent or null: the default, min(10, k)
            assert len(r.json()["items"]) <= (body.get("n") or 10)

    check()
