"""What a GPUNodeClass says about itself (tgp/class_status.py, issue 35 items 4 and 11): a
credentials Secret gone makes Ready False and is a Warning once, naming the Secret; a blocked
provider account is a condition naming provider, Secret and error type; pure."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from decimal import Decimal

from tgp.class_ledger import sighted
from tgp.class_status import ACCOUNTS, CREDENTIALS, account_blocked, class_conditions, class_status, credentials_missing
from tgp.messages import Ledger, NodeSighting, Reservation
from tgp.types import CredentialsRef

REF = CredentialsRef(namespace="tgp-system", name="runpod-team", key="apiKey")
NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
LEDGER = Ledger(reservations={"n1": Reservation(node_id="n1", pool="ml/p", hourly_price=Decimal("0.44"))})


def test_a_valid_class_with_its_secrets_is_ready() -> None:
    wanted = class_conditions([], [], LEDGER)
    assert wanted["Ready"] == ("True", "Valid", "1 nodes hold $0.44/h of the budget")
    assert wanted[CREDENTIALS][0] == "True" and wanted[ACCOUNTS][0] == "True"


def test_a_missing_secret_makes_ready_false_naming_it_and_what_to_do() -> None:
    for key_only, says in ((False, "Secret tgp-system/runpod-team does not exist"), (True, "Secret tgp-system/runpod-team has no key 'apiKey'")):
        wanted = class_conditions([], [credentials_missing("runpod", REF, key_only=key_only)], LEDGER)
        status, reason, message = wanted[CREDENTIALS]
        assert (status, reason) == ("False", "CredentialsMissing") and says in message and "re-create it" in message
        assert wanted["Ready"][:2] == ("False", "CredentialsMissing") and says in wanted["Ready"][2]


def test_validation_naming_the_same_secret_is_said_once_and_other_problems_stay() -> None:
    problems = ["providers[runpod].credentialsRef: Secret tgp-system/runpod-team does not exist; create it or fix the reference", "bootstrapTemplate: bad"]
    ready = class_conditions(problems, [credentials_missing("runpod", REF, key_only=False)], LEDGER)["Ready"]
    assert ready[2].count("runpod-team") == 1 and "bootstrapTemplate: bad" in ready[2], ready
    assert class_conditions(problems, [], LEDGER)["Ready"][:2] == ("False", "InvalidSpec")


def test_a_blocked_account_names_provider_secret_and_error_type_and_keeps_ready() -> None:
    for ref, whose in ((REF, "Secret tgp-system/runpod-team"), (None, "the worker's own key")):
        wanted = class_conditions([], [account_blocked("runpod", ref, "PermissionDenied")], LEDGER)
        status, reason, message = wanted[ACCOUNTS]
        assert (status, reason) == ("False", "ProviderAccountBlocked")
        assert "provider runpod" in message and whose in message and "PermissionDenied" in message, message
        assert wanted["Ready"][0] == "True" and "account blocked: runpod" in wanted["Ready"][2]
    # Only the documented error types are quoted.
    assert "secret-looking" not in account_blocked("runpod", REF, "secret-looking").message


def test_a_warning_once_when_a_condition_turns_false_or_changes() -> None:
    def warned(accounts: list, previous: dict) -> tuple[dict, str | None]:
        status, warning = class_status(generation=1, problems=[], accounts=accounts, ledger=LEDGER, now=NOW, previous=previous)
        return {c.type: c for c in status.conditions}, warning

    gone = [credentials_missing("runpod", REF, key_only=False)]
    conditions, warning = warned(gone, {})
    assert warning is not None and "runpod-team" in warning
    again, warning = warned(gone, conditions)
    assert warning is None, "the next pass says nothing new"
    other = CredentialsRef(name="lambda-team", key="apiKey")
    _, warning = warned([*gone, credentials_missing("lambdalabs", other, key_only=False)], again)
    assert warning is not None and "lambda-team" in warning, "a change is told"
    back, warning = warned([], again)
    assert warning is None and back[CREDENTIALS].status == "True" and back["Ready"].status == "True"
    # A blocked account is told by the launch that blocked it (activities/node.py), not twice.
    _, warning = warned([account_blocked("runpod", REF, "AuthError")], back)
    assert warning is None


def test_the_ledger_holds_unknown_running_nodes_and_finds_stale_reservations() -> None:
    ledger = Ledger(
        reservations={
            "tgp-node/ml/p/old": Reservation(node_id="tgp-node/ml/p/old", pool="ml/p", reserved_at=NOW - timedelta(minutes=5)),
            "tgp-node/ml/p/young": Reservation(node_id="tgp-node/ml/p/young", pool="ml/p", reserved_at=NOW),
        },
        released=["tgp-node/ml/p/ended"],
    )
    seen = [NodeSighting(workflow_id=w, hourly_price=Decimal("1")) for w in ("tgp-node/ml/q/new", "tgp-node/ml/p/ended", "tgp-node/ml/p/old")]
    holds, stale = sighted(ledger, seen, {"tgp-node/ml/p/old", "tgp-node/ml/p/young"}, now=NOW, grace=timedelta(minutes=2))
    assert [(r.node_id, r.pool, r.hourly_price) for r in holds] == [("tgp-node/ml/q/new", "ml/q", Decimal("1"))]
    assert stale == ["tgp-node/ml/p/old"], "a young reservation's node may not be started yet"
