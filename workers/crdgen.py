"""Generate the CRD manifests in deploy/crds/ and in the Helm chart's crds/ from the pydantic
models in tgp.crds.

    python -m workers.crdgen            # rewrite deploy/crds/*.yaml and deploy/helm/tgp/crds/*.yaml
    python -m workers.crdgen --check    # exit 1 when a committed file is stale

Pydantic's JSON Schema is turned into a Kubernetes structural schema: $refs inlined, titles
and `additionalProperties: false` dropped, `X | None` as `nullable: true`, constants as one-value enums,
defaults written the way the model serializes them (a duration as `10m`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pydantic_core
import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from tgp.crds import (
    GROUP,
    POOL_NAME_MESSAGE,
    POOL_NAME_RULE,
    VERSION,
    GPUNodeClassSpec,
    GPUNodeClassStatus,
    GPUNodePoolSpec,
    GPUNodePoolStatus,
)

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
OUT_DIR = DEPLOY / "crds"
# Helm installs what a chart's crds/ holds before its templates, and reads only files inside
# the chart: a copy, written from the same models, which --check keeps equal.
CHART_CRDS_DIR = DEPLOY / "helm" / "tgp" / "crds"


class _SerializedDefaults(GenerateJsonSchema):
    """Input (validation-mode) schema whose defaults are written by the field's own serializer.

    Plain pydantic encodes a `timedelta` default as ISO 8601 (`PT10M`) next to a pattern that
    wants `10m`; the API server validates every default against its field's schema and refuses
    the whole CRD when one does not match.
    """

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        json_schema = super().default_schema(schema)
        if "default" in json_schema:
            serializer = pydantic_core.SchemaSerializer(schema["schema"])
            default = serializer.to_python(self.get_default_value(schema), mode="json", by_alias=self.by_alias)
            json_schema["default"] = _without_nulls(default)
        return json_schema


def _without_nulls(value: Any) -> Any:
    """A default without its unset fields: a null in a default is refused where the field is not
    nullable (a budget's `schedule`), and means the same as an absent field where it is."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's schema (by camelCase alias), in the subset Kubernetes accepts."""
    raw = model.model_json_schema(by_alias=True, mode="validation", schema_generator=_SerializedDefaults)
    defs = raw.pop("$defs", {})
    return _clean(raw, defs)


def _clean(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_clean(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _clean(merged, defs)
    any_of = node.get("anyOf")
    if any_of is not None:
        options = [o for o in any_of if o.get("type") != "null"]
        if len(options) == 1:
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            cleaned = _clean({**options[0], **rest}, defs)
            if len(options) < len(any_of):
                cleaned["nullable"] = True
            return cleaned
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "title":
            continue
        if key == "default" and value is None:
            continue
        if key == "additionalProperties" and value is False:
            continue  # not allowed in structural schemas; the API server prunes unknown fields
        if key == "const":
            out["enum"] = [value]
            continue
        if key == "properties":
            out[key] = {name: _clean(prop, defs) for name, prop in value.items()}
            continue
        out[key] = _clean(value, defs)
    if "enum" in out and "type" not in out and all(isinstance(v, str) for v in out["enum"]):
        out["type"] = "string"
    return out


def crd(
    *,
    kind: str,
    plural: str,
    short_names: list[str],
    scope: str,
    spec: type[BaseModel],
    status: type[BaseModel],
    description: str,
    columns: list[dict[str, Any]],
    rules: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """One CustomResourceDefinition with spec, status subresource and printer columns; `rules`
    are CEL rules on the whole object (its metadata.name, say)."""
    root = {
        "type": "object",
        "description": description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": structural_schema(spec),
            "status": structural_schema(status),
        },
        **({"x-kubernetes-validations": rules} if rules else {}),
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": short_names,
                "categories": ["tgp"],
            },
            "scope": scope,
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": columns,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def _ready_column() -> dict[str, Any]:
    return {"name": "Status", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'}


def manifests() -> dict[str, dict[str, Any]]:
    """File name -> CRD manifest."""
    age = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
    return {
        f"gpunodeclasses.{GROUP}.yaml": crd(
            kind="GPUNodeClass",
            plural="gpunodeclasses",
            short_names=["gnc"],
            scope="Cluster",
            spec=GPUNodeClassSpec,
            status=GPUNodeClassStatus,
            description="Infrastructure template for GPU nodes: providers and credentials, boot config, tailnet, and the budget shared by every pool that uses it.",
            columns=[
                _ready_column(),
                {"name": "Nodes", "type": "integer", "jsonPath": ".status.nodes"},
                {"name": "$/h", "type": "string", "jsonPath": ".status.hourlyCost"},
                age,
            ],
        ),
        f"gpunodepools.{GROUP}.yaml": crd(
            kind="GPUNodePool",
            plural="gpunodepools",
            short_names=["gnp"],
            scope="Namespaced",
            spec=GPUNodePoolSpec,
            status=GPUNodePoolStatus,
            description="A request for GPU nodes: which GPUs, how many, at what price, with which labels and taints.",
            rules=[{"rule": POOL_NAME_RULE, "message": POOL_NAME_MESSAGE}],
            columns=[
                {"name": "Ready", "type": "integer", "jsonPath": ".status.readyNodes"},
                {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredNodes"},
                {"name": "$/h", "type": "string", "jsonPath": ".status.hourlyCost"},
                {"name": "Disrupting", "type": "integer", "jsonPath": ".status.disrupting"},
                _ready_column(),
                age,
                # -o wide: US$/h consolidation found it could save now (docs/lifecycle.md "Disruption").
                {"name": "Savings", "type": "string", "jsonPath": ".status.consolidation.savingsFoundHourly", "priority": 1},
            ],
        ),
    }


def render(manifest: dict[str, Any]) -> str:
    header = "# Generated by `python -m workers.crdgen` from tgp/crds/. Do not edit by hand.\n"
    return header + yaml.safe_dump(manifest, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if deploy/crds or the chart's crds/ is not up to date")
    args = parser.parse_args(argv)
    stale = []
    for name, manifest in manifests().items():
        text = render(manifest)
        for folder in (OUT_DIR, CHART_CRDS_DIR):
            path = folder / name
            if args.check:
                if not path.exists() or path.read_text() != text:
                    stale.append(str(path.relative_to(DEPLOY.parent)))
            else:
                folder.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    if stale:
        print(f"stale CRDs: {', '.join(stale)}; run `make crds`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
