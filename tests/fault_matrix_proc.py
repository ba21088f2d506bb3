"""`python -m tests.fault_matrix_proc worker|bridge [tgp flags]`: the `tgp worker` and `tgp bridge`
processes of the fault matrix (tests/test_fault_matrix.py).

This is `workers.cli.main` itself, configured from the environment like the real commands; only
the intervals a deployment never needs to change, and a test cannot wait for, get test values
first (the process is otherwise exactly what `tgp worker` / `tgp bridge` run):

* worker: the pricing cache keeps no offers (TTL 0; tgp: 60 s), so the matrix's `select` stage
  catches each node while it lists (concurrent lookups still share one listing); the wait-for-*
  and drain activities look every 0.2 s (tgp: 5 s); an unanswered create
  is looked for by name for 5 s (tgp: 30 s); the simulated provider's consistency window is 6 s
  (tgp: 0, a simulated cloud without lag), past the matrix's provider-model faults (3 s); a node's API-call timeout and the pool's and class's
  activity timeout, which are also how soon a SIGKILLed worker's activity is retried elsewhere,
  are 10 s and 15 s (tgp: 2 min and 60 s; the class's status write keeps its own 30 s);
* bridge: pod batches settle in 0.2 s (max 2 s), nodes are looked at every second (or every
  TGP_MATRIX_WATCH_INTERVAL seconds), and a pool may
  idle its nodes out after 1 s (tgp's bounds refuse less than 30 s).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

API_CALL = timedelta(seconds=10)
ENTITY_ACTIVITY = timedelta(seconds=15)
MATRIX_WINDOW = timedelta(seconds=6)


def _configure() -> None:
    import tgp.pools
    import workflows.entity
    from activities.clouds.simulated import SimulatedProvider
    from activities.node import NodeActivities
    from activities.offer_cache import OfferCache
    from crd_bridge.bridge import Bridge
    from tgp.crds import DisruptionBounds
    from tgp.types import LifecycleTimeouts

    NodeActivities.__init__.__kwdefaults__.update(poll_interval=timedelta(seconds=0.2), create_settle=timedelta(seconds=5))
    OfferCache.__init__.__kwdefaults__.update(ttl=timedelta(0))
    SimulatedProvider.__init__.__kwdefaults__.update(consistency_window=MATRIX_WINDOW)
    Bridge.__init__.__kwdefaults__.update(
        batch_idle=timedelta(milliseconds=200),
        batch_max=timedelta(seconds=2),
        pool_watch_interval=timedelta(seconds=float(os.environ.get("TGP_MATRIX_WATCH_INTERVAL", "1"))),
        disruption_bounds=DisruptionBounds(min_idle_timeout=timedelta(seconds=1)),
    )

    class MatrixTimeouts(LifecycleTimeouts):
        """The timeouts a pool gives its nodes (tgp.pools.node_request), with the short API call."""

        api_call: timedelta = API_CALL

    tgp.pools.LifecycleTimeouts = MatrixTimeouts  # type: ignore[misc]
    # Every pool and class activity that names no timeout of its own (status writes included).
    workflows.entity.BEST_EFFORT_TIMEOUT = ENTITY_ACTIVITY
    workflows.entity.ENTITY_TIMEOUT_CAP = ENTITY_ACTIVITY  # and those that name one (a pass's batch of starts: a few nodes here)


if __name__ == "__main__":
    _configure()
    from workers.cli import main

    sys.exit(main(sys.argv[1:]))
