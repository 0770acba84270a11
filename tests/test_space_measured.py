"""Measured priors live apart from validity (issue 39 item 3): a space's `measured:` entries prune like constraints
but carry the evidence they were measured on; a constraint is what the kernel cannot do."""

from __future__ import annotations

import re

import pytest
from _paths import REPO_ROOT

from evotune.errors import UsageError
from evotune.space.reader import load_builtin, load_space

SPACE = """family: softmax
params:
  rows_per_cta: {values: [1, 2, 4], default: 1, doc: rows}
constraints:
  - expr: rows_per_cta != 4
    why: validity
measured:
  - expr: rows_per_cta != 2
    why: measured to lose
    evidence: docs/somewhere.md
"""


def _write(tmp_path, text):
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return path


def test_measured_entries_prune_and_name_their_evidence(tmp_path):
    space = load_space(_write(tmp_path, SPACE))
    measured = [c for c in space.constraints if c.measured]
    validity = [c for c in space.constraints if not c.measured]
    assert [c.evidence for c in measured] == ["docs/somewhere.md"] and len(validity) == 1


def test_a_measured_prior_without_evidence_is_a_file_line_error(tmp_path):
    text = SPACE.replace("    evidence: docs/somewhere.md\n", "")
    with pytest.raises(UsageError, match=r"space.yaml:\d+: .*measured prior has no `evidence`"):
        load_space(_write(tmp_path, text))


def test_attention_separates_its_measured_priors_and_each_evidence_exists():
    space = load_builtin("attention")
    measured = [c for c in space.constraints if c.measured]
    assert {"exp2_fma == 0 or mma == 'sync'", "acc_regs <= 160"} <= {c.expr for c in measured}
    for c in measured:
        for path in re.findall(r"(?:docs|search_spaces|kernels|tools)/[\w./-]+\.\w+", c.evidence):
            assert (REPO_ROOT / path).exists(), (c.expr, path)
    assert not any("lost" in c.why or "measured" in c.why.lower() for c in space.constraints if not c.measured)
