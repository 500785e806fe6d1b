"""Every private Lightning/torch name the template relies on still exists in the installed
versions (project.engine.private_api.USED): an upgrade that renames one fails here, in the
quick tier, instead of in a run."""

from __future__ import annotations

import importlib

import pytest

from project.engine.private_api import USED

pytestmark = pytest.mark.quick  # the fast tier: `make test`


def instance_attributes(cls: type) -> set[str]:
    """Attributes a class sets on its instances in __init__ (e.g. MLFlowLogger._run_id)."""
    import inspect
    import re

    return set(
        re.findall(r"^\s*self\.(\w+)\s*(?::[^=\n]*)?=", inspect.getsource(cls.__init__), re.M)
    )


@pytest.mark.parametrize(("module", "dotted"), USED, ids=[f"{m}:{d}" for m, d in USED])
def test_private_name_exists(module: str, dotted: str) -> None:
    obj = importlib.import_module(module)
    *owners, name = dotted.split(".")
    for owner in owners:
        obj = getattr(obj, owner)
    assert hasattr(obj, name) or name in instance_attributes(obj), f"{module}.{dotted} is gone"


def test_the_check_can_fail() -> None:
    """A renamed attribute is reported (the check above is not vacuous)."""
    import lightning.pytorch.loops.training_epoch_loop as loop

    assert not hasattr(loop._TrainingEpochLoop, "_broadcast_sigterm_tensor_renamed")
    assert "_no_such_attribute" not in instance_attributes(loop._TrainingEpochLoop)
