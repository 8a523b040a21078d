"""A report as a list of blocks, rendered to Markdown and to self-contained HTML.

Both renderings come from the same blocks, so they hold the same content. The HTML has its CSS
inline and refers only to images beside it (relative paths): nothing is fetched from a network.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from typing import Sequence, Union


@dataclass(frozen=True)
class Heading:
    level: int  # 1 = the title
    text: str


@dataclass(frozen=True)
class Para:
    text: str  # plain text; `code` and **bold** spans are kept in both renderings


@dataclass(frozen=True)
class Bullets:
    items: tuple[str, ...]


@dataclass(frozen=True)
class Table:
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    caption: str = ""
    total: tuple[str, ...] | None = None  # a bold last row


@dataclass(frozen=True)
class Image:
    src: str  # a file name beside the report
    alt: str
    caption: str = ""


@dataclass(frozen=True)
class Code:
    text: str


@dataclass(frozen=True)
class Contents:
    """A list of links to every level-2 heading of the document, drawn where it stands."""

    title: str = "Contents"


Block = Union[Heading, Para, Bullets, Table, Image, Code, Contents]


def anchor(text: str) -> str:
    """The id of a heading: GitHub's slug (lower case, punctuation dropped, spaces to '-'),
    so the same link works in the Markdown on GitHub and in the HTML."""
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def _sections(blocks: Sequence[Block]) -> list[str]:
    return [b.text for b in blocks if isinstance(b, Heading) and b.level == 2]


def table(columns: Sequence[str], rows: Sequence[Sequence[object]], caption: str = "",
          total: Sequence[object] | None = None) -> Table:
    return Table(tuple(columns), tuple(tuple(str(c) for c in r) for r in rows), caption,
                 None if total is None else tuple(str(c) for c in total))


# ---------------------------------------------------------------------------------------------
# Markdown

_NUMBER = re.compile(r"^[*]*[-+]?[\d,.]+(\s?[kMGTPE]?(i?B)?|%)?[*]*$")


def _numeric_columns(b: Table) -> list[bool]:
    """Right-align a column (not the first) when every cell in it is a number."""
    rows = list(b.rows) + ([b.total] if b.total else [])
    return [i > 0 and all(_NUMBER.match(r[i].strip()) for r in rows if r[i].strip())
            for i in range(len(b.columns))]

def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(blocks: Sequence[Block]) -> str:
    out: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append("#" * b.level + " " + b.text)
        elif isinstance(b, Para):
            out.append(b.text)
        elif isinstance(b, Bullets):
            out.append("\n".join(f"- {item}" for item in b.items))
        elif isinstance(b, Table):
            aligns = ["---:" if right else "---" for right in _numeric_columns(b)]
            lines = ["| " + " | ".join(_md_cell(c) for c in b.columns) + " |",
                     "| " + " | ".join(aligns) + " |"]
            lines += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in b.rows]
            if b.total is not None:
                lines.append("| " + " | ".join(f"**{_md_cell(c)}**" for c in b.total) + " |")
            if b.caption:
                lines += ["", f"*{b.caption}*"]
            out.append("\n".join(lines))
        elif isinstance(b, Image):
            text = f"![{b.alt}]({b.src})"
            out.append(text + (f"\n\n*{b.caption}*" if b.caption else ""))
        elif isinstance(b, Code):
            out.append("```\n" + b.text.rstrip("\n") + "\n```")
        elif isinstance(b, Contents):
            out.append(f"**{b.title}:** " + " · ".join(
                f"[{_md_cell(t)}](#{anchor(t)})" for t in _sections(blocks)))
        else:  # pragma: no cover - a new block kind without a renderer
            raise TypeError(f"unknown block {b!r}")
    return "\n\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# HTML

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; max-width: 72rem;
       margin: 2rem auto; padding: 0 1rem; color: #1a1a1a; line-height: 1.45; }
h1 { border-bottom: 2px solid #333; padding-bottom: .3rem; }
h2 { border-bottom: 1px solid #ccc; padding-bottom: .2rem; margin-top: 2.2rem; }
.table-wrap { overflow-x: auto; max-width: 100%; margin: .8rem 0; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #ccc; padding: .25rem .6rem; }
th { background: #f2f2f2; }
th { text-align: left; }
.num { text-align: right; white-space: nowrap; }
tr.total td { font-weight: bold; background: #fafafa; }
caption, figcaption, .caption { caption-side: bottom; text-align: left; color: #555;
       font-size: .9rem; font-style: italic; padding-top: .3rem; }
figure { margin: 1.2rem 0; }
figure img { max-width: 100%; border: 1px solid #ddd; }
code, pre { font-family: ui-monospace, "DejaVu Sans Mono", monospace; background: #f5f5f5; }
code { padding: 0 .2rem; }
pre { padding: .6rem; overflow-x: auto; }
nav.contents { background: #f7f7f7; border: 1px solid #ddd; padding: .4rem 1rem; }
nav.contents ol { margin: .3rem 0; columns: 2; }
"""


def _inline(text: str) -> str:
    """Escape, then keep the two inline marks both renderings share: `code` and **bold**."""
    t = html.escape(text, quote=False)
    t = re.sub(r"`([^`]+)`", r"<code>\1</code>", t)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", t)


def to_html(blocks: Sequence[Block], title: str) -> str:
    body: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            body.append(f'<h{b.level} id="{anchor(b.text)}">{_inline(b.text)}</h{b.level}>')
        elif isinstance(b, Para):
            body.append(f"<p>{_inline(b.text)}</p>")
        elif isinstance(b, Bullets):
            body.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in b.items) + "</ul>")
        elif isinstance(b, Table):
            num = _numeric_columns(b)

            def cells(row, tag="td", num=num):
                return "".join(f'<{tag}{" class=num" if n else ""}>{_inline(c)}</{tag}>'
                               for c, n in zip(row, num))
            rows = ["<tr>" + cells(b.columns, "th") + "</tr>"]
            rows += ["<tr>" + cells(r) + "</tr>" for r in b.rows]
            if b.total is not None:
                rows.append('<tr class="total">' + cells(b.total) + "</tr>")
            caption = f"<caption>{_inline(b.caption)}</caption>" if b.caption else ""
            # a wide table scrolls inside its own box rather than widening the page
            body.append(f'<div class="table-wrap"><table>{caption}{"".join(rows)}</table></div>')
        elif isinstance(b, Image):
            cap = f"<figcaption>{_inline(b.caption)}</figcaption>" if b.caption else ""
            body.append(f'<figure><img src="{html.escape(b.src)}" alt="{html.escape(b.alt)}">'
                        f"{cap}</figure>")
        elif isinstance(b, Code):
            body.append(f"<pre>{html.escape(b.text)}</pre>")
        elif isinstance(b, Contents):
            links = "".join(f'<li><a href="#{anchor(t)}">{_inline(t)}</a></li>'
                            for t in _sections(blocks))
            body.append(f'<nav class="contents"><strong>{html.escape(b.title)}</strong>'
                        f"<ol>{links}</ol></nav>")
        else:  # pragma: no cover
            raise TypeError(f"unknown block {b!r}")
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
            + "\n".join(body) + "\n</body>\n</html>\n")
