"""The CRD models and the manifests generated from them."""

import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from tests.hostile import HOSTILE_KEYS, HOSTILE_VALUES
from workers import crdgen
from tgp.crds import (
    DEFAULT_CLASS_MAX_NODES,
    DURATION_PATTERN,
    MAX_MIN_NODES,
    MAX_NODES,
    MAX_POOL_LABELS,
    MAX_POOL_TAINTS,
    MAX_TEMPLATE_LENGTH,
    MIN_IDLE_TIMEOUT,
    ClassLimits,
    Disruption,
    DisruptionBounds,
    GPUNodeClass,
    GPUNodeClassSpec,
    GPUNodePool,
    GPUNodePoolSpec,
    format_duration,
    parse_duration,
)
from tgp.labels import TAINT_EFFECTS, label_value_problems, qualified_name_problems
from sim.kube_schema import go_regexp

SEED = Path(__file__).parent / "data" / "seed_examples.yaml"


def test_committed_crds_are_generated_from_the_models() -> None:
    assert crdgen.main(["--check"]) == 0, "run `make crds`"


def test_the_original_readme_examples_parse() -> None:
    klass, pool = yaml.safe_load_all(SEED.read_text())
    c = GPUNodeClass.model_validate(klass)
    p = GPUNodePool.model_validate(pool)
    assert [x.name for x in c.spec.providers] == ["runpod", "lambdalabs"]
    assert str(c.spec.limits.max_hourly_cost) == "50.0"
    assert p.spec.gpu_types == ["RTX4090"] and p.spec.weight == 10


def test_schema_has_descriptions_printer_columns_and_status() -> None:
    pool = crdgen.manifests()["gpunodepools.tgp.io.yaml"]
    version = pool["spec"]["versions"][0]
    assert [c["name"] for c in version["additionalPrinterColumns"]][:3] == ["Ready", "Desired", "$/h"]
    assert version["subresources"] == {"status": {}}
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["weight"]["maximum"] == 100
    undocumented = [name for name, prop in spec["properties"].items() if not prop.get("description")]
    assert undocumented == []
    assert pool["spec"]["names"]["shortNames"] == ["gnp"]


# --- defaults, bounds and durations (issue 10 items 4-5, issue 8 item 6) ----------------------


def _schema_errors(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    """A small OpenAPI v3 structural-schema check (type, enum, pattern, bounds, lengths,
    required, properties, items), independent of the emulator's."""
    if value is None:
        return [] if schema.get("nullable") else [f"{path}: null is not nullable"]
    kinds = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}
    wanted = schema.get("type")
    if wanted and (not isinstance(value, kinds[wanted]) or (wanted in ("integer", "number") and isinstance(value, bool))):
        return [f"{path}: {value!r} is not of type {wanted}"]
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, str):
        if "pattern" in schema and re.search(schema["pattern"], value) is None:
            errors.append(f"{path}: {value!r} does not match {schema['pattern']}")
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: {value!r} is shorter than {schema['minLength']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} > {schema['maximum']}")
    if isinstance(value, list):
        for i, item in enumerate(value):
            errors += _schema_errors(item, schema.get("items") or {}, f"{path}[{i}]")
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        errors += [f"{path}.{name}: required" for name in schema.get("required") or [] if name not in value]
        for key, item in value.items():
            sub = properties.get(key, schema.get("additionalProperties"))
            if not isinstance(sub, dict):
                errors.append(f"{path}.{key}: unknown field")
            elif not (item is None and not sub.get("nullable")):  # the API server drops such nulls
                errors += _schema_errors(item, sub, f"{path}.{key}")
    return errors


def _defaults(schema: dict[str, Any], path: str) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """Every (path, default, schema of that field) in a schema tree."""
    if "default" in schema:
        yield path, schema["default"], schema
    if isinstance(schema.get("items"), dict):
        yield from _defaults(schema["items"], f"{path}[]")
    for name, sub in (schema.get("properties") or {}).items():
        yield from _defaults(sub, f"{path}.{name}")


