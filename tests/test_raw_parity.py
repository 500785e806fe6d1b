"""The raw DDP trainer: same config keys, same losses step for step, same final weights."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from project.compare import scaling, scaling_table, summarise, table, with_devices
from project.engine.config.schema import check_schema
from project.engine.raw.keys import classify
from tests.helpers import (
    CHARLM,
    SHORT_STATS,
    assert_parity,
    assert_same_training,
    options,
    run_script,
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
