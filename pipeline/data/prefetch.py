"""Batches handed over by a background thread, each tensor copied to the device ahead of use.

:class:`DevicePrefetcher` runs the batch producer (engine, decoding, transform) on its own thread
with at most ``depth`` batches in flight: on an accelerator the copies go through pinned host
memory on a side CUDA stream; on the CPU it only overlaps producing the next batch with the step
(what the Petastorm engine uses so that reading adds no stall of its own to training).
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Iterable, Iterator, Optional

_END = object()


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


def _map_tensors(item: Any, fn) -> Any:
    if isinstance(item, tuple):
        return tuple(_map_tensors(x, fn) for x in item)
    if isinstance(item, list):
        return [_map_tensors(x, fn) for x in item]
    return fn(item) if hasattr(item, "to") else item


class DevicePrefetcher:
    """Iterate ``batches`` on a background thread, each tensor copied to ``device`` ahead of use.

    ``pin`` (default: the device is CUDA) stages every tensor in pinned host memory so the copy
    runs asynchronously (``non_blocking=True``) on a side CUDA stream; the consumer's stream
    waits for that copy before the batch is handed out. At most ``depth`` batches are in flight.
    Exceptions of the producer are re-raised in the consumer; closing the iterator early stops
    the thread, which closes ``batches`` (a generator's ``finally`` and ``with`` blocks run on the
    thread that iterated it).
    """

    def __init__(self, batches: Iterable, device: Any, depth: int = 2, pin: Optional[bool] = None):
        import torch

        self.batches = batches
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pin = self.cuda if pin is None else bool(pin)
        self.depth = max(1, int(depth))

    def _copy(self, t):
        if self.pin and not t.is_pinned():
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def _produce(self, q: "queue.Queue", stop: threading.Event) -> None:
        import torch

        stream = torch.cuda.Stream(self.device) if self.cuda else None
        try:
            for item in self.batches:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        moved = _map_tensors(item, self._copy)
                        event = torch.cuda.Event()
                        event.record(stream)
                else:
                    moved, event = _map_tensors(item, self._copy), None
                while not stop.is_set():
                    try:
                        q.put((moved, event), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(_END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put(_Failed(e))
        finally:
            close = getattr(self.batches, "close", None)
            if close is not None:
                close()

    def __iter__(self) -> Iterator:
        import torch

        q: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        t = threading.Thread(target=self._produce, args=(q, stop), name="pipeline-prefetch", daemon=True)
        t.start()
        try:
            while True:
                got = q.get()
                if got is _END:
                    return
                if isinstance(got, _Failed):
                    raise got.exc
                moved, event = got
                if event is not None:
                    current = torch.cuda.current_stream(self.device)
                    current.wait_event(event)
                    _map_tensors(moved, lambda x: x.record_stream(current))
                yield moved
        finally:
            stop.set()
            while t.is_alive():      # free a producer blocked on a full queue, and wait for it in short steps
                try:
                    while True:
                        q.get_nowait()
                except queue.Empty:
                    pass
                t.join(0.002)
