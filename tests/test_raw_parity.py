"""The raw DDP trainer: same config keys, same losses step for step, same final weights."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from project.compare import scaling, scaling_table, summarise, table, with_devices
from project.engine.config.schema import check_schema
from project.engine.errors import UserError
from project.engine.raw.keys import check_config, classify
from tests.helpers import (
    CHARLM,
    SHORT_STATS,
    assert_one_line_error,
    assert_parity,
    assert_same_training,
    options,
    run_script,
    run_trainer,
)


def leaf_keys(node, prefix: str = "") -> list[str]:
    if OmegaConf.is_dict(node):
        keys = []
        for key in node:
            keys += leaf_keys(node._get_node(key), f"{prefix}{key}.")
        return keys  # an empty group (callbacks=none) configures nothing
    return [prefix[:-1]]


def all_option_overrides() -> list[list[str]]:
    groups = ["data", "model", "model/task", "model/optimizer", "model/scheduler", "trainer",
              "strategy", "callbacks", "logger", "experiment", "debug"]  # fmt: skip
    return [[]] + [[f"{g}={o}"] for g in groups for o in options(g)]


@pytest.mark.quick
def test_every_config_key_is_classified_by_the_raw_trainer(compose_train) -> None:
    """A key that changes Lightning's training but that the raw trainer ignores fails here:
    add it to project.engine.raw.keys.CONSUMED (and implement it) or PRESENTATION/REFUSED."""
    unknown = set()
    for overrides in all_option_overrides():
        cfg = compose_train(overrides)
        unknown |= {k for k in leaf_keys(cfg) if classify(k) is None}
        check_schema(cfg)  # composed once, checked twice: every shipped option is well typed
    assert not unknown, f"config keys the raw trainer does not classify: {sorted(unknown)}"


@pytest.mark.quick
def test_classification_catches_a_new_key() -> None:
    assert classify("trainer.max_epochs") == "consumed"
    assert classify("model.net.hidden") == "consumed"  # handed whole to the shared builder
    assert classify("callbacks.progress_bar.refresh_rate") == "presentation"
    # Where users change things: a new adapter argument or Lightning option is unclassified...
    for key in (
        "trainer.some_new_switch",
        "model.label_smoothing",
        "data.shuffle_buffer",
        "callbacks.early_stopping.check_finite",
        "callbacks.fault_tolerance.new",
    ):
        assert classify(key) is None, key
    # ... but a new callback or logger only watches the run.
    assert classify("callbacks.my_callback.every_n") == "presentation"
    assert classify("logger.mlflow.tracking_uri") == "presentation"


@pytest.mark.quick
@pytest.mark.parametrize(
    "override, key",
    [("+trainer.val_check_interval=0.5", "trainer.val_check_interval=0.5"),
     ("+trainer.foo=1", "trainer.foo=1"), ("+model.label_smoothing=0.1", "model.label_smoothing"),
     ("+callbacks.early_stopping.check_finite=false", "early_stopping.check_finite=False"),
     ("callbacks.early_stopping.check_on_train_epoch_end=true", "check_on_train_epoch_end=True")],
)  # fmt: skip
def test_a_key_the_raw_trainer_does_not_implement_is_refused(compose_train, override, key) -> None:
    """Set on the command line, a key Lightning would act on and the raw trainer would ignore
    stops it (the test above only sees the shipped configs)."""
    check_config(compose_train(["+trainer.max_steps=3", "callbacks.early_stopping=null"]))
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        check_config(compose_train([override]))


def test_an_unknown_trainer_key_is_one_line_before_anything_starts(base_args, tmp_path) -> None:
    proc = run_script("-m project.raw_train", [*base_args, "+trainer.foo=1",
                                               f"hydra.run.dir={tmp_path}/run"])  # fmt: skip
    assert_one_line_error(proc, "trainer.foo=1 is not implemented by the raw trainer", "train.py")
    assert not (tmp_path / "run" / "config_tree.log").exists()  # before the run's set-up


@pytest.mark.parametrize("max_steps", [3, 13])
def test_max_steps_ends_both_trainers_after_the_same_optimizer_step(
    base_args, tmp_path, max_steps: int
) -> None:
    """`+trainer.max_steps` counts optimizer steps (windows of 2 batches here, 10 an epoch).
    3 ends the first epoch before any validation; 13 ends the second after 3 of its 10 steps:
    that cut epoch is not validated and steps no epoch scheduler, as in Lightning. The same
    losses, bitwise, and the same metrics in both trainers. Early stopping checks after each
    validation (the raw trainer's rule; Lightning's default would fail at the first epoch's
    end on the missing val/loss)."""
    args = [*base_args, "step_stats=true", f"+trainer.max_steps={max_steps}",
            "trainer.accumulate_grad_batches=2", "model/scheduler=step",
            "model.scheduler.step_size=1",
            "callbacks.early_stopping.check_on_train_epoch_end=false"]  # fmt: skip
    runs = {"project.train": tmp_path / "lightning", "project.raw_train": tmp_path / "raw"}
    losses = [run_trainer(module, args, run_dir)["losses"] for module, run_dir in runs.items()]
    assert len(losses[0]) == 2 * max_steps and losses[0] == losses[1]
    assert [trained(run) for run in runs.values()] == [(max_steps, max_steps // 10)] * 2
    metrics = [json.loads((run / "metrics.json").read_text()) for run in runs.values()]
    assert ("val/loss" in metrics[1]) == (max_steps > 10)
    for key in metrics[1]:
        assert metrics[0][key] == pytest.approx(metrics[1][key], abs=1e-6), key


def trained(run_dir) -> tuple[int, int]:
    """(optimizer steps, epoch scheduler steps) in a run's last checkpoint, either trainer."""
    import torch

    raw = run_dir / "checkpoints" / "last.pt"
    if raw.is_file():
        ckpt = torch.load(raw, weights_only=True)
        return ckpt["global_step"], ckpt["scheduler"]["last_epoch"]
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    return ckpt["global_step"], ckpt["lr_schedulers"][0]["last_epoch"]


