"""CustomResourceDefinitions and their structural schemas in the embedded Kubernetes API
(`sim.kube`), as k8s.io/apiextensions-apiserver applies them:

* a write of a custom resource is pruned (fields the schema does not declare go, unless
  `x-kubernetes-preserve-unknown-fields`), nulls the schema does not allow are dropped,
  defaults applied, then validated (types, int-or-string, enum, lengths, patterns with Go's RE2
  meaning of `$`, bounds, items, required and counted properties), 422 naming every field
  (`CustomVersion.shape`, `CustomVersion.validate`); `prune` and `removed_fields` also tell
  `fieldValidation` which fields a write would lose;
* a custom resource's name must be a DNS subdomain (`name_errors`), its apiVersion and kind
  those of its URL (`check_type_meta`);
* a CRD itself is checked (group, names, scope, exactly one storage version, an object schema
  at the root) and every `default` in it must be valid against its own field's schema, or the
  CRD is refused with 422 (`check_crd`); a stored CRD gets its defaults and the status its
  controllers set (`default_crd`).

CEL rules (`x-kubernetes-validations`) are evaluated in the subset sim/kube_cel.py knows
(the rules tgp's CRDs use); others are not. Pure functions and values: where CRDs
are registered, stored and served is kube_store's.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from typing import Any

import attrs
import kmock

from sim.kube_cel import Unsupported, compile_rule, go_regexp
from tgp.labels import label_value_problems, qualified_name_problems
from sim.kube_machinery import ApiStatus, FieldError, Obj, api_version, go_number, go_value, invalid, now_time


@attrs.frozen
class CustomVersion:
    """One served version of a CRD: its schema and subresources."""

    schema: Mapping[str, Any]
    subresources: frozenset[str]
    selectable_fields: frozenset[str]
    printer_columns: tuple[Mapping[str, Any], ...] = ()  # additionalPrinterColumns, for Tables

    @classmethod
    def from_crd(cls, version: Mapping[str, Any]) -> CustomVersion:
        return cls(
            schema=(version.get("schema") or {}).get("openAPIV3Schema") or {},
            subresources=frozenset((version.get("subresources") or {}).keys()),
            selectable_fields=frozenset(
                str(f.get("jsonPath", "")).lstrip(".") for f in version.get("selectableFields") or []
            ),
            printer_columns=tuple(version.get("additionalPrinterColumns") or ()),
        )

    def shape(self, obj: Obj) -> Obj:
        """What the API server stores for `obj`: unknown fields pruned, non-nullable nulls
        dropped, defaults applied (structural schema semantics)."""
        shaped = copy.deepcopy(obj)
        self.shape_in_place(shaped)
        return shaped

    def shape_in_place(self, obj: Obj) -> None:
        """`shape`, on an object the caller owns (no copy: the store's writes already made one)."""
        prune(obj, self.schema, root=True)
        _drop_nulls(obj, self.schema)
        _apply_defaults(obj, self.schema)

    def validate(self, obj: Obj) -> list[FieldError]:
        errors: list[FieldError] = []
        _validate(obj, self.schema, "", errors)
        return errors


@attrs.define
class CustomResource:
    """A registered CustomResourceDefinition."""

    kind: str
    list_kind: str
    namespaced: bool
    storage: kmock.resource
    versions: dict[str, CustomVersion]
    terminating: bool = False


def check_type_meta(resource: kmock.resource, custom: CustomResource, obj: Obj) -> None:
    """A custom resource is decoded as unstructured JSON: apiVersion and kind must be right."""
    if not obj.get("kind"):
        raise ApiStatus(400, "BadRequest", f"Object 'Kind' is missing in '{json.dumps(obj, separators=(',', ':'))}'")
    if obj.get("apiVersion") != api_version(resource):
        raise ApiStatus(
            400, "BadRequest",
            f"the API version in the data ({obj.get('apiVersion')}) does not match the expected API version "
            f"({api_version(resource)})",
        )
    if obj["kind"] != custom.kind:
        raise ApiStatus(
            400, "BadRequest",
            f"the kind in the data ({obj['kind']}) does not match the expected kind ({custom.kind})",
        )


def check_crd(crd: Obj) -> None:
    """The CustomResourceDefinition validation tgp's CRDs could trip over; 422 like the server."""
    name = (crd.get("metadata") or {}).get("name") or ""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group, plural, kind = spec.get("group") or "", names.get("plural") or "", names.get("kind") or ""
    errors: list[FieldError] = []
    if not group:
        errors.append(FieldError.required("spec.group"))
    elif "." not in group:
        errors.append(FieldError.invalid("spec.group", group, "should be a domain with at least one dot"))
    if not plural:
        errors.append(FieldError.required("spec.names.plural"))
    if not kind:
        errors.append(FieldError.required("spec.names.kind"))
    if name != f"{plural}.{group}":
        errors.append(FieldError.invalid("metadata.name", name, 'must be spec.names.plural+"."+spec.group'))
    if spec.get("scope") not in ("Cluster", "Namespaced"):
        errors.append(FieldError.not_supported("spec.scope", spec.get("scope") or "", ["Cluster", "Namespaced"]))
    versions = spec.get("versions") or []
    if sum(1 for v in versions if v.get("storage")) != 1:
        errors.append(FieldError.invalid("spec.versions", versions, "must have exactly one version marked as storage version"))
    # The server validates its internal form, which hoists a schema that every version shares
    # into spec.validation: its errors name that field once (measured on 1.34).
    schemas = [json.dumps(v.get("schema"), sort_keys=True) for v in versions]
    hoisted = len(versions) > 0 and len(set(schemas)) == 1 and versions[0].get("schema") is not None
    for index, version in enumerate(versions):
        if hoisted and index > 0:
            break
        path = "spec.validation" if hoisted else f"spec.versions[{index}]"
        schema_path = path if hoisted else f"{path}.schema"
        if not version.get("name"):
            errors.append(FieldError.required(f"{path}.name"))
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if schema is None:
            errors.append(FieldError.required(f"{schema_path}.openAPIV3Schema", "schemas are required"))
        elif not schema.get("type"):
            errors.append(FieldError.required(f"{schema_path}.openAPIV3Schema.type", "must not be empty at the root"))
        elif schema["type"] != "object":
            errors.append(FieldError.invalid(f"{schema_path}.openAPIV3Schema.type", schema["type"], "must be object at the root"))
        else:
            _default_errors(schema, f"{schema_path}.openAPIV3Schema", errors)
    if errors:
        raise invalid("apiextensions.k8s.io", "CustomResourceDefinition", name, errors)


def _default_errors(schema: Mapping[str, Any], path: str, errors: list[FieldError]) -> None:
    """apiextensions' ValidateDefaults at CRD create and update: each `default` must have no
    unknown fields and be valid against its own field's schema, or the whole CRD is refused.
    A null member of a non-nullable field is refused too (1.34; the reference's 1.19 dropped
    it). The messages name the field relative to the default (` in body` for the default
    itself, `team in body` for a member), the cause's field is the full path. additionalProperties
    is not followed: defaults are forbidden there."""
    if schema.get("default") is not None:
        default = copy.deepcopy(schema["default"])
        pruned = copy.deepcopy(default)
        prune(pruned, schema)
        _drop_nulls(pruned, schema)
        unknown = copy.deepcopy(default)
        _drop_nulls(unknown, schema)
        if pruned != unknown:
            errors.append(FieldError.invalid(f"{path}.default", schema["default"], "must not have unknown fields"))
        found: list[FieldError] = []
        _validate(default, schema, f"{path}.default", found)
        root = f"{path}.default"
        errors.extend(
            FieldError(e.reason, e.field, e.body.replace(f" {root}.", " ").replace(f" {root} in body", "  in body"))
            for e in found
        )
    if isinstance(schema.get("items"), Mapping):
        _default_errors(schema["items"], f"{path}.items", errors)
    for key, sub in (schema.get("properties") or {}).items():
        _default_errors(sub, f"{path}.properties[{key}]", errors)


def default_crd(crd: Obj) -> None:
    """The defaults a stored CRD gets, and the status its controllers set (instantly here)."""
    spec = crd["spec"]
    names = spec["names"]
    names.setdefault("singular", names["kind"].lower())
    names.setdefault("listKind", f"{names['kind']}List")
    spec.setdefault("conversion", {"strategy": "None"})
    now = now_time()
    status = crd.setdefault("status", {})
    status["acceptedNames"] = copy.deepcopy(names)
    stored = {*(status.get("storedVersions") or []), *(v["name"] for v in spec["versions"] if v.get("storage"))}
    status["storedVersions"] = sorted(stored)
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    for kind, reason, message in (
        ("NamesAccepted", "NoConflicts", "no conflicts found"),
        ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
    ):
        if (conditions.get(kind) or {}).get("status") != "True":
            conditions[kind] = {"type": kind, "status": "True", "reason": reason, "message": message, "lastTransitionTime": now}
    status["conditions"] = list(conditions.values())


# --- structural schemas (k8s.io/apiextensions-apiserver pruning, defaulting, validation) ---


_RESOURCE_FIELDS = ("apiVersion", "kind", "metadata")


def prune(value: Any, schema: Mapping[str, Any] | None, *, root: bool = False) -> None:
    """Remove, in place, the fields `schema` does not declare."""
    if schema is not None and schema.get("x-kubernetes-preserve-unknown-fields"):
        _prune_declared(value, schema, root=root)
        return
    if isinstance(value, dict):
        if schema is None:
            value.clear()
            return
        embedded = root or schema.get("x-kubernetes-embedded-resource")
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key in list(value):
            if embedded and key in _RESOURCE_FIELDS:
                continue
            if key in properties:
                prune(value[key], properties[key])
            elif extra is not None and extra is not False:
                prune(value[key], extra if isinstance(extra, Mapping) else None)
            else:
                del value[key]
    elif isinstance(value, list):
        for item in value:
            prune(item, schema.get("items") if schema is not None else None)


def _prune_declared(value: Any, schema: Mapping[str, Any], *, root: bool = False) -> None:
    """x-kubernetes-preserve-unknown-fields: keep unknown fields, prune inside declared ones."""
    if isinstance(value, dict):
        embedded = root or schema.get("x-kubernetes-embedded-resource")
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if embedded and key in _RESOURCE_FIELDS:
                continue
            if key in properties:
                prune(item, properties[key])
            elif isinstance(extra, Mapping):
                prune(item, extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for item in value:
            _prune_declared(item, schema["items"])


def removed_fields(before: Any, after: Any, path: str) -> list[str]:
    """The fields of `before` that pruning removed (`spec.foo`, `spec.items[0].bar`)."""
    if isinstance(before, Mapping) and isinstance(after, Mapping):
        removed = []
        for key, value in before.items():
            field = _child_path(path, key)
            removed += [field] if key not in after else removed_fields(value, after[key], field)
        return removed
    if isinstance(before, list) and isinstance(after, list):
        return [f for i, (b, a) in enumerate(zip(before, after, strict=False)) for f in removed_fields(b, a, f"{path}[{i}]")]
    return []


def _child_schema(schema: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    properties: Mapping[str, Mapping[str, Any]] = schema.get("properties") or {}
    if key in properties:
        return properties[key]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, Mapping) else None


def _drop_nulls(value: Any, schema: Mapping[str, Any]) -> None:
    """Drop nulls the schema does not allow and cannot default (they would fail validation)."""
    if isinstance(value, dict):
        for key in list(value):
            sub = _child_schema(schema, key)
            if sub is None:
                continue
            if value[key] is None and not sub.get("nullable") and "default" not in sub:
                del value[key]
            else:
                _drop_nulls(value[key], sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for item in value:
            _drop_nulls(item, schema["items"])


def _apply_defaults(value: Any, schema: Mapping[str, Any]) -> None:
    """Set absent (or non-nullable null) properties that have a default, then recurse, so the
    defaults inside a defaulted object apply too."""
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if "default" in sub and (key not in value or (value[key] is None and not sub.get("nullable"))):
                value[key] = copy.deepcopy(sub["default"])
                _drop_nulls(value[key], sub)  # a default's null members of non-nullable fields are dropped
        for key, item in value.items():
            sub = _child_schema(schema, key)
            if sub is not None:
                _apply_defaults(item, sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        items = schema["items"]
        for index, item in enumerate(value):
            if item is None and not items.get("nullable") and "default" in items:
                value[index] = copy.deepcopy(items["default"])
            _apply_defaults(value[index], items)


def _validate(value: Any, schema: Mapping[str, Any], path: str, errors: list[FieldError]) -> None:
    """OpenAPI v3 validation as kube-openapi reports it (messages name the field)."""
    if value is None and schema.get("nullable"):
        return
    declared = ["integer", "string"] if schema.get("x-kubernetes-int-or-string") else (
        [schema["type"]] if schema.get("type") else []
    )
    actual = _json_type(value)
    if declared and not any(_has_type(value, t) for t in declared):
        errors.append(FieldError(
            "FieldValueTypeInvalid", path,
            f'Invalid value: {go_value(actual)}: {path} in body must be of type {",".join(declared)}: "{actual}"',
        ))
        return
    if "enum" in schema and not any(_json_equal(value, allowed) for allowed in schema["enum"]):
        errors.append(FieldError.not_supported(
            path, value, [a if isinstance(a, str) else json.dumps(a) for a in schema["enum"]],
        ))
    if isinstance(value, str):
        length = len(value)
        if "maxLength" in schema and length > schema["maxLength"]:
            errors.append(FieldError("FieldValueTooLong", path, f"Too long: may not be longer than {schema['maxLength']}"))
        if "minLength" in schema and length < schema["minLength"]:
            errors.append(FieldError.invalid(path, value, f"{path} in body should be at least {schema['minLength']} chars long"))
        if "pattern" in schema and go_regexp(schema["pattern"]).search(value) is None:
            errors.append(FieldError.invalid(path, value, f"{path} in body should match '{schema['pattern']}'"))
    elif actual in ("integer", "number"):
        _validate_number(value, schema, path, errors)
    elif isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(FieldError("FieldValueTooMany", path, f"Too many: {len(value)}: must have at most {schema['maxItems']} items"))
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(FieldError.invalid(path, len(value), f"{path} in body should have at least {schema['minItems']} items"))
        if schema.get("uniqueItems") and len({json.dumps(v, sort_keys=True) for v in value}) < len(value):
            errors.append(FieldError.invalid(path, "", f"{path} in body shouldn't contain duplicates"))
        if isinstance(schema.get("items"), Mapping):
            for index, item in enumerate(value):
                _validate(item, schema["items"], f"{path}[{index}]", errors)
    elif isinstance(value, dict):
        for required in schema.get("required") or []:
            if required not in value:
                errors.append(FieldError.required(_child_path(path, required)))
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            errors.append(FieldError("FieldValueTooMany", path, f"Too many: {len(value)}: must have at most {schema['maxProperties']} items"))
        if "minProperties" in schema and len(value) < schema["minProperties"]:
            errors.append(FieldError.invalid(path, schema["minProperties"], f"{path} in body should have at least {schema['minProperties']} properties"))
        for key, item in value.items():
            if not path and key in _RESOURCE_FIELDS and key not in (schema.get("properties") or {}):
                continue
            sub = _child_schema(schema, key)
            if sub is not None:
                _validate(item, sub, _child_path(path, key), errors)
    _validate_rules(value, schema, path, actual, errors)


def _validate_rules(value: Any, schema: Mapping[str, Any], path: str, actual: str, errors: list[FieldError]) -> None:
    """The schema's CEL rules (`x-kubernetes-validations`) that sim.kube_cel evaluates; as the
    API server words a broken rule: `Invalid value: "object": <message>`."""
    for rule in schema.get("x-kubernetes-validations") or []:
        try:
            holds = compile_rule(rule["rule"])(value)
        except Unsupported:
            continue  # outside the evaluated subset: not checked (see sim/kube_cel.py)
        if not holds:
            message = rule.get("message") or f"failed rule: {rule['rule']}"
            errors.append(FieldError.invalid(path, actual, message))


def _validate_number(value: float, schema: Mapping[str, Any], path: str, errors: list[FieldError]) -> None:
    if "maximum" in schema:
        limit = schema["maximum"]
        if schema.get("exclusiveMaximum") and value >= limit:
            errors.append(FieldError.invalid(path, value, f"{path} in body should be less than {go_number(limit)}"))
        elif value > limit:
            errors.append(FieldError.invalid(path, value, f"{path} in body should be less than or equal to {go_number(limit)}"))
    if "minimum" in schema:
        limit = schema["minimum"]
        if schema.get("exclusiveMinimum") and value <= limit:
            errors.append(FieldError.invalid(path, value, f"{path} in body should be greater than {go_number(limit)}"))
        elif value < limit:
            errors.append(FieldError.invalid(path, value, f"{path} in body should be greater than or equal to {go_number(limit)}"))
    factor = schema.get("multipleOf")
    if factor and not float(value / factor).is_integer():
        errors.append(FieldError.invalid(path, value, f"{path} in body should be a multiple of {go_number(factor)}"))


def _child_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _has_type(value: Any, wanted: str) -> bool:
    actual = _json_type(value)
    if wanted == "integer":  # JSON has one number type; a whole number decodes as an integer
        return actual == "integer" or (actual == "number" and float(value).is_integer())
    if wanted == "number":
        return actual in ("integer", "number")
    return actual == wanted


def _json_equal(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def label_errors(meta: Mapping[str, Any]) -> list[FieldError]:
    """metadata.labels as apimachinery's ValidateLabels checks them on every object: keys are
    qualified names, values label values (at most 63 characters). A Node named longer than 63
    cannot carry its own kubernetes.io/hostname label, so it cannot register."""
    labels = meta.get("labels")
    if not isinstance(labels, Mapping):
        return []
    errors = []
    for key, value in labels.items():
        for problem in qualified_name_problems(str(key)):
            errors.append(FieldError.invalid("metadata.labels", key, problem))
        for problem in label_value_problems(value if isinstance(value, str) else str(value)):
            errors.append(FieldError.invalid("metadata.labels", value, problem))
    return errors


def name_errors(name: str) -> list[FieldError]:
    """Custom resource names must be DNS subdomains (as most built-in kinds' names)."""
    errors = []
    if len(name) > 253:
        errors.append(FieldError.invalid("metadata.name", name, "must be no more than 253 characters"))
    if not _DNS_SUBDOMAIN.fullmatch(name):
        errors.append(FieldError.invalid("metadata.name", name, (
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
            "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
            "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
        )))
    return errors