def _committed_schemas() -> dict[str, dict[str, Any]]:
    return {
        path.name: yaml.safe_load(path.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for path in sorted(crdgen.OUT_DIR.glob("*.yaml"))
    }


def test_every_committed_default_is_valid_against_its_own_schema() -> None:
    """A real API server refuses the whole CRD when one default does not match its field
    (`…default: Invalid value: "PT10M": … should match '…'`)."""
    checked = 0
    for name, schema in _committed_schemas().items():
        for path, default, field_schema in _defaults(schema, name):
            assert _schema_errors(default, field_schema, path) == []
            checked += 1
    assert checked > 20


def test_schema_defaults_are_the_model_defaults() -> None:
    """The API server fills a pool's missing fields from the schema; the workflows read them
    with pydantic: both must mean the same thing (10m is 10 minutes on both sides)."""
    disruption = _committed_schemas()["gpunodepools.tgp.io.yaml"]["properties"]["spec"]["properties"]["disruption"]
    assert disruption["properties"]["idleTimeout"]["default"] == "10m"
    assert Disruption.model_validate(disruption["default"]) == Disruption()
    limits = _committed_schemas()["gpunodeclasses.tgp.io.yaml"]["properties"]["spec"]["properties"]["limits"]
    assert ClassLimits.model_validate(limits["default"]) == ClassLimits()


@pytest.mark.parametrize("text", ["90s", "10m", "1h30m", "720h", "1h0m0s", "0s"])
def test_a_kubernetes_style_duration_is_accepted_by_schema_and_model(text: str) -> None:
    assert re.search(DURATION_PATTERN, text)
    assert re.search(DURATION_PATTERN, format_duration(parse_duration(text)))


@pytest.mark.parametrize("text", ["", "PT10M", "10", "1d", "1.5h", "10M", "m"])
def test_other_durations_are_refused_by_schema_and_model(text: str) -> None:
    assert re.search(DURATION_PATTERN, text) is None
    with pytest.raises(ValueError):
        parse_duration(text)


def test_spend_is_bounded_in_the_schema() -> None:
    schemas = _committed_schemas()
    pool = schemas["gpunodepools.tgp.io.yaml"]["properties"]["spec"]["properties"]
    assert (pool["minNodes"]["maximum"], pool["maxNodes"]["maximum"]) == (MAX_MIN_NODES, MAX_NODES)
    limits = schemas["gpunodeclasses.tgp.io.yaml"]["properties"]["spec"]["properties"]["limits"]["properties"]
    assert limits["maxNodes"]["default"] == DEFAULT_CLASS_MAX_NODES and not limits["maxNodes"].get("nullable")
    assert limits["maxNodes"]["maximum"] == MAX_NODES
    assert re.search(limits["maxHourlyCost"]["pattern"], "99999.99")
    assert re.search(limits["maxHourlyCost"]["pattern"], "100000") is None
    with pytest.raises(ValidationError, match="maxHourlyCost"):
        ClassLimits.model_validate({"maxHourlyCost": "100000"})
    with pytest.raises(ValidationError, match="minNodes"):
        GPUNodePoolSpec.model_validate({"nodeClassRef": {"name": "c"}, "minNodes": 1_000_000_000})


def test_a_class_without_limits_gets_the_default_cap() -> None:
    spec = GPUNodeClassSpec.model_validate({"providers": [{"name": "simulated"}]})
    assert spec.limits.max_nodes == DEFAULT_CLASS_MAX_NODES
    # A ledger recorded before the cap (maxNodes null) still decodes, and gets the cap.
    assert ClassLimits.model_validate({"max_nodes": None}).max_nodes == DEFAULT_CLASS_MAX_NODES


def _pool(**disruption: str) -> dict[str, Any]:
    return {"metadata": {"name": "p"}, "spec": {"nodeClassRef": {"name": "c"}, "disruption": disruption}}


@pytest.mark.parametrize(
    ("field", "value", "bound"),
    [("idleTimeout", "0s", "minimum of 30s"), ("idleTimeout", "1s", "minimum of 30s"),
     ("expireAfter", "5m", "minimum of 10m"), ("drainTimeout", "25h", "maximum of 24h")],
)
def test_admission_refuses_churning_durations_naming_field_and_bound(field: str, value: str, bound: str) -> None:
    with pytest.raises(ValidationError) as refused:
        GPUNodePool.admit(_pool(**{field: value}))
    [error] = refused.value.errors()
    assert error["loc"] == ("spec", "disruption", field) and bound in error["msg"]
    # A spec that was admitted before (carried in a workflow message) always decodes.
    assert GPUNodePool.model_validate(_pool(**{field: value}))


def test_admission_accepts_the_bounds_themselves() -> None:
    pool = GPUNodePool.admit(_pool(idleTimeout="30s", expireAfter="10m", drainTimeout="24h"))
    assert pool.spec.disruption.idle_timeout == MIN_IDLE_TIMEOUT
    assert GPUNodePool.admit(_pool(idleTimeout="2s"), DisruptionBounds(min_idle_timeout=timedelta(seconds=2)))


# --- tenant labels and taints (issue 10 item 1) ------------------------------------------------


def _labelled(labels: dict[str, str] | None = None, taints: list[dict[str, str]] | None = None) -> dict[str, Any]:
    template = {"metadata": {"labels": labels or {}}, "spec": {"taints": taints or []}}
    return {"metadata": {"name": "p"}, "spec": {"nodeClassRef": {"name": "c"}, "template": template}}


def _pool_schema() -> dict[str, Any]:
    return _committed_schemas()["gpunodepools.tgp.io.yaml"]["properties"]["spec"]["properties"]["template"]["properties"]


def _schema_accepts(value: str, schema: dict[str, Any]) -> bool:
    """pattern and maxLength as the API server applies them (Go RE2: `$` is the end of text)."""
    return len(value) <= schema["maxLength"] and go_regexp(schema["pattern"]).search(value) is not None


VALID_KEYS = ["team", "example.com/team", "a.b-c.example/Name_1.x", f"{'d' * 200}.example.com/{'n' * 63}", "node.kubernetes.io/x", "kubelet.kubernetes.io/y"]
VALID_VALUES = ["", "a", "v1.2_x-Y", "9" * 63]


def test_the_schema_checks_label_values_and_taints_as_admission_does() -> None:
    """The API server refuses what tgp's own check refuses, for values and taint keys alike."""
    template = _pool_schema()
    value_schema = template["metadata"]["properties"]["labels"]["additionalProperties"]
    taint = template["spec"]["properties"]["taints"]["items"]["properties"]
    assert taint["effect"]["enum"] == list(TAINT_EFFECTS)
    for value in [*HOSTILE_VALUES, *VALID_VALUES]:
        expected = label_value_problems(value) == []
        assert _schema_accepts(value, value_schema) is expected, value
        assert _schema_accepts(value, taint["value"]) is expected, value
    for key in [*HOSTILE_KEYS, *VALID_KEYS]:
        if len(key.rpartition("/")[0]) <= 253:  # a prefix's length is admission's alone (no lookahead in RE2)
            assert _schema_accepts(key, taint["key"]) is (qualified_name_problems(key) == []), key


@pytest.mark.parametrize("key", HOSTILE_KEYS, ids=range(len(HOSTILE_KEYS)))
def test_admission_refuses_hostile_and_reserved_label_keys_naming_the_field(key: str) -> None:
    with pytest.raises(ValidationError) as refused:
        GPUNodePool.admit(_labelled({key: "v"}))
    [error] = refused.value.errors()
    assert error["loc"] == ("spec", "template", "metadata", "labels")
    assert "label key" in error["msg"] and "\n" not in error["msg"] and len(error["msg"]) < 1000
    # A spec admitted before this check (carried in a workflow message) still decodes.
    assert GPUNodePool.model_validate(_labelled({key: "v"}))


def test_admission_refuses_reserved_taint_keys_and_bad_values() -> None:
    for taint, expected in (
        ({"key": "tgp.io/initializing"}, "tgp's own"),
        ({"key": "x.tgp.io/y"}, "tgp's own"),
        ({"key": "node-role.kubernetes.io/worker"}, "role in the cluster"),
        ({"key": "a b"}, "name part"),
        ({"key": "k", "value": "$(reboot)"}, "taints[0].value"),
    ):
        with pytest.raises(ValidationError) as refused:
            GPUNodePool.admit(_labelled(taints=[taint]))
        [error] = refused.value.errors()
        assert error["loc"] == ("spec", "template", "spec", "taints") and expected in error["msg"], error
    with pytest.raises(ValidationError, match="effect"):
        GPUNodePool.model_validate(_labelled(taints=[{"key": "k", "effect": "NoSchedule\nx"}]))


def test_admission_accepts_kubernetes_label_syntax() -> None:
    labels = {key: VALID_VALUES[i % len(VALID_VALUES)] for i, key in enumerate(VALID_KEYS)}
    taints = [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}, {"key": "example.com/x", "effect": "NoExecute"}]
    pool = GPUNodePool.admit(_labelled(labels, taints))
    assert pool.spec.template.metadata.labels == labels and len(pool.spec.template.spec.taints) == 2


