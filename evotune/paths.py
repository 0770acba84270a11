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


def runs_root() -> Path | None:
    """Where runs live: $EVOTUNE_RUNS, else ./runs in the current folder; None where the current folder is gone.
    (records.runs.runs_dir says so as an error; outputs reads it to keep `-o` out of run folders.)"""
    import os

    if os.environ.get("EVOTUNE_RUNS"):
        return Path(os.environ["EVOTUNE_RUNS"])
    try:
        return Path.cwd() / "runs"
    except OSError:  # the current folder was removed under us
        return None


def cache_root() -> Path:
    """evotune's cache: $EVOTUNE_CACHE, else ~/.cache/evotune (compiled kernels in its cubin/ folder, the default
    tuning table at its top)."""
    import os

    return Path(os.environ.get("EVOTUNE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "evotune"))
