"""The Lightning adapters (a task in Lightning's loop, a data source as batches) and callbacks."""
