"""The one place that talks to the terminal (and the only Rich user).

`UI` holds a stdout console (data: tables, JSON, task logs) and a stderr
console (progress, notes, errors), so `--json` output stays clean and tests can
swap both streams. Rich is imported lazily: `plan --json` never needs it.
Everything printed here passes safetext.escape: no value from a spec or a host
reaches the terminal with a raw control character (task output itself is LogMux's).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import IO, Any, Iterable, Sequence

from tfcluster.safetext import escape


class UI:
    def __init__(self, stdout: IO[str] | None = None, stderr: IO[str] | None = None,
                 *, color: bool | None = None, debug: bool = False) -> None:
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        if color is None:
            color = self.stdout.isatty() and "NO_COLOR" not in os.environ
        self.color = color
        self.debug = debug
        self._out = None
        self._err = None
        # what holds the live footer off the terminal while a message is printed (train)
        self.pause = contextlib.nullcontext

    # -- consoles, created on first use -------------------------------------------------
    @property
    def out(self):
        if self._out is None:
            self._out = _console(self.stdout, self.color)
        return self._out

    @property
    def err(self):
        if self._err is None:
            self._err = _console(self.stderr, self.color and self.stderr.isatty())
        return self._err

    @property
    def byte_stdout(self):
        """The binary stream under stdout, for task output (LogMux writes bytes)."""
        return getattr(self.stdout, "buffer", self.stdout)

    # -- messages ------------------------------------------------------------------------
    def error(self, message: str, hint: str | None = None) -> None:
        with self.pause():
            self.stderr.write(f"tfcluster: error: {escape(message)}\n")
            if hint:
                self.stderr.write(f"hint: {escape(hint)}\n")
            self.stderr.flush()

    def details(self, text: str) -> None:
        """An error's multi-line context (a log tail, a table), printed before its line."""
        self.stderr.write(escape(text.rstrip("\n"), newlines=True) + "\n")

    def warn(self, message: str) -> None:
        with self.pause():
            _write(self.stderr, f"tfcluster: warning: {escape(message)}\n")

    def info(self, message: str) -> None:
        """A progress/status line on stderr (never parsed, never markup)."""
        with self.pause():
            if _terminal(self.stderr):
                self.err.print(escape(message), markup=False, highlight=False, emoji=False, soft_wrap=True)
            else:
                _write(self.stderr, escape(message) + "\n")

    def ok(self, message: str) -> None:
        with self.pause():
            if _terminal(self.stderr):
                self.err.print(f"✓ {escape(message)}", style="green", markup=False, highlight=False,
                               emoji=False, soft_wrap=True)
            else:
                _write(self.stderr, f"✓ {escape(message)}\n")

    def json(self, document: Any) -> None:
        indent = 2 if self.stdout.isatty() else None  # pipes get compact JSON: 1,000 tasks stay fast
        # json escapes every other control character (and all non-ASCII); DEL it leaves raw
        self.stdout.write(json.dumps(document, indent=indent).replace("\x7f", "\\u007f") + "\n")
        self.stdout.flush()

    def table(self, title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]],
              *, stderr: bool = False) -> None:
        stream = self.stderr if stderr else self.stdout
        if _terminal(stream):
            (self.err if stderr else self.out).print(_table(title, columns, rows))
        else:
            _write(stream, plain_table(title, columns, rows))

    def table_text(self, title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
        """The same table as text, for an error's `details` (shown just before its line)."""
        if not _terminal(self.stderr):
            return plain_table(title, columns, rows)
        console = _console(io.StringIO(), False)
        with console.capture() as captured:
            console.print(_table(title, columns, rows))
        return captured.get()

    def text(self, text: str, *, style: str | None = None) -> None:
        """Lines of data on stdout (commands to copy among them): never wrapped by us."""
        if _terminal(self.stdout):
            self.out.print(escape(text, newlines=True), style=style, markup=False, highlight=False,
                           emoji=False, soft_wrap=True)
        else:
            _write(self.stdout, escape(text, newlines=True) + "\n")


# Off a terminal (a pipe, a file, CI) everything is written as is: Rich is not imported on
# the way to a command's first connection (docs/design/remote-execs.md, "Start-up cost"), no line
# is wrapped at Rich's 200 columns (a command saved from `plan --commands` stays one line),
# and a table is plain aligned columns a reader can grep and cut. A terminal keeps Rich
# for tables and colours; its lines are soft-wrapped (the terminal folds them, a copy of
# one is still one line). Neither path turns `:name:` into an emoji, as Rich would by default.
def _terminal(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _write(stream: IO[str], text: str) -> None:
    stream.write(text)
    stream.flush()


def plain_table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A title line, a header line and a line per row, columns two spaces apart and aligned
    by display width (an East Asian wide character takes two); no trailing spaces."""
    grid = [[escape(c) for c in columns]] + [[escape(str(c)) for c in row] for row in rows]
    widths = [max(_width(line[i]) for line in grid if i < len(line)) for i in range(len(columns))]
    out = [escape(title)] if title else []
    for line in grid:
        cells = [c + " " * (widths[i] - _width(c)) for i, c in enumerate(line)]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out) + "\n"


def _width(text: str) -> int:
    if text.isascii():
        return len(text)
    from unicodedata import combining, east_asian_width
    return sum(0 if combining(c) else 2 if east_asian_width(c) in "WF" else 1 for c in text)


def _table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]):
    from rich.table import Table
    from rich.text import Text

    table = Table(title=escape(title) if title else title, title_justify="left", header_style="bold")
    for column in columns:      # a narrow terminal folds a cell; it never cuts an id to "nuaudi…"
        table.add_column(escape(column), overflow="fold")
    for row in rows:
        table.add_row(*(c if not isinstance(c, str) else Text(escape(c)) for c in row))
    return table


def _console(stream: IO[str], color: bool):
    from rich.console import Console

    return Console(file=stream, no_color=not color, highlight=False,
                   force_terminal=color if color else None, soft_wrap=False,
                   width=None if stream.isatty() else 200)
