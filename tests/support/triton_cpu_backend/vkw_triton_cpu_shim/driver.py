"""A Triton driver for the shim's ``cpu`` backend: CPU target and torch device, opt-in only."""

from typing import Any, NoReturn

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase

from vkw_triton_cpu_shim import enabled


# Triton ships no type information, so its base classes are Any to mypy.
class CPUShimDriver(DriverBase):  # type: ignore[misc]
    """Reports an x86-64 CPU target; active only when ``VKW_TRITON_CPU_SHIM=1``."""

    @classmethod
    def is_active(cls) -> bool:
        return enabled()

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("vkw-triton-cpu-shim does not generate launchers")

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cpu", "x86_64", 0)

    def get_active_torch_device(self) -> Any:
        import torch  # noqa: PLC0415  (Triton imports drivers at its own import; keep it cheap)

        return torch.device("cpu")

    # Triton's JIT launch path asks for a device index and a stream; a CPU has one of each.
    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        return

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_benchmarker(self) -> NoReturn:
        raise NotImplementedError("vkw-triton-cpu-shim cannot benchmark kernels")
