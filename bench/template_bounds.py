"""What hostile boot templates cost the worker: event-loop stall, a benign class's validation
and a DNS lookup meanwhile, and peak memory.

    PYTHONPATH=. .venv/bin/python bench/template_bounds.py [RUNS]   (or: make bench)

Sixteen constant-folding templates (`{{ '%0999999999d' % 1 }}`) and one of 256 KiB from one
class, with a benign class validating and a DNS lookup in the meantime (the scenario of
tests/test_template_bounds.py, which checks loaded-machine margins). Targets (issue 18): the
loop never stalls more than 100 ms, the benign validation and the lookup finish within 1 s,
and the worker's peak memory grows by less than 100 MiB.
"""

from __future__ import annotations

import asyncio
import os
import sys

from tests.test_template_bounds import hostile_while_benign


async def main(runs: int) -> None:
    print(f"template bounds: {runs} run(s), {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(f"{'run':>4} {'worst stall ms':>15} {'benign s':>9} {'dns s':>7} {'peak RSS growth MiB':>20}")
    worst = [0.0, 0.0, 0.0, 0]
    for i in range(runs):
        probe, benign, dns, _reports, grew = await hostile_while_benign()
        print(f"{i + 1:>4} {probe.worst * 1000:>15.0f} {benign:>9.2f} {dns:>7.3f} {grew // 2**20:>20}")
        worst = [max(worst[0], probe.worst), max(worst[1], benign), max(worst[2], dns), max(worst[3], grew)]
    ok = worst[0] < 0.1 and worst[1] < 1 and worst[2] < 1 and worst[3] < 100 * 2**20
    print(f"worst: stall {worst[0] * 1000:.0f} ms (target < 100), benign {worst[1]:.2f} s (< 1), dns {worst[2]:.3f} s (< 1), "
          f"memory +{worst[3] // 2**20} MiB (< 100): {'met' if ok else 'MISSED'}")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3))
