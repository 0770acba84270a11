"""evotune's own Optuna samplers (kept out of search.py so that importing SAMPLERS does not import Optuna).

Optuna's BruteForceSampler is not used for "exhaustive": it proposes constraint-pruned
configurations too, in a random order, counts a FAIL trial as visited (so a trial lost to
a killed process would never be proposed again on resume), and on the last tell() calls
study.stop(), which raises outside study.optimize() in our ask/tell loop.
"""

from __future__ import annotations

from typing import Callable, Sequence

import optuna


class _Digests:
    """configs[i].digest() for each i asked, computed when first asked: a sampler looks at a few configs an ask."""

    def __init__(self, configs: Sequence):
        self._configs = configs
        self._known: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._configs)

    def __getitem__(self, i: int) -> str:
        digest = self._known.get(i)
        if digest is None:
            digest = self._known[i] = self._configs[i].digest()
        return digest


class ExhaustiveSampler(optuna.samplers.BaseSampler):
    """Every admitted configuration exactly once, in the space's order (the order of the file's
    parameters and values, the last parameter varying fastest), skipping each one `taken(digest)`
    says is already recorded or asked and still in flight.

    The search loop decides what "taken" means, from its records rather than the study's trial
    states: a trial lost to a killed process has no record and is proposed again on resume.
    `recorded(digest)` (default: `taken`) says which taken configs stay taken: a config another
    agent is measuring becomes free again if that agent dies, so it is looked at again.
    """

    def __init__(self, configs: Sequence, distributions: dict, taken: Callable[[str], bool],
                 recorded: Callable[[str], bool] | None = None):
        self._configs = list(configs)
        self._digests = _Digests(self._configs)
        self._distributions = dict(distributions)
        self._taken = taken
        self._recorded = recorded if recorded is not None else taken
        self._next = 0  # everything before it is recorded; recorded configs never become free again

    def infer_relative_search_space(self, study, trial) -> dict:
        return dict(self._distributions)

    def sample_relative(self, study, trial, search_space) -> dict:
        while self._next < len(self._configs) and self._recorded(self._digests[self._next]):
            self._next += 1
        i = self._next
        while i < len(self._configs) and self._taken(self._digests[i]):  # in flight here or elsewhere: a few
            i += 1
        if i == len(self._configs):
            return {}  # exhausted: sample_independent answers with a repeat, which the loop records as a duplicate
        config = self._configs[i]
        return {name: config[name] for name in search_space}

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self._configs[0][param_name] if self._configs else param_distribution.choices[0]


