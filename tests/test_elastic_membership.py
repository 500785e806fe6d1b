"""Elastic membership under torchrun (NNODES=MIN:MAX, c10d): two "nodes" on localhost, one
killed (its agent and its worker) or one joining late; the run goes on and finishes. Real
processes, CPU, gloo, one process per node (docs/elastic.md)."""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    ROOT,
    finish,
    free_port,
    job_processes,
    kill_job,
    process_tree,
    recorded_data,
    recorded_reads,
    start,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# Long enough epochs (600 rows in batches of 2: 150 optimizer steps of 4 rows) that a node
# dies or joins in epoch 0, with a last.ckpt every 20 steps to resume from.
ROWS = 600
ELASTIC_ARGS = ["data.batch_size=2", "trainer.max_epochs=2", "test=false",
                "callbacks.fault_tolerance.every_n_train_steps=20"]  # fmt: skip
RESUMED = "Training, resuming from"
# A node's death -> the survivor trains again: ~15 s here (torch's defaults: ~50 s).
RECOVERY_S = 45


class Node:
    """One `launch/multinode.sh` (a torchrun agent and its worker): its output lines with
    the time each arrived, and every process id its tree has had."""

    def __init__(self, args: list[str], **env: str) -> None:
        self.proc = start([str(ROOT / "launch" / "multinode.sh"), *args], **env)
        self.lines: list[tuple[float, str]] = []
        self.pids: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def _watch(self) -> None:
        while self.proc.poll() is None:
            self.pids.update(process_tree(self.proc.pid))
            time.sleep(0.2)

    def first(self, text: str, after: float = 0.0) -> float | None:
        """When the first line holding `text` arrived (after `after`), or None."""
        return next((t for t, line in list(self.lines) if t > after and text in line), None)

    def out(self) -> str:
        return "".join(line for _, line in list(self.lines))

    def kill(self) -> float:
        """SIGKILL the agent and its worker (torchrun puts workers in sessions of their own);
        returns when."""
        for pid in process_tree(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return time.monotonic()

    def finish(self, timeout: float) -> int:
        self.proc.stdout = None  # the reader thread owns the pipe
        code, _ = finish(self.proc, timeout)
        return code


def wait_for(nodes: list[Node], text: str, timeout: float) -> float:
    """When `text` first appeared in any node's output."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = [t for n in nodes if (t := n.first(text)) is not None]
        if seen:
            return min(seen)
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} within {timeout}s:\n" + nodes[0].out()[-3000:])


def wait_listening(port: int, timeout: float = 60) -> None:
    """Until the first node's agent hosts the rendezvous store: the store lives in that agent,
    so it is the node that must survive (docs/elastic.md)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"no rendezvous store on port {port} after {timeout}s")


def saved_mid_epoch(log_dir: Path, node: Node, timeout: float = 90) -> None:
    """Until the job wrote last.ckpt at step 20 (mid-epoch 0: a checkpoint to resume; the
    cadence's saves are logged to train.log only)."""
    train_log = log_dir / "train" / "runs" / "torchrun-elastic" / "train.log"
    deadline = time.monotonic() + timeout
    while not (train_log.exists() and "last.ckpt at step 20" in train_log.read_text()):
        assert time.monotonic() < deadline, node.out()[-3000:]
        time.sleep(0.05)


def alive(pids: set[int]) -> list[str]:
    """The processes of `pids` still running, with their command lines (what was left)."""
    left = []
    for pid in pids:
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                left.append(f"{pid}: {cmd[:200]}")
    return left


@pytest.fixture
def elastic_node(base_args, tmp_path):
    """() -> a started Node of one c10d job (NNODES=1:2, one process per node, one run
    folder) training on ROWS recorded rows (reads-try<restart>-rank<R>.txt in tmp_path);
    the first one hosts the rendezvous store."""
    port = free_port()
    # A last call of 6 s (the script's default: 3 s): the second node's agent, started once
    # the first hosts the store, joins the first round also on a loaded machine.
    env = {"NNODES": "1:2", "NPROC_PER_NODE": "1", "RDZV_ENDPOINT": f"127.0.0.1:{port}",
           "RDZV_ID": "elastic", "MAX_RESTARTS": "3", "RECORD_TAG": "try{restart}",
           "RDZV_LAST_CALL": "6"}  # fmt: skip
    nodes: list[Node] = []
    data = recorded_data(tmp_path, ROWS)

    def node(*extra: str) -> Node:
        nodes.append(Node([*base_args, *data, *ELASTIC_ARGS, *extra], **env))
        if len(nodes) == 1:
            wait_listening(port)
        return nodes[-1]

    return node


