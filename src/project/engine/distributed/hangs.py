"""The hang report: which rank, which collective, where, on one screen.

A watchdog thread on every rank compares the time since the rank's last ledger mark
(project.engine.distributed.ledger) with the deadline of the phase it is in: the short one
(`strategy.step_timeout_s`) inside the training steps after the first, never less than three
of the slowest recent steps, so a model whose steps take minutes is not reported as hung; the
long one (`strategy.timeout`) until then and around validation, checkpoint saves and other
long work (project.engine.run.long_work). A rank waiting for its DataLoader is shown at its
worker's frame (project.engine.distributed.worker_stacks). The collectives time out 30 s later
(project.engine.distributed.ddp.CollectiveTimeout), so the report comes first. When it passes,
or when a collective fails because a peer died (`report_peer_failure`), every live rank

1. writes `<run>/hang/rank-<R>.json` (step, phase, collectives issued, its last collectives
   from torch's Flight Recorder) and `rank-<R>.txt` (every thread's Python stack);
2. rank 0 waits up to GATHER_S for the others' reports (a rank whose process is gone on this
   host is not waited for: its ledger file says where it was, its `.crash` file the stack of
   a fatal signal), prints one screen (at most ~30 lines) on stderr and keeps it in
   `hang/report.txt`: where each rank is, which rank is behind (it never issued the
   collective the others wait in) or which collective does not match across ranks, and the
   innermost frame of project or user code of each;
3. every rank exits with EXIT_HUNG (a stall) or EXIT_FAILED (a peer died), the others once
   rank 0 has begun its report (or is gone), so that Lightning's launcher does not kill rank
   0 while it writes; rank 0 then kills the ranks that launcher started: no process is left
   (a rank's DataLoader workers and fork server end with it: project.engine.data.die_with_rank).

A rank stuck in C code that holds the GIL runs no thread of its own, so it cannot report:
faulthandler's C thread ends it STUCK_S after its deadline (`Watchdog._backstop`), leaving its
stacks in the ledger's `.crash` file, which the others' screen reads.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from project.engine.distributed import ledger as ledgers
from project.engine.distributed import worker_stacks
from project.engine.distributed.exits import EXIT_FAILED, EXIT_HUNG, record_exit
from project.engine.distributed.ledger import Ledger, Record
from project.engine.launch.env import resume_command
from project.engine.private_api import collective_counter, flight_recorder, pause_child_observer

FOLDER = "hang"
THREAD = "hang-watchdog"  # the watchdog thread's name
GATHER_S = 10.0  # how long rank 0 waits for the other ranks' reports
# A rank that cannot report (stuck in C code that holds the GIL) is ended this long after its
# deadline: within the others' wait for its report, which then shows where it was stuck.
STUCK_S = 10.0
REPORT_BOUND_S = 3 * GATHER_S + 30  # a report that takes longer ends its process all the same
SCREEN = "report.txt"
UNKNOWN = ("collectives unknown: torch's Flight Recorder is off or laid out otherwise; the count "
           "issued is the ledger's")  # fmt: skip
DOCS = "docs/troubleshooting.md#a-hang-report"

_active: Watchdog | None = None


def active() -> Watchdog | None:
    """The watchdog of this process while training runs (None outside, or one process)."""
    return _active


class Watchdog:
    """One per rank while training runs: `start()` at train start, `stop()` at its end."""

    def __init__(
        self,
        ledger: Ledger,
        deadline: Callable[[], float],
        run_dir: Path,
        kill_children: Callable[[], None] | None = None,
        on_end: Callable[[int], None] | None = None,
    ) -> None:
        self.ledger, self.deadline = ledger, deadline
        self.folder = run_dir / FOLDER
        self.kill_children, self.on_end = kill_children, on_end
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name=THREAD, daemon=True)
        self._arming = threading.Lock()
        self._stacks: Any = sys.stderr  # where the backstop writes the stacks (_backstop)

    def start(self) -> None:
        global _active
        self.ledger.attach(collective_counter())
        _active = self
        if self.ledger.folder is not None:  # beside a fatal signal's stacks (ledger.py)
            crash = self.ledger.folder / f"rank-{self.ledger.rank}.crash"
            self._stacks = open(crash, "a")  # noqa: SIM115  # closed by stop()
        self.rearm()
        self._thread.start()

    def stop(self) -> None:
        global _active
        with self._arming:
            self._stop.set()
            reporting = self._lock.locked()
            if not reporting:
                faulthandler.cancel_dump_traceback_later()
                if self._stacks is not sys.stderr:
                    self._stacks.close()
        if _active is self:
            _active = None
        if reporting:  # a report is being written: it ends the process
            time.sleep(3 * GATHER_S + 30)

    def rearm(self) -> None:
        """The deadline changed (project.engine.distributed.ddp.CollectiveTimeout): the
        backstop follows at once, not at the next tick (a rank may be stuck before it)."""
        self._backstop(self.limit() + STUCK_S)

    def _backstop(self, seconds: float, reporting: bool = False) -> None:
        """Unless called again within `seconds`, a C thread of faulthandler's, which needs no
        GIL, writes every thread's stack to the rank's crash file and ends the process (exit
        1). A rank stuck in C code that holds the GIL runs neither the watchdog thread nor a
        signal handler: nothing else ends it (Lightning's launcher does not, when it is rank
        0). Process-wide: a user's own faulthandler.dump_traceback_later is replaced."""
        with self._arming:
            if self._lock.locked() != reporting:  # a report has its own bound
                return
            if self._stop.is_set() and not reporting:  # training ended: nothing may end it
                return
            try:
                faulthandler.dump_traceback_later(seconds, exit=True, file=self._stacks)
            except (ValueError, OSError):  # the file was closed by stop()
                faulthandler.dump_traceback_later(seconds, exit=True)

    def limit(self) -> float:
        """The phase's deadline (never less than 3 of the slowest recent steps: the trainers
        stretch it, and the collective timeout with it, at a window start)."""
        return self.deadline()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.limit() / 20)):
            self.rearm()
            stalled = time.monotonic() - self.ledger.progress
            if stalled > (limit := self.limit()):
                self.report(f"no progress for {stalled:.0f} s (deadline {limit:.0f} s)",
                            code=EXIT_HUNG)  # fmt: skip
            if (peer := self._peer_report()) is not None:  # the ranks' deadlines differ
                first = peer.get("first", f"rank {peer['rank']}: {peer['reason']}")
                self.report(first, code=peer.get("code", EXIT_HUNG))

    def _peer_report(self) -> dict[str, Any] | None:
        """Another rank's report of this attempt, if one was written: this rank joins it. One
        stat a second (the folder changes when a report is written into it)."""
        if not _current(self.folder, self.ledger.created):
            return None
        for path in self.folder.glob("rank-*.json"):
            if path.name != f"rank-{self.ledger.rank}.json" and _current(path, self.ledger.created):
                return _read(path)
        return None

    def report(self, reason: str, code: int, error: BaseException | None = None) -> NoReturn:
        """Write this rank's report; rank 0 the screen; exit `code` (never returns)."""
        if not self._lock.acquire(blocking=False):
            time.sleep(3 * GATHER_S + 30)  # the other thread is reporting and ends the process
            os._exit(code)  # ... unless its report got stuck
        self._backstop(REPORT_BOUND_S, reporting=True)
        stalled = time.monotonic() - self.ledger.progress
        where = {"step": self.ledger.step, "phase": self.ledger.phase, "seq": self.ledger.seq()}
        self.ledger.stalled()  # the time since the last mark: detection (goodput)
        if self.ledger.rank == 0 and "lightning" in sys.modules:
            pause_child_observer()
        where |= {"code": code, "reason": reason, "first": reason if reason.startswith("rank ")
                  else f"rank {self.ledger.rank}: {reason}"}  # fmt: skip
        write_own(self.folder, self.ledger.rank, where, stalled, error)
        since, ledger_dir = self.ledger.created, self.folder.parent / ledgers.FOLDER
        rank0 = self.ledger.rank == 0
        if not rank0:  # Lightning's launcher kills rank 0 when a rank ends first: stay until
            # rank 0 has begun its report (it then stops that watcher), or is gone
            started = self.folder / "rank-0.json"
            rank0 = not wait_for(lambda: _current(started, since) or _gone(ledger_dir, 0),
                                 GATHER_S) or _gone(ledger_dir, 0)  # fmt: skip
            rank0 = rank0 and self._lowest(since)  # rank 0 gone or silent: the lowest prints
        if rank0:
            lines = screen(self.folder, self.ledger.world, reason, code, since)
            sys.stderr.write("\n".join(lines) + "\n")
            sys.stderr.flush()
            _atomic_text(self.folder / SCREEN, "\n".join(lines) + "\n")
            if self.on_end is not None:  # the goodput, the loggers: bounded
                ending = threading.Thread(target=self.on_end, args=(code,), daemon=True)
                ending.start()
                ending.join(10)
            if self.kill_children is not None:
                self.kill_children()
        record_exit(code)
        os._exit(code)

    def _lowest(self, since: float) -> bool:
        """No lower rank of this attempt reported: this one prints the screen."""
        reports = gather(self.folder, self.ledger.world, since, seconds=1.0)
        return min(reports, default=self.ledger.rank) >= self.ledger.rank


