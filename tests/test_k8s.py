"""The Kubernetes recipes: the Trainer v2 TrainJob is valid for Trainer's own schema (vendored:
launch/k8s/trainjob.schema.json) and starts the very job the v1 PyTorchJob starts."""

from __future__ import annotations

import json
import re
import subprocess

import jsonschema
import pytest
import yaml

from tests.helpers import ROOT, child_env

pytestmark = pytest.mark.quick  # the fast tier: `make test`

K8S = ROOT / "launch" / "k8s"


def manifest(name: str) -> dict:
    return yaml.safe_load((K8S / name).read_text())


def trainjob_errors(doc: dict) -> list[str]:
    schema = json.loads((K8S / "trainjob.schema.json").read_text())
    return [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)]


def test_the_trainjob_validates_against_trainers_schema() -> None:
    assert trainjob_errors(manifest("trainjob.yaml")) == []


def test_the_schema_refuses_what_the_api_server_would_silently_drop() -> None:
    """A misspelt field is pruned without a word by the API server: the check refuses it."""
    doc = manifest("trainjob.yaml")
    doc["spec"]["trainer"]["numProcsPerNode"] = 8
    assert any("numProcsPerNode" in e for e in trainjob_errors(doc))
    doc = manifest("trainjob.yaml")
    doc["spec"]["trainer"]["numNodes"] = "2"
    assert trainjob_errors(doc)


def launch_command(script: str, **operator_env: str) -> str:
    """The command a pod's `bash -c` script starts (DRY_RUN: printed, not run), from the
    repo instead of the image's /workspace/project."""
    script = re.sub(r"cd /workspace/\S+", f"cd {ROOT}", script)
    proc = subprocess.run(["bash", "-c", script], env=child_env(DRY_RUN="1", **operator_env),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_the_trainjob_starts_what_the_pytorchjob_starts() -> None:
    """Node 1 of each: the same torchrun, overrides, image, GPUs, env and volumes, from the
    environment each operator gives its pods (v1: RANK, MASTER_*; v2: PET_*)."""
    v1, v2 = manifest("pytorchjob.yaml"), manifest("trainjob.yaml")
    pod = v1["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (container,) = pod["containers"]
    trainer = v2["spec"]["trainer"]
    addr, port = "127.0.0.1", "29400"
    old = launch_command(container["args"][0], RANK="1", MASTER_ADDR=addr, MASTER_PORT=port)
    new = launch_command(trainer["args"][0], PET_NNODES=str(trainer["numNodes"]),
                         PET_NPROC_PER_NODE=str(trainer["numProcPerNode"]), PET_NODE_RANK="1",
                         PET_MASTER_ADDR=addr, PET_MASTER_PORT=port)  # fmt: skip
    assert new == old and "--nnodes=2 --nproc-per-node=8" in new and "--node-rank=1" in new
    replicas = sum(spec["replicas"] for spec in v1["spec"]["pytorchReplicaSpecs"].values())
    assert trainer["numNodes"] == replicas
    assert trainer["image"] == container["image"] and trainer["env"] == container["env"]
    assert trainer["resourcesPerNode"] == container["resources"]
    (patch,) = v2["spec"]["runtimePatches"]
    (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    patched = job["template"]["spec"]["template"]["spec"]
    assert patched["volumes"] == pod["volumes"]
    assert patched["containers"][0]["volumeMounts"] == container["volumeMounts"]
