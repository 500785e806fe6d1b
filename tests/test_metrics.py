"""A metric means the same on any batch size and world size: the loss of a stage is the mean
over its samples (each batch weighted by `Task.weight`: samples, scored tokens), and
evaluation shards count every sample once. One checkpoint, tested with the whole split in
one batch, with batches of 64 and on 2 processes: the same test/loss, both trainers, both
shipped tasks."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from project.engine.data.samplers import EvalShardSampler
from project.engine.lightning.module import TaskModule
from tests.helpers import (
    CHARLM,
    QUIET,
    ROOT,
    assert_groups_closed,
    exit_check_env,
    finish,
    start,
    torchrun,
)

IGNORE = -100  # a target the LM's loss does not score (cross_entropy's ignore_index)
REL = 1e-5  # what "the same" means here: float32 forward passes at other batch shapes

OPTIMIZER = {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-3}
CLASSIFIER = {
    "task": {"_target_": "project.tasks.classification.Classification", "num_classes": 10},
    "net": {"_target_": "project.models.mlp.MLP", "in_features": 64, "hidden": 32, "depth": 1,
            "out_features": 10},
}  # fmt: skip
LM = {
    "task": {"_target_": "project.tasks.language_model.LanguageModel"},
    "net": {"_target_": "project.models.gpt.GPT", "vocab_size": 256, "block_size": 16,
            "d_model": 16, "n_layer": 1, "n_head": 2, "dropout": 0.0},
}  # fmt: skip


def evaluated(module: TaskModule, batches: list[tuple[torch.Tensor, ...]]) -> dict[str, float]:
    """The module's test metrics over `batches` (its test_step, as Lightning calls it)."""
    module.eval()
    with torch.no_grad():
        for i, batch in enumerate(batches):
            module.test_step(batch, i)
    values = {name: float(m.compute()) for name, m in module.test_metrics.items()}
    for metric in module.test_metrics.values():
        metric.reset()
    return values


def batched(data: tuple[torch.Tensor, ...], size: int, rows=None) -> list[tuple]:
    rows = list(range(len(data[0]))) if rows is None else list(rows)
    return [tuple(t[rows[i : i + size]] for t in data) for i in range(0, len(rows), size)]


def two_ranks(module: TaskModule, data: tuple[torch.Tensor, ...], size: int) -> dict[str, float]:
    """What 2 ranks report: each tests its EvalShardSampler share, the metric states are summed
    (torchmetrics' sync at compute)."""
    twin = TaskModule(**module.hparams)
    twin.load_state_dict(module.state_dict())
    modules = (module, twin)
    with torch.no_grad():
        for rank, m in enumerate(modules):
            m.eval()
            shard = EvalShardSampler(data[0], world=2, rank=rank)
            for i, batch in enumerate(batched(data, size, shard)):
                m.test_step(batch, i)
    for name, metric in module.test_metrics.items():
        metric.merge_state(twin.test_metrics[name])
    return evaluated(module, [])


@pytest.mark.quick
def test_classifier_loss_and_accuracy_do_not_depend_on_batching() -> None:
    """270 samples (the digits' test split): one batch, batches of 64 (a last one of 14), 2
    ranks of 135. Before the weighting the loss was a mean of batch means."""
    torch.manual_seed(0)
    module = TaskModule(**CLASSIFIER, optimizer=OPTIMIZER)
    x, y = torch.randn(270, 64) * 4, torch.randint(0, 10, (270,))
    with torch.no_grad():
        logits = module.task(x)
    whole = {"loss": F.cross_entropy(logits, y).item(),
             "acc": (logits.argmax(1) == y).float().mean().item()}  # fmt: skip
    for values in (evaluated(module, batched((x, y), 270)), evaluated(module, batched((x, y), 64)),
                   two_ranks(module, (x, y), 64)):  # fmt: skip
        assert values == pytest.approx(whole, rel=REL)


