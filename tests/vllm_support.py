"""What every real-vLLM test needs on a CPU machine: the capture environment and the shim."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from typing import Final

import pytest

# Capture needs Model Runner V2, whose Triton kernels run in Triton's interpreter on CPU through
# the test-support backend (opt-in). Set before the engine's processes are spawned.
CAPTURE_ENV: Final = {
    "VKW_TRITON_CPU_SHIM": "1",
    "TRITON_INTERPRET": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "1",
}


def activate_triton_cpu_shim() -> None:
    """List the shim's `cpu` Triton backend in this process too, as its .pth does at start-up.

    vLLM checks in this process that Triton has a `cpu` backend before it agrees to Model Runner
    V2; the engine's spawned processes see the backend through the inherited variable. Triton
    reads its backends once, at import, and building the tiny model (torch) has imported it by
    now, so its registry is refreshed in place.
    """
    importing = sys.modules.get("vllm.triton_utils.importing")
    if importing is not None and not importing.HAS_TRITON:
        pytest.fail(
            "vLLM was imported in this process before the capture tests enabled the Triton CPU "
            "shim; run them in their own process or start pytest with VKW_TRITON_CPU_SHIM=1",
            pytrace=False,
        )
    importlib.import_module("vkw_triton_cpu_shim._startup")
    registry = importlib.import_module("triton.backends")
    if "cpu" not in registry.backends:
        registry.backends.update(registry._discover_backends())
    assert "cpu" in registry.backends


@contextlib.contextmanager
def capture_environment() -> Iterator[None]:
    """The capture variables set, and the shim listed, while an engine is built and started.

    The engine's processes keep the variables they were spawned with; on leaving, this process
    gets its own back, so a later engine without capture (the plain CPU path) starts clean.
    """
    with pytest.MonkeyPatch.context() as mp:
        for name, value in CAPTURE_ENV.items():
            mp.setenv(name, value)
        activate_triton_cpu_shim()
        yield