# What gloo and NCCL say when the other side of a collective is gone or stopped answering
# (torch 2.13's texts; tests/test_hang_exit.py makes gloo's for real). Not any "timed out": a
# user's DataLoader(timeout=...) or download says that too, and is their own error.
PEER_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError")  # torch.distributed's
PEER_GONE = re.compile(
    r"Connection (?:closed|reset) by peer|Connection refused|Broken pipe"  # a socket closed
    r"|Timed out waiting \d+ms for (?:send|recv) operation"  # gloo's collective timeout
    r"|Application timeout caused pair closure"  # gloo, after such a timeout
    r"|NCCL communicator was aborted|Watchdog caught collective operation timeout"
)


def is_peer_failure(err: BaseException) -> bool:
    """gloo/NCCL errors that mean "the other side is gone", not a bug in this process."""
    return type(err).__name__ in PEER_ERRORS or PEER_GONE.search(str(err)) is not None


def report_peer_failure(err: BaseException) -> None:
    """A collective failed because a peer died or timed out: the hang report (never returns)
    while training runs. Called where the error surfaces, before the stop's signal handlers
    are put back: a launcher's SIGTERM to the survivors must not cut the report short."""
    if _active is not None and isinstance(err, RuntimeError) and is_peer_failure(err):
        text = re.sub(r"\[[^\]]*\]\s*", "", str(err).splitlines()[0]).split(". ")[0]
        _active.report(f"a collective failed: {text[:100]}", code=EXIT_FAILED, error=err)


