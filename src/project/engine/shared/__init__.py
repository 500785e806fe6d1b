"""What both trainers build from besides the data (project.engine.data): optimizer, metrics,
step statistics, throughput.

No Lightning here: the raw trainer imports these modules.
"""
