"""`python -m bench.proc worker|bridge [tgp flags]`: the `tgp worker` and `tgp bridge` processes
that `make bench` measures (bench/run.py).

This is `workers.cli.main` itself, configured from the environment exactly as the real
commands are, with tgp's own intervals and timeouts. One bound only is lowered, so the idle
reaction does not wait out production's 30 s minimum: the bridge accepts a pool idle timeout
down to 1 s (the reaction is measured as terminate call minus pod deletion minus the pool's
idle timeout, so the timeout's length does not enter the figure).
"""

from __future__ import annotations

import sys
from datetime import timedelta


def _configure() -> None:
    from crd_bridge.bridge import Bridge
    from tgp.crds import DisruptionBounds

    Bridge.__init__.__kwdefaults__.update(disruption_bounds=DisruptionBounds(min_idle_timeout=timedelta(seconds=1)))


if __name__ == "__main__":
    _configure()
    from workers.cli import main

    sys.exit(main(sys.argv[1:]))
