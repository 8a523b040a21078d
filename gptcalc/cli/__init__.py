"""The `gptcalc` command line. Analytic commands import neither torch nor matplotlib."""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import traceback

import click

from ..errors import ConfigError
from .blame import blame, shorten, typed
from .options import option_for


# click 8.2+ signals "no arguments, show help" with an exception; older clicks print it directly
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class GptcalcGroup(click.Group):
    """A group whose errors are one line on stderr and exit code 2, never a traceback."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        held = _Held(sys.stdout)
        try:
            with contextlib.redirect_stdout(held):
                rv = super().main(args, prog_name or "gptcalc", complete_var,
                                  standalone_mode=False, **extra)
            held.release()
        except ConfigError as e:
            _fail(getattr(e, "line", None) or f"{option_for(e.field)}: {e.message}")
        except _NO_ARGS_IS_HELP as e:  # click >= 8.2 raises this for a bare `gptcalc`
            click.echo(e.ctx.get_help() if e.ctx else str(e))
            sys.exit(0)
        except click.ClickException as e:
            _fail(e.format_message())
        except click.exceptions.Abort:
            _fail("aborted", code=1)
        except Exception as e:  # noqa: BLE001 - a bug must not print a traceback as an answer
            if os.environ.get("GPTCALC_DEBUG"):
                traceback.print_exc()
            detail = " ".join(str(e).split())[:200]
            _fail(f"internal error ({type(e).__name__}: {detail}); please report it "
                  "(GPTCALC_DEBUG=1 shows the traceback)", code=1)
        code = rv if isinstance(rv, int) else 0
        if not standalone_mode:
            return code
        sys.exit(code)


class _Held(io.StringIO):
    """Standard output held until the command ends: an error then leaves no results printed
    above it. A terminal stays one (rich asks `isatty` to pick its width and colours)."""

    def __init__(self, stream) -> None:
        super().__init__()
        self.stream = stream

    def isatty(self) -> bool:
        return self.stream.isatty()

    def release(self) -> None:
        self.stream.write(self.getvalue())
        self.stream.flush()


def _fail(message: str, code: int = 2) -> None:
    click.echo("Error: " + shorten(message), err=True)
    sys.exit(code)


# a number that is not finite, as Python prints it ("inf s per step", "nan"), not a word of a
# label ("inf/nan tracker", AMD's "Infinity Fabric": Python never prints "infinity");
# JSON is strict already (`render.emit_json`)
_NONFINITE = re.compile(r"(?<![\w./-])-?(inf|nan)(?![\w/-])", re.IGNORECASE)


def _blaming(command: click.Command) -> None:
    """A command whose ConfigError is told against what the user typed (`blame`), and whose
    result past a float's range (OverflowError, or `inf`/`nan` in its text) is one line naming
    the typed option furthest from 1, never a traceback or an infinite figure."""
    invoke = command.invoke

    def run(ctx: click.Context):
        _no_nul(ctx)
        try:
            rv = invoke(ctx)
        except ConfigError as e:
            if not hasattr(e, "line"):
                e.line = blame(e, ctx)
            raise
        except OverflowError:
            raise _out_of_range(ctx) from None
        held = sys.stdout
        if (isinstance(held, _Held) and not ctx.params.get("as_json")
                and _NONFINITE.search(held.getvalue())):
            raise _out_of_range(ctx)
        return rv
    command.invoke = run


def _no_nul(ctx: click.Context) -> None:
    """No option's text holds a NUL character: no path, name or number can, and the OS
    refuses such a path with an error that names nothing."""
    for name, value in ctx.params.items():
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, str) and "\x00" in v:
                raise ConfigError(name, "holds a NUL character")


def _out_of_range(ctx: click.Context) -> ConfigError:
    from .options import _most_extreme

    from ..schema import OPTIONS

    given = typed(ctx)
    name = _most_extreme(given or ctx.params)
    keyword = OPTIONS[name].keyword if name in OPTIONS else name
    e = ConfigError(name, "a result passes the floating-point range (about 1.8e308) or is not "
                          "a number, with a value this far from 1")
    value = given.get(keyword)
    e.line = blame(e, ctx) if value is None else f"{option_for(name)} {value!r}: {e.message}"
    return e


@click.group(cls=GptcalcGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gptcalc", prog_name="gptcalc")
def cli() -> None:
    """Exact parameter, FLOP and memory counts for GPT-style models, checked against PyTorch."""


def _register() -> None:
    from . import (flops, gpus, infer, memory, params, plan, plot, presets, report, serve, time,
                   verify)

    for module in (presets, params, flops, memory, plan, gpus, time, infer, serve, verify, plot,
                   report):
        _blaming(module.command)
        cli.add_command(module.command)


_register()


def main() -> None:
    cli.main()
