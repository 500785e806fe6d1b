"""Every private Lightning/torch name the template relies on still exists in the installed
versions (project.engine.private_api.USED): an upgrade that renames one fails here, in the
quick tier, instead of in a run."""

from __future__ import annotations

import functools
import importlib

import pytest

from project.engine.private_api import FR_DUMP, FR_ENTRY, USED

pytestmark = pytest.mark.quick  # the fast tier: `make test`


def instance_attributes(cls: type) -> set[str]:
    """Attributes a class sets on its instances in __init__ (e.g. MLFlowLogger._run_id), or
    a dataclass's fields (e.g. Lightning's _Progress.current)."""
    import dataclasses
    import inspect
    import re

    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(
        re.findall(r"^\s*self\.(\w+)\s*(?::[^=\n]*)?=", inspect.getsource(cls.__init__), re.M)
    )


@functools.cache
def flight_recorder_entry() -> frozenset[str]:
    """The fields of a real Flight Recorder entry: one all-reduce in a 1-process gloo group."""
    import json

    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace_json

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(1))
        dump = json.loads(_dump_fr_trace_json(includeCollectives=True, onlyActive=False))
    finally:
        dist.destroy_process_group()
    return frozenset(dump["entries"][-1])


@pytest.mark.parametrize(("module", "dotted"), USED, ids=[f"{m}:{d}" for m, d in USED])
def test_private_name_exists(module: str, dotted: str) -> None:
    if dotted.startswith(f"{FR_DUMP}.entries."):  # a field of the dump's entries
        field = dotted.removeprefix(f"{FR_DUMP}.entries.")
        assert field in flight_recorder_entry(), f"Flight Recorder entries have no {field!r}"
        return
    obj = importlib.import_module(module)
    *owners, name = dotted.split(".")
    for owner in owners:
        obj = getattr(obj, owner)
    if isinstance(obj, list | tuple):  # a class's __slots__: one of them
        assert name in obj, f"{module}.{dotted} is gone"
        return
    assert hasattr(obj, name) or name in instance_attributes(obj), f"{module}.{dotted} is gone"


def test_the_check_can_fail() -> None:
    """A renamed attribute is reported (the check above is not vacuous)."""
    import lightning.pytorch.loops.progress as progress
    import lightning.pytorch.loops.training_epoch_loop as loop

    assert not hasattr(loop._TrainingEpochLoop, "_broadcast_sigterm_tensor_renamed")
    assert "_no_such_attribute" not in instance_attributes(loop._TrainingEpochLoop)
    assert not hasattr(progress._Progress, "current")  # a field with a default factory
    assert "current" in instance_attributes(progress._Progress)
    assert "currently" not in instance_attributes(progress._Progress)


def test_the_hang_report_reads_only_the_declared_flight_recorder_fields() -> None:
    """Every field hangs.py reads of an entry by key is declared in FR_ENTRY (and so checked
    above against a real dump); "frames" is optional, read with .get."""
    import re
    from pathlib import Path

    hangs = Path(__file__).resolve().parents[1] / "src/project/engine/distributed/hangs.py"
    read = set(re.findall(r'\be\["(\w+)"\]', hangs.read_text()))
    assert read and read <= set(FR_ENTRY), read - set(FR_ENTRY)


def test_the_template_uses_no_other_private_name_of_powersgd_and_the_fit_loop() -> None:
    """Every private torch name the comm hooks import, every PowerSGDState slot they read,
    and every progress counter the Lightning datamodule wrapper touches is in USED."""
    import re
    from pathlib import Path

    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    src = Path(__file__).resolve().parents[1] / "src" / "project" / "engine"
    listed = {dotted.rsplit(".", 1)[-1] for _, dotted in USED}
    hooks = "".join(p.read_text() for p in (src / "distributed" / "comm_hooks").glob("*.py"))
    imported = set(re.findall(r"powerSGD_hook import (_\w+)", (src / "private_api.py").read_text()))
    slots = set(re.findall(r"(?:self\.state|state|s)\.(\w+)", hooks)) & set(PowerSGDState.__slots__)
    wrapper = (src / "lightning" / "datamodule.py").read_text()
    wrapper += (src / "lightning" / "callbacks.py").read_text()
    loops = r"fit_loop|fit|epoch_loop|epoch_progress|batch_progress|progress|current|total|counts"
    counters = set(re.findall(rf"(?=\b(?:{loops})\.(\w+))", wrapper))  # chains overlap
    assert imported and slots and counters
    assert (imported | slots | counters) - listed == set()
