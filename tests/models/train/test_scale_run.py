"""The SSD tier's scale run, at a small size: killed with SIGKILL mid-run, resumed from its
chain of incremental snapshots, it trains on with exactly the losses it had before."""

import json
import subprocess
import sys


def test_scale_run_resumes_bit_for_bit_after_kill_9(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "genrec.models.train.scale_run", "--dir", str(tmp_path / "run"), "--rows", "60000",
         "--host-rows", "6000", "--steps", "24", "--snapshot-every", "6", "--max-deltas", "2", "--kill-at", "21"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["losses_identical"] and result["resumed_steps_compared"] == 3  # steps 19-21, from step 18's
    kinds = [r["progress"]["snapshot"]["kind"] for r in result["reports"] if "progress" in r]
    assert kinds[:3] == ["full", "delta", "delta"], kinds  # then compaction: full again after 2 deltas
    first = [r["progress"] for r in result["reports"] if "progress" in r and r["progress"]["process"] == "first"]
    assert first and first[-1]["io"]["write_bytes"] > 0
    assert subprocess.run([sys.executable, "-m", "genrec.models.train.scale_run", "--dir", str(tmp_path / "run")],
                          capture_output=True, text=True).returncode != 0  # never reuses a used directory
