"""The comm hook's per-rank state files beside the last checkpoint, for both trainers.

PowerSGD's state differs between ranks (project.engine.distributed.comm_hooks.hook), so every
rank writes its own file next to `last`, named by the optimizer step, and reads it back on a
resume. Every rank saves and loads at the same point and the ranks agree on the outcome
(`agreed`): one rank's missing, unreadable or unwritable file stops all of them with the same
line, instead of one rank failing while the others wait in their next collective.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from project.engine.checkpoints.state import atomic_save, numpy_state_loaded, numpy_state_saved
from project.engine.distributed.comm_hooks.hook import (
    ABSENT,
    OK,
    OTHER_WORLD,
    UNREADABLE,
    CommHook,
)
from project.engine.errors import UserError
from project.engine.launch.env import resume_command

log = logging.getLogger(__name__)


def stored(state: dict[str, Any]) -> dict[str, Any]:
    """A hook's `state_dict()` as its file holds it: tensors and plain values (weights_only)."""
    return state | {"rng": numpy_state_saved(state["rng"])} if "rng" in state else state


def live(saved: dict[str, Any]) -> dict[str, Any]:
    """A state file's content as the hook's `load_state_dict()` takes it."""
    return saved | {"rng": numpy_state_loaded(saved["rng"])} if "rng" in saved else saved


def state_file(last: Path, step: int | str, rank: int) -> Path:
    """Where rank `rank` keeps its hook state for the checkpoint of optimizer step `step`."""
    return last.with_name(f"{last.stem}.comm_hook.step{step}.rank{rank}.pt")


def save_state(hook: CommHook | None, last: Path, step: int) -> None:
    """Every rank, just before the last checkpoint of `step` is written: its own hook state.
    Named by the step, so a write killed midway never pairs a checkpoint with other state.
    A write that fails on any rank stops every rank with the same line."""
    if hook is None or not hook.stateful:
        return
    rank, world = rank_and_world()
    path = state_file(last, step, rank)
    # Complete: checkpoints are written between optimizer steps, when no part of PowerSGD's
    # state waits between buckets (hook.state_dict checks it: BucketLayouts.saved). Whatever
    # fails on this rank is agreed on below, so no rank leaves before the others' collective.
    code, text = OK, ""
    try:
        atomic_save({"world_size": world, **stored(hook.state_dict())}, path)
    except Exception as err:  # torch.save's zip writer raises RuntimeError
        code = UNREADABLE
        text = (
            f"the PowerSGD state of rank {rank} could not be written to {path} "
            f"({one_line(err)}): check the space and write access in {path.parent}, then "
            f"resume with {resume_command()} (from the checkpoint before)"
        )
    codes, first = agreed(code, text, collective_device(hook))
    if max(codes) != OK:
        raise UserError(first)


def prune_state(hook: CommHook | None, last: Path, step: int) -> None:
    """After the last checkpoint of `step` is on disk: this rank's older hook states go."""
    if hook is None or not hook.stateful:
        return
    rank, _ = rank_and_world()
    keep = state_file(last, step, rank)
    for path in last.parent.glob(state_file(last, "*", rank).name):
        if path != keep:
            path.unlink(missing_ok=True)


def load_state(
    hook: CommHook | None, last: Path, step: int, device: Any, required: bool = True
) -> None:
    """On resume from the checkpoint `last` of `step`: every rank its own hook state, or every
    rank the same line saying why it cannot be restored (training on without it would
    silently diverge). Not `required` (an explicit ckpt_path: a new run from a checkpoint):
    PowerSGD starts afresh instead, with one warning unless no rank has a file. Written by
    another number of processes (an elastic restart with fewer or more nodes): afresh with
    one warning, on every rank alike, since error feedback is per rank and cannot be
    redistributed."""
    if hook is None or not hook.stateful:
        return
    code, text, saved = read_state(hook, last, step, device)
    codes, first = agreed(code, text, collective_device(hook))
    problem, _, fix = first.partition("\n")
    worst = max(codes)
    if worst == OK:
        hook.load_state_dict(live(saved))
    elif worst == OTHER_WORLD or not required:
        if rank_and_world()[0] == 0 and set(codes) != {ABSENT}:
            log.warning(problem if worst == OTHER_WORLD else f"{problem}: PowerSGD starts afresh")
    else:
        raise UserError(f"{problem}; {fix}")


