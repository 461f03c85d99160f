"""`train.cpu_affinity`: local ranks get disjoint, equal shares of the cores, and binding
reaches every thread of the process, those started before it included."""

import os
import subprocess
import sys
import textwrap

import pytest

from genrec.models.train.distributed import local_cores

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux's affinity API")


def test_local_ranks_get_disjoint_equal_shares_of_the_allowed_cores():
    allowed = sorted(os.sched_getaffinity(0))
    for world in range(2, len(allowed) + 1):
        shares = [local_cores(r, world) for r in range(world)]
        assert all(len(s) == len(allowed) // world for s in shares)
        flat = [c for s in shares for c in s]
        assert len(set(flat)) == len(flat) and set(flat) <= set(allowed)
    assert local_cores(0, 1) is None  # one rank: nothing to split
    assert local_cores(0, len(allowed) + 1) is None  # more ranks than cores: left to the OS


def test_binding_reaches_threads_started_before_and_after():
    # In a child process: binding changes the affinity of the process that does it.
    code = textwrap.dedent("""
        import os, threading, time
        from genrec.models.train.distributed import bind_to_cores
        stop = threading.Event()
        before = threading.Thread(target=stop.wait); before.start()
        core = sorted(os.sched_getaffinity(0))[-1]
        bind_to_cores([core])
        after = threading.Thread(target=stop.wait); after.start()
        masks = {tid: os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")}
        stop.set(); before.join(); after.join()
        assert len(masks) >= 3, masks
        assert all(m == {core} for m in masks.values()), masks
        print("ok", len(masks))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")
