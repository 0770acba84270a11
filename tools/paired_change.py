"""The paired per-round change between two contenders of a tools/time_configs.py record.

    python3 tools/paired_change.py RECORD.json "config 1" "config 2" ["config 1" "config 3" ...]

For each (base, other) pair of labels: the median over the interleaved rounds of other / base - 1 (each round timed
both in one process, in a new order), the rounds in which other was faster, and both contenders' median times. The
labels are the record's `labels` keys ("config N", "config N +flag", "cudnn", "flash")."""

from __future__ import annotations

import json
import statistics
import sys

from evotune.gpu.interleave import paired_ratios


def paired(record: dict, base: str, other: str) -> tuple[float, int, int, float, float]:
    """(median change, rounds other won, rounds, base median us, other median us)."""
    medians = record["interleaved"]["round_medians"]
    if base not in medians or other not in medians:
        raise SystemExit(f"paired_change: no contender {base!r} or {other!r}; the record has {sorted(medians)}")
    a, b = medians[base], medians[other]
    ratios = paired_ratios(a, b)
    return (ratios["median"] - 1, sum(r < 1 for r in ratios["per_round"]), len(a), statistics.median(a),
            statistics.median(b))


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 3 or len(args) % 2 == 0:
        raise SystemExit(__doc__)
    record = json.load(open(args[0]))
    for base, other in zip(args[1::2], args[2::2]):
        change, won, rounds, ta, tb = paired(record, base, other)
        print(f"{other} vs {base}: paired {100 * change:+.1f}%, faster in {won}/{rounds} rounds "
              f"(medians {ta:.1f} -> {tb:.1f} us)")


if __name__ == "__main__":
    main()
