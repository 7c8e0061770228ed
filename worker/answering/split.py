"""Results larger than a record: split by completion, routing moved to the payload store.

Kafka runs best with records of a few MB, and topics are often capped at 1 MiB, while a GRPO
group of 16 long samples carries tens of MB of routing. So a result over the budget goes out as
several `Completed` records, each with whole completions, the job-level fields and a `part`;
a completion that does not fit a record even alone has its routed experts written to the store
and referenced. A result that fits stays one record, byte for byte what it was before.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Final

import msgspec

from schemas import Completed, Completion, Part, RoutedExperts, encode
from worker.answering.encoder import encode_completion, encode_result
from worker.answering.payload_store import FilePayloadStore, PayloadStoreError
from worker.core.errors import ResultTooLargeError
from worker.core.metrics import Metrics

__all__ = ["ResultSplitter"]

# The skeleton's list, where a part's completions go; the first match is the field itself
# (`job_id` comes before it, and a JSON string cannot hold an unescaped quote).
_COMPLETIONS: Final = b'"completions":['
# base64 is 4 bytes per 3; a result whose routing alone is this far over the budget is split
# without first being encoded whole.
_BASE64_RATIO: Final = 4 / 3


class ResultSplitter:
    """Encodes a result into record values of at most `budget` bytes each."""

    def __init__(self, store: FilePayloadStore | None, metrics: Metrics) -> None:
        self._store = store
        self._metrics = metrics

    async def encode(self, result: Completed, budget: int, limit: str) -> list[bytes]:
        """The values to publish for `result`, each at most `budget` bytes (`limit` names what
        sets it): one when it fits (no `part`), else its parts in order. Raises ResultTooLargeError
        when a completion cannot fit a record."""
        routed = sum(
            len(c.routed_experts.data) for c in result.completions if c.routed_experts is not None
        )
        if routed * _BASE64_RATIO <= budget:
            value = encode_result(result)
            if len(value) <= budget:
                return [value]
        attempt = secrets.token_hex(8)
        count = len(result.completions)
        overhead = len(
            _skeleton(result, Part(index=max(count - 1, 0), count=count, attempt=attempt))
        )
        encoded = [encode_completion(c) for c in result.completions]
        oversized = [i for i, e in enumerate(encoded) if overhead + len(e) > budget]
        if oversized:
            completions = await self._store_routing(result, oversized, attempt, budget, limit)
            result = msgspec.structs.replace(result, completions=completions)
            for i in oversized:
                encoded[i] = encode_completion(completions[i])
                if overhead + len(encoded[i]) > budget:
                    raise ResultTooLargeError(
                        f"completion {completions[i].index} is {len(encoded[i])} bytes without its "
                        f"routed experts; a record holds {budget - overhead} ({limit})"
                    )
        groups = _pack(encoded, overhead, budget)
        if len(groups) == 1:
            return [encode_result(result)]
        values = []
        for index, group in enumerate(groups):
            skeleton = _skeleton(result, Part(index=index, count=len(groups), attempt=attempt))
            at = skeleton.index(_COMPLETIONS) + len(_COMPLETIONS)
            values.append(b"".join((skeleton[:at], b",".join(group), skeleton[at:])))
        self._metrics.result_parts.inc(len(values))
        return values

    async def _store_routing(
        self, result: Completed, oversized: list[int], attempt: str, budget: int, limit: str
    ) -> list[Completion]:
        """The completions, with the routed experts of those at `oversized` in the store."""
        completions = list(result.completions)
        store = self._store
        if store is None:
            c = completions[oversized[0]]
            raise ResultTooLargeError(
                f"{len(oversized)} of {len(completions)} completions do not fit one record alone "
                f"(completion {c.index}: {len(encode_completion(c))} bytes, a record holds "
                f"{budget}: {limit}); start the worker with --payload-store file:///shared/dir to publish "
                "their routed experts by reference"
            )
        to_store = [i for i in oversized if completions[i].routed_experts is not None]
        try:
            written = await asyncio.gather(
                *(
                    asyncio.to_thread(
                        store.put, attempt, completions[i].index, _routing(completions[i]).data
                    )
                    for i in to_store
                )
            )
        except PayloadStoreError as exc:
            raise ResultTooLargeError(str(exc), retryable=True) from exc
        for i, (uri, sha256) in zip(to_store, written, strict=True):
            routing = _routing(completions[i])
            self._metrics.payload_bytes.inc(len(routing.data))
            completions[i] = msgspec.structs.replace(
                completions[i], routed_experts=routing.as_reference(uri, sha256)
            )
        return completions


def _routing(completion: Completion) -> RoutedExperts:
    routed = completion.routed_experts
    if routed is None:  # callers only pass completions with routing
        raise ValueError(f"completion {completion.index} has no routed experts")
    return routed


def _skeleton(result: Completed, part: Part) -> bytes:
    return encode(msgspec.structs.replace(result, completions=[], part=part))


def _pack(encoded: list[bytes], overhead: int, budget: int) -> list[list[bytes]]:
    """Consecutive completions into as few groups as fit `budget` with `overhead` each."""
    groups: list[list[bytes]] = []
    size = 0
    for value in encoded:
        if groups and size + 1 + len(value) <= budget:
            groups[-1].append(value)
            size += 1 + len(value)
        else:
            groups.append([value])
            size = overhead + len(value)
    return groups
