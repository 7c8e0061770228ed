"""What HF transformers computes for the same weights: router top-k and greedy tokens, in fp32."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class Reference:
    """HF's view of one forward pass over `token_ids`.

    `experts[i, layer]` are the top-k expert ids the router of `layer` picks for position `i`,
    highest first (dense layers stay zero, as vLLM reports them); `greedy[i]` is the argmax
    next token after position `i`, and `greedy_logprobs[i]` its log-probability (what vLLM
    reports for a greedy sample: the raw logits' log-softmax).
    """

    experts: npt.NDArray[np.int64]
    greedy: list[int]
    greedy_logprobs: list[float]


def hf_reference(
    model_dir: Path,
    token_ids: Sequence[int],
    moe_layers: Sequence[int],
    num_layers: int,
    top_k: int,
) -> Reference:
    """Run HF transformers over `token_ids` and record each MoE router's top-k per position."""
    import torch  # noqa: PLC0415 - heavy; only the vLLM tests need it
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    router_logits: dict[int, Any] = {}

    def hook(layer: int) -> Any:
        def record(module: Any, inputs: Any, output: Any) -> None:
            # Newer transformers return (logits, weights, indices) from the router, older ones
            # the logits alone; the top-k of the logits is the same either way.
            logits = output[0] if isinstance(output, tuple) else output
            router_logits[layer] = logits.detach().reshape(len(token_ids), -1)

        return record

    handles = [model.model.layers[i].mlp.gate.register_forward_hook(hook(i)) for i in moe_layers]
    try:
        with torch.no_grad():
            out = model(torch.tensor([list(token_ids)]))
    finally:
        for handle in handles:
            handle.remove()
    experts = np.zeros((len(token_ids), num_layers, top_k), dtype=np.int64)
    for layer in moe_layers:
        experts[:, layer] = torch.topk(router_logits[layer], top_k, dim=-1).indices.numpy()
    logprobs = torch.log_softmax(out.logits[0].double(), dim=-1)
    best = logprobs.max(-1)
    return Reference(
        experts=experts, greedy=best.indices.tolist(), greedy_logprobs=best.values.tolist()
    )


def hf_reference_switched(
    first: Path,
    then: Path,
    token_ids: Sequence[int],
    *,
    switch: int,
    moe_layers: Sequence[int],
    num_layers: int,
    top_k: int,
) -> Reference:
    """HF's view of a sequence whose weights changed mid-way with its KV cache kept: `first`
    runs over `token_ids[:switch]`, then `then` runs over the rest reading `first`'s keys and
    values for those positions (its own layers compute only the positions from `switch` on)."""
    import torch  # noqa: PLC0415 - heavy; only the vLLM tests need it
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    router_logits: dict[int, list[Any]] = {layer: [] for layer in moe_layers}

    def hook(layer: int) -> Any:
        def record(module: Any, inputs: Any, output: Any) -> None:
            logits = output[0] if isinstance(output, tuple) else output
            router_logits[layer].append(logits.detach().reshape(-1, logits.shape[-1]))

        return record

    logits: list[Any] = []
    cache: Any = None
    for model_dir, part in ((first, token_ids[:switch]), (then, token_ids[switch:])):
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.eval()
        handles = [
            model.model.layers[i].mlp.gate.register_forward_hook(hook(i)) for i in moe_layers
        ]
        try:
            with torch.no_grad():
                out = model(torch.tensor([list(part)]), past_key_values=cache, use_cache=True)
        finally:
            for handle in handles:
                handle.remove()
        cache = out.past_key_values
        logits.append(out.logits[0])
    experts = np.zeros((len(token_ids), num_layers, top_k), dtype=np.int64)
    for layer in moe_layers:
        every = torch.cat(router_logits[layer])
        experts[:, layer] = torch.topk(every, top_k, dim=-1).indices.numpy()
    logprobs = torch.log_softmax(torch.cat(logits).double(), dim=-1)
    best = logprobs.max(-1)
    return Reference(
        experts=experts, greedy=best.indices.tolist(), greedy_logprobs=best.values.tolist()
    )
