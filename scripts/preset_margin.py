"""The paired difference of two presets' test metric over the seeds (and data draws) of a
sweep with a ``preset`` axis, with its 95% t interval.

    python scripts/preset_margin.py studies/conditions store-tiny store-conditioned-tiny

``flarepp sweep``'s ``paired`` report pairs mixers; here the runs of the two presets (the
same mixer) are paired by seed and draw with the report's own functions
(:func:`flarepp.experiments.reports.stats.paired_differences` and ``interval``): the
difference B - A per pair, its mean, sample std and ``mean ± t(0.975, n - 1) std / sqrt(n)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from flarepp.experiments.reports.rows import collect
from flarepp.experiments.reports.stats import interval, paired_differences, verdict


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", help="the sweep's directory")
    parser.add_argument("a", help="preset A (the reference)")
    parser.add_argument("b", help="preset B")
    args = parser.parse_args()
    _, rows = collect(args.study)
    paired = [dataclasses.replace(r, mixer=r.get("preset")) for r in rows
              if r.get("preset") in (args.a, args.b)]  # each preset counts as a mixer
    stats = interval(paired_differences(paired, args.a, args.b))
    by = {p: sorted(r.value for r in paired if r.mixer == p and r.status == "done")
          for p in (args.a, args.b)}
    print(json.dumps({"A": args.a, "B": args.b, "values": by, "B - A": stats}, indent=2))
    lower = all(r.lower_is_better for r in paired)
    print(f"{args.b} - {args.a}: {stats['mean']:+.4g} (95% interval [{stats['low']:+.4g}, "
          f"{stats['high']:+.4g}], {stats['n']} pairs): "
          f"{verdict(stats, args.a, args.b, lower)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
