"""Triton's interpreter with its language patched once per kernel launch, not rebuilt each time.

Why: under ``TRITON_INTERPRET=1`` every kernel launch, and every call of a ``@triton.jit``
helper inside one, rebuilds the interpreted language: ``_patch_lang`` walks
``triton.language`` with ``inspect.getmembers`` and wraps every builtin anew, and the launch
puts the originals back when it ends. Profiled in vLLM's model worker (Model Runner V2, about
ten kernels a decoding step), that walk was 21 % of the worker's time. The wrappers it builds
are the same every time: here the first launch records them, each later launch sets the
recorded ones (and still puts the originals back when it ends), and a helper called inside a
launch finds them set already. Generation on the tiny model went from 24 to 29 tokens/s.

Each launch patches both ``triton.language`` and ``triton.language.core``, whichever of the two
the kernel's module names: Triton's own helpers (``tl.sum``, ``tl.max``) are jit functions whose
module names ``core``, and upstream patches it at their first call inside a launch and never
puts it back.

Installed by ``_startup`` (so only when opted in) as an import hook: ``triton.runtime.interpreter``
is patched as it is imported. A Triton whose interpreter has no ``_patch_lang`` or
``_LangPatchScope`` keeps its own behaviour; one whose scope no longer records its changes in
``_changes`` fails at the first launch, loudly.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

_INTERPRETER = "triton.runtime.interpreter"

#: The interpreter's own `_patch_lang`, once the hook has replaced it.
upstream_patch_lang: Callable[[Any], Any] | None = None


class _NothingToRestore:
    """The scope a helper called inside a launch gets: the launch restores the language."""

    def restore(self) -> None:
        return


def install(interpreter: types.ModuleType) -> bool:
    """Replace `interpreter._patch_lang` with the recording one; False where it is installed
    already or this Triton's interpreter lacks what that needs (left as it is then)."""
    global upstream_patch_lang  # noqa: PLW0603 - the one interpreter a process has
    upstream = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if upstream is None or scope_type is None or upstream_patch_lang is not None:
        return False
    tl = interpreter.tl
    # What `_patch_lang` reads of a function: the modules its globals name.
    both_languages = types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core})
    recorded: list[tuple[object, str, object]] = []
    in_launch = False

    class _Launch(scope_type):  # type: ignore[valid-type, misc]
        def restore(self) -> None:
            nonlocal in_launch
            try:
                super().restore()
            finally:
                in_launch = False

    def patch_lang(fn: Any) -> Any:
        nonlocal in_launch
        if in_launch:
            return _NothingToRestore()
        launch = _Launch()
        if recorded:
            for obj, name, value in recorded:
                launch.set_attr(obj, name, value)
        else:
            first = upstream(both_languages)
            changes: Sequence[tuple[object, str, object]] = first._changes
            recorded.extend((obj, name, getattr(obj, name)) for obj, name, _ in changes)
            launch._changes = first._changes
        in_launch = True
        return launch

    upstream_patch_lang = upstream
    interpreter._patch_lang = patch_lang  # type: ignore[attr-defined]
    return True


class _InstallingLoader(importlib.abc.Loader):
    """The interpreter module's own loader, with `install` run once the module has executed."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        install(module)

    def __getattr__(self, name: str) -> Any:
        # get_source, get_filename and the rest, for tracebacks and inspect.
        return getattr(self._inner, name)


class _InstallOnImport(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _INTERPRETER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _InstallingLoader(spec.loader)
        return spec


def install_on_import() -> None:
    """Patch the interpreter when it is imported (at once if it already is)."""
    if _INTERPRETER in sys.modules:
        install(sys.modules[_INTERPRETER])
    elif not any(isinstance(finder, _InstallOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _InstallOnImport())
