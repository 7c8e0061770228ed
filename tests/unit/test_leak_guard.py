"""The leak guard fails the test that leaves a connection open, and only that test."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

INNER_CONFTEST = 'pytest_plugins = ["tests.leak_guard"]\n'

INNER_TESTS = """
import asyncio

_keep = []


async def _serve():
    async def answer(reader, writer):
        _keep.append(writer)

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_left_open():
    server, port = await _serve()
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    _keep.append(writer)
    server.close()


async def test_closed():
    server, port = await _serve()
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.close()
    await writer.wait_closed()
    await asyncio.sleep(0.05)
    for accepted in _keep:
        accepted.close()
    _keep.clear()
    server.close()
    await server.wait_closed()
"""


def test_a_connection_left_open_fails_its_own_test_at_teardown(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_inner=INNER_TESTS)
    pytester.makeini(
        "[pytest]\n"
        "asyncio_mode = auto\n"
        "asyncio_default_fixture_loop_scope = function\n"
        "filterwarnings = error\n"
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_left_open*",
            "*test_left_open left connections open when its event loop closed:*127.0.0.1*",
        ]
    )
    # The aborted transports are released on their loop: nothing is left for the collector.
    result.stdout.no_fnmatch_line("*ResourceWarning*")
