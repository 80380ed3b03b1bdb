"""From the engine's thread to an asyncio event loop: one wakeup per engine step, not one per event.

The engine loop emits one event per stream per step; handing each over with `call_soon_threadsafe`
writes the loop's self-pipe every time, and each write wakes the event-loop thread, which takes the
GIL from the engine thread mid-step: as many wakeups per step as streams. A thread that posts
inside `batched()` (the engine loop, around each step) only queues; leaving it wakes each event loop
that got something once, with everything it got. Posts outside `batched()` wake at once. Events of
one queue keep their order.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()
_batch = threading.local()  # .boxes: the mailboxes this thread posted to inside `batched()`, still to wake


class Mailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: list[tuple[asyncio.Queue, Any]] = []
        self._lock = threading.Lock()
        self._scheduled = False  # a wakeup is on its way and has not taken `_pending` yet
        self.wakeups = 0  # callbacks scheduled on the event loop

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        """From any thread: `queue.put_nowait(item)` on the event loop, soon. RuntimeError once the loop is closed
        (nobody will read it: the caller stops producing)."""
        if self.loop.is_closed():
            raise RuntimeError("the event loop is closed")
        with self._lock:
            self._pending.append((queue, item))
        boxes = getattr(_batch, "boxes", None)
        if boxes is None:
            self.wake()
        else:
            boxes.add(self)

    def wake(self) -> None:
        """Schedule one delivery of everything pending, unless one is already on its way."""
        with self._lock:
            if self._scheduled or not self._pending:
                return
            self._scheduled = True
            self.wakeups += 1
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop closed meanwhile: nobody will read what is pending
            with self._lock:
                self._pending.clear()
                self._scheduled = False
            raise

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, [], False
        for queue, item in pending:
            queue.put_nowait(item)


def mailbox(loop: asyncio.AbstractEventLoop | None = None) -> Mailbox:
    """The one mailbox of `loop` (the running loop by default); it goes when the loop does."""
    loop = loop or asyncio.get_running_loop()
    box = _mailboxes.get(loop)
    if box is None:
        box = _mailboxes[loop] = Mailbox(loop)
    return box


@contextmanager
def batched() -> Iterator[None]:
    """This thread's posts inside are delivered when it leaves: one wakeup per event loop (nesting joins the outer)."""
    if getattr(_batch, "boxes", None) is not None:
        yield
        return
    _batch.boxes = set()
    try:
        yield
    finally:
        boxes, _batch.boxes = _batch.boxes, None
        for box in boxes:
            try:
                box.wake()
            except RuntimeError:  # that loop is gone; its requests are cancelled at their next post
                pass
        if boxes:  # let a woken event loop take the GIL now, not after this thread's next switch interval
            time.sleep(0)