@pytest.mark.quick
def test_language_model_loss_is_over_scored_tokens_and_ppl_its_exp() -> None:
    """Windows whose targets are partly not scored (IGNORE, as padding is): the loss is the mean
    over the scored tokens on any batching, and the perplexity is its exp."""
    torch.manual_seed(0)
    module = TaskModule(**LM, optimizer=OPTIMIZER)
    x, y = torch.randint(0, 256, (45, 16)), torch.randint(0, 256, (45, 16))
    y[::3, 5:] = IGNORE  # a third of the windows score 5 positions, the others 16
    with torch.no_grad():
        whole = F.cross_entropy(module.task(x).flatten(0, 1), y.flatten()).item()
    for values in (evaluated(module, batched((x, y), 45)), evaluated(module, batched((x, y), 4)),
                   two_ranks(module, (x, y), 4)):  # fmt: skip
        assert values["loss"] == pytest.approx(whole, rel=REL)
        assert values["ppl"] == pytest.approx(math.exp(whole), rel=REL)


@pytest.mark.quick
def test_weighted_mean_sums_in_float64_and_keeps_a_nan() -> None:
    from project.engine.shared.metrics import WeightedMean

    mean = WeightedMean()
    mean.update(torch.tensor(1.0), 3)
    mean.update(torch.tensor(2.0), torch.tensor(1))
    assert mean.compute().item() == 1.25 and mean.compute().dtype == torch.float64
    mean.update(torch.tensor(float("nan")), 2)  # the same NaN on any batching
    assert math.isnan(mean.compute().item())


# --- one checkpoint, tested by each trainer at three batchings -------------------------------
DIGITS = ["trainer.max_epochs=1", "trainer.limit_train_batches=6"]  # 270 test samples
LM_TEST = [*CHARLM, "trainer.max_epochs=1", "trainer.limit_test_batches=1.0"]  # all windows
TASKS = {"digits": (DIGITS, "digits", 270), "charlm": (LM_TEST, "chars", 2048)}
TRAINERS = {  # the entry point that trains, the checkpoint it leaves
    "lightning": ("train.py", "last.ckpt"),
    "raw": ("-m project.raw_train", "last.pt"),  # feature:raw
}


def run_job(target: list[str], run_dir: Path, nproc: int = 1) -> None:
    """`target` with its run folder `run_dir`, to success (under torchrun with nproc > 1)."""
    cmd = torchrun([*target, f"hydra.run.dir={run_dir}", *QUIET], nproc)
    code, out = finish(start(cmd, **(exit_check_env() if nproc > 1 else {})), timeout=240)
    assert code == 0, out[-4000:]
    if nproc > 1:
        assert_groups_closed(out, nproc)


def reported(trainer: str, run_dir: Path) -> dict[str, float]:
    """What a test run reported: eval.py's CSV log (Lightning), metrics.json (raw)."""
    if trainer == "raw":
        metrics = json.loads((run_dir / "metrics.json").read_text())
    else:
        with open(run_dir / "csv" / "metrics.csv") as f:
            metrics = {k: float(v) for k, v in next(csv.DictReader(f)).items() if v}
    return {k: v for k, v in metrics.items() if k.startswith("test/")}


@pytest.mark.distributed
@pytest.mark.parametrize("trainer", list(TRAINERS))
@pytest.mark.parametrize("task", ["digits", "charlm"])
def test_one_checkpoint_tests_alike_on_any_batch_size_and_world_size(
    base_args, tmp_path, task: str, trainer: str
) -> None:
    """Lightning tests with eval.py (the checkpoint alone), the raw trainer with train=false:
    the whole split in one batch, batches of 64 (a short last one), 2 processes of 64."""
    overrides, data, whole = TASKS[task]
    args = [*base_args, *overrides]
    script, last = TRAINERS[trainer]
    entry = script.split()
    run_job([*entry, *args, "test=false"], tmp_path / "train")
    ckpt = tmp_path / "train" / "checkpoints" / last
    if trainer == "lightning":  # eval.py: the model and the split from the checkpoint
        entry = [str(ROOT / "eval.py"), "logger=csv", f"data={data}", *base_args[:2]]
    else:
        entry = [*entry, *args, "train=false", "logger=none"]
    results = {}
    for batch, nproc in ((whole, 1), (64, 1), (64, 2)):
        run_dir = tmp_path / f"test-{batch}-{nproc}"
        run_job([*entry, f"ckpt_path={ckpt}", f"data.batch_size={batch}"], run_dir, nproc)
        results[batch, nproc] = reported(trainer, run_dir)
    reference = results[whole, 1]
    assert {"test/loss", "test/acc" if task == "digits" else "test/ppl"} <= reference.keys()
    for key, values in results.items():
        assert values == pytest.approx(reference, rel=REL), (key, results)
