"""Output helpers: rich tables for people, JSON with exact integers for machines."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable, Sequence

import click

from ..config import GPTConfig
from ..workload import Workload


# The version of the JSON every command emits (docs/json.md); bumped when a key changes meaning.
SCHEMA = "gptcalc/2"


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2))


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


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]],
                caption: str | None = None, total_row: Sequence[Any] | None = None) -> None:
    """A rich table; the first column is left-aligned, numbers to the right."""
    from rich.table import Table

    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        table.add_row(*(str(c) for c in row))
    if total_row is not None:
        table.add_section()
        table.add_row(*(f"[bold]{c}[/bold]" for c in total_row))
    _console().print(table)


def print_line(text: str) -> None:
    _console().print(text, soft_wrap=True, highlight=False)


def _console():
    from rich.console import Console

    console = Console()
    # piped output has no width to go by: rich would squeeze tables into 80 columns
    return console if console.is_terminal else Console(width=120)
