"""The frameworks' released modules, loaded once for the lane (see `released.py`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import pytest

from tests.integration.frameworks import released

T = TypeVar("T")


def _installed(load: Callable[[], T]) -> T:
    try:
        return load()
    except released.FrameworksNotInstalledError as exc:
        # Under CI the lane installs them (`make setup`): missing means a broken pipeline.
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{exc} (CI=true: the frameworks lane must not skip)", pytrace=False)
        pytest.skip(str(exc))


def _module(name: str) -> ModuleType:
    return _installed(lambda: released.load(name))


@pytest.fixture(scope="session")
def releases() -> Path:
    """The folder of the releases, on sys.path (their metadata reads from there)."""
    return _installed(released.enable)


@pytest.fixture(scope="session")
def verifiers_graph() -> ModuleType:
    return _module("verifiers.v1.graph")


@pytest.fixture(scope="session")
def verifiers_types() -> ModuleType:
    return _module("verifiers.v1.types")


@pytest.fixture(scope="session")
def verl_r3() -> ModuleType:
    return _installed(released.load_verl_r3)


@pytest.fixture(scope="session")
def verl_padding() -> ModuleType:
    return _module("verl.workers.utils.padding")


@pytest.fixture(scope="session")
def skyrl_routed_experts() -> ModuleType:
    return _module("skyrl.backends.skyrl_train.utils.routed_experts")


@pytest.fixture(scope="session")
def skyrl_wire() -> ModuleType:
    return _module("skyrl.backends.skyrl_train.inference_servers.generate_wire")


@pytest.fixture(scope="session")
def skyrl_preprocess() -> ModuleType:
    return _module("skyrl.train.dataset.preprocess")