@pytest.mark.quick
@pytest.mark.parametrize(
    "group, adapter",
    [("model", "project.engine.lightning.module.TaskModule"),
     ("data", "project.engine.lightning.datamodule.DataModule")],
)  # fmt: skip
def test_every_adapter_argument_is_classified(group: str, adapter: str) -> None:
    """An argument added to the Lightning adapters (even one no config sets yet) must be
    implemented by the raw trainer or declared as not changing training."""
    import importlib
    import inspect

    module, name = adapter.rsplit(".", 1)
    params = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    unknown = [p for p in params if classify(f"{group}.{p}") is None]
    assert not unknown, f"{adapter} arguments the raw trainer does not classify: {unknown}"


def test_parity_float16_mixed_precision_on_cpu(base_args, tmp_path) -> None:
    """Lightning runs `16-mixed` as bfloat16 AMP on a CPU; the raw trainer does the same."""
    assert_parity(tmp_path, [*base_args, *SHORT_STATS, "trainer.precision=16-mixed",
                             "trainer.accelerator=cpu"])  # fmt: skip


@pytest.mark.parametrize("algorithm, value", [("norm", 0.5), ("value", 0.01)])
def test_parity_one_process_cnn_accumulation_clipping(
    base_args, tmp_path, algorithm: str, value: float
) -> None:
    assert_parity(tmp_path, [*base_args, *SHORT_STATS, "model=cnn",
                             "trainer.accumulate_grad_batches=3", "model/scheduler=step",
                             f"trainer.gradient_clip_val={value}",
                             f"trainer.gradient_clip_algorithm={algorithm}"])  # fmt: skip


@pytest.mark.quick  # the fast tier's DDP run and parity check
@pytest.mark.distributed
def test_parity_two_processes_charlm(base_args, tmp_path) -> None:
    """The Transformer LM (embeddings, tied weights, attention dropout) under 2-process DDP."""
    assert_parity(tmp_path, [*base_args, *CHARLM, "step_stats=true"], nproc=2)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "strategy", ["ddp", "ddp_static", pytest.param("ddp_unused", marks=pytest.mark.slow)]
)
def test_parity_two_processes_torchrun(torchrun_runs, strategy: str) -> None:
    """Both trainers under launch/single_node.sh with each DDP preset (the Lightning runs are
    the ones the DDP-option tests in test_launch.py compare with plain DDP)."""
    options = () if strategy == "ddp" else (f"strategy={strategy}",)  # ddp: the default
    lightning, raw = torchrun_runs(*options), torchrun_runs(*options, trainer="raw")
    assert_same_training(lightning.dir, raw.dir)