def wait_for(done: Callable[[], bool], seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not done():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def collectives(limit: int = 12) -> list[dict[str, Any]] | None:
    """The default process group's last collectives from the Flight Recorder; None when it
    is off or laid out otherwise (private_api.FR_ENTRY): the report then has the ledger's
    count of collectives issued, never an error in the watchdog thread."""
    entries = flight_recorder()
    if entries is None:
        return None
    rows = []
    try:
        for e in entries:
            if e["process_group"][1] != "default_pg" or e["is_p2p"]:
                continue
            rows.append({
                "seq": int(e["collective_seq_id"]), "op": str(e["profiling_name"]).split(":")[-1],
                "sizes": list(e["input_sizes"]), "done": bool(e["retired"]),
                "issued_at": _issued_at(e.get("frames")),
            })  # fmt: skip
    except (LookupError, TypeError, ValueError):
        return None
    return rows[-limit:]


def _issued_at(frames: Any) -> str | None:
    """Where a collective was issued, when the entry has its frames (an optional field)."""
    try:
        return ledgers.where(frames) if frames else None
    except (LookupError, TypeError, ValueError, AttributeError):
        return None


def write_own(
    folder: Path, rank: int, where: dict[str, Any], stalled: float, error: BaseException | None
) -> None:
    """This rank's report (`where`: its step, phase and collectives issued when it stalled,
    the exit code and the reason): JSON for rank 0's screen, text with every thread's stack."""
    import socket
    import traceback

    folder.mkdir(parents=True, exist_ok=True)
    main, stacks = ledgers.thread_stacks()
    if (tb := None if error is None else error.__traceback__) is not None:
        # where the failing call was made: the frames down to where it was caught, then its
        main = traceback.extract_stack(tb.tb_frame)[:-1] + traceback.extract_tb(tb)
    # Waiting for a batch: the frame that matters is in the worker that has it.
    workers = worker_stacks.collect() if worker_stacks.waits_for_loader(main) else {}
    stuck = next((f"{at} (worker pid {pid})" for pid, text in workers.items()
                  if (at := worker_stacks.innermost(text))), None)  # fmt: skip
    own = {
        "rank": rank, "host": socket.gethostname(), "pid": os.getpid(), **where,
        "stalled_s": round(stalled, 1),
        "error": None if error is None else str(error).splitlines()[0][:200],
        "where": stuck or (ledgers.where(main) if main else "?"), "collectives": collectives(),
    }  # fmt: skip
    known = own["collectives"]
    text = [f"rank {rank} on {own['host']} (pid {own['pid']}): {own['reason']}",
            f"step {own['step']}, {ledgers.PHASES[own['phase']]}, {own['seq']} collectives issued",
            *(f"  #{c['seq']} {c['op']} {c['sizes']} {'done' if c['done'] else 'NOT DONE'}"
              f"{' from ' + c['issued_at'] if c['issued_at'] else ''}" for c in known or ()),
            *([] if known is not None else [f"  {UNKNOWN}"]), "", stacks,
            *(f"\nDataLoader worker {pid}:\n{dump}" for pid, dump in workers.items())]  # fmt: skip
    _atomic_text(folder / f"rank-{rank}.txt", "\n".join(text))
    _atomic_text(folder / f"rank-{rank}.json", json.dumps(own))


def _current(path: Path, since: float) -> bool:
    """A file written by this attempt (an earlier attempt's report is older than its start)."""
    try:
        return path.stat().st_mtime >= since
    except OSError:
        return False


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def gather(
    folder: Path, world: int, since: float = 0.0, seconds: float = GATHER_S
) -> dict[int, dict[str, Any]]:
    """This attempt's reports, waiting for the ranks whose process may still write one."""
    reports: dict[int, dict[str, Any]] = {}
    ledger_dir = folder.parent / ledgers.FOLDER

    def complete() -> bool:
        for r in range(world):
            path = folder / f"rank-{r}.json"
            if r not in reports and _current(path, since) and (report := _read(path)):
                reports[r] = report
        missing = [r for r in range(world) if r not in reports]
        return all(_gone(ledger_dir, r) for r in missing)

    wait_for(complete, seconds)
    return reports


def _gone(ledger_dir: Path, rank: int) -> bool:
    record = ledgers.read(ledger_dir / f"rank-{rank}.bin")
    return record is not None and record.alive() is False


def screen(folder: Path, world: int, reason: str, code: int, since: float = 0.0) -> list[str]:
    """The one screen: each group of ranks in the same place, then what it means."""
    reports = gather(folder, world, since)
    ledger_dir = folder.parent / ledgers.FOLDER
    rows = {r: _row(reports.get(r), ledgers.read(ledger_dir / f"rank-{r}.bin"),
                    ledger_dir / f"rank-{r}.crash") for r in range(world)}  # fmt: skip
    what = "stalled" if code == EXIT_HUNG else "failed"
    lines = [f"hang report: {_gone_title(rows)}the job {what} ({reason}); {world} ranks:"]
    groups: dict[tuple[str, ...], list[int]] = {}
    for r, row in rows.items():
        groups.setdefault(row["cells"], []).append(r)
    table = [(f"rank {_ranks(ranks)}", *cells) for cells, ranks in list(groups.items())[:16]]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False))
                     + "  " + row[-1])  # fmt: skip
    lines += verdict(rows)
    lines = lines[:27]
    lines.append(f"  every rank's stacks and last collectives: {folder}/rank-<R>.txt")
    lines.append(f"  exit {code}; how to read this: {DOCS}")
    lines.append(f"  next: {next_step(code)}")
    return lines