def test_label_and_taint_counts_are_bounded_at_admission_and_in_the_schema() -> None:
    template = _pool_schema()
    assert template["metadata"]["properties"]["labels"]["maxProperties"] == MAX_POOL_LABELS
    assert template["spec"]["properties"]["taints"]["maxItems"] == MAX_POOL_TAINTS
    many_labels = {f"k{i}": "v" for i in range(MAX_POOL_LABELS + 1)}
    many_taints = [{"key": f"k{i}"} for i in range(MAX_POOL_TAINTS + 1)]
    with pytest.raises(ValidationError, match=f"at most {MAX_POOL_LABELS}"):
        GPUNodePool.admit(_labelled(many_labels))
    with pytest.raises(ValidationError, match=f"at most {MAX_POOL_TAINTS}"):
        GPUNodePool.admit(_labelled(taints=many_taints))
    assert GPUNodePool.model_validate(_labelled(many_labels, many_taints))  # history still decodes
    klass = _committed_schemas()["gpunodeclasses.tgp.io.yaml"]["properties"]["spec"]["properties"]
    assert klass["bootstrapTemplate"]["maxLength"] == MAX_TEMPLATE_LENGTH
    assert klass["talosConfig"]["properties"]["machineConfigTemplate"]["maxLength"] == MAX_TEMPLATE_LENGTH


