"""The `evotune` command line: a thin typer + rich layer over the library.

Errors the user can fix print one line and exit non-zero (2 for bad input);
tracebacks appear only with --debug. GPU work happens in worker processes.

The commands live beside this file, one module per group: family (shapes, check), search, candidate
(replay, bench, verify, sanitize, sass), records (export, runs), table (table build|show, tune), priors
(priors build|show), new_family (new-family). They
register on common.app, which also holds what they share; this module adds the root options and main().
"""

from __future__ import annotations

import sys
from typing import Optional

import typer

from ..errors import EvotuneError
from .common import INTERRUPTED, INTERRUPTED_EXIT, app, err_console

# Importing a command module registers its commands on app, and --help lists them in this order.
from . import family, search, candidate, records, table, priors, new_family  # noqa: F401

_state = {"debug": False}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
          plugin: Optional[list[str]] = typer.Option(
              None, "--plugin", help="Allow this module's kernel families (package.module; repeatable). "
              "Plugin families are code: evotune imports none that you did not allow here or in EVOTUNE_PLUGINS.")):
    _state["debug"] = debug
    if plugin:
        from ..problems import allow_plugins

        allow_plugins(plugin)


def _invoke(args: list[str]) -> None:
    """Parse `args` and run the command, as click's main would but letting exceptions through: its main
    turns Ctrl-C into an exit code (typer) or a bare newline (click) before main() below could say so."""
    command = typer.main.get_command(app)
    with command.make_context("evotune", args) as ctx:
        command.invoke(ctx)


def _parser_error(e: Exception) -> str:
    """A parser usage error (no such option, a value out of range, ...) as one line."""
    ctx = getattr(e, "ctx", None)
    where = f"; see `{ctx.command_path} --help`" if ctx is not None else ""
    return " ".join(e.format_message().split()).rstrip(".") + where


def main() -> None:
    try:
        _invoke(sys.argv[1:])
    except EvotuneError as e:
        if _state["debug"]:
            raise
        err_console.print(f"evotune: error: {e}", highlight=False, markup=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err_console.print(INTERRUPTED, highlight=False)
        sys.exit(INTERRUPTED_EXIT)
    except typer.Exit as e:  # --help, or a command's own exit code (a search stopped by Ctrl-C)
        sys.exit(e.exit_code)
    except Exception as e:  # the parser's own usage errors, and anything unexpected
        # Typer vendors click; its exceptions carry `format_message()` and an exit code (2 for usage).
        if type(e).__name__ == "NoArgsIsHelpError":
            e.show()  # `evotune` alone: the help text
            sys.exit(e.exit_code)
        if hasattr(e, "format_message") and isinstance(getattr(e, "exit_code", None), int):
            err_console.print(f"evotune: error: {_parser_error(e)}", highlight=False, markup=False, soft_wrap=True)
            sys.exit(e.exit_code)
        if _state["debug"]:
            raise
        usage_line = getattr(e, "evotune_usage_line", None)  # a plugin module that raised on import
        if isinstance(usage_line, str):
            err_console.print(f"evotune: error: {usage_line}", highlight=False, markup=False, soft_wrap=True)
            sys.exit(2)
        err_console.print(f"evotune: internal error: {type(e).__name__}: {str(e)[:300]} "
                          f"(rerun with --debug for the traceback)",
                          highlight=False, markup=False, soft_wrap=True)
        sys.exit(1)
