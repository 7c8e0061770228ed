"""A connection a test leaves open fails that test, instead of the session's last garbage collection.

An asyncio transport still open when its event loop closes is reported only by its `__del__`,
when the garbage collector reaches it. With vLLM's heap in the process a full collection is rare,
so that can be the session's end, where pytest turns the ResourceWarnings into a failed run that
names no test. Each async test's loop is made here instead: its `close` aborts the transports still
open, and the test whose loop it was fails at teardown with the peers it left connected.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator, Mapping

import pytest

_left_open: list[str] = []


def _describe(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    local = transport.get_extra_info("sockname")
    return f"{type(transport).__name__} {local} -> {peer}"


class LeakCheckingEventLoop(asyncio.SelectorEventLoop):
    """A selector loop that, on close, aborts and records the transports its owner left open."""

    def close(self) -> None:
        if not self.is_closed() and not self.is_running():
            # Every selector transport registers itself here by file descriptor (asyncio's own
            # bookkeeping, used to refuse a second transport on one fd).
            registered: Mapping[int, asyncio.Transport] = getattr(self, "_transports", {})
            open_now = [t for t in list(registered.values()) if not t.is_closing()]
            for transport in open_now:
                _left_open.append(_describe(transport))
                transport.abort()
            if open_now:
                # abort() releases the socket in a callback; run it while the loop still can.
                self.run_until_complete(asyncio.sleep(0))
        super().close()


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """pytest-asyncio's hook for the loops it runs tests and async fixtures on."""
    return {"leak_checked": LeakCheckingEventLoop}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    # A test's loop closes while its fixtures are torn down, inside this hook.
    yield
    if _left_open:
        left = "; ".join(_left_open)
        _left_open.clear()
        pytest.fail(
            f"{item.nodeid} left connections open when its event loop closed: {left}",
            pytrace=False,
        )
