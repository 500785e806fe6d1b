"""A Hydra sweeper that runs an Optuna study stored in SQLite and survives being killed.

    python train.py -m hparams_search=optuna          # pip install -e ".[sweep]"
    RUN_ID=lr-search python train.py -m hparams_search=optuna   # killed? the same command again

The study lives in `<sweep dir>/optuna.db` (or `hydra.sweeper.storage`), so running the same
command again (same RUN_ID, hence the same sweep folder) continues it: finished trials are
not repeated and the study stops when `n_trials` trials have ended (a trial that raised counts
as ended, FAIL, and is not retried). A trial that was running when
the sweep died is marked FAIL and its parameters run again as the next trial, in the dead
trial's own job folder: the training resumes there from its last checkpoint (auto_resume).
Trials run one after another, each through Hydra's launcher (a multi-device trial is its own
torchrun job, see project.train). Hydra finds the class through src/hydra_plugins/.

Search spaces use Hydra's sweep syntax: `choice(32, 64)`, `range(1, 4)`, `interval(0.1, 1)`,
`tag(log, interval(1e-4, 1e-2))`.
"""

from __future__ import annotations

import logging
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from project.engine.errors import UserError

log = logging.getLogger(__name__)

DIRECTIONS = {"min": "minimize", "max": "maximize", "minimize": "minimize", "maximize": "maximize"}
FOLDER = "job_folder"  # trial user attribute: the job number (folder) the trial trained in


@dataclass
class OptunaSqliteSweeperConf:
    """hydra/sweeper=optuna_sqlite: its keys (a misspelt one is refused by Hydra)."""

    # Hydra instantiates sweepers from the hydra_plugins package only (it re-exports this one).
    _target_: str = "hydra_plugins.optuna_sqlite_sweeper.OptunaSqliteSweeper"
    study_name: str = "sweep"
    storage: str | None = None  # null: sqlite:///<sweep dir>/optuna.db
    direction: str = "minimize"  # minimize | maximize (min | max)
    n_trials: int = 10  # trials that end (finish, or fail with an error) before it stops
    seed: int = 42  # the TPE sampler's seed
    params: dict[str, str] = field(default_factory=dict)  # key: Hydra sweep syntax


def distribution(override: Override) -> Any:
    """The Optuna distribution of one `key=choice(...)|range(...)|interval(...)` override."""
    import optuna.distributions as d

    value = override.value()
    if isinstance(value, ChoiceSweep):
        return d.CategoricalDistribution(list(value.list))
    if isinstance(value, RangeSweep):
        if all(isinstance(v, int) for v in (value.start, value.stop, value.step)):
            return d.IntDistribution(value.start, value.stop - 1, step=value.step)
        return d.FloatDistribution(value.start, value.stop, step=value.step)
    if isinstance(value, IntervalSweep):
        log_scale = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return d.IntDistribution(value.start, value.end, log=log_scale)
        return d.FloatDistribution(value.start, value.end, log=log_scale)
    raise UserError(
        f"hydra.sweeper.params.{override.input_line}: use choice(...), range(...) or "
        "interval(...) (tag(log, interval(...)) for a log scale)"
    )


def check_storage(storage: str) -> None:
    """An existing SQLite file must be an SQLite database: never touched otherwise."""
    path = Path(storage.removeprefix("sqlite:///"))
    if not storage.startswith("sqlite:///") or not path.exists():
        return
    with path.open("rb") as f:
        if f.read(16) != b"SQLite format 3\x00":
            raise UserError(
                f"{path} is not an SQLite database: it is left as it is; move it away or use "
                "another RUN_ID (another sweep folder)"
            )


