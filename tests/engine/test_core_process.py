"""The engine core process: its sockets (sending a step's outputs never preempts the step loop) and the
OpenMP environment it starts with."""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

import pytest
import zmq

from prefixcache.engine.core_process import CORE_WAIT_POLICY, _environment, _never_preempt_the_step, core_environment


def thread_policies() -> dict[str, set[int]]:
    """This process's threads by name, with the scheduling policy of each."""
    policies: dict[str, set[int]] = {}
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        name = (task / "comm").read_text().strip()
        policies.setdefault(name, set()).add(os.sched_getscheduler(int(task.name)))
    return policies


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_BATCH and /proc are Linux's")
def test_the_io_thread_that_sends_outputs_runs_as_batch_and_the_loop_keeps_its_policy(tmp_path):
    main_policy = os.sched_getscheduler(0)
    context = zmq.Context()
    _never_preempt_the_step(context)
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    try:
        pull.bind(f"ipc://{tmp_path}/outputs")
        push.connect(f"ipc://{tmp_path}/outputs")
        push.send(b"step")
        assert pull.recv() == b"step"  # the I/O thread is running: it set its policy before its first message
        policies = thread_policies()
        assert policies["ZMQbg/IO/0"] == {os.SCHED_BATCH}
        assert os.sched_getscheduler(0) == main_policy  # the probe changed only its own throwaway thread
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        context.term()


def test_the_core_sleeps_at_openmp_barriers_when_the_user_set_no_policy():
    assert core_environment({"OMP_NUM_THREADS": "2", "PATH": "/bin"}) == {"OMP_WAIT_POLICY": CORE_WAIT_POLICY}


@pytest.mark.parametrize(
    "user", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "passive"}, {"GOMP_SPINCOUNT": "infinite"}]
)
def test_a_wait_policy_or_spin_count_the_user_set_is_left_as_it_is(user):
    # either one decides how libgomp waits: nothing is added beside it
    assert core_environment(user) == {}


def _report_environment(queue, names):
    queue.put({name: os.environ.get(name) for name in names})


def test_a_spawned_child_starts_with_the_overrides_and_the_parent_keeps_its_own(monkeypatch):
    monkeypatch.setenv("PREFIXCACHE_TEST_KEPT", "parent")
    monkeypatch.delenv("PREFIXCACHE_TEST_ADDED", raising=False)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(
        target=_report_environment, args=(queue, ["PREFIXCACHE_TEST_KEPT", "PREFIXCACHE_TEST_ADDED"])
    )
    with _environment({"PREFIXCACHE_TEST_KEPT": "child", "PREFIXCACHE_TEST_ADDED": "child"}):
        child.start()
    try:
        assert queue.get(timeout=120) == {"PREFIXCACHE_TEST_KEPT": "child", "PREFIXCACHE_TEST_ADDED": "child"}
    finally:
        child.join(timeout=30)
    assert os.environ["PREFIXCACHE_TEST_KEPT"] == "parent"
    assert "PREFIXCACHE_TEST_ADDED" not in os.environ
