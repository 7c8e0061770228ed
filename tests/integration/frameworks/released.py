"""The frameworks' released code, imported the way this lane needs it.

`make setup` installs the releases pinned in `requirements.txt` (next to this file) with
`--no-deps` into a folder of their own, `<venv>/frameworks` (`VKW_FRAMEWORKS_DIR` overrides
it). That folder goes at the END of `sys.path`: verl's wheel also installs top-level `tests` and
`scripts` packages, which must never shadow this project's.

The functions called here use numpy and torch only, but their packages' `__init__` modules
import each framework's whole training stack (ray, Megatron, sandboxes, HTTP servers). Such a
package is entered as a bare shell: its submodules load from the installed files, its
`__init__` does not run. verl's router replay module imports Megatron at the top for functions
this lane does not call; those imports get stand-ins while that one module loads.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from types import ModuleType
from typing import Final
from unittest import mock

#: Packages whose `__init__` pulls in a framework's runtime; their submodules are what we call.
_SHELLS: Final = (
    "verifiers",
    "verifiers.v1",
    "verl",
    "verl.utils",
    "verl.workers",
    "verl.workers.utils",
    "skyrl.backends",
    "skyrl.train.dataset",
)
#: What verl/utils/megatron/router_replay_utils.py imports at the top for the Megatron side of
#: router replay; `build_r3_replay_mask` and `align_r3_router_replay_data` use torch alone.
_VERL_R3_STAND_INS: Final = (
    "megatron",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.pipeline_parallel",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.tensor_parallel",
    "megatron.core.transformer",
    "megatron.core.transformer.moe",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.transformer_config",
    "megatron.core.transformer.transformer_layer",
    "verl.models",
    "verl.models.mcore",
    "verl.models.mcore.util",
    "verl.utils.device",
    "verl.utils.megatron.router_replay_patch",
)


class FrameworksNotInstalledError(RuntimeError):
    """The pinned releases are not where the lane looks for them."""


def frameworks_dir() -> Path:
    return Path(os.environ.get("VKW_FRAMEWORKS_DIR", Path(sys.prefix) / "frameworks"))


def enable() -> Path:
    """Put the releases on `sys.path` (last) and enter the shells; idempotent."""
    root = frameworks_dir()
    if not (root / "verl").is_dir():
        raise FrameworksNotInstalledError(
            f"no framework releases in {root}: run `make setup` (it installs "
            "tests/integration/frameworks/requirements.txt there)"
        )
    if str(root) not in sys.path:
        sys.path.append(str(root))
    for name in _SHELLS:
        if name not in sys.modules:
            shell = types.ModuleType(name)
            shell.__path__ = [str(root / name.replace(".", "/"))]
            sys.modules[name] = shell
    return root


def load(name: str) -> ModuleType:
    enable()
    return importlib.import_module(name)


def load_verl_r3() -> ModuleType:
    """verl's `router_replay_utils`, with stand-ins for the Megatron imports it never calls
    from the two R3 functions; the stand-ins are gone again once it has loaded."""
    root = enable()
    name = "verl.utils.megatron.router_replay_utils"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, root / "verl/utils/megatron/router_replay_utils.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    missing = [m for m in _VERL_R3_STAND_INS if m not in sys.modules]
    sys.modules.update({m: _StandIn(m) for m in missing})
    try:
        spec.loader.exec_module(module)
    finally:
        for m in missing:
            del sys.modules[m]
    sys.modules[name] = module
    return module


class _StandIn(ModuleType):
    """A module whose every attribute is a mock: enough for `from ... import` and for calls
    made while the module that imports it loads."""

    __path__: list[str] = []  # noqa: RUF012 - a package to the import system, never mutated

    def __getattr__(self, attribute: str) -> mock.MagicMock:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return mock.MagicMock(name=f"{self.__name__}.{attribute}")
