"""How DataLoader workers start (project.engine.data.worker_start). That a rank's workers
really come from the fork server under DDP is checked end to end in tests/test_streaming.py
(test_a_user_stream_over_uneven_shards_trains_on_2_ranks_x_2_workers)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import random
from collections.abc import Iterator
from functools import partial

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from project.engine.data.loaders import plain_loader, seed_worker
from project.engine.data.worker_start import configure_worker_start, imports_of, preload

pytestmark = pytest.mark.quick

DATA = {
    "_target_": "project.engine.lightning.datamodule.DataModule",
    "num_workers": 0,
    "dataset": {"_target_": "project.data.digits.Digits"},
}


@pytest.fixture
def start_method() -> Iterator[None]:
    """Give the test process its start method and fork-server preload back afterwards."""
    method = multiprocessing.get_start_method(allow_none=True)
    preloaded = list(multiprocessing.forkserver._forkserver._preload_modules)
    yield
    multiprocessing.set_start_method(method, force=True)
    multiprocessing.set_forkserver_preload(preloaded)


def test_the_server_preloads_torch_the_entry_points_imports_and_the_datasets_module() -> None:
    modules = preload(DATA, "project.train")
    assert modules[:2] == ["torch", "project.engine.data.loaders"]
    assert "project.engine.run.skeleton" in modules and "hydra" in modules  # what it imports
    assert "project.train" not in modules  # a worker runs it again: runpy warns if loaded
    assert modules[-1] == "project.data.digits"  # what a worker unpickles: not Lightning's
    assert not any("lightning" in m for m in modules)


def test_a_users_datamodule_is_preloaded_where_its_datasets_live() -> None:
    modules = preload({"_target_": "my_project.data.Module", "num_workers": 2}, "project.train")
    assert modules[-1] == "my_project.data"


def test_an_entry_modules_imports_are_modules_not_its_own_attributes() -> None:
    assert "project.engine.run.cli" in imports_of("project.eval")
    assert all(not m.startswith("__") or m == "__future__" for m in imports_of("project.eval"))


@pytest.mark.parametrize("method", ["forkserver", "fork", "spawn"])
def test_the_method_becomes_every_loaders_default(method: str, start_method: None) -> None:
    configure_worker_start(method, DATA, "project.train")  # num_workers=0: no server started
    assert multiprocessing.get_start_method() == method
    if method == "forkserver":
        assert "project.data.digits" in multiprocessing.forkserver._forkserver._preload_modules


def test_unset_means_forkserver(start_method: None) -> None:
    configure_worker_start(None, DATA, "project.train")
    assert multiprocessing.get_start_method() == "forkserver"


class Draws(Dataset):
    """Each item: a draw of numpy's and of random's global generators in the worker."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[float, float]:
        return float(np.random.rand()), random.random()


def worker_draws(rank: int) -> list[tuple[float, float]]:
    torch.manual_seed(0)  # what seed_everything does on every rank
    loader = plain_loader(Draws(), "val", batch_size=1, num_workers=2)
    loader.worker_init_fn = partial(seed_worker, rank=rank)  # as on that rank
    # fork, whatever start method an earlier test left in this process: a fork server started
    # elsewhere cannot import this test module to unpickle Draws (its workers exit at once)
    loader.multiprocessing_context = "fork"
    return [(float(a), float(b)) for a, b in loader]


def test_workers_draw_apart_per_worker_and_rank_and_alike_on_a_rerun() -> None:
    """Torch seeds each worker apart, but from a base the rank's generator draws, seeded alike
    on every rank: without the rank mixed in, worker w of every rank draws alike (checked:
    the last assert fails with seed_worker doing nothing)."""
    rank0, rank1 = worker_draws(0), worker_draws(1)
    assert rank0 == worker_draws(0)  # the same seed: the same draws
    assert len(set(rank0)) == 4  # batch 0 and 1 come from two workers, 2 and 3 again
    assert not set(rank0) & set(rank1)
