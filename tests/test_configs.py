"""Every option of every config group composes, and what it configures instantiates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from project.engine.distributed import ddp
from project.engine.lightning.build import instantiate_all
from tests.helpers import CONFIG_DIR, options, run_script

pytestmark = pytest.mark.quick  # the fast tier: `make test`


def test_every_group_has_options() -> None:
    for group in (
        "data",
        "model",
        "trainer",
        "callbacks",
        "logger",
        "paths",
        "hydra",
        "experiment",
        "debug",
        "model/optimizer",
        "model/scheduler",
    ):
        assert options(group), f"config group {group} is empty"


@pytest.mark.parametrize("option", options("data"))
def test_data_options(compose_train, option: str, tmp_path: Path) -> None:
    overrides = [f"data={option}"]
    if option == "chars_stream":  # reads shards written beforehand
        from project.data.prepare import main as prepare

        prepare(["--out", str(tmp_path / "shards"), "--windows-per-shard", "500"])
        overrides.append(f"data.dataset.folder={tmp_path / 'shards'}")
    dm = instantiate(compose_train(overrides).data)
    dm.prepare_data()
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape[0] == y.shape[0] > 0


@pytest.mark.parametrize("option", options("model"))
@pytest.mark.parametrize("optimizer", options("model/optimizer"))
@pytest.mark.parametrize("scheduler", options("model/scheduler"))
def test_model_options(compose_train, option: str, optimizer: str, scheduler: str) -> None:
    data = ["data=chars"] if option == "gpt" else []  # the GPT's context is the data's window
    cfg = compose_train(
        [f"model={option}", f"model/optimizer={optimizer}", f"model/scheduler={scheduler}", *data]
    )
    model = instantiate(cfg.model)
    if option == "gpt":
        tokens = torch.randint(0, cfg.model.net.vocab_size, (4, 8))
        assert model(tokens).shape == (4, 8, cfg.model.net.vocab_size)
    else:
        assert model(torch.rand(4, 64)).shape == (4, cfg.model.task.num_classes)
    built = model.configure_optimizers()
    optimizer = built["optimizer"] if isinstance(built, dict) else built
    assert type(optimizer).__name__ == cfg.model.optimizer._target_.rsplit(".", 1)[1]
    assert len(optimizer.param_groups[0]["params"]) == len(list(model.parameters()))
    if cfg.model.get("scheduler"):
        assert built["lr_scheduler"]["interval"] == cfg.model.scheduler.interval


@pytest.mark.parametrize("option", options("trainer"))
def test_trainer_options(compose_train, option: str) -> None:
    cfg = compose_train([f"trainer={option}"])
    if cfg.trainer.accelerator == "gpu" and not torch.cuda.is_available():
        pytest.skip("trainer=gpu needs a CUDA GPU; composes fine (checked above)")
    ddp.resolve_topology(cfg.trainer)  # devices/num_nodes "auto" -> numbers, as train.py does
    trainer = instantiate(cfg.trainer, logger=False, enable_progress_bar=False)
    assert trainer.max_epochs == cfg.trainer.max_epochs


@pytest.mark.parametrize("option", options("strategy"))
def test_strategy_options(compose_train, option: str) -> None:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from project.engine.distributed.fsdp import options as fsdp_options

    cfg = compose_train([f"strategy={option}"])
    built = ddp.build_strategy(cfg.strategy, ddp.Topology(2, 1, None))
    if option == "fsdp":  # its own check (tests/test_fsdp.py), and no checkpoints yet
        fsdp_options.check(cfg, 2)
        assert isinstance(built, ModelParallelStrategy)
        return
    ddp.check_options(cfg.strategy, cfg.trainer)
    assert isinstance(built, DDPStrategy)


@pytest.mark.parametrize("option", options("callbacks"))
def test_callbacks_options(compose_train, option: str) -> None:
    cfg = compose_train([f"callbacks={option}"])
    callbacks = instantiate_all(cfg.callbacks)
    assert len(callbacks) == len([c for c in (cfg.callbacks or {}).values() if c])


@pytest.mark.parametrize("option", options("logger"))
def test_logger_options(compose_train, option: str, tmp_path: Path) -> None:
    cfg = compose_train([f"logger={option}", f"paths.log_dir={tmp_path / 'logs'}"])
    loggers = instantiate_all(cfg.logger)
    assert len(loggers) == len([lg for lg in (cfg.logger or {}).values() if lg])
    assert (option == "none") == (not loggers)
    for lg in loggers:  # every logger writes into the run folder (MLflow: a store beside)
        if hasattr(lg, "run_dir"):  # MLflow: a tracked run per run folder, the store beside
            assert lg.run_dir == cfg.paths.output_dir and str(tmp_path) in lg._tracking_uri
        else:
            assert Path(lg.save_dir) == Path(cfg.paths.output_dir)


@pytest.mark.parametrize("option", options("experiment") + options("debug"))
def test_experiment_and_debug_options(compose_train, option: str) -> None:
    group = "experiment" if (CONFIG_DIR / "experiment" / f"{option}.yaml").exists() else "debug"
    cfg = compose_train([f"{group}={option}"])
    assert sum(p.numel() for p in instantiate(cfg.model).parameters()) > 0
    ddp.resolve_topology(cfg.trainer)
    instantiate(cfg.trainer, logger=False)


def test_eval_config_composes(compose_train) -> None:
    cfg = compose_train(["ckpt_path=/x.ckpt"], config_name="eval")
    assert cfg.ckpt_path == "/x.ckpt" and cfg.logger == {}


def test_eval_help_offers_only_the_groups_eval_takes(compose_train) -> None:
    """`eval.py --help` listed every group in configs/, `strategy` and `model` among them,
    which eval.py refuses (Hydra: "use +strategy=fsdp"): each option it lists composes."""
    proc = run_script("eval.py", ["--help"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    groups = proc.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    listed = dict(ln.split(": ", 1) for ln in groups.splitlines() if ": " in ln)
    assert {"data", "trainer", "logger"} <= set(listed) and "strategy" not in listed, listed
    for group, names in listed.items():
        for option in names.split(", "):
            compose_train([f"{group}={option}", "ckpt_path=/x.ckpt"], config_name="eval")


# feature:raw
def test_eval_of_a_raw_trainer_checkpoint_names_how_to_test_it(tmp_path: Path) -> None:
    """eval.py reads Lightning's checkpoints; a raw trainer's .pt is tested by the raw trainer
    (train=false ckpt_path=...), and the refusal says so (docs/extending.md)."""
    from project.engine.errors import UserError
    from project.eval import load_checkpoint

    torch.save({"config": {"model": {}}, "model": {}, "project": {}}, tmp_path / "last.pt")
    with pytest.raises(UserError, match=r"raw_train train=false ckpt_path=\.\.\. tests it"):
        load_checkpoint(str(tmp_path / "last.pt"))


# /feature:raw
def test_a_fault_tolerance_block_of_ones_own_is_settings_not_a_callback(compose_train) -> None:
    """`callbacks=none +callbacks.fault_tolerance.every_n_seconds=60`: Lightning gets no
    callback from it (nor a half-built one), the run's checkpoints follow it, the rest of its
    keys from the shipped file."""
    from project.engine.checkpoints.resume import Resume
    from project.engine.checkpoints.run import RunCheckpoints, shipped
    from project.engine.lightning.build import callbacks
    from project.engine.lightning.callbacks import RunState
    from project.engine.run.skeleton import Run

    cfg = compose_train(["callbacks=none", "+callbacks.fault_tolerance.every_n_seconds=60"])
    output_dir = Path(cfg.paths.output_dir)
    checkpoints = RunCheckpoints(cfg, output_dir, None, {}, {})
    run = Run(cfg, output_dir, ddp.resolve_topology(cfg.trainer), Resume(), checkpoints)
    assert [type(c) for c in callbacks(run, loggers=[])] == [RunState]
    settings = checkpoints.settings
    assert settings.every_n_seconds == 60 != shipped(cfg)["every_n_seconds"]
    assert settings.check_every_n_steps == shipped(cfg)["check_every_n_steps"]
    assert checkpoints.last == output_dir / "checkpoints" / "last.ckpt" and checkpoints.periodic


@pytest.mark.parametrize("flag", ["enable_progress_bar", "enable_model_summary"])
def test_the_trainer_flags_alone_switch_their_callback_off(compose_train, flag: str) -> None:
    """`trainer.enable_progress_bar=false` just works: the progress bar callback is left out
    (Lightning refuses the flag beside a progress bar callback); the same for the summary."""
    import lightning.pytorch as pl

    from project.engine.checkpoints.resume import Resume
    from project.engine.checkpoints.run import RunCheckpoints
    from project.engine.lightning.build import callbacks
    from project.engine.run.skeleton import Run

    kind = {"enable_progress_bar": pl.callbacks.ProgressBar,
            "enable_model_summary": pl.callbacks.ModelSummary}[flag]  # fmt: skip
    for value in (True, False):
        cfg = compose_train([f"trainer.{flag}={value}"])
        topology = ddp.resolve_topology(cfg.trainer)
        output_dir = Path(cfg.paths.output_dir)
        checkpoints = RunCheckpoints(cfg, output_dir, None, {}, {})
        run = Run(cfg, output_dir, topology, Resume(), checkpoints)
        found = callbacks(run, loggers=[])
        assert any(isinstance(c, kind) for c in found) == value
        instantiate(cfg.trainer, callbacks=found, logger=False)  # Lightning accepts it
