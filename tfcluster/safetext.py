"""Text that is safe to show: control characters escaped, commands quoted word by word.

Every value from a spec or a host that reaches the terminal passes `escape` (the UI
applies it to everything it prints; docs/design/spec-safety.md, "Spec safety"). A character is
shown as is only when Python calls it printable: C0 and C1 controls (ESC included), DEL,
bidi overrides, zero-width and other format characters, line and paragraph separators
and non-ASCII spaces are written as `\\x1b`, `\\u202e`, … instead. Pure, standard library only.
"""
from __future__ import annotations

import shlex


def escape(text: str, *, newlines: bool = False) -> str:
    """`text` with every non-printable character written as a Python escape (`\\x1b`).

    `newlines`: keep line breaks (a block of lines); every other control is escaped."""
    if text.isprintable():          # the common case, at C speed
        return text
    if newlines:
        return "\n".join(escape(line) for line in text.split("\n"))
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def shell_word(word: str) -> str:
    """One word of a command shown for copy and paste.

    Printable words are quoted by shlex.quote (POSIX sh). A word with a non-printable
    character becomes `$'...'` with the character escaped (`$'\\x1b'`): nothing raw reaches
    the terminal, and bash, zsh, ksh and POSIX.1-2024 shells read back the exact word."""
    if word.isprintable():
        return shlex.quote(word)
    return "$'" + "".join(_ansi_c(c) for c in word) + "'"


def shell_join(words) -> str:
    return " ".join(shell_word(w) for w in words)


def _ansi_c(c: str) -> str:
    if c in "\\'":
        return "\\" + c
    if c.isprintable():
        return c
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"
