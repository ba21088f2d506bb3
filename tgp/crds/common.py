"""What every part of the CRDs shares: the API group and version, the duration and price types
as Kubernetes users write them, the schema's bounds, the admission context the bridge
validates with (`ADMISSION`, `DisruptionBounds`), and `Spec`, the base of every part.

Its underscored helpers (`_admitting`, `_admission_bounds`, `_at_least`, `_default_max_nodes`)
are this package's own: its other modules import them, `tgp.crds` does not export them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    AliasGenerator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PlainSerializer,
    ValidationInfo,
    WithJsonSchema,
)
from pydantic.alias_generators import to_camel

from tgp.labels import DNS_SUBDOMAIN_MAX_LENGTH, LABEL_VALUE_MAX_LENGTH


GROUP = "tgp.io"
VERSION = "v1"
# On every GPUNodePool: Kubernetes deletes the pool only once its nodes are terminated.
FINALIZER = "tgp.io/nodes-terminated"

_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")
# One duration convention everywhere (schema, defaults, docs, Python): Kubernetes/Go style
# `90s`, `10m`, `1h30m`, with at least one component, so `""` is refused by the API server and
# not silently dropped later. RE2 has no lookahead, hence the alternation.
DURATION_PATTERN = r"^([0-9]+h([0-9]+m)?([0-9]+s)?|[0-9]+m([0-9]+s)?|[0-9]+s)$"
PRICE_PATTERN = r"^[0-9]+(\.[0-9]+)?$"

# Bounds that keep a typo from buying without end (a `minNodes: 1000000000` once did). The API
# server refuses larger values (422 naming the field); ask for more in several pools or classes.
MAX_MIN_NODES = 100  # a pool's floor: nodes kept (and paid for) even without demand
MAX_NODES = 1000  # a pool's or a class's maxNodes
# limits.maxHourlyCost below 10^5 US$/h (about 3000 top-end GPU nodes): the pattern allows at
# most 5 integer digits, since a decimal string cannot carry a schema `maximum`.
MAX_HOURLY_COST_DIGITS = 5
HOURLY_COST_LIMIT_PATTERN = rf"^[0-9]{{1,{MAX_HOURLY_COST_DIGITS}}}(\.[0-9]+)?$"
# A class that gives no limits.maxNodes still caps its nodes here, so a pool's typo or a demand
# storm buys at most this many; a class that needs more says so explicitly (up to MAX_NODES).
DEFAULT_CLASS_MAX_NODES = 10

# Durations that would churn buy -> terminate, or hold a node hostage: a node idle for less than
# MIN_IDLE_TIMEOUT is often only waiting for its GPU device plugin or the scheduler; expiring it
# sooner than MIN_EXPIRE_AFTER replaces it about as fast as it boots; a drain longer than
# MAX_DRAIN_TIMEOUT keeps paying for a node that is leaving. A pattern cannot express these and
# CEL rules are not checked by every API server tgp supports, so the bridge checks them at
# admission (`DisruptionBounds`) and reports a refused pool as a condition and a Warning Event.
MIN_IDLE_TIMEOUT = timedelta(seconds=30)
MIN_EXPIRE_AFTER = timedelta(minutes=10)
MAX_DRAIN_TIMEOUT = timedelta(hours=24)

# Tenant input that reaches boot payloads and Nodes, bounded in the schema. Label values and
# taints are checked by the API server (pattern, maxLength, enum); label *keys* cannot be: a
# structural schema has no propertyNames, and CEL is not checked by every API server tgp
# supports. The bridge checks keys, and refuses tgp's own and role prefixes, at admission
# (tgp/labels.py), reporting a refused pool like a churning one. Like the disruption bounds,
# these are checked at admission and by the API server, not on every decode: a spec admitted
# before them and carried in a workflow message must still decode.
MAX_POOL_LABELS = 64
MAX_POOL_TAINTS = 32
# A pool's spec is carried in its workflow's state and quoted in its status (Temporal refuses a
# payload over 2 MiB): every list and string a tenant writes in it is bounded, so the largest spec
# the schema allows stays far below that (a 508 kB requirement list once made a 1 MB status and
# a refused continue-as-new). Karpenter bounds a NodePool's requirements at 100; tgp's nodes know
# a handful of keys (tgp.io/gpu-type, tgp.io/region, tgp.io/provider, the template's labels).
MAX_POOL_REQUIREMENTS = 16
MAX_REQUIREMENT_VALUES = 64  # per requirement; a value is a label value (63 characters)
MAX_CLASS_LIST = 64  # a class's gpuTypes and regions
MAX_SCALAR_LENGTH = 32  # durations and prices ("1h30m", "2.50")
# A class's boot template; provider user data is smaller still (Lambda: 1 MB, most: 16-64 KiB).
MAX_TEMPLATE_LENGTH = 256 * 1024
# A class's spec is carried in its own workflow's state and in each of its pools' (PoolUpdate.
# node_class): every other list and string of it is bounded too, at what real use needs, so its
# templates are nearly all a class can weigh (tests/test_spec_bounds.py adds up the worst case).
MAX_CLASS_PROVIDERS = 16  # five providers, each perhaps with a few accounts
MAX_TAILSCALE_TAGS = 32
MAX_TAG_LENGTH = 4 + LABEL_VALUE_MAX_LENGTH  # "tag:" and a name
MAX_SECRET_KEY_LENGTH = DNS_SUBDOMAIN_MAX_LENGTH  # a Secret's data key (Kubernetes: 253)
MAX_IMAGE_LENGTH = 1024  # an image reference: registry, repository, tag and digest


def parse_duration(value: Any) -> Any:
    """'90s', '10m', '1h30m', '720h' -> timedelta (the Go duration subset Kubernetes users write)."""
    if isinstance(value, str):
        match = _DURATION.match(value.strip())
        if not match or not value.strip():
            raise ValueError(f"{value!r} is not a duration like 90s, 10m or 1h30m")
        h, m, s = (int(g) if g else 0 for g in match.groups())
        return timedelta(hours=h, minutes=m, seconds=s)
    return value


def format_duration(value: timedelta) -> str:
    total = int(value.total_seconds())
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    return "".join(f"{n}{unit}" for n, unit in ((h, "h"), (m, "m"), (s, "s")) if n) or "0s"


def _below_cost_limit(value: Decimal) -> Decimal:
    if value >= 10**MAX_HOURLY_COST_DIGITS:
        raise ValueError(f"must be below {10**MAX_HOURLY_COST_DIGITS} US$/h")
    return value


def _default_max_nodes(value: Any) -> Any:
    """No maxNodes (null, as ledgers written before the default cap carry it) is the default cap."""
    return DEFAULT_CLASS_MAX_NODES if value is None else value


Duration = Annotated[
    timedelta,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str),
    WithJsonSchema({"type": "string", "pattern": DURATION_PATTERN, "maxLength": MAX_SCALAR_LENGTH}),
]
# Prices are decimal strings ("2.0") in YAML so that no float rounding touches money.
Price = Annotated[
    Decimal,
    BeforeValidator(lambda v: str(v) if isinstance(v, (int, float)) else v),
    PlainSerializer(lambda d: str(d), return_type=str),
    WithJsonSchema({"type": "string", "pattern": PRICE_PATTERN, "maxLength": MAX_SCALAR_LENGTH}),
]
HourlyCostLimit = Annotated[
    Price,
    AfterValidator(_below_cost_limit),
    WithJsonSchema({"type": "string", "pattern": HOURLY_COST_LIMIT_PATTERN, "maxLength": MAX_SCALAR_LENGTH}),
]


@dataclass(frozen=True)
class DisruptionBounds:
    """The disruption durations the bridge admits (see MIN_IDLE_TIMEOUT). Tests that need
    nodes to idle out within seconds pass smaller ones to their bridge."""

    min_idle_timeout: timedelta = MIN_IDLE_TIMEOUT
    min_expire_after: timedelta = MIN_EXPIRE_AFTER
    max_drain_timeout: timedelta = MAX_DRAIN_TIMEOUT


# Validation-context key holding the DisruptionBounds to enforce. Only admission (the bridge)
# sets it: a spec already admitted and carried in a workflow message must always decode, even
# after the bounds changed.
ADMISSION = "tgp.admission"


def _at_least(value: timedelta, minimum: timedelta, why: str) -> None:
    """An admission bound on a duration: below `minimum`, an error saying the minimum and `why`."""
    if value < minimum:
        raise ValueError(f"{format_duration(value)} is below the minimum of {format_duration(minimum)}: {why}")


def _admission_bounds(info: ValidationInfo) -> DisruptionBounds | None:
    bounds = info.context.get(ADMISSION) if isinstance(info.context, dict) else None
    return bounds if isinstance(bounds, DisruptionBounds) else None


# A pool's nodes are named `<pool>-<5 hex>`, and a Node's name is its `kubernetes.io/hostname`
# label, a label value of at most 63 characters: a longer pool name passes the API server's
# own name rule but no node of it could ever register. In the CRD (a CEL rule on the root) and
# at admission.
MAX_POOL_NAME_LENGTH = 57
POOL_NAME_RULE = f"self.metadata.name.size() <= {MAX_POOL_NAME_LENGTH}"
POOL_NAME_MESSAGE = (
    f"a GPUNodePool's name may be at most {MAX_POOL_NAME_LENGTH} characters: its nodes are named <pool>-<5 characters>, "
    "and a Node's name is its kubernetes.io/hostname label (at most 63)"
)

# A Headscale login server: what `tailscale up --login-server` and tgp's Headscale adapter take.
# In the schema (RE2); `login_server_problems` says what is wrong in words.
LOGIN_SERVER_MAX_LENGTH = 2048
LOGIN_SERVER_PATTERN = (
    r"^https?://([A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*|\[[0-9A-Fa-f:.]+\])"
    r"(:[0-9]{1,5})?(/[-A-Za-z0-9._~%/]*)?$"
)


def login_server_problems(url: str) -> list[str]:
    """What is wrong with `url` as a Headscale login server; empty when it is fine (the same
    verdict as LOGIN_SERVER_PATTERN and LOGIN_SERVER_MAX_LENGTH, in words)."""
    shown = repr(url[:80])
    if len(url) > LOGIN_SERVER_MAX_LENGTH:
        return [f"must be at most {LOGIN_SERVER_MAX_LENGTH} characters"]
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return [f"{shown} is not a URL: its host or port cannot be read"]
    if parts.scheme not in ("http", "https") or not url.startswith(f"{parts.scheme}://"):
        return [f"{shown} must start with https:// (or http://)"]
    if "@" in parts.netloc:
        return [f"{shown} must not carry a user or password"]
    if "?" in url or "#" in url:
        return [f"{shown} must not have a query or fragment"]
    if port == 0 or not re.fullmatch(LOGIN_SERVER_PATTERN[1:-1], url):
        return [f"{shown} is not a URL of the form https://host[:port][/path]"]
    return []


def _admitting(info: ValidationInfo) -> bool:
    return isinstance(info.context, dict) and ADMISSION in info.context


class Spec(BaseModel):
    """Base of every CRD part: camelCase on the wire, unknown fields rejected in Python."""

    model_config = ConfigDict(alias_generator=AliasGenerator(alias=to_camel), populate_by_name=True, extra="forbid")
