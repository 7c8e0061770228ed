"""Loading a checkpoint into a running vLLM engine, and the start-up check that says whether
that is right on this platform.

The reload itself runs in vLLM's worker process (`worker.engines.vllm_extension`); this side
calls it and proves it: the engine's probe generation (greedy tokens and captured routing) after
reloading the checkpoint it already serves must equal the one before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from schemas import WeightReload
from worker.core.clock import Clock
from worker.core.errors import EngineError, WeightUpdateError
from worker.engines.vllm_extension import EXTENSION_QUALNAME, InPlaceReload

__all__ = [
    "Probe",
    "in_place_supported",
    "nonfinite_parameters",
    "probe",
    "reload_in_place",
    "same_model_after_reload",
]

logger = logging.getLogger(__name__)

_PROBE_PROMPT_LEN: Final = 8
_PROBE_MAX_TOKENS: Final = 4


@dataclass(frozen=True, slots=True)
class Probe:
    """One short greedy generation: what the engine's weights and routing make of a fixed prompt."""

    prompt_len: int
    token_ids: tuple[int, ...]
    #: (rows, layers, top_k), or None when routed experts are not captured.
    routed_experts: np.ndarray[Any, Any] | None
    #: Each sampled token's logprob (None where vLLM gave none).
    logprobs: tuple[float | None, ...] | None = None

    def differs_from(self, other: Probe) -> str | None:
        """What differs between two probes, or None."""
        if self.token_ids != other.token_ids:
            return f"tokens {list(other.token_ids)} became {list(self.token_ids)}"
        mine, theirs = self.routed_experts, other.routed_experts
        if (mine is None) != (theirs is None):
            return "routed experts appeared or vanished"
        if mine is not None and theirs is not None and not np.array_equal(mine, theirs):
            if mine.shape != theirs.shape:
                return f"routed experts' shape {theirs.shape} became {mine.shape}"
            changed = int((mine != theirs).any(axis=-1).sum())
            return f"routed experts changed ({changed} (row, layer) choices differ)"
        return None


async def probe(llm: Any, vllm_config: Any, request_id: str) -> Probe:
    """Run the probe on `llm` (an AsyncLLM); EngineError when it returns nothing (and vLLM's
    own errors as they come)."""
    from vllm import SamplingParams  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    vocab_size = int(vllm_config.model_config.get_vocab_size())
    # Spread-out ids rather than a run of one token, so routing varies across rows.
    prompt = [(1 + 97 * i) % vocab_size for i in range(_PROBE_PROMPT_LEN)]
    params = SamplingParams(
        max_tokens=_PROBE_MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0
    )
    final: Any = None
    # A salt of its own: the probe never reads KV cached by another request.
    tokens = TokensPrompt(prompt_token_ids=prompt, cache_salt=request_id)
    async for out in llm.generate(tokens, params, request_id):
        final = out
    if final is None or not final.outputs:
        raise EngineError("the probe request returned no output", retryable=False)
    completion = final.outputs[0]
    routed = completion.routed_experts
    token_ids = tuple(int(t) for t in completion.token_ids)
    logprobs = None
    if completion.logprobs is not None:
        logprobs = tuple(
            float(position[token].logprob) if position and token in position else None
            for position, token in zip(completion.logprobs, token_ids, strict=False)
        )
    return Probe(
        prompt_len=len(prompt),
        token_ids=token_ids,
        routed_experts=None if routed is None else np.asarray(routed),
        logprobs=logprobs,
    )


def in_place_supported(extension_cls: str) -> str | None:
    """Why a vLLM worker extended by `extension_cls` (the `--worker-extension-cls` argument)
    cannot reload in place, or None when it can."""
    if extension_cls == EXTENSION_QUALNAME:
        return None
    from vllm.utils.import_utils import resolve_obj_by_qualname  # noqa: PLC0415

    try:
        cls = resolve_obj_by_qualname(extension_cls)
    except (ImportError, AttributeError, ValueError) as exc:
        return f"--worker-extension-cls {extension_cls} cannot be imported: {exc}"
    if isinstance(cls, type) and issubclass(cls, InPlaceReload):
        return None
    return (
        f"the engine's --worker-extension-cls {extension_cls} does not include "
        f"{EXTENSION_QUALNAME} (subclass it to reload in place)"
    )


async def reload_in_place(llm: Any, checkpoint: Path) -> dict[str, Any]:
    """Load `checkpoint` into the running engine `llm`; how the first worker loaded it
    (`InPlaceReload.vkw_reload_checkpoint`'s answer). WeightUpdateError when vLLM raises."""
    try:
        per_worker = await llm.collective_rpc("vkw_reload_checkpoint", args=(str(checkpoint),))
    # vLLM's RPC raises whatever the worker process raised.
    except Exception as exc:
        raise WeightUpdateError(f"in-place reload from {checkpoint} failed: {exc!r}") from exc
    how: dict[str, Any] = dict(per_worker[0])
    logger.debug("reloaded %s in place: %s", checkpoint, how)
    return how


async def nonfinite_parameters(llm: Any) -> list[str]:
    """Names of parameters holding NaN or infinity in the engine `llm`'s model (a few at
    most); WeightUpdateError when vLLM raises."""
    try:
        per_worker = await llm.collective_rpc("vkw_nonfinite_parameters")
    # vLLM's RPC raises whatever the worker process raised.
    except Exception as exc:
        raise WeightUpdateError(f"reading the parameters failed: {exc!r}") from exc
    return sorted({str(name) for names in per_worker for name in names})


async def same_model_after_reload(
    llm: Any, vllm_config: Any, checkpoint: Path, before: Probe, *, clock: Clock
) -> WeightReload:
    """Reload `checkpoint` (the one `llm` serves) in place and probe again: `in-place` when the
    probe is unchanged, else `rebuild` with what changed (the time it took, on `clock`, goes
    in the reason). After a `rebuild` verdict the engine may hold a wrong model: the caller
    builds it again."""
    started = clock.monotonic()
    try:
        await reload_in_place(llm, checkpoint)
        await llm.reset_prefix_cache()
        after = await probe(llm, vllm_config, "vkw-reload-self-check")
    except Exception as exc:  # noqa: BLE001 - whatever vLLM raised, in place is not proven here
        return WeightReload(mode="rebuild", reason=f"reloading in place failed: {exc!r}")
    spent = clock.monotonic() - started
    changed = after.differs_from(before)
    if changed is not None:
        return WeightReload(
            mode="rebuild",
            reason=f"reloading its own checkpoint in place changed the model: {changed}",
        )
    return WeightReload(
        mode="in-place",
        reason=(
            f"reloading its own checkpoint in place ({spent:.2f} s with the probe) left the "
            "probe's tokens and routing unchanged"
        ),
    )
