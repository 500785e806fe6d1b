"""Typed configs: a wrong type or range stops at compose time with one line; the JSON schemas
editors read come from the same dataclasses, are current, and accept every shipped config."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml

from project.engine.config.schema import SCHEMAS, write_schemas
from tests.helpers import CONFIG_DIR, ROOT, run_script

pytestmark = pytest.mark.quick  # the fast tier: `make test`

# JSON schema file -> the config files it describes.
FILES = {"train": ["train.yaml"], "trainer": ["trainer/*.yaml"], "data": ["data/*.yaml"],
         "optimizer": ["model/optimizer/*.yaml"]}  # fmt: skip


@pytest.mark.parametrize(
    ("script", "override", "line"),
    [
        ("train.py", "trainer.max_epochs=abc",
         "trainer.max_epochs='abc': expected an integer or null (>= -1)"),
        ("train.py", "data.batch_size=0", "data.batch_size=0: expected an integer or null (>= 1)"),
        ("train.py", "trainer.precision=15", "trainer.precision=15: expected one of '"),
        # feature:raw
        ("-m project.raw_train", "model.optimizer.lr=0",
         "model.optimizer.lr=0: expected a number or null (> 0)"),
        ("-m project.compare", "trainer.limit_val_batches=-2",
         "trainer.limit_val_batches=-2: expected an integer or a number or null (>= 0)"),
        # /feature:raw
    ],
)  # fmt: skip
def test_a_wrong_type_or_range_is_one_line(base_args, script, override, line) -> None:
    proc = run_script(script, [*base_args, override], timeout=60)
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {line}"), lines


def test_schema_files_are_current(tmp_path) -> None:
    """schema/*.json is what `make schema` writes from project.engine.config.schema now."""
    for path in write_schemas(tmp_path):
        committed = ROOT / "schema" / path.name
        assert committed.is_file(), f"{committed} is missing: run make schema"
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run make schema"


@pytest.mark.parametrize("name", [name for _, name in SCHEMAS.values()])
def test_every_config_file_validates_and_names_its_schema(name: str) -> None:
    schema = json.loads((ROOT / "schema" / f"{name}.json").read_text())
    paths = [p for pattern in FILES[name] for p in sorted(CONFIG_DIR.glob(pattern))]
    assert paths
    for path in paths:
        text = path.read_text()
        jsonschema.validate(yaml.safe_load(text) or {}, schema)  # raises on a mismatch
        depth = "../" * (len(path.relative_to(CONFIG_DIR).parts))
        assert f"# yaml-language-server: $schema={depth}schema/{name}.json" in text, path


def test_the_json_schema_refuses_what_the_check_refuses() -> None:
    schema = json.loads((ROOT / "schema" / "trainer.json").read_text())
    for bad in ({"max_epochs": "abc"}, {"precision": 15}, {"accumulate_grad_batches": 0}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    jsonschema.validate({"max_epochs": "${oc.env:EPOCHS}", "devices": [0, 1]}, schema)
