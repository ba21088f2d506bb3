"""The CRD models and the manifests generated from them."""

from pathlib import Path

import yaml

from tgp import crdgen
from tgp.crds import GPUNodeClass, GPUNodePool

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