class OptunaStudySweeper(Sweeper):
    def __init__(self, study_name: str, storage: str | None, direction: str, n_trials: int,
                 seed: int, params: dict[str, str]) -> None:  # fmt: skip
        if direction not in DIRECTIONS:
            raise UserError(f"hydra.sweeper.direction={direction}: use minimize or maximize")
        if n_trials < 1:
            raise UserError(f"hydra.sweeper.n_trials={n_trials}: must be >= 1")
        self.study_name, self.storage, self.seed = study_name, storage, seed
        self.n_trials = n_trials
        self.direction = DIRECTIONS[direction]
        self.params = dict(params or {})

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:  # fmt: skip
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )
        self.sweep_dir = Path(config.hydra.sweep.dir)

    def search_space(self) -> dict[str, Any]:
        parser = OverridesParser.create()
        space = {}
        for key, text in self.params.items():
            if OmegaConf.select(self.config, key, default=KeyError) is KeyError:
                raise UserError(
                    f"hydra.sweeper.params.{key}: the config has no key {key} to sweep "
                    "(check the spelling; `python train.py --cfg job` shows the keys)"
                )
            override = parser.parse_override(f"{key}={text}")
            space[key] = distribution(override)
        return space

    def sweep(self, arguments: list[str]) -> None:
        import optuna

        space = self.search_space()  # bad parameters: one line before any study is touched
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        storage = self.storage or f"sqlite:///{self.sweep_dir / 'optuna.db'}"
        check_storage(storage)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        try:
            study = optuna.create_study(
                study_name=self.study_name, storage=storage, direction=self.direction,
                sampler=optuna.samplers.TPESampler(seed=self.seed), load_if_exists=True,
            )  # fmt: skip
        except (sqlite3.DatabaseError, optuna.exceptions.StorageInternalError) as err:
            raise UserError(f"{storage} cannot be used as an Optuna study ({err})") from None
        retry = self.fail_interrupted(study)
        while (done := ended(study) - len(retry)) < self.n_trials:  # retries: not ended
            if retry:
                params, folder = retry.pop(0)
                study.enqueue_trial(params)
            else:
                folder = len(study.trials)  # a new folder per new trial
            trial = study.ask(space)
            trial.set_user_attr(FOLDER, folder)
            log.info(f"Trial {trial.number} ({done + 1}/{self.n_trials}): {trial.params}")
            overrides = [*arguments, *(f"{k}={v}" for k, v in trial.params.items())]
            ret = self.launcher.launch([overrides], initial_job_idx=folder)[0]
            value = ret.return_value if ret.status.name == "COMPLETED" else None
            if isinstance(value, (int, float)):
                study.tell(trial, float(value))
            else:  # it raised, or returned no optimized_metric: it counts, and is not retried
                log.warning(f"Trial {trial.number} failed: {ret.status.name}, value {value!r}")
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
        self.report(study)

    def fail_interrupted(self, study: Any) -> list[tuple[dict[str, Any], int]]:
        """Trials a killed sweep left RUNNING: marked FAIL; (params, folder) to run again."""
        from optuna.trial import TrialState

        again = []
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            study.tell(t.number, state=TrialState.FAIL)
            again.append((t.params, t.user_attrs.get(FOLDER, t.number)))
            log.info(f"Trial {t.number} was running when the sweep stopped: it runs again")
        return again

    def report(self, study: Any) -> None:
        from optuna.trial import TrialState

        if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            log.warning("No trial finished with a value: no best trial")
            return
        best = study.best_trial
        results = {"best_value": best.value, "best_params": best.params, "best_trial": best.number,
                   "ended_trials": ended(study), "storage": str(self.sweep_dir)}  # fmt: skip
        OmegaConf.save(OmegaConf.create(results), self.sweep_dir / "optimization_results.yaml")
        log.info(
            f"Best trial {best.number} (folder {best.user_attrs.get(FOLDER)}): "
            f"{best.value:.6g} with {best.params}"
        )


def ended(study: Any) -> int:
    """Trials that count towards n_trials: finished or failed, but not one a killed sweep
    interrupted and a later trial ran again in the same folder."""
    from optuna.trial import TrialState

    def folder(t: Any) -> int:
        return t.user_attrs.get(FOLDER, t.number)

    last = {folder(t): t.number for t in study.trials}  # trials come in number order
    states = (TrialState.COMPLETE, TrialState.FAIL)
    return sum(t.state in states and last[folder(t)] == t.number for t in study.trials)