class SteeredNSGAIISampler(optuna.samplers.NSGAIISampler):
    """NSGA-II that breeds from the elites of every completed trial, inside the space's constraints,
    and never proposes a configuration already recorded or in flight.

    Elites: the `population_size` best distinct configurations completed so far, chosen the NSGA-II
    way (non-dominated rank on (time, error), feasible first, then crowding distance): (mu + lambda)
    survival over all parents and children, recomputed as results come in (a steady-state NSGA-II).
    Optuna's NSGA-II chooses a generation's parents once, from the previous generation and its
    parents; with proposals asked ahead of the GPU, part of each generation completes after that and
    is never looked at again, so it could lose its best trial (replaying attention-small: a 6.59 us
    config found at trial 62 never became a parent; the parents' best at trial 136 was 6.76 us).

    A child is a uniform crossover of two tournament-picked elites (with probability crossover_prob,
    else a copy of one) with each knob redrawn with probability mutation_prob: Optuna's operators.
    Optuna's NSGA-II breeds blind to the constraints and reads only COMPLETE trials, so it never learns
    them: on attention-small 5-44% of its proposals per generation violated a constraint, and once
    its population converges most children repeat a parent: 2216 of 2906 proposals in an H100 search
    (docs/experiments/CHANGELOG.md: mission-h100-nsga2-300). Here a child that violates a constraint or
    repeats a taken config is bred again (up to `tries` times); if none comes out, a random admissible
    untaken configuration joins instead (an immigrant, which also keeps a converged population exploring). Until a population has
    completed, children are random admissible configs. Only when all that fails is the last child
    proposed as it is (the loop records it as a constraint prune or a duplicate).
    """

    # Optuna's NSGA-II internals this subclass reads: not public API, so pyproject bounds optuna
    # (>=4.0,<6) and tests/test_strategies.py checks each is there with the shape used here.
    OPTUNA_INTERNALS = ("_elite_population_selection_strategy", "_child_generation_strategy", "_population_size", "_rng")

    def __init__(self, *, distributions: dict, admissible: Callable[[dict], bool],
                 taken: Callable[[dict], bool], tries: int = 64, variant: str | None = None,
                 variant_tries: int = 32768, admitted_by_variant: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        # Random draws (the first population, immigrants) pick the variant knob's value first, then
        # the rest until admitted: drawn blind, attention's wgmma variant (1 admitted config in ~576
        # draws of the other knobs) never came up in 64 trials on gpt2
        # (docs/experiments/CHANGELOG.md: gpt2-h100-fullspace).
        # variant_tries: on d128 (llama 1,4,2048,128) 1 wgmma draw in ~10,100 is admitted since the kv_load knob
        # (which wgmma pins), so 4096 tries found one a third of the time; 32768 find one in 96% of draws.
        # admitted_by_variant (variant value -> its admitted configs' params, where the loop enumerated them): the
        # same draw exactly, uniform over the variant's admitted untaken configs, instead of by rejection. Each knob
        # the variant pins halves or thirds its admitted share of blind draws (1 in ~30,000 on d128 once kv_load
        # gained tma_split and kv_cluster came: 32768 tries then failed a third of the time).
        self._variant = variant if variant in distributions and not distributions[variant].single() else None
        self._variant_tries = variant_tries
        self._admitted_by_variant = admitted_by_variant
        self._distributions = dict(distributions)
        self._varying = {name: d for name, d in self._distributions.items() if not d.single()}
        self._admissible = admissible
        self._taken = taken
        self._tries = tries
        self._parents_of, self._elites = -1, []  # completed trials the cached elites were chosen from

    def infer_relative_search_space(self, study, trial) -> dict:
        return dict(self._distributions)

    def _parents(self, study) -> list:
        """The current elites: the best `population_size` distinct configs of every completed trial
        (non-dominated rank on (time, error), feasible first, then crowding distance), or none while
        fewer than a population have completed."""
        from optuna.trial import TrialState

        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if len(done) != self._parents_of:
            pool, seen = [], set()
            for t in done:
                params = tuple(sorted(t.params.items()))
                if params not in seen:  # a repeated config is one individual: clones would crowd the elites
                    seen.add(params)
                    pool.append(t)
            self._elites = self._elite_population_selection_strategy(study, pool) \
                if len(pool) >= self._population_size else []
            self._parents_of = len(done)
        return self._elites

    def _complete(self, params: dict) -> dict:
        """A child with every knob: those NSGA-II left out (mutated ones) drawn uniformly, as its RandomSampler would."""
        rng = self._rng.rng
        out = {}
        for name, dist in self._distributions.items():
            out[name] = params[name] if name in params else dist.choices[rng.randint(len(dist.choices))]
        return out

    def _wanted(self, params: dict) -> bool:
        return self._admissible(params) and not self._taken(params)

    def _random_admissible(self, tries: int) -> dict | None:
        """A random admissible untaken config: with a variant knob, its value uniformly first (a variant
        whose draws all fail gives up after variant_tries), then the other knobs until one fits."""
        if self._variant is None:
            for _ in range(tries):
                child = self._complete({})
                if self._wanted(child):
                    return child
            return None
        choices = list(self._distributions[self._variant].choices)
        order = [choices[i] for i in self._rng.rng.permutation(len(choices))]
        for value in order:  # the drawn value first; the others only if it has nothing left
            if self._admitted_by_variant is not None:
                child = self._untaken_admitted(self._admitted_by_variant.get(value, ()))
                if child is not None:
                    return child
                continue
            for _ in range(self._variant_tries):
                child = self._complete({self._variant: value})
                if self._wanted(child):
                    return child
        return None

    def _untaken_admitted(self, pool) -> dict | None:
        """A uniformly drawn untaken config of `pool` (admitted configs' params), or None if all are taken: draws
        first, then, should they keep landing on taken ones, a scan in a random order."""
        rng = self._rng.rng
        for _ in range(min(len(pool), 64)):
            child = pool[rng.randint(len(pool))]
            if not self._taken(child):
                return dict(child)
        return next((dict(pool[i]) for i in rng.permutation(len(pool)) if not self._taken(pool[i])), None)

    def sample_relative(self, study, trial, search_space) -> dict:
        if trial.system_attrs.get("fixed_params"):
            return {}  # an enqueued (warm-start) trial: its params are given
        child = None
        parents = self._parents(study)
        if parents and self._varying:
            for _ in range(self._tries):
                child = self._complete(self._child_generation_strategy(study, self._varying, parents))
                if self._wanted(child):
                    return child
        else:
            child = self._random_admissible(self._tries)  # the first population: random
            if child is not None:
                return child
        immigrant = self._random_admissible(4 * self._tries)
        if immigrant is not None:
            return immigrant
        return child if child is not None else self._complete({})


class SurrogateSampler(optuna.samplers.BaseSampler):
    """evotune's default: every untaken admitted configuration is scored by an additive surrogate of the measured
    times, and the lowest predicted one is proposed (random ones until two configs have passed).

    The surrogate is ridge regression of log(time) on the one-hot values of the varying knobs (an intercept plus one
    weight per knob value, `ridge` the penalty on the weights): after n results it predicts every config of the
    space from the knob values' average effect. Each ask draws the weights from the fit's posterior, its covariance
    scaled by `explore` (Thompson sampling; 0: the fit itself): greedy on the fit alone never tries a knob value
    no measured config has while the measured ones look better than average. It is refitted on every ask from the COMPLETE trials (the ones that
    passed the gate); failed and pruned configs are taken, so never proposed again, and teach it nothing. Ties
    (e.g. configs sharing every knob value seen so far) are broken at random.

    Why (tools/kt_compare.py over both exhaustive oracles, docs/EFFICIENCY.md): Kernel Tuner's best strategies
    there are sequential local searches (genetic_algorithm on attention-small, simulated_annealing on
    attention-hopper), and the steered NSGA-II, whose first population is random and which waits for a whole
    population before breeding, needed more evaluations than either. The knob effects of these kernels are close
    to additive (tile shape, warps, pipeline depth each move the time in the same direction whatever the other
    knobs), so a model of one weight per knob value, fitted to a dozen results, already ranks the optimum's
    neighbourhood first; scoring the whole admitted space (not only neighbours of the incumbent) lets it jump
    between basins, which a Hamming-1 local step cannot. Single objective: the error only gates.

    Random draws (before the model has data) pick the variant knob's value first, as SteeredNSGAIISampler does,
    so a variant with few admitted configs is still drawn.

    Transfer (`prior_mean`: {(knob, value): mean of its weight}, from the shipped priors: warmstart.knob_prior): the
    ridge shrinks each weight toward its prior mean instead of toward 0, so before this shape has any result the
    model already ranks first the configs made of the knob values that won on the nearest shape classes, and the
    first measurements here move it from there rather than from a flat start. Measured results outweigh it as they
    come (each weight's prior counts as one observation, `ridge`). Random configs still come until `min_results`
    have passed: proposing from the prior mean alone made the first asks all neighbours of the priors' consensus, and
    in the CPU replay (docs/data/heldout/transfer_replay.py) the search then reached the optimum's 3% in 87 of 120
    searches instead of 90 with the random start.
    """

    def __init__(self, admitted: Sequence, distributions: dict, taken: Callable[[str], bool], *, seed: int = 0,
                 ridge: float = 1.0, explore: float = 1.0, variant: str | None = None, min_results: int = 2,
                 prior_mean: dict | None = None):
        import numpy as np

        self._configs = list(admitted)
        self._digests = _Digests(self._configs)  # as `taken` asks: 114,080 up front cost ~1.5 s on CI's CPU
        self._distributions = dict(distributions)
        self._taken = taken
        self._ridge = ridge
        self._explore = explore
        self._min_results = min_results
        self._rng = np.random.RandomState(seed)
        varying = [name for name, d in self._distributions.items() if len(d.choices) > 1]
        # The regression's columns: the intercept (0), then one per value of each varying knob. A config's row has
        # a 1 in the intercept and in one column per varying knob, so it is kept as those columns' indices: its
        # prediction is a sum of that many weights (gathered by index, not a dense configs x columns product
        # through BLAS, whose threads compete with the compile pool's processes for the CPUs).
        self._varying = varying
        self._column = {(name, value): 1 + k for k, (name, value) in
                        enumerate((n, v) for n in varying for v in self._distributions[n].choices)}
        self._width = 1 + len(self._column)
        self._active = np.array([self.active(c.as_dict()) for c in self._configs], dtype=np.intp).reshape(
            len(self._configs), 1 + len(varying))
        self._mean = np.zeros(self._width)  # the weights' prior mean (transfer); knob values it does not name: 0
        for key, mu in (prior_mean or {}).items():
            if key in self._column:
                self._mean[self._column[key]] = float(mu)
        self._variant = variant if variant in varying else None
        if self._variant is not None:  # each config's variant value, as its index in the values sorted by text
            of_config = [c.as_dict()[self._variant] for c in self._configs]
            self._variant_values = sorted(set(of_config), key=str)
            index = {value: k for k, value in enumerate(self._variant_values)}
            self._variant_index = np.array([index[value] for value in of_config], dtype=np.intp)

    def active(self, params: dict) -> list[int]:
        """The regression row of a config, as the indices of its nonzero (1.0) columns."""
        return [0] + [self._column[(name, params[name])] for name in self._varying]

    def predict(self, trials) -> "object":
        """log(time) predicted for every admitted config from `trials` (COMPLETE, values[0] = time)."""
        import numpy as np

        if not trials:  # transfer only: the prior mean ranks the configs (a constant intercept ranks nothing)
            return self._mean[self._active].sum(axis=1)
        x = np.zeros((len(trials), self._width))
        x[np.arange(len(trials))[:, None], [self.active(t.params) for t in trials]] = 1.0
        y = np.log([t.values[0] for t in trials])
        penalty = self._ridge * np.eye(self._width)
        penalty[0, 0] = 0.0  # the intercept is not shrunk: it is the mean log time
        gram = x.T @ x + penalty
        weights = np.linalg.solve(gram, x.T @ y + penalty @ self._mean)  # ridge toward the prior mean
        if self._explore > 0:
            # Thompson sampling: weights drawn from the ridge posterior (noise variance from the residuals), so a
            # knob value never measured, whose weight the data do not pin, is tried now and then.
            residual = y - x @ weights
            noise = max(float(residual @ residual) / max(len(y) - 1, 1), 1e-4)
            # The draw is weights + L z with L L^T the posterior covariance (gram^-1 * noise): a Cholesky factor of
            # gram, not numpy's multivariate_normal, whose SVD of the covariance took 1-90 ms an ask on a loaded CPU
            # (BLAS threads against the compile pool's processes) and was 5 s of a 77-ask first search on the H100.
            z = self._rng.standard_normal(self._width)
            try:  # gram is positive definite where the ridge is positive: x^T x plus it (the intercept's entry: n)
                factor = np.linalg.cholesky(gram)
                weights = weights + np.linalg.solve(factor.T, z) * np.sqrt(noise * self._explore)
            except np.linalg.LinAlgError:  # ridge 0 and too few results: the fit's weights, undrawn
                pass
        return weights[self._active].sum(axis=1)

    def infer_relative_search_space(self, study, trial) -> dict:
        return dict(self._distributions)

    def sample_relative(self, study, trial, search_space) -> dict:
        import numpy as np
        from optuna.trial import TrialState

        if trial.system_attrs.get("fixed_params"):
            return {}  # an enqueued (warm-start) trial: its params are given
        done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.values]
        if len(done) < self._min_results:
            index = self._random_free()
        else:
            # Lowest prediction first, random among equal ones; `taken` is asked lazily, in that order (the full
            # attention space has 10,104 admitted configs on the mission shape: one check each per ask cost ms).
            score = self.predict(done) + 1e-9 * self._rng.rand(len(self._configs))
            index = self._lowest_free(score)
        if index is None:
            return {}  # exhausted: sample_independent answers with a repeat, which the loop records as a duplicate
        config = self._configs[index].as_dict()
        return {name: config[name] for name in search_space if name in config}

    def _lowest_free(self, score) -> int | None:
        """The untaken config of lowest score, the first in the configs' order among equal ones: by argmin while
        the lowest few are taken (an argsort of 114,080 scores per ask cost ~10 ms), else in argsort's order."""
        import numpy as np

        if not np.isnan(score).any():
            score = score.copy()
            for _ in range(8):
                i = int(np.argmin(score))  # the first of the lowest, as a stable argsort's first
                if not np.isfinite(score[i]):
                    break
                if not self._taken(self._digests[i]):
                    return i
                score[i] = np.inf
        return next((int(i) for i in np.argsort(score, kind="stable") if not self._taken(self._digests[i])), None)

    def _random_free(self) -> int | None:
        """A random untaken config (None: none left), the variant knob's value drawn first among those with one."""
        order = self._rng.permutation(len(self._configs))
        if self._variant is not None:
            for v in self._rng.permutation(len(self._variant_values)):
                found = next((int(i) for i in order[self._variant_index[order] == v]
                              if not self._taken(self._digests[i])), None)
                if found is not None:
                    return found
            return None
        return next((int(i) for i in order if not self._taken(self._digests[i])), None)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self._configs[0][param_name] if self._configs else param_distribution.choices[0]
