"""Where evotune's shipped data lives, in a checkout and after a wheel install (the ground floor:
imports nothing of evotune)."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# The source tree holding this package: the repository in a checkout or an editable install
# (site-packages after a wheel install, where only the packaged data below exists).
REPO_ROOT = PACKAGE_DIR.parent


def package_data_dir(name: str) -> Path:
    """A data folder shipped with evotune (`kernels`, `search_spaces`): inside the package after a
    wheel install (pyproject maps them there), at the top of the repository in a checkout or an
    editable install."""
    packaged = PACKAGE_DIR / name
    return packaged if packaged.is_dir() else REPO_ROOT / name
