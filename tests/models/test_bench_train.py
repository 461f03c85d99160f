"""`genrec bench train`'s split of the 2-rank loss (the three parts account for all of it),
and its per-thread CPU and preemption counters."""

import os
import threading
import time

import pytest

from genrec.models.train.bench import _helper_cpu_since, _helper_threads_cpu, _preemptions, _scaling_breakdown


def test_the_lost_parts_add_up_to_what_two_ranks_miss_of_twice_one():
    scaling = [1.31, 1.52, 1.40]
    parts = [{"independent": 1.95, "independent_slower": 1.80, "same_batches": 1.50},
             {"independent": 2.01, "independent_slower": 1.94, "same_batches": 1.62},
             {"independent": 1.90, "independent_slower": 1.70, "same_batches": 1.41}]
    out = _scaling_breakdown(scaling, parts)
    lost = out["scaling_lost_to"]
    assert sum(lost.values()) == pytest.approx(2.0 - 1.40)
    # Medians of each figure over the rounds, not one round's figures.
    assert out["scaling_2independent_slower_vs_1rank"] == 1.80
    assert out["scaling_2rank_same_batches_vs_1rank"] == 1.50
    assert lost["shared_machine"] == pytest.approx(0.20)
    assert lost["communication"] == pytest.approx(0.30)
    assert lost["batch_imbalance"] == pytest.approx(0.10)
    assert out["scaling_2independent_vs_1rank_spread"] == {"median": 1.95, "min": 1.90, "max": 2.01, "n": 3}


def test_helper_threads_cpu_counts_the_other_threads_and_not_the_caller():
    started, spun, stop = threading.Event(), threading.Event(), threading.Event()

    def spin():
        started.set()
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.2:
            pass
        spun.set()
        stop.wait()

    helper = threading.Thread(target=spin)
    helper.start()
    started.wait()
    before = _helper_threads_cpu()
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.1:  # the caller's own CPU, which must not be counted
        pass
    spun.wait()
    after = _helper_threads_cpu()
    since = _helper_cpu_since(before)  # every other thread's growth: the helper's, little else
    stop.set()
    helper.join()
    assert threading.get_native_id() not in after and helper.native_id in after
    # It spun 0.2 s of CPU, a little of it before the first reading.
    assert 0.1 <= after[helper.native_id] - before.get(helper.native_id, 0.0) <= 0.25
    assert 0.1 <= since <= 0.25 + 0.05


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux's affinity API")
def test_preemptions_count_the_caller_taken_off_a_shared_core():
    """Two busy threads on one core: the scheduler must take the caller off it, again and
    again, while it could still run."""
    core, allowed = min(os.sched_getaffinity(0)), os.sched_getaffinity(0)
    ready, stop = threading.Event(), threading.Event()

    def rival():
        os.sched_setaffinity(0, {core})  # this thread only
        ready.set()
        while not stop.is_set():
            pass

    thread = threading.Thread(target=rival)
    os.sched_setaffinity(0, {core})
    try:
        thread.start()
        ready.wait()
        before = _preemptions()
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.2:  # 0.2 s of CPU while the rival wants the core too
            pass
        taken_off = _preemptions() - before
    finally:
        stop.set()
        thread.join()
        os.sched_setaffinity(0, allowed)
    assert taken_off >= 1
