"""Result encoding for the publish path: `schemas.encode`'s exact bytes, with faster base64.

Routed experts dominate a result (4 MiB of base64 for an 8k-token completion of a 48-layer top-8
model), and msgspec writes base64 one byte triple at a time, an order of magnitude slower than
pybase64's SIMD encoder. So this encodes the result with the routed experts' `data` left empty,
and splices pybase64's base64 into the empty strings. The `schemas` package keeps to msgspec and
numpy so that trainers can install it anywhere; the worker already carries heavier dependencies.
"""

from __future__ import annotations

from typing import Final

import msgspec
import pybase64

from schemas import Completed, Completion, Failed, encode

__all__ = ["encode_completion", "encode_result"]

# Below this many bytes of routed experts, msgspec's base64 costs less than a second pass.
SPLICE_MIN_BYTES: Final = 64 * 1024

# Where a completion's routed experts' base64 goes: `data` is RoutedExperts' first field. In
# msgspec's compact JSON every quote inside a string is escaped, and here the quotes follow
# letters and punctuation, never a backslash, so this only matches the structure itself: a
# `routed_experts` key whose value is an object starting with an empty `data`. Only a
# Completion has that key (metadata values are strings), so the matches are the completions'
# routed experts, in order.
_EMPTY_DATA: Final = b'"routed_experts":{"data":"'

_ENCODER: Final = msgspec.json.Encoder()


def encode_result(result: Completed | Failed) -> bytes:
    """Encode a result to the same bytes as `schemas.encode`, faster when it carries routing."""
    if not isinstance(result, Completed):
        return encode(result)
    payloads = [c.routed_experts.data for c in result.completions if c.routed_experts is not None]
    if sum(len(p) for p in payloads) < SPLICE_MIN_BYTES:
        return encode(result)
    stripped = msgspec.structs.replace(
        result, completions=[_without_data(c) for c in result.completions]
    )
    return _splice(_ENCODER.encode(stripped), payloads) or encode(result)


def encode_completion(completion: Completion) -> bytes:
    """One completion's bytes as they appear inside its result's `completions` list."""
    routed = completion.routed_experts
    if routed is None or len(routed.data) < SPLICE_MIN_BYTES:
        return encode(completion)
    return _splice(_ENCODER.encode(_without_data(completion)), [routed.data]) or encode(completion)


def _without_data(completion: Completion) -> Completion:
    routed = completion.routed_experts
    if routed is None:
        return completion
    return msgspec.structs.replace(
        completion, routed_experts=msgspec.structs.replace(routed, data=b"")
    )


def _splice(skeleton: bytes, payloads: list[bytes]) -> bytes | None:
    """`skeleton` with each payload's base64 in its routed experts' empty `data`, in order;
    None if the structure is not where it should be."""
    view = memoryview(skeleton)
    pieces: list[bytes | memoryview] = []
    done = 0
    for payload in payloads:
        at = skeleton.find(_EMPTY_DATA, done)
        if at < 0:  # only if the schema's field order changed; the tests pin it
            return None
        at += len(_EMPTY_DATA)
        pieces += (view[done:at], pybase64.b64encode(payload))
        done = at
    pieces.append(view[done:])
    return b"".join(pieces)
