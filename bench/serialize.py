"""Benchmark: our result encoding vs base64-of-int32 in `json.dumps`, for an 8k-token completion.

Run `python bench/serialize.py [--repeats N]`. Both paths run in the same process, interleaved
(their order alternates each repetition), and medians are reported, because the machines this runs
on share their cores with other work. It prints figures and ratios next to the goals; it never
fails on them (exit code 0).
"""

from __future__ import annotations

import argparse
import base64
import json
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from schemas import Completed, Completion, RoutedExperts, decode_result, encode

# Qwen3-30B-A3B: 48 decoder layers, 128 experts, 8 routed per token.
TOKENS: Final = 8192
LAYERS: Final = 48
TOP_K: Final = 8
NUM_EXPERTS: Final = 128
PROMPT_LEN: Final = 512
ENCODE_SPEEDUP_GOAL: Final = 20.0
SIZE_RATIO_GOAL: Final = 3.5

Experts = npt.NDArray[np.int32]


class Inputs:
    """What a vLLM-era engine hands over for one finished completion."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        # int32, as older vLLM returned it: the case narrowing is for.
        self.experts: Experts = rng.integers(
            0, NUM_EXPERTS, size=(TOKENS, LAYERS, TOP_K), dtype=np.int32
        )
        self.token_ids: list[int] = rng.integers(0, 151_936, size=TOKENS).tolist()
        self.logprobs: list[float | None] = np.log(rng.uniform(1e-6, 1.0, size=TOKENS)).tolist()


def encode_ours(inputs: Inputs) -> bytes:
    routed = RoutedExperts.from_array(inputs.experts, start=PROMPT_LEN)
    completion = Completion(
        index=0,
        token_ids=inputs.token_ids,
        text="",
        finish_reason="length",
        logprobs=inputs.logprobs,
        routed_experts=routed,
    )
    return encode(
        Completed(job_id="bench-1", completions=[completion], prompt_token_count=PROMPT_LEN)
    )


def encode_plain(inputs: Inputs) -> bytes:
    experts = inputs.experts
    doc = {
        "type": "completed",
        "job_id": "bench-1",
        "prompt_token_count": PROMPT_LEN,
        "completions": [
            {
                "index": 0,
                "token_ids": inputs.token_ids,
                "text": "",
                "finish_reason": "length",
                "logprobs": inputs.logprobs,
                "routed_experts": {
                    "data": base64.b64encode(experts.tobytes()).decode("ascii"),
                    "shape": list(experts.shape),
                    "dtype": experts.dtype.name,
                    "start": PROMPT_LEN,
                },
            }
        ],
    }
    return json.dumps(doc).encode()


def decode_ours(data: bytes) -> npt.NDArray[np.integer]:
    result = decode_result(data)
    routed = result.completions[0].routed_experts if isinstance(result, Completed) else None
    if routed is None:
        raise TypeError("expected a completed result with routed experts")
    return routed.to_array()


def decode_plain(data: bytes) -> npt.NDArray[np.integer]:
    routed: dict[str, Any] = json.loads(data)["completions"][0]["routed_experts"]
    raw = base64.b64decode(routed["data"])
    return np.frombuffer(raw, dtype=np.dtype(routed["dtype"])).reshape(routed["shape"])


class Samples:
    """Per-call wall and CPU seconds, and minor page faults, of one path."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.faults = 0

    def measure(self, call: Callable[[], object]) -> None:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cpu, wall = time.process_time(), time.perf_counter()
        call()
        self.wall.append(time.perf_counter() - wall)
        self.cpu.append(time.process_time() - cpu)
        self.faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    def line(self, name: str) -> str:
        q1, _, q3 = statistics.quantiles(self.wall, n=4)
        return (
            f"{name:5} {statistics.median(self.wall) * 1e3:8.2f} ms wall"
            f" (IQR {q1 * 1e3:.1f}-{q3 * 1e3:.1f}), {statistics.median(self.cpu) * 1e3:8.2f} ms CPU,"
            f" {self.faults // len(self.wall):>6,} page faults/call"
        )


