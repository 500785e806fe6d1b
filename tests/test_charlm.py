"""The second shipped task, a character-level Transformer LM: train, eval, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest

from project.data.text import CharCorpus, read_corpus, unigram_baseline
from project.engine.errors import UserError
from tests.helpers import CHARLM, assert_one_line_error, logged_metrics, run_script


@pytest.mark.quick
def test_corpus_ships_with_python_and_splits_contiguously() -> None:
    corpus = CharCorpus(block_size=32)
    splits = corpus.splits()
    text = np.frombuffer(read_corpus(None), dtype=np.uint8)
    assert np.array_equal(np.concatenate([splits[s] for s in ("train", "val", "test")]), text)
    x, y = corpus.dataset("val")[3]
    assert x.shape == y.shape == (32,) and bytes(x[1:].tolist()) == bytes(y[:-1].tolist())
    # A model that ignores context scores about 3.3 nats per character on this text.
    assert 3.0 < unigram_baseline(splits["train"], splits["val"]) < 3.5


def test_unreadable_corpus_is_one_line(tmp_path) -> None:
    with pytest.raises(UserError, match="cannot be read as UTF-8 text"):
        CharCorpus(path=str(tmp_path / "missing.txt"))
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00 not text")
    proc = run_script("train.py", ["experiment=charlm", f"data.dataset.path={binary}"])
    assert_one_line_error(proc, "data.dataset.path=", "UTF-8")


def test_train_then_eval_rebuilds_the_language_model(base_args, log_dir) -> None:
    proc = run_script("train.py", [*base_args, *CHARLM, "test_ckpt=last"], RUN_ID="lm")
    assert proc.returncode == 0, proc.stderr[-3000:]
    trained = logged_metrics(proc.stdout)
    assert trained["test/ppl"] == pytest.approx(math.exp(trained["test/loss"]), rel=0.02)
    last = log_dir / "train" / "runs" / "lm" / "checkpoints" / "last.ckpt"
    # eval.py rebuilds the GPT and the corpus split from the checkpoint alone.
    quiet = [base_args[1], "trainer.enable_progress_bar=false"]
    evaluated = run_script("eval.py", [f"ckpt_path={last}", *quiet, "trainer.limit_test_batches=2"])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert logged_metrics(evaluated.stdout) == pytest.approx(
        {k: v for k, v in trained.items() if k.startswith("test/")}, abs=1e-4
    )
    # A data override that does not fit the checkpoint's task names both.
    wrong = run_script("eval.py", [f"ckpt_path={last}", "data=digits", *quiet])
    assert_one_line_error(wrong, "project.data.digits.Digits", "project.tasks.language_model",
                          "project.data.text.CharCorpus")  # fmt: skip


def test_a_task_that_does_not_exist_is_one_line(base_args) -> None:
    scripts = [
        "train.py",
        "-m project.raw_train",  # feature:raw
    ]
    for script in scripts:
        proc = run_script(script, [*base_args, "model.task._target_=project.tasks.nope.Nope"])
        assert_one_line_error(proc, "model.task._target_=project.tasks.nope.Nope", "imported")