def test_raw_trainer_refuses_to_start_processes_itself(base_args) -> None:
    proc = run_script("-m project.raw_train", [*base_args, "trainer.devices=2"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error: the raw trainer does not start processes")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_compare_command_writes_table_and_json(base_args, log_dir) -> None:
    """Also the parity check of the default config on one process: the compare runs."""
    args = ["--repeats", "1", "--warmup", "5", *base_args, "trainer.max_epochs=2"]
    proc = run_script("-m project.compare", args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "bitwise equal" in proc.stdout
    out_dir = next((log_dir / "compare" / "runs").iterdir())
    assert_same_training(out_dir / "lightning" / "r0", out_dir / "raw" / "r0")
    summary = json.loads((out_dir / "compare.json").read_text())
    assert summary["max_abs_loss_diff"] == 0.0 and summary["losses_bitwise_equal"]
    assert summary["lightning_over_raw_step_time"] > 0
    assert summary["lightning_over_raw_each"] == [
        pytest.approx(summary["lightning_over_raw_step_time"], abs=1e-3)
    ]
    assert summary["lightning"]["steady_step_ms_median"] > 0
    assert "| steady step time (ms, median) |" in (out_dir / "compare.md").read_text()
    for trainer in ("lightning", "raw"):  # both trainers' curves under the compare folder
        assert list((out_dir / trainer / "r0" / "tensorboard").glob("events.out.tfevents.*"))
    plt = pytest.importorskip("matplotlib.pyplot")  # dev installs it (.[plot])
    image = plt.imread(out_dir / "compare.png")  # a real PNG: losses and step-time panels
    assert image.shape[:2] == (400, 1100) and image.std() > 0.05


@pytest.mark.quick
def test_compare_summary_shows_each_repeat_pair() -> None:
    """Medians over repeats, and the spread of the back-to-back pairs' ratios beside them."""

    def run(step_ms: float) -> dict:
        stats = {"step_starts_s": [i * step_ms / 1000 for i in range(12)], "losses": [1.0] * 12,
                 "peak_rss_mib": 1.0, "peak_gpu_mib": None}  # fmt: skip
        return {"stats": stats, "metrics": {}, "dir": "d"}

    results = {"lightning": [run(6.0), run(4.5), run(5.0)], "raw": [run(3.0), run(3.0), run(5.0)]}
    summary = summarise(results, warmup=1)
    assert summary["lightning_over_raw_each"] == [2.0, 1.5, 1.0]
    assert summary["lightning_over_raw_step_time"] == pytest.approx(5.0 / 3.0)
    assert summary["losses_bitwise_equal"]
    assert "**1.667x** (+2000 us per step; repeats 1.000x-2.000x)" in table(summary)


@pytest.mark.quick
def test_scaling_efficiency_is_throughput_over_n_times_one_process() -> None:
    def run(step_ms: float, units: int) -> dict:
        stats = {"step_starts_s": [i * step_ms / 1000 for i in range(12)], "losses": [1.0] * 12,
                 "unit": "samples", "units_per_step": units}  # fmt: skip
        return {"stats": stats, "metrics": {}, "dir": "d"}

    results = {1: {"lightning": [run(4.0, 64)], "raw": [run(4.0, 64)]},
               2: {"lightning": [run(5.0, 128)], "raw": [run(4.0, 128)]}}  # fmt: skip
    rows = {(r["trainer"], r["processes"]): r for r in scaling(results, warmup=1)["rows"]}
    assert rows["raw", 1]["per_s"] == pytest.approx(16000)  # 64 samples per 4 ms
    assert rows["raw", 2]["efficiency"] == pytest.approx(1.0)  # twice the samples, same time
    assert rows["lightning", 2]["efficiency"] == pytest.approx(0.8)
    text = scaling_table(scaling(results, warmup=1))
    assert "| lightning | 2 | 5.00 | 25600 | 0.80 |" in text
    assert with_devices(["trainer.devices=2", "seed=1"], 1) == ["seed=1", "trainer.devices=1"]
