"""Background prefetch of micro-batches onto a CUDA device (pinned host memory).

On CUDA the host->device copy of the next micro-batches and the Python work of building
them (index lookups, collation) run in a background thread while the GPU computes: each
batch's tensors are pinned and copied with ``non_blocking=True`` on a side stream, and the
consumer's stream waits on that copy's event before using them.  ``get_batch`` then finds
them already on the device (its ``.to(device)`` is a no-op).  Batches come out in exactly
the order the wrapped iterator yields them, so the data a run sees does not change.
Only the training loop's CUDA path uses this; CPU runs keep the plain iterator.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterator, Optional

import torch

_DONE = object()


class DevicePrefetcher:
    """Iterate ``source`` ``depth`` items ahead in a daemon thread, moving every tensor of
    each (dict) item to ``device``.  An exception in the thread is re-raised by ``next``."""

    def __init__(self, source: Iterator, device, depth: int = 2):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.items: "queue.Queue" = queue.Queue(maxsize=max(1, depth))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(source,), daemon=True,
                                       name="megalite-prefetch")
        self.thread.start()

    def _move(self, item):
        if not isinstance(item, dict):
            return item, None
        if not self.cuda:
            return {k: v.to(self.device) if torch.is_tensor(v) else v
                    for k, v in item.items()}, None
        with torch.cuda.stream(self.stream):
            out = {k: v.pin_memory().to(self.device, non_blocking=True) if torch.is_tensor(v)
                   else v for k, v in item.items()}
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, event

    def _run(self, source):
        if self.cuda:
            torch.cuda.set_device(self.device)
        try:
            for item in source:
                moved = self._move(item)
                while not self.stop.is_set():
                    try:
                        self.items.put(moved, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self.stop.is_set():
                    return
            self.items.put((_DONE, None))
        except BaseException as exc:  # noqa: BLE001 -- handed to the consumer
            self.items.put((exc, None))

    def __iter__(self):
        return self

    def __next__(self):
        item, event = self.items.get()
        if item is _DONE:
            self.items.put((_DONE, None))          # stay exhausted
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for v in item.values():               # memory is reused only after this use
                if torch.is_tensor(v):
                    v.record_stream(current)
        return item

    def close(self) -> None:
        self.stop.set()


def prefetch_to_device(iterator: Optional[Iterator], device, depth: int = 2):
    """``iterator`` wrapped in a ``DevicePrefetcher`` when ``device`` is CUDA, else as is."""
    if iterator is None or torch.device(device).type != "cuda":
        return iterator
    return DevicePrefetcher(iterator, device, depth)
