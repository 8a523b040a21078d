"""Optional dependencies: a command that needs one says which extra installs it."""

from __future__ import annotations

import importlib.util

import click

# module -> (what it is, the extra that installs it)
_EXTRAS = {
    "torch": ("PyTorch", "verify"),
    "fvcore": ("fvcore", "verify"),
    "matplotlib": ("matplotlib", "plots"),
    "transformers": ("transformers", "hf"),
}


class MissingExtra(click.ClickException):
    """Exit 2 with one line: what is missing and the pip command that installs it."""

    exit_code = 2


def require(command: str, *modules: str) -> None:
    """Raise MissingExtra naming the first of `modules` that is not installed.

    Checks with importlib.util.find_spec, so nothing heavy is imported here."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            what, extra = _EXTRAS[module]
            raise MissingExtra(f"gptcalc {command} needs {what}: pip install 'gptcalc[{extra}]'")


__all__ = ["MissingExtra", "require"]
