"""One run from start to end, for both trainers: preflight, dispatch, stop, results, CLI."""
