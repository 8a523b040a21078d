"""Output helpers: rich tables for people, JSON with exact integers for machines."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Iterable, Sequence

import click

from ..config import GPTConfig
from ..workload import Workload


# The version of the JSON every command emits (docs/json.md); bumped when a key changes meaning.
SCHEMA = "gptcalc/2"


def emit_json(obj: Any) -> None:
    """Strict JSON: a value that is not finite (NaN, Infinity: not JSON) raises OverflowError,
    which the commands computing in floats turn into one line naming an option."""
    try:
        text = json.dumps(obj, indent=2, allow_nan=False)
    except ValueError:
        raise OverflowError("a result is not a finite number") from None
    click.echo(text)


def envelope(cfg: GPTConfig | None, workload: Workload | None = None,
             training: Any = None) -> dict[str, Any]:
    """The keys every command's --json starts with, the same meaning everywhere:

    schema: SCHEMA; config: every GPTConfig field of the model the options resolved to;
    workload: batch_size (B, sequences per device) and seq_len (tokens per sequence);
    training: the command's training set-up (a dataclass such as TrainingSetup, or a dict),
    only for commands that have one. `cfg=None` (a command about no single model, `presets`)
    gives the schema alone."""
    out: dict[str, Any] = {"schema": SCHEMA}
    if cfg is not None:
        out["config"] = dataclasses.asdict(cfg)
    if workload is not None:
        out["workload"] = dataclasses.asdict(workload)
    if training is not None:
        out["training"] = (dataclasses.asdict(training) if dataclasses.is_dataclass(training)
                           else dict(training))
    return out


def print_table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]],
                caption: str | None = None, total_row: Sequence[Any] | None = None,
                edge: bool = True) -> None:
    """A rich table; the first column is left-aligned, numbers to the right; `edge` False:
    no outer frame (two lines fewer, for a one-screen answer).

    A number is never cut: every column but the first is as wide as its widest cell and never
    wraps or ellipsizes; the first column (the labels) wraps at spaces instead. When even that
    does not fit the terminal, the table is printed wider than the terminal (its lines wrap on
    screen, the numbers stay whole in the text)."""
    from rich import box
    from rich.table import Table

    rows = [[str(c) for c in row] for row in rows]
    total = None if total_row is None else [str(c) for c in total_row]
    table = Table(title=title, title_justify="left", show_edge=edge,
                  **({} if edge else {"box": box.SIMPLE_HEAD}))
    for i, name in enumerate(columns):
        cells = [r[i] for r in rows if i < len(r)] + ([total[i]] if total else [])
        widest = max([len(name), *map(len, cells)])
        if i == 0:
            table.add_column(name, justify="left", overflow="fold")
        else:
            table.add_column(name, justify="right", no_wrap=True, overflow="fold",
                             min_width=widest)
    for row in rows:
        table.add_row(*row)
    if total is not None:
        if edge:
            table.add_section()
        table.add_row(*(f"[bold]{c}[/bold]" for c in total))
    console = _console()
    # measured without a width to keep to: the labels' longest word, the numbers whole
    need = console.measure(table, options=console.options.update_width(10**4))
    width = console.width if _fixed_width(console) else need.maximum
    _console(max(width, need.minimum)).print(table, crop=False)
    if caption:  # under the table, wrapped as a line of text, not to the table's width
        print_line(caption)


def print_line(text: str, wrap: bool = False) -> None:
    """One line of text. `wrap`: at a width to keep to (a terminal's, or COLUMNS), broken at
    spaces into lines no wider than it, a number never parted from its unit nor an option
    from its value; piped without COLUMNS, one line whatever its length."""
    console = _console()
    if wrap and _fixed_width(console):
        for line in wrap_text(text, console.width):
            console.print(line, soft_wrap=True, highlight=False, markup=False)
        return
    console.print(text, soft_wrap=True, highlight=False)


def print_wrapped(text: str) -> None:
    """`print_line(text, wrap=True)`: broken at spaces to the width there is."""
    print_line(text, wrap=True)


# a space that must not break a line: between a number and its unit ("1.25 GiB", "8,192
# tokens") and between an option and its value ("--tp 2")
_NUMBER_UNIT = re.compile(r"(\d) (?=(?:[KMGTPEZ]i?)?B\b|[kMGTPEZ]?FLOP|s\b|ms\b|h\b|days\b"
                          r"|tokens\b)")
_OPTION_VALUE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*) (?=[^\s-])")


def wrap_text(text: str, width: int) -> list[str]:
    """`text` broken at spaces into lines of at most `width` characters (a longer word stays
    whole on its own line), the glued spaces kept; its indent starts every line."""
    import textwrap

    indent = text[:len(text) - len(text.lstrip(" "))]
    glued = _OPTION_VALUE.sub("\\1\u00a0", _NUMBER_UNIT.sub("\\1\u00a0", text.strip()))
    lines = textwrap.wrap(glued, width=max(width, len(indent) + 1), initial_indent=indent,
                          subsequent_indent=indent, break_long_words=False,
                          break_on_hyphens=False) or [""]
    return [line.replace("\u00a0", " ") for line in lines]


def _fixed_width(console) -> bool:
    """A width to keep to: a terminal's, or the COLUMNS a pipe was given."""
    import os

    return console.is_terminal or os.environ.get("COLUMNS", "").strip().isdigit()


def _console(width: int | None = None):
    """The console to print on; `width` None: the terminal's, or COLUMNS, else no limit (piped
    output has no width to go by, and tables then take the width they need)."""
    from rich.console import Console

    if width is None and not _fixed_width(Console()):
        width = 10**4
    return Console(width=width)
