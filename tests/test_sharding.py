"""Every loader sharded across ranks: the template's, and a user's plain DataLoader."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

from project.engine.errors import UserError
from project.engine.shared import sharding
from project.engine.shared.sharding import EvalShardSampler, ResumableSampler, shard_loader
from tests.helpers import QUIET, finish, start, torchrun

DATA = TensorDataset(torch.arange(101))


def indices(loader: DataLoader) -> list[int]:
    return [int(i) for (batch,) in loader for i in batch]


@pytest.mark.quick
def test_a_plain_shuffled_loader_is_sharded_and_resumable() -> None:
    plain = DataLoader(DATA, batch_size=10, shuffle=True, drop_last=False)
    shards = [shard_loader(plain, "train", 2, r, seed=3) for r in (0, 1)]
    assert all(isinstance(s.sampler, ResumableSampler) for s in shards)
    seen = [indices(s) for s in shards]
    # DistributedSampler pads the train shards to equal length (one repeated sample here).
    assert set(seen[0]) | set(seen[1]) == set(range(101)) and len(seen[0]) == len(seen[1]) == 51
    assert shards[0].batch_size == 10 and seen[0] != sorted(seen[0])  # shuffled
    assert indices(shards[0]) == seen[0]  # the order is a function of (seed, epoch) only
    shards[0].sampler.skip_batches(2, 10)
    assert indices(shards[0]) == seen[0][20:]  # a mid-epoch resume continues where it was


@pytest.mark.quick
@pytest.mark.parametrize("world", [1, 2, 3])
def test_evaluation_counts_every_sample_once(world: int) -> None:
    plain = DataLoader(DATA, batch_size=8)
    seen = collections.Counter()
    for rank in range(world):
        shard = shard_loader(plain, "val", world, rank, seed=0)
        assert isinstance(shard.sampler, EvalShardSampler)
        seen.update(indices(shard))
    assert seen == collections.Counter(range(101))


@pytest.mark.quick
def test_a_padded_distributed_sampler_for_validation_is_replaced() -> None:
    from torch.utils.data import DistributedSampler

    padded = DataLoader(DATA, batch_size=8, sampler=DistributedSampler(DATA, 2, 0, shuffle=False))
    assert isinstance(shard_loader(padded, "test", 2, 0, 0).sampler, EvalShardSampler)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


@pytest.mark.quick
@pytest.mark.parametrize(
    "loader, what",
    [
        (DataLoader(Stream(), batch_size=2), "IterableDataset"),
        (DataLoader(DATA, sampler=WeightedRandomSampler([1.0] * 101, 101)), "custom sampler"),
    ],
)
def test_what_cannot_be_sharded_stops_a_multi_process_run(
    loader, what, caplog, monkeypatch
) -> None:
    monkeypatch.setattr(sharding, "_warned", set())  # the warning is once per process
    with pytest.raises(UserError, match=f"cannot be sharded across the 2 processes.*{what}"):
        shard_loader(loader, "train", 2, 0, 0)
    assert shard_loader(loader, "train", 1, 0, 0) is loader  # one process: used as it is
    assert "not exact" in caplog.text  # ... with one warning about mid-epoch resume


@pytest.mark.distributed
def test_a_user_datamodule_is_sharded_under_ddp(tmp_path: Path, base_args) -> None:
    """A LightningDataModule returning DataLoader(dataset, shuffle=True), as Lightning's docs
    write it, under 2-process torchrun: the ranks split the train set and every validation
    sample is counted once."""
    (tmp_path / "configs" / "data").mkdir(parents=True)
    (tmp_path / "configs" / "data" / "user.yaml").write_text(
        f"_target_: tests.user_data.PlainDataModule\nrecord_dir: {tmp_path}\n"
    )
    cmd = [*torchrun(["-m", "project.train"]), *base_args, "data=user",
           f"hydra.searchpath=[file://{tmp_path}/configs]",
           "trainer.max_epochs=1", "trainer.num_sanity_val_steps=0", "test=false",
           f"hydra.run.dir={tmp_path}/run", *QUIET]  # fmt: skip
    code, out = finish(start(cmd), timeout=180)
    assert code == 0, out[-3000:]
    reads = {r: (tmp_path / f"reads-rank{r}.txt").read_text().split("\n") for r in (0, 1)}
    train = [{int(x.split()[1]) for x in reads[r] if x.startswith("train")} for r in (0, 1)]
    assert train[0] | train[1] == set(range(400)) and not train[0] & train[1]
    val = collections.Counter(x for r in (0, 1) for x in reads[r] if x.startswith("val"))
    assert len(val) == 101 and set(val.values()) == {1}
