"""BackgroundLoop: an event loop on its own thread, so plain threads can drive async code."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="paged-backend-ray-client", daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the loop and wait for its result (its exception is raised here)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        """Iterate an async generator from this thread; leaving early closes it on the loop."""
        try:
            while True:
                try:
                    item = self.run(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield item
        finally:
            self.run(agen.aclose())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
