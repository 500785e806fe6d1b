"""Write launch/k8s/trainjob.schema.json from Kubeflow Trainer's TrainJob CRD, for the offline
check of launch/k8s/trainjob.yaml (tests/test_k8s.py):

    python launch/k8s/vendor_schema.py trainer.kubeflow.org_trainjobs.yaml v2.2.1 COMMIT

The CRD is `CRD` below, from github.com/kubeflow/trainer at the given tag. Kept: the
openAPIV3Schema of TrainJob's spec, less `initializer` (the recipe downloads nothing), the
descriptions and Kubernetes' own `x-kubernetes-*` keywords (CEL rules, list types: a JSON
schema validator ignores them). Added: `additionalProperties: false` on every object with
fixed fields, because the API server silently prunes an unknown (misspelt) field where this
check should refuse it, and the apiVersion and kind the manifest must name.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

OUT = Path(__file__).with_name("trainjob.schema.json")
CRD = "manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml"  # in kubeflow/trainer
DROPPED = ("initializer",)


def closed(node: Any) -> Any:
    """`node` without descriptions, every object with `properties` closed to other keys."""
    if isinstance(node, list):
        return [closed(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: closed(v) for k, v in node.items() if k != "description" and not k.startswith("x-")}
    if "properties" in out and not node.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


def trainjob_schema(crd: dict[str, Any], tag: str, commit: str) -> dict[str, Any]:
    """The JSON schema of a TrainJob manifest, from the CRD document `crd`."""
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage", True)]
    group = crd["spec"]["group"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"] = {k: v for k, v in spec["properties"].items() if k not in DROPPED}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": (
            f"github.com/kubeflow/trainer {tag} ({commit}): {CRD}, openAPIV3Schema of spec; "
            f"written by launch/k8s/vendor_schema.py (no descriptions, no "
            f"{', '.join(DROPPED)}, objects closed)"
        ),
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": f"{group}/{version['name']}"},
            "kind": {"const": crd["spec"]["names"]["kind"]},
            "metadata": {"type": "object"},
            "spec": closed(spec),
        },
    }


if __name__ == "__main__":
    crd_path, tag, commit = sys.argv[1:4]
    schema = trainjob_schema(yaml.safe_load(Path(crd_path).read_text()), tag, commit)
    OUT.write_text(json.dumps(schema, indent=1) + "\n")
    print(OUT)