def test_a_dead_node_is_left_behind_and_the_survivor_resumes(
    elastic_node, tmp_path, log_dir
) -> None:
    """The survivor resumes within RECOVERY_S of the death, keeps the global batch (the same
    optimizer steps as two nodes would take), and trains every row of the interrupted epoch
    once from the checkpoint's position on."""
    host, other = elastic_node(), elastic_node()
    saved_mid_epoch(log_dir, host)
    killed = other.kill()
    assert host.finish(timeout=150) == 0, host.out()[-4000:]
    resumed = host.first(RESUMED, after=killed)
    assert resumed is not None, host.out()[-4000:]
    print(f"node killed -> survivor training again after {resumed - killed:.1f} s")
    assert resumed - killed < RECOVERY_S, host.out()[-4000:]
    out = host.out()
    assert "Metrics:" in out and "the global batch of 4 is kept" in out, out[-4000:]
    # What the survivor says: the peer is gone (not a hang), and what happens next.
    assert "hang report: rank 1 died: the job failed" in out, out[-4000:]
    assert "next: torchrun restarts the job (restart 1 of 3)" in out, out[-4000:]
    assert re.search(
        r"launcher: the workers failed: restart 1 of 3, waiting for the nodes: a "
        r"node whose heartbeats stopped is left out after <= 3 s, then 6 s",
        out,
    ), out[-4000:]
    assert not alive(host.pids | other.pids)
    last = log_dir / "train" / "runs" / "torchrun-elastic" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 2 * math.ceil(ROWS / 4)
    # Epoch 0: the rows both nodes had read when the checkpoint was written (its position),
    # then what the survivor read after its restart, before its epoch 1 (ROWS rows).
    position = int(re.search(r"Resuming epoch 0 at global position (\d+)", out)[1])
    first, (after,) = recorded_reads(tmp_path, "try0"), recorded_reads(tmp_path, "try1")
    epoch0 = [i for rank in first for i in rank[: position // 2]] + after[:-ROWS]
    assert collections.Counter(epoch0) == collections.Counter(range(ROWS))


def workers(node: Node) -> list[int]:
    """The node's training processes (not its agent or the launch script)."""
    return [pid for pid, command in job_processes(node.proc).items()
            if "project.train" in command and "project.launcher" not in command]  # fmt: skip


@pytest.mark.parametrize("survivor", ["training", "paused"])
def test_when_the_store_host_dies_the_survivor_says_so_in_one_line(
    elastic_node, log_dir, survivor
) -> None:
    """The node hosting the c10d store dies: the survivor cannot meet again (docs/elastic.md).
    It said so with two 30-frame C++ stacks and a start-up checklist ("a node was not
    started ..."); now one line names the store and its host, exit 1, nothing left.
    "paused": the survivor's worker is still running (SIGSTOP) when the host dies, so its
    agent finds the store gone while asking it for new nodes, before any restart (that line
    was once the start-up checklist's)."""
    host, other = elastic_node(), elastic_node()
    saved_mid_epoch(log_dir, other)
    paused = workers(other) if survivor == "paused" else []
    assert paused or survivor == "training", other.out()[-3000:]
    for pid in paused:
        os.kill(pid, signal.SIGSTOP)
    host.kill()
    if paused:
        wait_for([other], "closing signal SIGTERM", timeout=60)  # the agent stops its workers
        for pid in paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert other.finish(timeout=200) == 1, other.out()[-4000:]
    out = other.out()
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "the rendezvous store at 127.0.0.1:" in errors[0], out[-4000:]
    assert "is gone" in errors[0] and "RDZV_ENDPOINT" in errors[0], errors
    assert "docs/elastic.md): RUN_ID=torchrun-elastic NNODES=1:2 " in errors[0], errors
    assert "frame #" not in out and "Likely causes" not in out, out[-4000:]
    assert not alive(host.pids | other.pids)


def test_a_busy_machine_leaves_no_node_out(elastic_node, log_dir) -> None:
    """Both cores busy with other work while two nodes train (from their first save on): with
    the launch script's heartbeats (a node silent for 3 s is left out) they train to the end
    without a restart."""
    host, other = elastic_node(), elastic_node()
    saved_mid_epoch(log_dir, host)  # both in one round, training (the start is not the test)
    busy = [start([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        codes = host.finish(timeout=240), other.finish(timeout=60)
    finally:
        for proc in busy:
            kill_job(proc)
    assert codes == (0, 0), host.out()[-4000:] + other.out()[-2000:]
    goodput = json.loads((log_dir / "train/runs/torchrun-elastic/goodput.json").read_text())
    assert len(goodput["attempts"]) == 1, goodput
    assert "the workers failed" not in host.out() + other.out(), host.out()[-4000:]


def test_a_node_that_joins_is_taken_in_at_the_next_restart(elastic_node) -> None:
    # Long enough (8 epochs of 300 steps alone) that the first node is still training when the
    # second has started on a busy machine; both end once the 8 epochs are done together.
    first = elastic_node("trainer.max_epochs=8")
    wait_for([first], "Training", timeout=90)  # training alone (world size 1)
    second = elastic_node("trainer.max_epochs=8")
    began = time.monotonic()
    codes = [first.finish(timeout=150), second.finish(timeout=150)]
    both = first.out() + second.out()
    assert codes == [0, 0], both[-4000:]
    assert "Starting with 2 processes" in both, both[-4000:]
    joined = min(t for n in (first, second) if (t := n.first(RESUMED, after=began)))
    print(f"node started -> both training together after {joined - began:.1f} s")
    assert not alive(first.pids | second.pids)


def test_no_survivor_waits_on_a_node_that_died_at_the_end(elastic_node) -> None:
    """torchrun's agent waits up to 300 s at the end for every other agent; ours only for
    those whose heartbeats still come."""
    host, other = elastic_node(), elastic_node()
    wait_for([host, other], "Metrics:", timeout=120)  # training has ended on rank 0
    killed = other.kill()
    assert host.finish(timeout=120) == 0, host.out()[-4000:]
    print(f"node killed at the end -> survivor exited after {time.monotonic() - killed:.1f} s")
    assert time.monotonic() - killed < 30
    assert not alive(host.pids | other.pids)
