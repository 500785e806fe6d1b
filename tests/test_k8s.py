"""The Kubernetes recipes: the Trainer v2 TrainJobs are valid for Trainer's own schema
(vendored: launch/k8s/trainjob.schema.json) and start the very job their v1 PyTorchJob starts;
the object-storage variants need no shared volume and take their keys from a Secret."""

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


PAIRS = [("pytorchjob.yaml", "trainjob.yaml"),
         ("pytorchjob-object-storage.yaml", "trainjob-object-storage.yaml")]  # fmt: skip


@pytest.mark.parametrize("name", ["trainjob.yaml", "trainjob-object-storage.yaml"])
def test_the_trainjob_validates_against_trainers_schema(name: str) -> None:
    assert trainjob_errors(manifest(name)) == []


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


def node_commands(v1_name: str, v2_name: str) -> tuple[str, str]:
    """The command node 1 of each recipe starts, from the environment each operator gives its
    pods (v1: RANK, MASTER_*; v2: PET_*)."""
    v1, v2 = manifest(v1_name), manifest(v2_name)
    (container,) = v1["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    trainer = v2["spec"]["trainer"]
    addr, port = "127.0.0.1", "29400"
    old = launch_command(container["args"][0], RANK="1", MASTER_ADDR=addr, MASTER_PORT=port)
    new = launch_command(trainer["args"][0], PET_NNODES=str(trainer["numNodes"]),
                         PET_NPROC_PER_NODE=str(trainer["numProcPerNode"]), PET_NODE_RANK="1",
                         PET_MASTER_ADDR=addr, PET_MASTER_PORT=port)  # fmt: skip
    return old, new


@pytest.mark.parametrize("v1_name, v2_name", PAIRS)
def test_the_trainjob_starts_what_the_pytorchjob_starts(v1_name: str, v2_name: str) -> None:
    """Node 1 of each: the same torchrun, overrides, image, GPUs, env and volumes."""
    v1, v2 = manifest(v1_name), manifest(v2_name)
    pod = v1["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (container,) = pod["containers"]
    trainer = v2["spec"]["trainer"]
    old, new = node_commands(v1_name, v2_name)
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


def walk(node: object) -> list[dict]:
    """Every mapping inside a manifest."""
    if isinstance(node, dict):
        return [node, *(m for v in node.values() for m in walk(v))]
    if isinstance(node, list):
        return [m for v in node for m in walk(v)]
    return []


@pytest.mark.parametrize("v1_name, v2_name", PAIRS[1:])
def test_the_object_storage_recipes_need_no_shared_volume(v1_name: str, v2_name: str) -> None:
    """The base recipes' job, with the checkpoints at a URL and the run folders on each pod's
    own disk: no PersistentVolumeClaim (a ReadWriteMany volume), the keys from a Secret
    (never a literal value), the endpoint optional (AWS itself without it)."""
    base, _ = node_commands(*PAIRS[0])
    old, _ = node_commands(v1_name, v2_name)
    job = manifest(v1_name)["metadata"]["name"]  # project-train, renamed in a generated copy
    prefix = job.removesuffix("-train")
    url = f"s3://{prefix}-checkpoints/k8s-{job}"
    local = f"paths.log_dir=/scratch/logs callbacks.fault_tolerance.dirpath={url}"
    assert old == base.replace("paths.log_dir=/shared/logs", local)
    for name in (v1_name, v2_name):
        doc = manifest(name)
        assert not [m for m in walk(doc) if "persistentVolumeClaim" in m], name
        env = [m for m in walk(doc) if str(m.get("name", "")).startswith("AWS_")]
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env}
        assert all("value" not in e for e in env) and set(refs) == {
            "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"
        }, name  # fmt: skip
        assert {r["name"] for r in refs.values()} == {f"{prefix}-object-storage"}
        optional = [k for k, r in refs.items() if r.get("optional")]
        assert optional == ["AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"]
        assert all(r["key"] == k for k, r in refs.items())


def test_the_pytorchjob_env_is_valid_kubernetes_env() -> None:
    """The v1 recipe has no vendored schema of its own: its env (the Secret references) is
    checked against the core EnvVar schema Trainer's CRD embeds, which refuses a misspelt
    field (e.g. `secretKeyRefs`)."""
    schema = json.loads((K8S / "trainjob.schema.json").read_text())
    env_schema = schema["properties"]["spec"]["properties"]["trainer"]["properties"]["env"]
    pod = manifest("pytorchjob-object-storage.yaml")["spec"]["pytorchReplicaSpecs"]["Worker"]
    (container,) = pod["template"]["spec"]["containers"]
    validator = jsonschema.Draft202012Validator(env_schema)
    assert [e.message for e in validator.iter_errors(container["env"])] == []
    wrong = json.loads(json.dumps(container["env"]).replace("secretKeyRef", "secretKeyRefs"))
    assert list(validator.iter_errors(wrong))
