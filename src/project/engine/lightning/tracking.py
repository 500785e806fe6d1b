"""MLflow tracking with one tracked run per training run (`logger=mlflow`).

Lightning's MLFlowLogger starts a new MLflow run at every start of the script, so a run that
resumes (a torchrun restart, a requeued SLURM job, the same RUN_ID again) would be split over
several MLflow runs. Here the run folder keeps the id of its MLflow run (`mlflow_run_id`), and
every attempt logs into that run; a new run folder (or one deleted and made again) gets a new
MLflow run. Lightning calls loggers on rank 0 only, so under DDP there is one writer. A
tracking server that does not answer stops the run at start-up with one line instead of
minutes of HTTP retries.
"""

from __future__ import annotations

import importlib.util
import logging
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from project.engine.errors import UserError
from project.engine.private_api import flat_params

log = logging.getLogger(__name__)

RUN_DIR_TAG = "run_dir"  # shown in the MLflow UI: which run folder a tracked run belongs to
RUN_ID_FILE = "mlflow_run_id"  # in the run folder: the MLflow run its attempts log into
SQLITE = "sqlite:///"
NO_STORE = "http://rank-zero-only.invalid"  # never contacted: its client is never used


def check_reachable(tracking_uri: str, timeout_s: float = 5.0) -> None:
    """An http(s) tracking server must answer (any HTTP status counts as an answer)."""
    if tracking_uri == NO_STORE or not tracking_uri.startswith(("http://", "https://")):
        return
    try:
        urllib.request.urlopen(f"{tracking_uri.rstrip('/')}/health", timeout=timeout_s)
    except urllib.error.HTTPError:
        return  # it answered
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise UserError(
            f"the MLflow tracking server {tracking_uri} cannot be reached ({reason}): start it, "
            "or unset MLFLOW_TRACKING_URI to track into logs/mlflow"
        ) from None


class MLflowRun(MLFlowLogger):
    """MLFlowLogger whose MLflow run is the run folder's: found again on every attempt."""

    def __init__(self, run_dir: str, tracking_uri: str, **kwargs: Any) -> None:
        needs = ["mlflow", *(["sqlalchemy", "alembic"] if tracking_uri.startswith(SQLITE) else [])]
        if missing := [m for m in needs if importlib.util.find_spec(m) is None]:
            raise UserError(f"logger=mlflow needs {', '.join(missing)}: pip install -e '.[track]'")
        if rank_zero_only.rank != 0:
            # Ranks > 0 never log, but Lightning makes a client of the store on every rank,
            # and a client of a new SQLite store creates its tables: racing rank 0's.
            tracking_uri = NO_STORE
        check_reachable(tracking_uri)
        if tracking_uri.startswith(SQLITE):  # SQLite creates the file, not its folder
            Path(tracking_uri.removeprefix(SQLITE)).parent.mkdir(parents=True, exist_ok=True)
        tags = {**(kwargs.pop("tags", None) or {}), RUN_DIR_TAG: run_dir}
        super().__init__(tracking_uri=tracking_uri, tags=tags, **kwargs)
        self.run_dir = run_dir

    @property
    def experiment(self) -> Any:
        first_use = rank_zero_only.rank == 0 and not self._initialized
        if first_use and self._run_id is None:
            self._run_id = self.earlier_run_id()
        experiment = super().experiment
        if first_use:  # the run folder remembers its MLflow run for the next attempt
            Path(self.run_dir).mkdir(parents=True, exist_ok=True)
            (Path(self.run_dir) / RUN_ID_FILE).write_text(self._run_id)
        return experiment

    def earlier_run_id(self) -> str | None:
        """The MLflow run an earlier attempt in this run folder made: its id is kept in the
        folder, so a folder deleted and made again (same path, a new training) starts a new
        MLflow run instead of appending to the old one."""
        kept = Path(self.run_dir) / RUN_ID_FILE
        if not kept.is_file():
            return None
        run_id = kept.read_text().strip()
        try:
            return self._mlflow_client.get_run(run_id).info.run_id
        except Exception:  # that run is gone from the store (a new store, a deleted run)
            log.warning(f"MLflow run {run_id} of {kept} is gone: a new run")
            return None

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        """Into an earlier attempt's run: only keys it lacks (MLflow parameters cannot change;
        a key whose value differs now keeps the first attempt's value, and says so)."""
        flat = flat_params(params)
        earlier = self.experiment.get_run(self.run_id).data.params
        changed = sorted(k for k, v in flat.items() if k in earlier and earlier[k] != str(v)[:250])
        if changed:
            log.warning(f"MLflow run {self.run_id} keeps its first values of {', '.join(changed)}")
        super().log_hyperparams({k: v for k, v in flat.items() if k not in earlier})
