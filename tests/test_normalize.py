"""GPU and region names from each provider normalise to the same label values."""

import pytest

from tgp.normalize import normalize_gpu, normalize_region


@pytest.mark.parametrize(
    ("raw", "label"),
    [
        ("NVIDIA GeForce RTX 4090", "RTX4090"),  # RunPod id
        ("RTX 4090", "RTX4090"),  # Vast gpu_name, RunPod name
        ("RTX_4090", "RTX4090"),  # Vast CLI
        ("H100 (80 GB SXM5)", "H100-SXM"),  # Lambda gpu_description
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),  # RunPod id
        ("H100 PCIe", "H100-PCIE"),
        ("H100", "H100-PCIE"),  # Paperspace machine type
        ("A100 (40 GB SXM4)", "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("A100-80G", "A100-80GB"),  # Paperspace
        ("NVIDIA RTX A6000", "A6000"),
        ("A6000", "A6000"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("RTX 6000 Ada", "RTX6000ADA"),
        ("V100-32G", "V100-32GB"),
        ("Tesla T4", "T4"),
        ("GH200 (96 GB)", "GH200"),
        ("NVIDIA H200", "H200"),
        ("Some Future GPU", "SOME-FUTURE-GPU"),
    ],
)
def test_gpu_names(raw: str, label: str) -> None:
    assert normalize_gpu(raw) == label


@pytest.mark.parametrize(
    ("raw", "label"),
    [("us-east-1", "us-east-1"), ("US-KS-2", "us-ks-2"), ("East Coast (NY2)", "ny2"), ("Helsinki, FI", "fi"), ("US", "us")],
)
def test_regions(raw: str, label: str) -> None:
    assert normalize_region(raw) == label
