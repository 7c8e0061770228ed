"""The worker reads time from the `Clock` it is built with (`worker.core.clock`), never from a
clock function captured as a default argument: such a capture keeps reading the machine's time
when the simulation hands the worker its virtual clock."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import time
from collections.abc import Iterator

import worker
from schemas import ErrorCode, Failed, Job, SamplingSpec
from tests.fakes import ManualClock
from worker.client.inflight import InFlight
from worker.core.clock import SYSTEM_CLOCK, Clock
from worker.core.tracing import TraceContext

#: Packages whose objects live as long as the worker or the client does.
_RUNTIME = (
    "worker.core",
    "worker.engines",
    "worker.answering",
    "worker.delivery",
    "worker.loop",
    "worker.control",
    "worker.client",
    "worker.build",
)
_CLOCK_FUNCTIONS = (time.monotonic, time.time, time.monotonic_ns, time.time_ns)


def _runtime_modules() -> Iterator[object]:
    for info in pkgutil.walk_packages(worker.__path__, "worker."):
        if not info.name.startswith(_RUNTIME):
            continue
        try:
            yield importlib.import_module(info.name)
        except ImportError:  # vLLM's modules, where vLLM is not installed
            continue


def _captured_clocks(cls: type) -> list[str]:
    found = []
    for name, member in vars(cls).items():
        if not inspect.isfunction(member):
            continue
        defaults = [*(member.__defaults__ or ()), *(member.__kwdefaults__ or {}).values()]
        if any(d is f for d in defaults for f in _CLOCK_FUNCTIONS):
            found.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    return found


def test_no_class_of_the_worker_or_client_captures_a_clock_function_as_a_default() -> None:
    captured = [
        where
        for module in _runtime_modules()
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == getattr(module, "__name__", None)
        for where in _captured_clocks(cls)
    ]
    assert captured == []


def test_the_system_clock_reads_the_machine_clocks() -> None:
    clock: Clock = SYSTEM_CLOCK
    before_wall, before_monotonic = time.time(), time.monotonic()
    wall, monotonic = clock.wall(), clock.monotonic()
    assert before_wall <= wall <= time.time()
    assert before_monotonic <= monotonic <= time.monotonic()


async def test_a_client_job_expires_when_the_wall_clock_it_is_given_reaches_its_timeout() -> None:
    clock = ManualClock(wall=1_000.0)
    inflight = InFlight(
        timeout_s=5.0,
        max_retries=0,
        resolve=False,
        payload_root=None,
        resend=lambda _: None,
        clock=clock,
    )
    job = Job(job_id="j", prompt_token_ids=[1, 2, 3], sampling=SamplingSpec(max_tokens=4))
    pending = inflight.add(job, TraceContext())
    assert pending.deadline == 1_005.0
    inflight.expire(clock.wall() + 4.9)
    assert not pending.future.done()
    inflight.expire(clock.wall() + 5.0)
    result = pending.future.result()
    assert isinstance(result, Failed)
    assert result.error.code is ErrorCode.EXPIRED
