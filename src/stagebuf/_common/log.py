"""The package logger and its once-per-process warnings."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("stagebuf")

_seen: set[object] = set()
_lock = threading.Lock()


def warn_once(key: object, message: str) -> bool:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
    logger.warning(message)
    return True