def test_a_class_needs_at_least_one_well_formed_tailnet_tag() -> None:
    import pytest
    from pydantic import ValidationError

    from tgp.crds import GPUNodeClassSpec

    for tags in ([], ["gpu"], ["tag:"]):
        with pytest.raises(ValidationError, match="tailscaleConfig"):
            GPUNodeClassSpec.model_validate({"providers": [{"name": "simulated"}], "tailscaleConfig": {"tags": tags}})
    schema = yaml.safe_load((crdgen.OUT_DIR / "gpunodeclasses.tgp.io.yaml").read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    tags = schema["properties"]["spec"]["properties"]["tailscaleConfig"]["properties"]["tags"]
    assert tags["minItems"] == 1 and tags["items"]["pattern"].startswith("^tag:")


# --- disruption budgets, consolidation, terminationGracePeriod (issue 21) ----------------------


def _rules(schema: Any, path: str = "") -> Iterator[tuple[str, dict[str, str]]]:
    if isinstance(schema, dict):
        for rule in schema.get("x-kubernetes-validations") or []:
            yield path, rule
        for key, sub in schema.items():
            if key != "x-kubernetes-validations":
                yield from _rules(sub, f"{path}.{key}")
    elif isinstance(schema, list):
        for i, sub in enumerate(schema):
            yield from _rules(sub, f"{path}[{i}]")


def test_the_emulator_evaluates_every_cel_rule_of_the_crds() -> None:
    """A rule outside sim.kube_cel's subset would be skipped by the emulator, and the tests would
    not see what a real API server refuses."""
    from sim.kube_cel import compile_rule

    rules = [(path, rule) for schema in _committed_schemas().values() for path, rule in _rules(schema)]
    assert len(rules) >= 6
    for path, rule in rules:
        compile_rule(rule["rule"])  # raises Unsupported
        assert rule["message"] and "\n" not in rule["message"], path


def test_existing_pools_get_the_default_budget_and_no_consolidation() -> None:
    schema = _committed_schemas()["gpunodepools.tgp.io.yaml"]["properties"]["spec"]["properties"]["disruption"]
    assert schema["default"]["budgets"] == [{"nodes": "10%"}] and "consolidation" not in schema["default"]
    assert Disruption.model_validate(schema["default"]) == Disruption()
    old = GPUNodePool.admit(_pool(idleTimeout="5m"))
    assert [b.nodes for b in old.spec.disruption.budgets] == ["10%"]
    assert old.spec.disruption.consolidation is None and old.spec.disruption.termination_grace_period is None
    budget = schema["properties"]["budgets"]["items"]["properties"]
    assert "nullable" not in budget["schedule"] and "nullable" not in budget["duration"]  # has() sees a null as absent


def test_a_full_disruption_block_round_trips() -> None:
    disruption = {
        "idleTimeout": "10m",
        "drainTimeout": "10m",
        "budgets": [{"nodes": "0", "schedule": "0 9 * * mon-fri", "duration": "8h", "reasons": ["Drifted", "Cheaper"]}, {"nodes": "20%"}],
        "consolidation": {"cheaperBy": "25%", "after": "1h", "policy": "WhenEmpty"},
        "terminationGracePeriod": "24h",
    }
    pool = GPUNodePool.admit({"metadata": {"name": "p"}, "spec": {"nodeClassRef": {"name": "c"}, "disruption": disruption}})
    assert pool.spec.disruption.termination_grace_period == timedelta(hours=24)
    assert pool.spec.disruption.model_dump(mode="json", by_alias=True, exclude_none=True) == disruption


def test_the_emulators_cel_has_and_matches_read_as_the_api_servers() -> None:
    from sim.kube_cel import compile_rule

    window = compile_rule("has(self.schedule) == has(self.duration)")
    assert window({}) and window({"schedule": "@daily", "duration": "1h"})
    assert not window({"duration": "1h"}) and not window({"schedule": "@daily"})
    assert compile_rule("has(self.a.b)")({"a": {"b": 1}}) and not compile_rule("has(self.a.b)")({"a": {}})
    assert compile_rule("self.matches('[0-9]+%')")("x10%y")  # CEL's matches is a search, unanchored
    assert not compile_rule("self.matches('^[0-9]+%$')")("10%\n")  # RE2: $ is the end of the text
    assert compile_rule("self.matches('^a\\\\.b$')")("a.b") and not compile_rule("self.matches('^a\\\\.b$')")("axb")
