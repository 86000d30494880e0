"""One log format for every process of a command (the CLI, its workers, its helpers): time, level, message; and
how a count is worded in them."""

from __future__ import annotations

import logging
import sys

__all__ = ["plural", "setup_logging"]


def setup_logging(debug: bool = False) -> None:
    """Log to stderr (stdout may carry the command's one JSON document), INFO or DEBUG."""
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("pgserver").setLevel(logging.DEBUG if debug else logging.WARNING)


def plural(n: int, word: str) -> str:
    """`n word`, with an s where n is not 1."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"
