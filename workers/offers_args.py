"""`tgp offers`' arguments, apart from the command (workers.offers_cli): every `tgp` command builds
its parser with them, and the command's imports (every cloud adapter, the Kubernetes client)
would slow each of them down."""

from __future__ import annotations

import argparse
from decimal import Decimal


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu", action="append", default=[], help="GPU type, e.g. RTX4090 or 'A100 80GB' (repeatable)")
    parser.add_argument("--region", action="append", default=[], help="region label value, e.g. us-east-1 (repeatable)")
    parser.add_argument("--max-price", type=Decimal, help="most US$ per hour per instance")
    parser.add_argument("--spot", action="store_true", help="include spot/bid offers")
    parser.add_argument("--provider", action="append", default=[], help="only this provider (repeatable)")
    parser.add_argument("--min-gpus", type=int, default=1, help="GPUs per instance")
    parser.add_argument("--secret", help="read API keys from this Kubernetes Secret (NAMESPACE/NAME) instead of the environment")
    parser.add_argument("--limit", type=int, default=30, help="rows to show")
    parser.add_argument("--json", action="store_true", help="print JSON")
