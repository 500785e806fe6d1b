"""The pure rules behind the end-to-end guarantees, in milliseconds: the stop budget, the raw
trainer's early stopping, what a checkpoint may be resumed by, which weights are tested, which
profiler Lightning gets."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from project.engine.checkpoints.resume import Resume, check_resumable, training_identity
from project.engine.checkpoints.run import RunCheckpoints
from project.engine.distributed.signals import StopSignal
from project.engine.errors import UserError
from project.engine.run.skeleton import Run, checkpoint_to_test
from tests.helpers import CONFIG_DIR

pytestmark = pytest.mark.quick  # the fast tier: `make test`


# --- the stop budget (project.engine.distributed.signals) ----------------------------------------
def stop_signal(every_n_steps: int, budget_s: float | None) -> StopSignal:
    return StopSignal(every_n_steps=every_n_steps, budget_s=budget_s,
                      save_every_n_train_steps=None, save_every_n_seconds=None)  # fmt: skip


def test_check_interval_shrinks_to_fit_the_budget() -> None:
    stop = stop_signal(every_n_steps=10, budget_s=25.0)
    stop._adapt(window_s=0.1, save_s=1.0)  # 10 windows + a save fit easily
    assert stop.interval == 10
    stop._adapt(window_s=4.0, save_s=5.0)  # (25 - 5) / 4 = 5 windows
    assert stop.interval == 5
    stop._adapt(window_s=30.0, save_s=5.0)  # not even one fits: check every window
    assert stop.interval == 1


def test_no_budget_keeps_the_interval() -> None:
    stop = stop_signal(every_n_steps=7, budget_s=None)
    stop._adapt(window_s=100.0, save_s=100.0)
    assert stop.interval == 7


def owner(tmp_path: Path, **callbacks: object) -> RunCheckpoints:
    cfg = {"callbacks": callbacks, "paths": {"output_dir": str(tmp_path)}}
    return RunCheckpoints(cfg, tmp_path, None, {}, {})


def test_cadences_come_from_the_fault_tolerance_config(tmp_path: Path) -> None:
    """One home per value: the config group's file. On: its cadences; off: its stop-check
    keys, and no save cadence (a stop still saves)."""
    yaml = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "callbacks" / "fault_tolerance.yaml"))
    yaml = yaml["fault_tolerance"] | {"dirpath": str(tmp_path / "ft")}
    on, off = owner(tmp_path, fault_tolerance=yaml), owner(tmp_path, fault_tolerance=None)
    for stop in (on.stop_signal(), off.stop_signal()):
        assert (stop.every_n_steps, stop.budget_s) == (
            yaml["check_every_n_steps"], yaml["stop_budget_s"])  # fmt: skip
    assert on.stop_signal().save_every_n_seconds == yaml["every_n_seconds"] is not None
    assert off.stop_signal().save_every_n_seconds is None
    assert (on.periodic, off.periodic) == (True, False)
    assert on.last == tmp_path / "ft" / "last.ckpt"  # fault tolerance's folder
    assert off.last == tmp_path / "checkpoints" / "last.ckpt"  # the run's checkpoint folder
    assert (
        owner(tmp_path, fault_tolerance={"every_n_seconds": 5}).settings.check_every_n_steps
        == yaml["check_every_n_steps"]
    )  # a user's own block: the rest from the file
    with pytest.raises(UserError, match=r"callbacks\.fault_tolerance\.check_every_n_step "):
        owner(tmp_path, fault_tolerance={"check_every_n_step": 3})
    old = "project.engine.lightning.callbacks.FaultTolerance"
    with pytest.raises(UserError, match=r"fault_tolerance\._target_ must be \w+\.engine\.check"):
        owner(tmp_path, fault_tolerance={"_target_": old})


def test_an_older_templates_lightning_checkpoint_gives_its_rng_states(tmp_path: Path) -> None:
    """Before one owner, a Lightning checkpoint kept its RNG states in its FaultTolerance
    callback's state: they are found, and that state is dropped (Lightning would warn that
    the callback is missing)."""
    rng = {"torch": "state"}
    old = {"callbacks": {"FaultTolerance": {"rng": rng}, "ModelCheckpoint{...}": {"k": 1}}}
    assert RunCheckpoints.rng_of(old) is rng
    assert old["callbacks"] == {"ModelCheckpoint{...}": {"k": 1}} and old["rng"] is rng
    new = {"rng": rng, "callbacks": {}}
    assert RunCheckpoints.rng_of(new) is rng and RunCheckpoints.rng_of({"callbacks": {}}) is None


# feature:raw
# --- the raw trainer's early stopping (Lightning's rule) ------------------------------------
def early_stopping(patience: int, min_delta: float = 0.0, mode: str = "min"):
    from project.engine.raw.early_stopping import EarlyStopping

    cfg = OmegaConf.create({"monitor": "val/loss", "mode": mode, "patience": patience,
                            "min_delta": min_delta})  # fmt: skip
    return EarlyStopping(cfg)


def test_early_stopping_waits_patience_checks_without_improvement() -> None:
    stopper = early_stopping(patience=2)
    losses = [1.0, 0.9, 0.95, 0.92]  # improves, then two checks without improvement
    assert [stopper.should_stop({"val/loss": v}) for v in losses] == [False, False, False, True]


def test_early_stopping_needs_min_delta_and_follows_mode() -> None:
    stopper = early_stopping(patience=1, min_delta=0.1)
    assert not stopper.should_stop({"val/loss": 1.0})
    assert stopper.should_stop({"val/loss": 0.95})  # better, but by less than min_delta
    rising = early_stopping(patience=1, mode="max")
    assert not rising.should_stop({"val/acc": 0.5})  # another metric: never stops
    assert [rising.should_stop({"val/loss": v}) for v in (0.5, 0.6, 0.6)] == [False, False, True]


@pytest.mark.parametrize(
    "trainer, epochs, steps",
    [({"max_epochs": 30}, 30, None), ({"max_epochs": 30, "max_steps": -1}, 30, None),
     ({"max_epochs": 30, "max_steps": 3}, 30, 3), ({"max_epochs": -1, "max_steps": 3}, None, 3),
     ({"max_epochs": None, "max_steps": 3}, None, 3), ({"max_epochs": None}, 1000, None),
     ({"max_epochs": 30, "max_steps": 9, "fast_dev_run": True}, 1, 1),
     ({"max_epochs": 30, "fast_dev_run": 4}, 1, 4)],
)  # fmt: skip
def test_the_raw_trainer_reads_the_loop_limits_as_lightning(trainer, epochs, steps) -> None:
    """Lightning's `_parse_loop_limits` and fast_dev_run: -1 and an unset max_epochs beside
    max_steps mean no epoch limit (None), an unset one alone 1000 epochs."""
    from project.engine.raw import limits

    cfg = OmegaConf.create(trainer)
    assert (limits.max_epochs(cfg), limits.max_steps(cfg)) == (epochs, steps)
    assert not limits.reached(None, 10**9) and limits.reached(3, 3) and not limits.reached(3, 2)


# /feature:raw
# --- what a checkpoint may be resumed by (project.engine.checkpoints.resume) ----------------
CFG = {"seed": 42, "model": {"net": {"hidden": 64}, "compile": False},
       "data": {"batch_size": 32, "num_workers": 0, "dataset": {"data_dir": "/a"}}}  # fmt: skip


def with_(**changes: object) -> dict:
    cfg = OmegaConf.create(CFG)
    for key, value in changes.items():
        OmegaConf.update(cfg, key.replace("__", "."), value)
    return OmegaConf.to_container(cfg)


def test_identity_leaves_out_where_and_how_data_is_loaded() -> None:
    identity = training_identity(CFG)
    assert identity["model.net.hidden"] == 64 and identity["data.batch_size"] == 32
    assert "data.num_workers" not in identity and "data.dataset.data_dir" not in identity
    assert "model.compile" not in identity
    moved = with_(data__dataset__data_dir="/b", data__num_workers=4)
    assert training_identity(moved) == identity


def test_auto_resume_refuses_another_training_and_names_the_keys() -> None:
    ckpt = {"project": {"identity": training_identity(CFG)}}
    check_resumable("last.ckpt", ckpt, CFG, explicit=False)  # the same training: fine
    with pytest.raises(UserError, match=r"seed: 42 there, 7 now"):
        check_resumable("last.ckpt", ckpt, with_(seed=7), explicit=False)


def test_the_refusal_of_another_training_names_fine_tuning_through_ckpt_path() -> None:
    """A run folder refuses another config; the line names the way to train on from its
    weights anyway: a new RUN_ID with ckpt_path."""
    ckpt = {"project": {"identity": training_identity(CFG)}}
    moved = with_(model__net__hidden=32)  # as if it followed a key the command changed
    cases = [(with_(seed=7), None, "trained with another config"),
             (moved, {"model.net.hidden": "x"}, "the command changed x")]  # fmt: skip
    for changed, follows, said in cases:
        with pytest.raises(UserError) as err:
            check_resumable("r/last.ckpt", ckpt, changed, explicit=False, follows=follows)
        line = str(err.value)
        assert said in line and "another RUN_ID" in line and "ckpt_path=r/last.ckpt" in line, line


def test_an_explicit_checkpoint_may_change_all_but_the_network() -> None:
    ckpt = {"project": {"identity": training_identity(CFG)}}
    check_resumable("x.ckpt", ckpt, with_(seed=7, data__batch_size=8), explicit=True)
    with pytest.raises(UserError, match=r"another network \(model.net.hidden: 64 there, 128"):
        check_resumable("x.ckpt", ckpt, with_(model__net__hidden=128), explicit=True)


# --- which weights `test` evaluates, the same rule in both trainers -------------------------
def run_of(tmp_path: Path, train: bool, test_ckpt: str, resume: Resume) -> Run:
    cfg = OmegaConf.create({"train": train, "test_ckpt": test_ckpt})
    checkpoints = owner(tmp_path, fault_tolerance={"dirpath": str(tmp_path)})  # tmp_path/last.ckpt
    return Run(cfg, tmp_path, None, resume, checkpoints)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("train", "which", "resume", "expected"),
    [
        (True, "best", "fresh", "best"),
        (True, "last", "fresh", "last"),
        (True, "current", "fresh", None),
        (True, "best", "finished", "best"),  # a finished run only tested: its best
        (True, "current", "finished", "resumed"),  # ... or the weights it finished with
        (False, "best", "explicit", "resumed"),  # train=false ckpt_path=x: test x itself
        (False, "current", "none", None),
    ],
)
def test_checkpoint_to_test(tmp_path, train, which, resume, expected) -> None:
    best, last, resumed = tmp_path / "best.ckpt", tmp_path / "last.ckpt", tmp_path / "r.ckpt"
    for path in (best, last, resumed):
        path.write_text("")
    state = {"fresh": Resume(), "none": Resume(), "finished": Resume(resumed, finished=True),
             "explicit": Resume(resumed)}[resume]  # fmt: skip
    chosen = checkpoint_to_test(run_of(tmp_path, train, which, state), best)
    assert chosen == {"best": best, "last": last, "resumed": resumed, None: None}[expected]


def test_a_missing_best_falls_back_to_the_current_weights(tmp_path) -> None:
    run = run_of(tmp_path, True, "best", Resume())
    assert checkpoint_to_test(run, tmp_path / "no-best.ckpt") is None


def test_throughput_counts_the_tasks_units() -> None:
    import torch

    from project.engine.shared.throughput import Throughput
    from project.tasks.classification import Classification
    from project.tasks.language_model import LanguageModel

    net = torch.nn.Identity()
    batch = (torch.zeros(8, 32, dtype=torch.long), torch.zeros(8, 32, dtype=torch.long))
    assert (LanguageModel(net).unit, LanguageModel(net).count(batch)) == ("tokens", 256)
    assert (
        Classification(net, num_classes=10).unit,
        Classification(net, num_classes=10).count(batch),
    ) == ("samples", 8)
    meter = Throughput(world_size=2)
    meter.count(100)
    assert meter.rate() > 0 and meter.units == 0  # counted units over both ranks, then reset


# --- the profiler (project.engine.lightning.build) ------------------------------------------
def test_the_profiler_is_the_configured_one_else_one_that_costs_nothing(compose_train) -> None:
    from lightning.pytorch.profilers import Profiler

    from project.engine.lightning.build import NoProfiler, profiler

    assert profiler(compose_train(["debug=profiler"])) == "simple"  # Lightning builds it
    free = profiler(compose_train([]))
    assert isinstance(free, NoProfiler) and isinstance(free, Profiler)
    with free.profile("a") as first, free.profile("b") as nested:  # reusable, re-entrant
        assert first is None and nested is None
    assert free.profile("a") is free.profile("b")  # no object built per hook call
