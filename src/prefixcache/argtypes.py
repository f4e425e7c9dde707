"""What the commands share on the command line: ``type=`` converters (a bad value is a usage error naming the
option) and the parser class every ``prefixcache`` subcommand is built from."""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Sequence
from typing import NoReturn

from prefixcache.units import parse_memory


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):  # NaN fails the comparison
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def comma_separated(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """A parser of comma-separated names out of ``choices`` (at least one, in the order given, duplicates dropped)."""

    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [name for name in names if name not in choices]
        if not names or unknown:
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(choices)}, got {text!r}")
        return list(dict.fromkeys(names))

    return parse


def memory_size(text: str) -> int:
    """A size such as ``8MiB`` or a byte count (``parse_memory``), its own words when it cannot be read."""
    try:
        return parse_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def port(text: str) -> int:
    """A TCP port; 0 asks the system for a free one (the server logs the one it got)."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {value}")
    return value


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions keep their paragraphs (they are docstrings) without their reST double backticks; every option
    with a default worth showing says it, with or without help text (not ``None`` or ``False``: an option that is
    off unless given)."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(text.replace("``", ""))

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.option_strings and _shown_default(action) is not None:
            action = copy.copy(action)
            action.help = "-"  # a placeholder _get_help_string replaces with the default alone
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = "" if action.help == "-" else (action.help or "").replace("``", "")
        default = _shown_default(action)
        if default is None or "default" in help_text:
            return help_text
        return f"{help_text} (default: {default})".lstrip().replace("%", "%%")


def _shown_default(action: argparse.Action) -> str | None:
    default = action.default
    if not action.option_strings or default is None or default is False or default is argparse.SUPPRESS:
        return None
    return " ".join(map(str, default)) if isinstance(default, list | tuple) else str(default)


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` that shows defaults in ``--help`` and reports a usage error in one line.

    Subcommands made with ``add_subparsers().add_parser`` are of this class too (argparse builds them from the
    parent's class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
