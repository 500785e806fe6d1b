"""A small FSDP2 training for the sharded-checkpoint tests, run under torchrun (gloo, CPU):
an MLP of a few blocks, `fully_shard` per block and at the root, AdamW, N steps, `last` saved
with ShardedLast every K steps (sync or async), resumed from it when one is published.

    torchrun --nproc-per-node=2 tests/fsdp_mlp.py --folder DIR --steps 8 --save-every 2 \
        [--exit-at 4] [--async] [--fail-at 6 --fail-rank 1 --fail-mode sigkill] [--out W.pt]

The global batch is 2 slots whatever the world size (rank r trains slots r, r+W, ...), so a
resume on 1 process trains on the same samples. --out: rank 0 writes the final full weights.
--bench save|load: the timings of docs/performance.md instead (medians of 3, printed by
rank 0; `load` reads what `save` left in --folder, on any world size).
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from project.engine.checkpoints.sharded import ShardedLast
from project.engine.checkpoints.state import rng_state, set_rng_state
from project.engine.distributed.exits import close_process_group

SLOTS = 2  # samples groups of one step, whatever the world size
ROWS = 4  # rows per slot


def build(width: int, layers: int, dropout: float) -> nn.Module:
    """The MLP, the same initial weights on every rank, sharded per block and at the root."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Dropout(dropout))
              for _ in range(layers)]  # fmt: skip
    model = nn.Sequential(*blocks)
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def batch(step: int, rank: int, world: int, width: int) -> torch.Tensor:
    """This rank's slots of `step`'s global batch: a pure function of the step."""
    rows = [torch.randn(ROWS, width, generator=torch.Generator().manual_seed(1000 * step + s))
            for s in range(rank, SLOTS, world)]  # fmt: skip
    return torch.cat(rows)


class Cut(ShardedLast):
    """ShardedLast whose rank `rank` dies (or fails) at step `at` while writing its own file,
    before DCP writes the shards: a save cut midway."""

    def __init__(self, *args, at: int, rank: int, mode: str) -> None:
        super().__init__(*args)
        self.at, self.cut_rank, self.mode = at, rank, mode

    def write_own(self, folder: str, per_rank: dict, step: int) -> None:
        if step == self.at and self.rank == self.cut_rank:
            if self.mode == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError("injected failure")
        super().write_own(folder, per_rank, step)


class Stale(ShardedLast):
    """ShardedLast whose rank `rank` sees no manifest (a stale view of a shared folder): the
    ranks must still act on one view, rank 0's."""

    def __init__(self, *args, rank: int) -> None:
        super().__init__(*args)
        self.stale_rank = rank

    def read_manifest(self) -> dict | None:
        return None if self.rank == self.stale_rank else super().read_manifest()


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args.width, args.layers, args.dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if args.fail_at:
        last = Cut(args.folder, "last", "test", at=args.fail_at, rank=args.fail_rank,
                   mode=args.fail_mode)  # fmt: skip
    elif args.stale_rank is not None:
        last = Stale(args.folder, "last", "test", rank=args.stale_rank)
    else:
        last = ShardedLast(args.folder, "last", "test")
    torch.manual_seed(100 + rank)  # dropout: each rank its own stream
    start = 0
    loaded = last.load(model, optimizer)
    if loaded is not None:
        start = loaded.common["step"]
        if loaded.own:
            set_rng_state(loaded.mine["rng"])
        else:  # another world size: the streams cannot continue, start new ones
            torch.manual_seed(100 + rank + 1000 * start)
        print(f"rank {rank}: resumed at step {start} saved by {loaded.world} (own {loaded.own})")
    for step in range(start + 1, args.steps + 1):
        x = batch(step, rank, world, args.width)
        loss = nn.functional.mse_loss(model(x), x.roll(1, dims=1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % args.save_every == 0:
            last.save(step, model, optimizer, {"step": step}, {"rng": rng_state()},
                      asynchronous=args.asynchronous)  # fmt: skip
        if step == args.exit_at:
            break
    last.wait()  # an async save still in flight: written and published (close only writes)
    last.close()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))  # fmt: skip
    if rank == 0 and args.out:
        torch.save(full, args.out)


def template(args: argparse.Namespace) -> None:
    """The template's own LightningModule (configs/, the default model), sharded at the root,
        one AdamW step (gradients of ones), saved as step 1 with what a Lightning checkpoint of the
    template carries (hyperparameters, the run's identity) in `common`:
        what consolidation must turn into a checkpoint train.py and eval.py take."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from project.engine.checkpoints.resume import training_identity
    from project.engine.checkpoints.state import project_state
    from project.engine.config.compose import CONFIG_DIR, register_resolvers, to_plain

    register_resolvers()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["paths.data_dir=.", "paths.output_dir=."])
    torch.manual_seed(0)
    module = instantiate(cfg.model)
    fully_shard(module)
    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    last = ShardedLast(args.folder, "last", "lightning")
    data = {k: v for k, v in to_plain(cfg.data).items() if not k.startswith("_")}
    common = {"hyper_parameters": dict(module.hparams), "datamodule_hyper_parameters": data,
              "project": project_state(training_identity(to_plain(cfg)))}  # fmt: skip
    last.save(1, module, optimizer, common, {})
    last.close()


def bench(args: argparse.Namespace) -> None:
    """Blocked seconds of a sync and an async save, and a load's seconds, medians of 3."""
    rank = dist.get_rank()
    model = build(args.width, args.layers, 0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    last = ShardedLast(args.folder, "last", "bench")
    if args.bench == "load":  # on whatever world size: the checkpoint a save run left
        times = []
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            last.load(model, optimizer)
            times.append(time.perf_counter() - start)
        if rank == 0:
            print(
                f"bench: load on {dist.get_world_size()} processes {statistics.median(times):.3f} s"
            )
        last.close()
        return
    x = batch(1, rank, dist.get_world_size(), args.width)
    nn.functional.mse_loss(model(x), x).backward()
    optimizer.step()
    params = sum(p.numel() for p in model.parameters())  # DTensors: their global sizes
    figures, publish = {}, []
    for mode in ("sync", "async"):
        times = []
        for i in range(3):
            dist.barrier()
            times.append(last.save(i + 1, model, optimizer, {"step": i + 1}, {"rng": rng_state()},
                                   asynchronous=mode == "async"))  # fmt: skip
            start = time.perf_counter()
            last.wait()  # the write's end and the publication (a trainer: at its next save)
            publish.append(time.perf_counter() - start) if mode == "async" else None
        figures[mode] = statistics.median(times)
    last.close()
    if rank == 0:
        print(
            f"bench: {params:,} parameters on {dist.get_world_size()} processes: "
            f"sync save blocked {figures['sync']:.3f} s, async save blocked "
            f"{figures['async']:.3f} s (then wait+publish {statistics.median(publish):.3f} s)"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True, help="a local folder or an fsspec URL")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--exit-at", type=int, default=0)
    parser.add_argument("--async", dest="asynchronous", action="store_true")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--fail-at", type=int, default=0)
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--fail-mode", choices=("sigkill", "exception"), default="sigkill")
    parser.add_argument("--stale-rank", type=int, help="this rank sees no manifest of its own")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--bench", choices=("save", "load"))
    parser.add_argument("--template", action="store_true", help="save the template's module")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        bench(args) if args.bench else template(args) if args.template else train(args)
    finally:
        gc.collect()  # the FSDP modules' cycles hold the group: gone before it is destroyed
        close_process_group()


if __name__ == "__main__":
    main()
