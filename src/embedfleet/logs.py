"""One log format for every process of a command (the CLI, its workers, its helpers): time, level, message."""

from __future__ import annotations

import logging
import sys

__all__ = ["setup_logging"]


def setup_logging(debug: bool = False) -> None:
    """Log to stderr (stdout may carry the command's one JSON document), INFO or DEBUG."""
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("pgserver").setLevel(logging.DEBUG if debug else logging.WARNING)
