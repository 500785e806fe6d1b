"""What both trainers build from: loaders and sharding, optimizer, metrics, step statistics.

No Lightning here: the raw trainer imports these modules.
"""
