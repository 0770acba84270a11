"""The repository the tests run from. Tests read kernels/, search_spaces/ and tools/ here, not through
evotune's own REPO_ROOT, so the suite also runs against a wheel install of evotune (.ci/run does)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
