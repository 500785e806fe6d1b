"""Your tasks: what a training step computes (loss) and what is measured (metrics), in plain
PyTorch, selected by the `model.task` config (`_target_`). See project.tasks.task.Task.
"""
