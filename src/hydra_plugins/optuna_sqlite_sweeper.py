"""Registers the Optuna sweeper (project.engine.cluster.sweeper) as hydra/sweeper=optuna_sqlite.

Hydra imports every module below `hydra_plugins` at start-up, so this stays light: Optuna
itself is imported only when a sweep starts.
"""

from hydra.core.config_store import ConfigStore

from project.engine.cluster.sweeper import OptunaSqliteSweeperConf, OptunaStudySweeper


class OptunaSqliteSweeper(OptunaStudySweeper):
    """Hydra runs sweepers whose classes are defined below hydra_plugins only."""


ConfigStore.instance().store(
    group="hydra/sweeper", name="optuna_sqlite", node=OptunaSqliteSweeperConf, provider="project"
)
