"""The console every command prints through: full tables wherever the output goes.

On a terminal a console keeps the terminal's width (rich wraps what does not fit). Off a terminal
(``nohup``, ``| tee``, a pipe, a cluster job's log) rich would assume 80 columns and cut every wider
table (``│ fed… │ 89.… │``); there a log must hold the whole table, so the console is given
:data:`LOG_WIDTH` columns: a table takes the width its cells need, never more, and a long line
stays one line. ``COLUMNS`` (a number) always wins, as in rich.
"""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console

__all__ = ["LOG_WIDTH", "make_console"]

#: columns of a console whose output is not a terminal: more than any table fedhetero prints needs
#: (tables take their natural width, so nothing is padded to it)
LOG_WIDTH = 1000


def make_console(**kwargs: Any) -> Console:
    """A rich :class:`~rich.console.Console` that never cuts a table off a terminal; ``kwargs`` go
    to the console (``highlight=False``, ``stderr=True``, ``file=``, ...)."""
    console = Console(**kwargs)
    columns = os.environ.get("COLUMNS", "").strip()
    if "width" not in kwargs and not columns.isdigit() and not console.is_terminal and not console.is_jupyter:
        console.width = LOG_WIDTH
    return console