def _gone_title(rows: dict[int, dict[str, Any]]) -> str:
    """What a report about ranks that are gone is first: "rank 1 died: ", "rank 3 is gone
    (no report: its node left?): ", else nothing."""
    died = [r for r, row in rows.items() if row["gone"] == "died"]
    left = [r for r, row in rows.items() if row["gone"] == "left"]
    said = [f"rank {_ranks(died)} died"] if died else []
    said += [f"rank {_ranks(left)} is gone (no report: its node left?)"] if left else []
    return ", ".join(said) + ": " if said else ""


def next_step(code: int) -> str:
    """The report's last line: a restart torchrun still has in hand, else the command that
    resumes the run (and, for a hang, the timeout to raise when steps are that long)."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) + 1
    slow = "; steps that are legitimately this long: raise strategy.step_timeout_s"
    if restart <= restarts:
        return (f"torchrun restarts the job (restart {restart} of {restarts}), which resumes "
                f"from the last checkpoint{slow if code == EXIT_HUNG else ''}")  # fmt: skip
    return f"resume with {resume_command()}{slow if code == EXIT_HUNG else ''}"


def _row(report: dict[str, Any] | None, record: Record | None, crash: Path) -> dict[str, Any]:
    """What one rank was doing: from its report, else (dead, or stuck holding the GIL) from
    its ledger file and the stack a fatal signal left. `cells`: step, phase, state, where."""
    if report is not None:
        known = report["collectives"]  # None: the Flight Recorder could not say (UNKNOWN)
        pending = [c for c in known or () if not c["done"]]
        if pending:
            c = pending[-1]
            state = f"waits in #{c['seq']} {c['op']} {_sizes(c['sizes'])}"
        elif known is None:
            state = f"issued #{report['seq']} (collectives unknown)"
        else:
            state = f"in no collective (issued #{report['seq']})"
        phase = ledgers.PHASES[report["phase"]]
        cells = (f"step {report['step']}", phase, state, f"at {report['where']}")
        latest = next((c for c in known or () if c["seq"] == report["seq"]), None)
        return {"seq": report["seq"], "phase": phase, "step": report["step"], "op": latest,
                "pending": pending[-1] if pending else None, "cells": cells,
                "dead": False, "gone": None}  # fmt: skip
    if record is None:
        return {"seq": None, "phase": "?", "step": None, "op": None, "dead": True, "gone": None,
                "cells": ("", "", "no report, no ledger", "(never started training)")}  # fmt: skip
    how = {False: f"died (pid {record.pid} gone)", None: "no report (another host)",
           True: "no report (stuck holding the GIL?)"}[record.alive()]  # fmt: skip
    at = _crash_frame(crash)
    cells = (f"step {record.step}", record.phase_name, f"{how}, issued #{record.seq}",
             f"crash at {at}" if at else "")  # fmt: skip
    gone = {False: "died", None: "left", True: None}[record.alive()]  # None: stuck here
    return {"seq": record.seq, "phase": record.phase_name, "step": record.step, "op": None,
            "cells": cells, "dead": True, "gone": gone}  # fmt: skip


def _crash_frame(crash: Path) -> str | None:
    """The innermost user frame of the main thread in faulthandler's dump, if it wrote one."""
    try:
        text = crash.read_text()
    except OSError:
        return None
    blocks = [b for b in re.split(r"\n(?=(?:Current thread|Thread) 0x)", text) if 'File "' in b]
    if not blocks:
        return None
    main = next((b for b in blocks if " in <module>" in b), blocks[-1])  # the main thread
    frames = []
    for line in main.splitlines():
        if (found := re.match(r'\s*File "(.+)", line (\d+) in (.+)', line)) is not None:
            frames.insert(0, {"filename": found[1], "line": found[2], "name": found[3]})
    return ledgers.where(frames) if frames else None


