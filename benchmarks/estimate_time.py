"""Seconds one estimate takes in a warm process (imports done), per config: the estimator's own cost.

``python benchmarks/estimate_time.py CONFIG [CONFIG ...] [--repeats N]`` prints, per config, the wall
seconds of each ``estimate()`` call (the first call also imports the recipe and builds Lightning's
first Trainer). To compare two versions of the code on a loaded machine, run this script from each
checkout in turn, alternating, and compare run against run.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    start = time.perf_counter()
    from lightning_mem.estimate import estimate

    rows = {"import_s": round(time.perf_counter() - start, 2)}
    warnings.simplefilter("ignore")
    for config in args.configs:
        seconds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            estimate(config)
            seconds.append(round(time.perf_counter() - start, 2))
        rows[config] = seconds
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
