"""Every retry policy of tgp's workflows, in one place: how hard each kind of call is tried
before the workflow hears of its failure."""

from __future__ import annotations

from datetime import timedelta

from temporalio.common import RetryPolicy

# Calls to a provider, a tailnet or Kubernetes from the node workflow: ten tries over a few
# minutes, then the stage decides (fail over, or go on to the cleanup).
API_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30), maximum_attempts=10)
# Launch is bounded: failing over to the next offer beats hammering one provider.
LAUNCH_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=2),
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=5,
    non_retryable_error_types=["CapacityError", "OfferRefused", "AuthError", "PermissionDenied", "ConfigError", "TemplateError", "LaunchFailed"],
)
# Cleanup never gives up: a leaked instance costs money every hour.
CLEANUP_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(minutes=2), maximum_attempts=0)

# A few quick retries inside one pass; past them the pass reports the problem and the next
# pass (a minute later, or on the next signal) tries again. An unbounded retry here would
# freeze the entity's loop behind one failing call.
BEST_EFFORT_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10), maximum_attempts=3)

# The sweeper's calls: a few tries; the next sweep comes anyway.
SWEEP_RETRY = RetryPolicy(maximum_interval=timedelta(minutes=1), maximum_attempts=5)
