"""The stream's lane layout (project.data.lanes) as pure functions: the epoch's order is a
permutation of the rows, the same global batches on every world size dividing the lanes, each
rank reading only its part of the shards, a global batch mixing every lane, exact resume, and
a world size the lanes do not admit refused in one line."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from omegaconf import OmegaConf

from project.data.lanes import Layout, admitted, check_world, default_lanes
from project.data.stream import ShardedStream
from project.engine.data import elastic, sharding
from project.engine.data.loaders import plain_loader
from project.engine.data.sharding import set_epoch, shard_loader
from project.engine.errors import UserError

pytestmark = pytest.mark.quick


class Classes(ShardedStream):
    """Shards of `rows` rows; row i of shard s is the pair (s, i), of class s % 10."""

    def __init__(self, shards: int = 64, rows: int | list[int] = 50, **layout) -> None:
        lengths = [rows] * shards if isinstance(rows, int) else rows
        super().__init__(lengths, shuffle=True, **layout)

    def read(self, shard: int) -> list[tuple[int, int]]:
        return [(shard, i) for i in range(self.lengths[shard])]


def ranks(make, world: int, batch: int, epoch: int = 0, start: int = 0) -> list[list]:
    """Each rank's rows of one epoch (rank r of `world`, per-rank batch `batch`)."""
    out = []
    for rank in range(world):
        stream = make()
        stream.shard(world, rank, batch, seed=7, pad=True)
        stream.set_epoch(epoch)
        stream.skip(start)
        out.append(list(stream))
    return out


def global_batches(per_rank: list[list], batch: int) -> list[list]:
    """Optimizer step s of all ranks together: each rank's batch s, in rank order."""
    steps = len(per_rank[0]) // batch
    return [sorted(r for rank in per_rank for r in rank[s * batch : (s + 1) * batch])
            for s in range(steps)]  # fmt: skip


def test_an_epoch_is_every_row_once_in_a_new_order_each_epoch() -> None:
    rng = np.random.default_rng(0)
    for lanes, block in [(8, 4096), (8, 30), (6, 7), (1, 4096), (16, 1)]:
        lengths = rng.integers(1, 90, size=13).tolist()
        layout = Layout(lengths, 3, 1, lanes, block)
        shards, rows = layout.locate(np.arange(sum(lengths)))
        assert sorted(zip(shards.tolist(), rows.tolist(), strict=True)) == [
            (s, i) for s, n in enumerate(lengths) for i in range(n)
        ]
        again = Layout(lengths, 3, 2, lanes, block).locate(np.arange(sum(lengths)))
        assert not np.array_equal(again[0] * 1000 + again[1], shards * 1000 + rows)
    stored = Layout([3, 2], 3, 1, 8, 4096, shuffle=False).locate(np.arange(5))
    assert stored[0].tolist() == [0, 0, 0, 1, 1] and stored[1].tolist() == [0, 1, 2, 0, 1]


def test_the_same_global_batches_on_every_world_size_dividing_the_lanes() -> None:
    lengths = [50, 17, 80, 3, 64, 29, 51, 40, 12, 77, 60, 9]  # 492 rows
    whole = None
    for world in (1, 2, 4, 8):
        batch = 32 // world
        steps = global_batches(ranks(lambda: Classes(rows=lengths, lanes=8), world, batch), batch)
        whole = whole or steps
        assert steps == whole, world
    assert sum(map(len, whole)) == 15 * 32 and len({r for s in whole for r in s}) == 480


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("rows", ["even", "uneven"])
def test_a_rank_reads_about_its_share_of_the_shards(world: int, rows: str) -> None:
    """S >= 4W shards: at most 1.25 S/W + 2 distinct shards a rank (default lanes). The lanes
    balance rows: "uneven" shards are within 20 % of each other, the last one short, as a
    writer cutting shards of a size makes them."""
    rng = np.random.default_rng(world)
    for shards in (4 * world, 64, 200):
        lengths = [50] * shards if rows == "even" else rng.integers(40, 61, shards).tolist()
        lengths[-1] = 7 if rows == "uneven" else 50
        stream = Classes(shards, lengths)
        stream.shard(world, 0, 16, seed=1, pad=True)
        read = [len(stream.shards_of(r)) for r in range(world)]
        assert max(read) <= 1.25 * shards / world + 2, (shards, read)
        if world > 1:
            assert sum(read) <= 1.25 * shards + 2 * world  # shards read by two ranks are few


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_global_batch_draws_from_every_class(world: int) -> None:
    """64 one-class shards of 50 rows, 10 classes: >= 9 distinct classes per global batch of
    64 (the shard-major order gave ~2)."""
    batch = 64 // world
    steps = global_batches(ranks(Classes, world, batch), batch)
    distinct = [len({s % 10 for s, _ in step}) for step in steps]
    assert np.mean(distinct) >= 9, distinct
    for epoch in (1, 2):
        steps = global_batches(ranks(Classes, world, batch, epoch=epoch), batch)
        assert np.mean([len({s % 10 for s, _ in step}) for step in steps]) >= 9


