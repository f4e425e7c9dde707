"""The engine core process's sockets: sending a step's outputs never preempts the step loop."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import zmq

from prefixcache.engine.core_process import _never_preempt_the_step


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