def time_interleaved(
    first: Callable[[], object], second: Callable[[], object], repeats: int
) -> tuple[Samples, Samples]:
    """Measure both, alternating which goes first, after one warm-up call each."""
    first()
    second()
    samples = (Samples(), Samples())
    for i in range(repeats):
        order = ((0, first), (1, second)) if i % 2 == 0 else ((1, second), (0, first))
        for slot, call in order:
            samples[slot].measure(call)
    return samples


def time_alone(call: Callable[[], object], repeats: int) -> float:
    call()
    samples = Samples()
    for _ in range(repeats):
        samples.measure(call)
    return statistics.median(samples.wall)


def ratios(plain: Samples, ours: Samples) -> tuple[float, float]:
    """Plain over ours, by median wall time and by median CPU time."""
    return (
        statistics.median(plain.wall) / statistics.median(ours.wall),
        statistics.median(plain.cpu) / statistics.median(ours.cpu),
    )


def verdict(value: float, goal: float) -> str:
    return "met" if value >= goal else "NOT met"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    repeats: int = max(3, args.repeats)
    inputs = Inputs(args.seed)

    ours_bytes, plain_bytes = encode_ours(inputs), encode_plain(inputs)
    # Both paths must carry the same array, or the comparison means nothing.
    same = np.array_equal(decode_ours(ours_bytes), inputs.experts) and np.array_equal(
        decode_plain(plain_bytes), inputs.experts
    )

    enc_ours, enc_plain = time_interleaved(
        lambda: encode_ours(inputs), lambda: encode_plain(inputs), repeats
    )
    dec_ours, dec_plain = time_interleaved(
        lambda: decode_ours(ours_bytes), lambda: decode_plain(plain_bytes), repeats
    )
    routed = RoutedExperts.from_array(inputs.experts, start=PROMPT_LEN)
    part_from_array = time_alone(
        lambda: RoutedExperts.from_array(inputs.experts, start=PROMPT_LEN), repeats
    )
    part_encode = time_alone(lambda: encode(routed), repeats)

    enc_wall, enc_cpu = ratios(enc_plain, enc_ours)
    dec_wall, dec_cpu = ratios(dec_plain, dec_ours)
    size_ratio = len(plain_bytes) / len(ours_bytes)

    print(
        f"Completed result: {TOKENS} tokens x {LAYERS} layers x top-{TOP_K} int32 expert ids in"
        f" [0, {NUM_EXPERTS}), plus {TOKENS} token ids and logprobs."
    )
    print(
        f"{repeats} repetitions per path, interleaved; medians. Both decode to the input:"
        f" {'yes' if same else 'NO'}."
    )
    print(f"ours  = RoutedExperts.from_array + schemas.encode (wire dtype {routed.dtype})")
    print("plain = base64.b64encode(int32 bytes) in a dict + json.dumps")
    print()
    print(f"encode {enc_ours.line('ours')}")
    print(f"       {enc_plain.line('plain')}")
    print(
        f"       speed-up {enc_wall:.1f}x wall, {enc_cpu:.1f}x CPU"
        f"   goal >= {ENCODE_SPEEDUP_GOAL:.0f}x: {verdict(enc_wall, ENCODE_SPEEDUP_GOAL)}"
    )
    print(
        f"       ours by part (wall): from_array {part_from_array * 1e3:.2f} ms,"
        f" encode of the RoutedExperts alone {part_encode * 1e3:.2f} ms"
    )
    print(f"decode {dec_ours.line('ours')}")
    print(f"       {dec_plain.line('plain')}")
    print(f"       speed-up {dec_wall:.1f}x wall, {dec_cpu:.1f}x CPU")
    print(f"size   ours  {len(ours_bytes):>12,} bytes")
    print(f"       plain {len(plain_bytes):>12,} bytes")
    print(
        f"       ours is 1/{size_ratio:.2f} of plain   goal <= 1/{SIZE_RATIO_GOAL}:"
        f" {verdict(size_ratio, SIZE_RATIO_GOAL)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