def test_a_smaller_shuffle_block_mixes_fewer_shards() -> None:
    """The memory/mixing knob: a block of one shard's rows takes a batch from about one shard
    a lane (8 lanes: ~9 shards, 6 of the 10 classes); a block of a whole lane from ~42."""
    mixed = {}
    for block in (50, 100, 200, 400):
        steps = global_batches(ranks(lambda b=block: Classes(shuffle_block=b), 1, 64), 64)
        mixed[block] = np.mean([len({s for s, _ in step}) for step in steps])
    assert mixed[50] < 9.5 < mixed[100] < mixed[200] < mixed[400]


@pytest.mark.parametrize("world, start", [(1, 0), (1, 777), (2, 640), (4, 1001), (8, 3199)])
def test_a_resume_at_any_position_reads_the_rest_of_the_epoch(world: int, start: int) -> None:
    """Rank r resumed at global position p reads positions p+r, p+r+w, ... of the epoch's
    order, as one process reads it whole (training's padding wraps to its first rows)."""
    order = ranks(Classes, 1, 8)[0]
    resumed = ranks(Classes, world, 8, start=start)
    for rank in range(world):
        expected = [order[p % 3200] for p in range(start + rank, 3200 + world - 1, world)]
        assert resumed[rank] == expected[: len(resumed[rank])]
        assert len(resumed[rank]) == -(-(3200 - start) // world)


class CountedReads(Classes):
    """Classes that count `read` and `release` calls per shard (a read may decode a file)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reads, self.open = collections.Counter(), set()

    def read(self, shard: int) -> list[tuple[int, int]]:
        self.reads[shard] += 1
        self.open.add(shard)
        return super().read(shard)

    def release(self, shard: int) -> None:
        self.open.remove(shard)


@pytest.mark.parametrize("layout", [{}, {"lanes": 1, "shuffle_block": 1}])
def test_each_shard_is_read_once_an_epoch_and_let_go(layout: dict) -> None:
    """8 shards of 20,000 rows: a rank reads each of its shards once an epoch (it read some 40
    times: let go at the end of each chunk of positions), and lets each go after its last row."""
    stream = CountedReads(8, 20_000, **layout)
    stream.shard(2, 1, 64, seed=7, pad=True)
    rows = list(stream)
    assert len(rows) == 80_000 and set(stream.reads.values()) == {1}, stream.reads
    assert stream.open == set()


def test_a_world_size_the_lanes_do_not_admit_is_one_line() -> None:
    assert [default_lanes(w) for w in (1, 2, 3, 4, 5, 8, 12, 64)] == [8, 8, 9, 8, 10, 8, 12, 64]
    assert admitted(12) == [1, 2, 3, 4, 6, 12]
    check_world(12, 4, "data.lanes=12")
    check_world(1, 5, "data.lanes=1")  # one lane: the shard-major order, read by every rank
    with pytest.raises(UserError) as err:
        check_world(8, 3, "the checkpoint's data position")
    message = str(err.value)
    assert "\n" not in message and "run on 1, 2, 4, 8 process(es)" in message
    stream = Classes(lanes=6)
    with pytest.raises(UserError, match=r"data\.lanes=6.*run on 1, 2, 3, 6 process\(es\), or set "
                       r"data\.lanes to a multiple of 4"):  # fmt: skip
        stream.shard(4, 0, 8, seed=1, pad=True)


def test_the_shards_a_rank_reads_are_those_shards_of_names() -> None:
    """shards_of(rank, start): the shards the rank's iterator reads from `start`, in first-read
    order (what a node's cache fetches ahead)."""
    lengths = [50, 17, 80, 3, 64, 29, 51, 40, 12, 77, 60, 9]
    for world, start in [(1, 0), (2, 0), (4, 100), (2, 333)]:
        for rank in range(world):
            stream = Classes(rows=lengths)
            stream.shard(world, rank, 8, seed=4, pad=True)
            stream.skip(start)
            first_read = list(collections.OrderedDict.fromkeys(s for s, _ in stream))
            other = Classes(rows=lengths)
            other.shard(world, 0, 8, seed=4, pad=True)
            assert other.shards_of(rank, start) == first_read


def stream_loader(world: int, rank: int, lanes: int | None = None):
    plain = plain_loader(Classes(), "train", 64 // world, lanes=lanes)
    loader = shard_loader(plain, "train", world, rank, seed=7)
    set_epoch(loader, 0)
    return loader


def pairs(batch) -> list[tuple[int, int]]:
    """A collated batch of (shard, row) as a list of pairs."""
    return list(zip(batch[0].tolist(), batch[1].tolist(), strict=True))


def test_a_checkpoint_records_the_layout_and_a_resume_keeps_it() -> None:
    """Written on 2 processes (8 lanes by default), resumed on 4 (default 8) and on 1 with
    lanes of its own asked for: the checkpoint's lanes are used; on 3, or with another
    data.lanes in the command, one line before anything is built."""
    cfg = OmegaConf.create({"data": {"batch_size": 32, "lanes": None}, "trainer": {}})
    saved = elastic.record(stream_loader(2, 0), 0, 3, 2, 1, cfg, elastic.asked(cfg))
    assert (saved["lanes"], saved["blocks"]) == ([8], [4096])
    position = elastic.Position.of(saved)
    whole = [pairs(b) for b in stream_loader(1, 0)]
    for world in (1, 4):
        elastic.fit_layout(cfg, position, world, "last.ckpt")
        loaders = [stream_loader(world, r, lanes=None if world > 1 else 16) for r in range(world)]
        for loader in loaders:
            elastic.apply_layout(loader, position, world)
            assert elastic.resume(loader, position, 0, world) == 3  # global batches of 64
        rest = [[pairs(b) for b in loader] for loader in loaders]
        steps = [sorted(r for rank in rest for r in rank[s]) for s in range(len(rest[0]))]
        assert steps == [sorted(b) for b in whole[3:]]
    with pytest.raises(UserError, match=r"^resuming from last\.ckpt: .* 8 lanes and 3 processes"
                       r" do not divide them: run on 1, 2, 4, 8 process\(es\)$"):  # fmt: skip
        elastic.fit_layout(cfg, position, 3, "last.ckpt")
    cfg.data.lanes = 16
    with pytest.raises(UserError, match=r"^data\.lanes=16, and last\.ckpt was written with "
                       r"data\.lanes=8: .*drop the override"):  # fmt: skip
        elastic.fit_layout(cfg, position, 2, "last.ckpt")


def test_a_checkpoint_from_before_the_lanes_resumes_exactly_in_its_order(caplog) -> None:
    """Its streams were shard-major (1 lane, blocks of 1 row): the run keeps that order, so
    its epoch continues exactly, with one warning; its next checkpoints record it."""
    cfg = OmegaConf.create({"data": {"batch_size": 32}, "trainer": {}})
    old_run = stream_loader(2, 0)
    sharding.lay_out(old_run, 1, 1)
    whole = [pairs(b) for b in old_run]
    saved = elastic.record(old_run, 0, 3, 2, 1, cfg, elastic.asked(cfg))
    old = elastic.Position.of({k: v for k, v in saved.items() if k not in ("lanes", "blocks")})
    loader = stream_loader(2, 0)
    with caplog.at_level("WARNING"):
        elastic.apply_layout(loader, old, 2)
        assert elastic.resume(loader, old, 0, 2) == 3
    assert "keeps the shard-major order it was trained in" in caplog.text
    assert [pairs(b) for b in loader] == whole[3:]
    assert elastic.record(loader, 0, 4, 2, 1, cfg, elastic.asked(cfg))["lanes"] == [1]


def test_an_elastic_jobs_default_lanes_admit_every_world_size_it_may_take(monkeypatch) -> None:
    """NNODES=1:3 with 2 processes a node (project.launcher names 2, 4, 6): 12 lanes, not 8,
    which a third node joining (6 processes) would have met with a refusal mid-run."""
    assert default_lanes(2) == 8
    monkeypatch.setenv("PROJECT_WORLD_SIZES", "2,4,6")
    assert default_lanes(2) == default_lanes(6) == 12
    assert all(12 % w == 0 for w in (2, 4, 6))
