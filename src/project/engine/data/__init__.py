"""The machinery around your data, for both trainers: the plain loaders (`loaders.py`), how
every loader is split across ranks and resumed (`sharding.py`, `samplers.py`), what a run keeps
when its world size changes (`elastic.py`), and how DataLoader workers start
(`worker_start.py`)."""
