"""`train.cpu_affinity`: local ranks get disjoint, equal shares of the cores, and binding
reaches every thread of the process that computes, those started before it included, and
leaves the collectives' threads free."""

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


def test_binding_reaches_compute_threads_started_before_and_after_and_not_the_collectives():
    # In a child process: binding changes the affinity of the process that does it.
    code = textwrap.dedent("""
        import os, socket, threading
        import torch.distributed as dist
        from genrec.models.train.distributed import COLLECTIVE_THREADS, bind_to_cores
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        allowed = os.sched_getaffinity(0)
        stop = threading.Event()
        before = threading.Thread(target=stop.wait); before.start()
        core = sorted(allowed)[-1]
        bind_to_cores([core])
        after = threading.Thread(target=stop.wait); after.start()
        def name(tid):
            return open(f"/proc/self/task/{tid}/comm").read().strip()
        masks = {tid: (name(tid), os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
        stop.set(); before.join(); after.join()
        dist.destroy_process_group()
        collective = {t: m for t, (n, m) in masks.items() if n.startswith(COLLECTIVE_THREADS)}
        compute = {t: m for t, (n, m) in masks.items() if not n.startswith(COLLECTIVE_THREADS)}
        for tid in (threading.get_native_id(), before.native_id, after.native_id):
            assert compute[str(tid)] == {core}, masks
        assert all(m == {core} for m in compute.values()), masks
        assert collective and all(m == allowed for m in collective.values()), masks
        print("ok", len(compute), len(collective))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok"), out.stdout