def verdict(rows: dict[int, dict[str, Any]]) -> list[str]:
    """Which rank(s) the others wait for, or which collective does not match."""
    known = {r: row for r, row in rows.items() if row["seq"] is not None}
    if not known:
        return []
    top = max(row["seq"] for row in known.values())
    behind = sorted(r for r, row in known.items() if row["seq"] < top)
    ahead = sorted(r for r, row in known.items() if row["seq"] == top)
    if behind:
        first = min(known[r]["seq"] for r in behind) + 1
        waiting = next((known[r]["pending"] for r in ahead if known[r].get("pending")), None)
        where = f" ({waiting['op']} {_sizes(waiting['sizes'])})" if waiting else ""
        if all(rows[r]["gone"] for r in behind):  # gone, not stuck: nothing to wait for
            return [f"  => rank {_ranks(behind)} never issued collective #{first}{where} that "
                    f"rank {_ranks(ahead)} issued, and is gone: the job cannot go on without "
                    "it (where it was: the frame shown)"]  # fmt: skip
        return [f"  => rank {_ranks(behind)} never issued collective #{first}{where} that rank "
                f"{_ranks(ahead)} issued: the job waits for rank {_ranks(behind)}, at the "
                "frame shown"]  # fmt: skip
    if not any(row.get("pending") or row["dead"] for row in rows.values()):
        return busy(known)
    kinds: dict[str, list[int]] = {}
    for r in ahead:
        row = known[r]
        op = f"{row['op']['op']} {_sizes(row['op']['sizes'])}" if row["op"] else "an unknown op"
        kinds.setdefault(f"{op} in {row['phase']}", []).append(r)
    if len(kinds) > 1:
        sizes = sorted(kinds.items(), key=lambda kv: len(kv[1]))
        extra = (
            [r for _, ranks in sizes[:-1] for r in ranks]
            if len(sizes[-1][1]) > len(sizes[-2][1])
            else [r for r in ahead if known[r]["phase"] not in _STEP_PHASES]
        )
        lines = [f"  => collective #{top} does not match across ranks (a desync): "
                 + "; ".join(f"rank {_ranks(rs)}: {k}" for k, rs in kinds.items())]  # fmt: skip
        if extra:
            lines.append(f"  => rank {_ranks(extra)} issued a collective the others did not "
                         f"(#{top}): rank-dependent code around the frame shown")  # fmt: skip
        return lines
    if any(row["dead"] for row in rows.values()):
        dead = sorted(r for r, row in rows.items() if row["dead"])
        return [f"  => rank {_ranks(dead)} died: the others lost their peer (its output and "
                "crash file say why)"]  # fmt: skip
    return [f"  => every rank waits in collective #{top}: the transport stalled (network, a "
            "wedged device: on CUDA see the Flight Recorder dumps, docs)"]  # fmt: skip


def busy(known: dict[int, dict[str, Any]]) -> list[str]:
    """No rank is in a collective: each is in its own code (a slow step, a stuck loader)."""
    data = sorted(r for r, row in known.items() if row["phase"] == ledgers.PHASES[ledgers.DATA])
    waits = f"; rank {_ranks(data)} waits for its data loader" if data else ""
    return [f"  => no rank is in a collective: the ranks are busy in their own code{waits}, at "
            "the frames shown (not a stalled transport)"]  # fmt: skip


_STEP_PHASES = {ledgers.PHASES[p] for p in (ledgers.STEP, ledgers.OPTIMIZER, ledgers.STOP_CHECK)}


def _sizes(sizes: list[list[int]]) -> str:
    return ",".join(str(s) for s in sizes) if sizes else "[]"


def _ranks(ranks: list[int]) -> str:
    """[0, 2, 3, 4] -> "0,2-4"."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts)
