"""Exceptions that the CLI turns into one clear line and an exit code."""


class EvotuneError(Exception):
    """An expected failure: the CLI prints its message and exits 1."""

    exit_code = 1


class UsageError(EvotuneError):
    """Bad input from the user (shape, space file, run name): exit code 2."""

    exit_code = 2


class NoGPUError(EvotuneError):
    """The command needs a CUDA GPU and none is visible."""

    exit_code = 1
