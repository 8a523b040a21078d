"""The `--engine` option's type and help, read from the engine registry
(`gptcalc.memory.engines`): the command line names no engine of its own."""

from __future__ import annotations

import click

from ..memory import engines


class EngineChoice(click.Choice):
    """One of the registered training engines, read when the option is parsed (an engine
    registered after import is a choice too)."""

    def __init__(self) -> None:
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        return engines.names()

    @choices.setter
    def choices(self, _value) -> None:  # click.Choice.__init__ assigns it; the registry decides
        pass


def engine_help(lead: str) -> str:
    """`lead` followed by each registered engine's own phrase, and whether --mode defaults to
    mixed under it."""
    phrases = []
    for name in engines.names():
        engine = engines.engine_named(name)
        phrases.append(engine.help + (", --mode mixed by default" if engine.mixed_by_default
                                      else ""))
    return f"{lead} " + "; ".join(phrases) + "."


__all__ = ["EngineChoice", "engine_help"]
