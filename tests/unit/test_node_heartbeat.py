"""The launch processes' heartbeats (smp_adapter/launch/node_heartbeat.py) and the ranks' watch on their launch
process (smp_adapter/launch/rank_watch.py), in one process on loopback: what each node learns when another goes
silent, dies, or ends its job with or without a failure. tests/distributed/test_cluster.py runs the same on
namespaced nodes through `smp-adapter launch`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from smp_adapter.launch import rank_watch as launch_watch
from smp_adapter.launch.free_port import free_port
from smp_adapter.launch.node_heartbeat import NodeHeartbeat, timeout_from


def _nodes(n: int, timeout: float) -> list[NodeHeartbeat]:
    port = free_port()
    nodes = [NodeHeartbeat(i, n, "127.0.0.1", port, timeout=timeout, job_key=f"{n}:{port}") for i in range(n)]
    for node in nodes:
        node.start()
    return nodes


def _wait(cond, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _connected(hub: NodeHeartbeat, n: int) -> bool:
    return len([p for p in hub._peers if p.node is not None]) == n


def test_a_silent_node_is_lost_on_both_sides_after_the_timeout():
    node0, node1 = _nodes(2, timeout=0.6)
    try:
        assert _wait(lambda: _connected(node0, 1), 5)
        start = time.monotonic()
        node1._stop.set()  # its thread stops beating, its socket stays open: a partition, not a death
        node1._thread.join(5)
        assert _wait(lambda: node0.event is not None, 5)
        took = time.monotonic() - start
        assert (node0.event.kind, node0.event.node, node0.event.address) == ("lost", 1, "127.0.0.1")
        assert "no heartbeat from its launch process for" in node0.event.reason and 0.5 < took < 2.5
        assert "node 1 (127.0.0.1) is unreachable" in node0.event.message()
    finally:
        node0.close()
        node1.close()


def test_a_busy_but_beating_node_is_not_lost():
    node0, node1 = _nodes(2, timeout=0.5)
    try:
        time.sleep(2.0)  # four timeouts: heartbeats keep both alive
        assert (node0.event, node1.event) == (None, None)
    finally:
        node0.close()
        node1.close()


def test_a_closed_connection_without_done_is_a_lost_node_at_once():
    node0, node1 = _nodes(2, timeout=30)
    try:
        assert _wait(lambda: _connected(node0, 1), 5)
        node1.close()  # the socket closes without "done": the kernel's way when the launch process dies
        assert _wait(lambda: node0.event is not None, 2)
        assert node0.event.kind == "lost" and "closed the heartbeat connection before its job ended" in node0.event.reason
    finally:
        node0.close()


def test_a_failed_node_is_named_everywhere_and_a_finished_one_is_not_reported():
    node0, node1, node2 = _nodes(3, timeout=30)
    try:
        assert _wait(lambda: _connected(node0, 2), 5)
        node1.finish(0, "")
        time.sleep(0.3)
        assert (node0.event, node2.event) == (None, None)  # a node that finished is neither lost nor failed
        node2.finish(1, "rank 5 failed (exit code 1): RuntimeError: boom")
        assert _wait(lambda: node0.event is not None, 3)
        assert (node0.event.kind, node0.event.node) == ("failed", 2)
        assert node0.event.message() == ("node 2 (127.0.0.1)'s job failed first: rank 5 failed (exit code 1): "
                                          "RuntimeError: boom")
    finally:
        for node in (node0, node1, node2):
            node.close()


def test_a_preempted_node_is_not_reported_as_failed():
    node0, node1 = _nodes(2, timeout=30)
    try:
        assert _wait(lambda: _connected(node0, 1), 5)
        node1.finish(143, "interrupted (SIGTERM)", interrupted=True)  # its ranks saved and exited on SIGTERM
        time.sleep(0.5)
        assert node0.event is None
    finally:
        node0.close()
        node1.close()


def test_node_0_relays_what_it_learnt():
    node0, node1, node2 = _nodes(3, timeout=30)
    try:
        assert _wait(lambda: _connected(node0, 2), 5)
        node2.close()  # died
        assert _wait(lambda: node1.event is not None, 3)
        assert (node1.event.kind, node1.event.node) == ("lost", 2) and "(reported by node 0)" in node1.event.reason
    finally:
        node0.close()
        node1.close()


def test_another_jobs_node_is_ignored():
    port = free_port()
    hub = NodeHeartbeat(0, 2, "127.0.0.1", port, timeout=0.5, job_key="2:1")
    stranger = NodeHeartbeat(1, 2, "127.0.0.1", port, timeout=30, job_key="2:2")
    hub.start()
    stranger.start()
    try:
        time.sleep(1.5)
        assert hub.event is None and hub._peers == []
    finally:
        hub.close()
        stranger.close()


def test_the_timeout_comes_from_the_flag_then_the_environment():
    assert timeout_from(7, {"SMP_ADAPTER_NODE_TIMEOUT": "9"}) == 7
    assert timeout_from(None, {"SMP_ADAPTER_NODE_TIMEOUT": "9"}) == 9
    assert timeout_from(None, {}) == 120


WATCHER = ("import sys, time; sys.path.insert(0, sys.argv[1]); from smp_adapter.launch import rank_watch as launch_watch; "
           "print(launch_watch.watch_if_launched(), flush=True); time.sleep(30)")


def _watcher(identity: str) -> subprocess.Popen:
    adapter = os.path.dirname(os.path.dirname(launch_watch.__file__))
    return subprocess.Popen([sys.executable, "-c", WATCHER, adapter], env={**os.environ, launch_watch.ENV: identity},
                            stdout=subprocess.PIPE, text=True)


def test_a_rank_ends_when_its_launch_process_is_killed():
    launch = subprocess.Popen(["sleep", "60"])
    rank = _watcher(launch_watch.identity(launch.pid))
    try:
        assert rank.stdout.readline().strip() == "watching"
        launch.kill()
        launch.wait(5)
        assert rank.wait(5) == -signal.SIGKILL
    finally:
        launch.kill()
        rank.kill()


def test_a_rank_whose_launch_process_is_already_gone_ends_at_once():
    launch = subprocess.Popen(["sleep", "60"])
    identity = launch_watch.identity(launch.pid)
    launch.kill()
    launch.wait(5)
    rank = _watcher(identity)
    try:
        assert rank.wait(5) == -signal.SIGKILL
    finally:
        rank.kill()


@pytest.mark.parametrize("value, said", [("123:456:another-machines-boot-id", "other machine"), ("", "no variable")])
def test_a_variable_from_another_machine_or_none_is_ignored(value, said):
    rank = _watcher(value)
    try:
        assert rank.stdout.readline().strip() == said
    finally:
        rank.kill()
