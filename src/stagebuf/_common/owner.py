"""The thread contract: a stateful object belongs to one thread at a time (it takes no locks). In check mode
each object's ``Owner`` binds it to the first thread that uses it and refuses the others, naming both."""

from __future__ import annotations

import threading

from .errors import UsageError


def thread_name(ident: int | None = None) -> str:
    """A thread's name and id, as errors name it (the calling thread by default)."""
    ident = threading.get_ident() if ident is None else ident
    for t in threading.enumerate():
        if t.ident == ident:
            return f"{t.name!r} (id {ident})"
    return f"id {ident} (ended)"


class Owner:
    """Check mode's record of the thread that an object (``what``) belongs to: the first to call ``check()``
    after construction or ``release()``."""

    __slots__ = ("what", "ident", "name")

    def __init__(self, what: str):
        self.what = what
        self.ident: int | None = None
        self.name = ""  # the owner's name, kept for errors after it ends

    def check(self) -> None:
        """Bind to the calling thread, or raise UsageError if another thread holds the object."""
        me = threading.get_ident()
        if self.ident is None:
            self.ident, self.name = me, thread_name(me)
        elif me != self.ident:
            raise UsageError(
                f"{self.what} belongs to thread {self.name}, the first to use it, and was "
                f"called from thread {thread_name(me)}. stagebuf's objects take no locks: use each from one "
                "thread, or call its release_thread() on the owning thread before another takes it"
            )

    def release(self) -> None:
        """Let the next thread that uses the object take it (from the owning thread, or before any)."""
        self.check()
        self.ident = None
