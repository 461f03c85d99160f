"""Shared by the serving tests: one synthetic model exported as artifacts, and `genrec serve`
on it in a child process."""

from __future__ import annotations

import shutil

import pytest

from genrec.models.serving.artifact import export_artifact
from genrec.models.serving.bench import build_synthetic_model
from serving_helpers import MAX_SEQ_LEN, NUM_ITEMS, TOKEN, ServerProcess


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> dict:
    """{"root": the reload directory, "v1": fp32, "v2": int8, "broken": v2 with a truncated
    dense file (all three under root), "outside": a valid artifact outside root, "feats"}."""
    base = tmp_path_factory.mktemp("artifacts")
    root = base / "reloadable"
    model, item_ids, feats = build_synthetic_model(num_items=NUM_ITEMS, dim=16, max_seq_len=MAX_SEQ_LEN, seed=5)
    out = {"root": root, "feats": feats}
    for version, dtype in (("v1", "fp32"), ("v2", "int8")):
        out[version] = export_artifact(model, {}, root / version, dtype=dtype, item_ids=item_ids,
                                       item_features=feats, version=version, export_program=False)
    broken = root / "broken"
    shutil.copytree(out["v2"], broken)
    (broken / "dense.safetensors").write_bytes((broken / "dense.safetensors").read_bytes()[:-10])
    out["broken"] = broken
    out["outside"] = base / "elsewhere" / "v3"
    shutil.copytree(out["v1"], out["outside"])
    return out


@pytest.fixture(scope="session")
def server(artifacts, tmp_path_factory):
    """`genrec serve` of v1 with K <= 40, reload on (token file, the artifacts' root) and two
    extra Host names (one given with a port, which is not matched; one IPv6). Tests that reload put v1 back."""
    token_file = tmp_path_factory.mktemp("secret") / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    proc = ServerProcess(artifacts["v1"], extra=[
        "--max-k", "40", "--max-wait-ms", "5", "--reload-token-file", str(token_file),
        "--reload-dir", str(artifacts["root"]), "--allowed-hosts", "Ranker.Test:9999,2001:db8::1"])
    try:
        yield {"url": proc.url, "arts": artifacts, "feats": artifacts["feats"], "proc": proc}
    finally:
        proc.close()
