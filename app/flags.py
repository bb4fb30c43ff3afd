"""Command-line flag values: each numeric flag is read by a type function that refuses what cannot work.

A value is refused while the arguments are read, before any model loads, so a typo costs nothing. Every
refusal is a `UsageError` (printed as one `error: ...` line, exit status 2), never argparse's own exit.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import NoReturn

from tandem.kernels.errors import UsageError
from tandem.runtime.cost import CostModel

SEED_MAX = 2**63 - 1  # torch's generators take a signed 64-bit seed; larger ones overflow inside torch


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises `UsageError` instead of printing the usage and exiting (subparsers inherit it)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def _describe(low: float | None, high: float | None, low_open: bool = False) -> str:
    def show(x: float | None) -> str:
        return str(x) if isinstance(x, int) else f"{x:g}"

    if high is None:
        return f"more than {show(low)}" if low_open else f"at least {show(low)}"
    if low is None:
        return f"at most {show(high)}"
    return f"more than {show(low)} and at most {show(high)}" if low_open else f"between {show(low)} and {show(high)}"


def whole(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """A whole number in [low, high] (either end open when None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_describe(low, high)} (got {text})")
        return value

    parse.__name__ = "whole number"
    return parse


def real(low: float | None = None, high: float | None = None, *, low_open: bool = False) -> Callable[[str], float]:
    """A finite number in [low, high] ((low, high] with `low_open`). NaN and infinities are refused: they pass
    every comparison test silently and then poison the arithmetic they reach (sampling, byte budgets)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number (got {text})")
        if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_describe(low, high, low_open)} (got {text})")
        return value

    parse.__name__ = "number"
    return parse


def cpu_threads_available() -> int:
    """The most threads worth asking for: the CPU threads this machine has (more only oversubscribes)."""
    return os.cpu_count() or 1


def threads(text: str) -> int:
    """A thread count from 1 to this machine's CPU threads (a count outside that never reaches the kernels)."""
    limit = cpu_threads_available()
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if not 1 <= value <= limit:
        raise argparse.ArgumentTypeError(
            f"must be between 1 and {limit}, the number of CPU threads this machine has (got {text})")
    return value


def path(text: str) -> str:
    """A file or folder name: an empty one is refused (`--model ""` from an unset shell variable must not quietly
    mean the default model, nor "" mean the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, not an empty string")
    return text


path.__name__ = "path"

MAX_VRAM_GB = 1e6  # a petabyte of accelerator memory: beyond any device, and bytes that still fit an int64

seed = whole(0, SEED_MAX)
seed.__name__ = "seed"


def cost(text: str) -> CostModel:
    """`--cost A,B,GPU,T`: four finite, non-negative latencies in ms."""
    try:
        return CostModel.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def names(known: tuple[str, ...], what: str) -> Callable[[str], tuple[str, ...]]:
    """A comma list of names, each one of `known` (an unknown name is refused, never replaced by a default)."""

    def parse(text: str) -> tuple[str, ...]:
        given = tuple(n.strip() for n in text.split(","))
        unknown = [n for n in given if n not in known]
        if unknown or not given:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(repr(n) for n in unknown)}; choose from {', '.join(known)}")
        return given

    parse.__name__ = what
    return parse


def whole_list(low: int, high: int) -> Callable[[str], tuple[int, ...]]:
    """A comma list of whole numbers, each in [low, high]."""
    one = whole(low, high)

    def parse(text: str) -> tuple[int, ...]:
        values = []
        for part in text.split(","):
            try:
                values.append(one(part.strip()))
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(f"a comma list of whole numbers from {low} to {high}: {e}") from None
        return tuple(values)

    parse.__name__ = "list of whole numbers"
    return parse