def read_state(
    hook: CommHook, last: Path, step: int, device: Any
) -> tuple[int, str, dict[str, Any]]:
    """This rank's saved state, or what is wrong with it: (code, problem + "\\n" + fix,
    state). A rank the saving run did not have reads rank 0's file for its world size."""
    rank, world = rank_and_world()
    path = state_file(last, step, rank)
    found = path if path.is_file() else state_file(last, step, 0)
    lost = f"the PowerSGD state of rank {rank} at step {step} cannot be restored"
    new_run = f"start a new run from the weights: ckpt_path={last} with another RUN_ID"
    try:
        saved = torch.load(found, map_location=device, weights_only=True) if found.is_file() else {}
    except Exception as err:  # truncated, not a checkpoint, unreadable: whatever torch.load raises
        unreadable = f"{found.name} beside {last.name} cannot be read ({one_line(err)})"
        return UNREADABLE, f"{unreadable}: {lost}\n{new_run}", {}
    saved_world = saved.pop("world_size", None)
    if saved_world is not None and saved_world != world:
        return OTHER_WORLD, (
            f"PowerSGD state of step {step} was written by {saved_world} processes, this run "
            f"has {world}: PowerSGD starts afresh (its per-rank error feedback cannot be "
            "redistributed)"
        ), {}  # fmt: skip
    if not path.is_file():
        missing = f"{path.name} is missing beside {last.name}"
        return ABSENT, f"{missing}: {lost} (files moved or deleted)\n{new_run}", {}
    code, problem = hook.check(saved, last)
    return code, problem, saved


def agreed(code: int, text: str, device: Any) -> tuple[list[int], str]:
    """Every rank's `code` (OK: nothing wrong), and the `text` of the first rank with the
    highest code: the same on every rank, so that all go on or all stop with one message.
    Without a process group of several ranks: this rank's own."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [code], text
    rank, world = dist.get_rank(), dist.get_world_size()
    codes = torch.zeros(world, dtype=torch.int64, device=device)
    codes[rank] = code
    dist.all_reduce(codes)
    found = codes.tolist()
    top = max(range(world), key=lambda r: (found[r], -r))
    if found[top] == OK:
        return found, ""
    message = torch.zeros(TEXT_BYTES, dtype=torch.uint8, device=device)
    if rank == top:
        raw = text.encode()[:TEXT_BYTES]
        message[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    dist.broadcast(message, src=top)
    return found, bytes(message.cpu().tolist()).rstrip(b"\0").decode(errors="ignore")


TEXT_BYTES = 2048  # the longest message `agreed` passes on (a line naming two paths)


def collective_device(hook: CommHook) -> Any:
    """Where `agreed` puts its tensors: the CPU wherever gloo serves it, else the model's
    device (NCCL takes CUDA tensors only)."""
    return agreement_device(hook.device)


def agreement_device(device: Any) -> Any:
    """The CPU wherever gloo serves the collectives (or there are none), else `device`."""
    if device is None or not dist.is_initialized() or "gloo" in str(dist.get_backend()):
        return torch.device("cpu")
    return device


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (the trainers call these functions under DDP)."""
    return dist.get_rank(), dist.get_world_size()


def one_line(err: BaseException) -> str:
    """An exception as a short part of a one-line message: its type and first sentence."""
    text = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    first = " ".join(text.split()).split(". ")[0].rstrip(".")
    return f"{type(err).__name__}: {first[:120]}"
