"""A Triton compiler backend for target ``cpu`` that refuses to compile anything."""

from types import ModuleType
from typing import Any, NoReturn

from triton.backends.compiler import BaseBackend, GPUTarget, Language


class ShimCompileError(RuntimeError):
    """Raised when Triton tries to compile a kernel for the shim's ``cpu`` target."""


def _refuse() -> NoReturn:
    # Compiling means TRITON_INTERPRET=1 is missing: there is no code generator behind this
    # backend, and failing here is clearer than a wrong answer later.
    raise ShimCompileError(
        "vkw-triton-cpu-shim cannot compile Triton kernels; run with TRITON_INTERPRET=1 "
        "so kernels run in Triton's interpreter"
    )


# Triton ships no type information, so its base classes are Any to mypy.
class CPUShimBackend(BaseBackend):  # type: ignore[misc]
    """Claims the ``cpu`` target; every compile step raises `ShimCompileError`."""

    @staticmethod
    def supports_target(target: GPUTarget) -> bool:
        return bool(target.backend == "cpu")

    def hash(self) -> str:
        return "vkw-triton-cpu-shim-0"

    def parse_options(self, options: dict[str, Any]) -> object:
        _refuse()

    def add_stages(self, stages: dict[str, Any], options: object, language: Language) -> None:
        _refuse()

    def load_dialects(self, context: object) -> None:
        # No dialects: this backend has no code generator. Compile steps raise instead.
        return

    def get_module_map(self) -> dict[str, ModuleType]:
        return {}
