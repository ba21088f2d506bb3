"""Provider GPU and region names -> the values of tgp's `tgp.io/gpu-type` and `tgp.io/region` labels.

Every adapter calls these once, when it translates its wire format, so pools can ask for
`RTX4090` or `A100-80GB` without knowing that RunPod says "NVIDIA GeForce RTX 4090", Lambda
"H100 (80 GB SXM5)", Vast "RTX 4090" and Paperspace "A100-80G".
"""

from __future__ import annotations

import re

# Canonical label values. Memory is part of the name only where a model ships in several sizes.
_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"gh200", "GH200"),
    (r"h200", "H200"),
    (r"b200", "B200"),
    (r"h100.*(sxm|hbm3)", "H100-SXM"),
    (r"h100.*nvl", "H100-NVL"),
    (r"h100", "H100-PCIE"),
    (r"a100.*(80|sxm4.?80)", "A100-80GB"),
    (r"a100", "A100-40GB"),
    (r"l40s", "L40S"),
    (r"l40", "L40"),
    (r"l4\b", "L4"),
    (r"rtx\s*pro\s*6000", "RTXPRO6000"),
    (r"rtx\s*6000\s*ada", "RTX6000ADA"),
    (r"rtx\s*a6000|^a6000", "A6000"),
    (r"rtx\s*a5000|^a5000", "A5000"),
    (r"rtx\s*a4000|^a4000", "A4000"),
    (r"rtx\s*4000", "RTX4000"),
    (r"a40\b", "A40"),
    (r"a10g", "A10G"),
    (r"a10\b", "A10"),
    (r"v100.*32", "V100-32GB"),
    (r"v100", "V100-16GB"),
    (r"rtx\s*5090", "RTX5090"),
    (r"rtx\s*5080", "RTX5080"),
    (r"rtx\s*4090", "RTX4090"),
    (r"rtx\s*4080", "RTX4080"),
    (r"rtx\s*3090", "RTX3090"),
    (r"rtx\s*3080", "RTX3080"),
    (r"p4000", "P4000"),
    (r"t4\b", "T4"),
)
_COMPILED = tuple((re.compile(p), label) for p, label in _PATTERNS)
_LABEL_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def normalize_gpu(raw: str) -> str:
    """'NVIDIA GeForce RTX 4090', 'RTX_4090', 'H100 (80 GB SXM5)', 'A100-80G' -> 'RTX4090',
    'RTX4090', 'H100-SXM', 'A100-80GB'. Unknown models keep their name, made label-safe."""
    text = raw.lower().replace("_", " ").replace("nvidia", "").replace("geforce", "").strip()
    for pattern, label in _COMPILED:
        if pattern.search(text):
            return label
    return _LABEL_SAFE.sub("-", raw.strip()).strip("-._").upper()[:63] or "UNKNOWN"


_REGION_SAFE = re.compile(r"[^a-z0-9]+")
# Paperspace names regions by description; the code in parentheses is the stable part.
_PAREN_CODE = re.compile(r"\(([A-Za-z0-9-]+)\)")


def normalize_region(raw: str) -> str:
    """A label-safe region value: 'us-east-1' stays, 'US-KS-2' -> 'us-ks-2',
    'East Coast (NY2)' -> 'ny2', 'Helsinki, FI' (Vast geolocation) -> 'fi'."""
    text = raw.strip()
    code = _PAREN_CODE.search(text)
    if code:
        text = code.group(1)
    elif "," in text:  # "City, CC": the country code is what users can ask for
        text = text.rsplit(",", 1)[1]
    return _REGION_SAFE.sub("-", text.lower()).strip("-")[:63] or "unknown"
