"""Your datasets: plain PyTorch, selected by the `data.dataset` config (`_target_`).

Each is a `project.data.source.DataSource`: `prepare()` (once per node) and
`dataset(split)` (every rank). Data in shards streams through `stream.ShardedStream`
(`shards.py`: the on-disk format `python -m project.data.prepare` writes; `remote/`: the
node's cache of a remote folder's shards). Batching,
sharding across ranks and resumable order are the machinery's job
(project.engine.data.sharding), the same for both trainers.
"""
