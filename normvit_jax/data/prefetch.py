"""Runs a batch generator in a background daemon thread, ``size`` items ahead of the consumer.

An exception in the producer is re-raised by the consumer's ``next``. The thread stops when the
iterator is closed, used as a context manager, exhausted, or garbage collected (the thread holds
no reference to the iterator object, only to its queue and stop flag).
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import queue
import threading
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
A = TypeVar("A")
_END = object()


def ordered_map(fn: Callable[[A], T], args: Iterable[A], in_flight: int) -> Iterator[T]:
    """``map(fn, args)`` with up to ``in_flight`` calls running at once on their own threads,
    results in order. For pure ``fn`` the output equals the plain map's; 1 is the plain map."""
    if in_flight <= 1:
        yield from map(fn, args)
        return
    pool = cf.ThreadPoolExecutor(in_flight, thread_name_prefix="data-batch")
    pending: collections.deque = collections.deque()
    try:
        for a in args:
            pending.append(pool.submit(fn, a))
            if len(pending) >= in_flight:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:  # closed early (or failed): drop what is queued, let running calls finish alone
        pool.shutdown(wait=False, cancel_futures=True)


class _Raised:
    def __init__(self, exc: BaseException):
        self.exc = exc


def _produce(make: Callable[[], Iterator], q: queue.Queue, stop: threading.Event) -> None:
    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)  # wake up now and then to notice `stop`
                return True
            except queue.Full:
                pass
        return False

    it = None
    try:
        it = make()
        for item in it:
            if not put(item):
                return
        put(_END)
    except BaseException as e:  # noqa: BLE001 - handed to the consumer, who re-raises it
        put(_Raised(e))
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


class Prefetcher(Iterator[T]):
    """Iterator over ``make()`` computed in a daemon thread; ``size`` 0 means synchronous."""

    def __init__(self, make: Callable[[], Iterator[T]], size: int, name: str = "data-prefetch"):
        self._stop = threading.Event()
        self._done = False
        if size <= 0:
            self._sync: Iterator[T] | None = iter(make())
            self.thread = None
            return
        self._sync = None
        self._queue: queue.Queue = queue.Queue(maxsize=size)
        self.thread = threading.Thread(target=_produce, args=(make, self._queue, self._stop),
                                       name=name, daemon=True)
        self.thread.start()

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        if self._sync is not None:
            return next(self._sync)
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Raised):
            self._done = True
            raise item.exc
        return item

    def close(self, timeout: float | None = 5.0) -> None:
        """Stops the producer and waits up to ``timeout`` seconds for its thread to end."""
        self._done = True
        self._stop.set()
        if self._sync is not None and hasattr(self._sync, "close"):
            self._sync.close()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def __enter__(self) -> "Prefetcher[T]":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self._stop.set()
