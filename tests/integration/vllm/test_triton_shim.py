"""The test-support Triton backend's interpreter patch (`vkw_triton_cpu_shim.launch_patch`): a
kernel computes what upstream's interpreter computes, the language is patched once per launch
and put back after it, and the walk over `triton.language` happens at the first launch only."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.vllm_support import CAPTURE_ENV

pytestmark = pytest.mark.vllm

# Runs in a process of its own: the shim's .pth installs the patch at interpreter start, and
# only where the process starts opted in.
SCRIPT = textwrap.dedent(
    """
    import inspect

    import torch
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    from vkw_triton_cpu_shim import launch_patch

    upstream = launch_patch.upstream_patch_lang
    assert upstream is not None and interpreter._patch_lang is not upstream, "not installed"

    @triton.jit
    def _twice(x):
        return x + x

    @triton.jit
    def kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        # A helper of ours (module names `tl`) and Triton's own `tl.sum` (module names `core`).
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + row * n + offs, mask=mask, other=0.0)
        tl.store(out_ptr + row * n + offs, _twice(x) * tl.sum(x, axis=0), mask=mask)

    walks = 0
    getmembers = inspect.getmembers

    def counted(*args, **kwargs):
        global walks
        walks += 1
        return getmembers(*args, **kwargs)

    inspect.getmembers = counted
    def language():
        return {
            "core.add": tl.core.add,
            "core.load": tl.core.load,
            "tl.add": tl.add,
            "tensor.__add__": tl.core.tensor.__add__,
        }

    builtins = language()
    x = torch.arange(3 * 5, dtype=torch.float32).reshape(3, 5)
    want = 2 * x * x.sum(dim=1, keepdim=True)

    def launch():
        out = torch.zeros_like(x)
        kernel[(3,)](x, out, 5, BLOCK=8)
        return out

    first = launch()
    walks_at_first = walks
    later = [launch() for _ in range(3)]
    assert language() == builtins, "the language was not put back after a launch"
    assert walks_at_first > 0 and walks == walks_at_first, (walks_at_first, walks)
    for out in (first, *later):
        torch.testing.assert_close(out, want)

    interpreter._patch_lang = upstream
    torch.testing.assert_close(launch(), want)
    assert walks > walks_at_first, "upstream's interpreter walks the language at every launch"
    print("ok", walks_at_first)
    """
)


def test_interpreted_kernels_compute_as_upstream_with_the_language_patched_once() -> None:
    env = {**os.environ, **CAPTURE_ENV}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok ")
