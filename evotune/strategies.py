"""evotune's own Optuna samplers (kept out of search.py so that importing SAMPLERS does not import Optuna).

Optuna's BruteForceSampler is not used for "exhaustive": it proposes constraint-pruned
configurations too, in a random order, counts a FAIL trial as visited (so a trial lost to
a killed process would never be proposed again on resume), and on the last tell() calls
study.stop(), which raises outside study.optimize() in our ask/tell loop.
"""

from __future__ import annotations

from typing import Callable, Sequence

import optuna


class ExhaustiveSampler(optuna.samplers.BaseSampler):
    """Every admitted configuration exactly once, in the space's order (the order of the file's
    parameters and values, the last parameter varying fastest), skipping each one `taken(digest)`
    says is already recorded or asked and still in flight.

    The search loop decides what "taken" means, from its records rather than the study's trial
    states: a trial lost to a killed process has no record and is proposed again on resume.
    """

    def __init__(self, configs: Sequence, distributions: dict, taken: Callable[[str], bool]):
        self._configs = list(configs)
        self._digests = [c.digest() for c in self._configs]
        self._distributions = dict(distributions)
        self._taken = taken
        self._next = 0  # everything before it is taken; taken configs never become free again mid-search

    def infer_relative_search_space(self, study, trial) -> dict:
        return dict(self._distributions)

    def sample_relative(self, study, trial, search_space) -> dict:
        while self._next < len(self._configs) and self._taken(self._digests[self._next]):
            self._next += 1
        if self._next == len(self._configs):
            return {}  # exhausted: sample_independent answers with a repeat, which the loop records as a duplicate
        config = self._configs[self._next]
        return {name: config[name] for name in search_space}

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self._configs[0][param_name] if self._configs else param_distribution.choices[0]
