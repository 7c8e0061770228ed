"""Named crash points for chaos tests, off unless `VKW_FAILPOINTS` names them.

Some crashes matter only at one instant (between the parts of a split result) that a test
cannot hit from outside by timing a signal. `VKW_FAILPOINTS=kill-between-parts` makes the
worker SIGKILL itself there, deterministically, as a power cut would. Read once at import, so
an unset variable costs one set lookup at each point.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Final

__all__ = ["ENV_VAR", "crash_point"]

logger = logging.getLogger(__name__)

ENV_VAR: Final = "VKW_FAILPOINTS"
_ACTIVE: Final = frozenset(name.strip() for name in os.environ.get(ENV_VAR, "").split(",")) - {""}


def crash_point(name: str) -> None:
    """SIGKILL this process here when `name` is in `VKW_FAILPOINTS`."""
    if name in _ACTIVE:
        logger.critical("failpoint %s: killing the process (%s)", name, ENV_VAR)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
