"""Benchmark: our result encoding vs base64-of-int32 in `json.dumps`, for an 8k-token completion.

Run `python bench/serialize.py [--blocks N]`. All paths run in the same process. Each is timed in
blocks of consecutive calls (the first call of a block is not timed) and the blocks rotate between
the paths, so each path is measured in its own steady state, as a worker encoding result after
result runs it, while noise from other work on the machine falls on all of them alike. Calls
interleaved one by one measure something else: the plain path's 60 MB of buffers make glibc hand
the heap back to the OS, and the next path pays page faults to get it back (about 4 us each on
these machines); that figure is printed too. It prints figures and ratios next to the goals; it
never fails on them (exit code 0).
"""

from __future__ import annotations

import argparse
import base64
import json
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from schemas import Completed, Completion, RoutedExperts, decode_result, encode
from worker.answering.encoder import encode_result

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


def completed_result(inputs: Inputs) -> Completed:
    routed = RoutedExperts.from_array(inputs.experts, start=PROMPT_LEN)
    completion = Completion(
        index=0,
        token_ids=inputs.token_ids,
        text="",
        finish_reason="length",
        logprobs=inputs.logprobs,
        routed_experts=routed,
    )
    return Completed(job_id="bench-1", completions=[completion], prompt_token_count=PROMPT_LEN)


def encode_ours(inputs: Inputs) -> bytes:
    """The worker's publish path."""
    return encode_result(completed_result(inputs))


def encode_schemas(inputs: Inputs) -> bytes:
    """`schemas.encode`: msgspec alone, as a trainer without the worker's dependencies has it."""
    return encode(completed_result(inputs))


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


Path = Callable[[], object]


def time_blocks(paths: Sequence[Path], blocks: int, block_size: int) -> list[Samples]:
    """Time each path in blocks of consecutive calls, rotating which path's block comes first."""
    samples = [Samples() for _ in paths]
    for block in range(blocks):
        for i in range(len(paths)):
            slot = (block + i) % len(paths)
            paths[slot]()  # settles the heap for this path; not timed
            for _ in range(block_size):
                samples[slot].measure(paths[slot])
    return samples


def time_one_by_one(paths: Sequence[Path], rounds: int) -> list[Samples]:
    """Time the paths alternating call by call: each call follows another path's."""
    samples = [Samples() for _ in paths]
    for round_ in range(rounds):
        for i in range(len(paths)):
            slot = (round_ + i) % len(paths)
            samples[slot].measure(paths[slot])
    return samples


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
    parser.add_argument("--blocks", type=int, default=5, help="timed blocks per path")
    parser.add_argument("--block-size", type=int, default=4, help="timed calls per block")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    blocks: int = max(1, args.blocks)
    block_size: int = max(1, args.block_size)
    inputs = Inputs(args.seed)

    ours_bytes, plain_bytes = encode_ours(inputs), encode_plain(inputs)
    # Every path must carry the same array, or the comparison means nothing; the worker's path
    # must write exactly what schemas.encode writes.
    same = (
        ours_bytes == encode_schemas(inputs)
        and np.array_equal(decode_ours(ours_bytes), inputs.experts)
        and np.array_equal(decode_plain(plain_bytes), inputs.experts)
    )

    enc_ours, enc_schemas, enc_plain = time_blocks(
        [lambda: encode_ours(inputs), lambda: encode_schemas(inputs), lambda: encode_plain(inputs)],
        blocks,
        block_size,
    )
    dec_ours, dec_plain = time_blocks(
        [lambda: decode_ours(ours_bytes), lambda: decode_plain(plain_bytes)], blocks, block_size
    )
    routed = RoutedExperts.from_array(inputs.experts, start=PROMPT_LEN)
    result = completed_result(inputs)
    part_from_array, part_encode = time_blocks(
        [
            lambda: RoutedExperts.from_array(inputs.experts, start=PROMPT_LEN),
            lambda: encode_result(result),
        ],
        blocks,
        block_size,
    )
    cold_ours, cold_plain = time_one_by_one(
        [lambda: encode_ours(inputs), lambda: encode_plain(inputs)], blocks * block_size // 2
    )

    enc_wall, enc_cpu = ratios(enc_plain, enc_ours)
    schemas_wall, _ = ratios(enc_plain, enc_schemas)
    cold_wall, _ = ratios(cold_plain, cold_ours)
    dec_wall, dec_cpu = ratios(dec_plain, dec_ours)
    size_ratio = len(plain_bytes) / len(ours_bytes)
    timed = blocks * block_size

    print(
        f"Completed result: {TOKENS} tokens x {LAYERS} layers x top-{TOP_K} int32 expert ids in"
        f" [0, {NUM_EXPERTS}), plus {TOKENS} token ids and logprobs."
    )
    print(
        f"{timed} timed calls per path in {blocks} rotating blocks of {block_size}; medians."
        f" All decode to the input, ours byte-identical to schemas.encode: {'yes' if same else 'NO'}."
    )
    print(
        f"ours    = RoutedExperts.from_array + the worker's encode_result (wire dtype {routed.dtype})"
    )
    print("schemas = RoutedExperts.from_array + schemas.encode (msgspec alone)")
    print("plain   = base64.b64encode(int32 bytes) in a dict + json.dumps")
    print()
    print(f"encode {enc_ours.line('ours')}")
    print(f"       {enc_schemas.line('schemas')}")
    print(f"       {enc_plain.line('plain')}")
    print(
        f"       speed-up {enc_wall:.1f}x wall, {enc_cpu:.1f}x CPU"
        f"   goal >= {ENCODE_SPEEDUP_GOAL:.0f}x: {verdict(enc_wall, ENCODE_SPEEDUP_GOAL)}"
        f"   (schemas.encode: {schemas_wall:.1f}x)"
    )
    print(
        f"       ours by part (wall): from_array {statistics.median(part_from_array.wall) * 1e3:.2f}"
        f" ms, encode_result {statistics.median(part_encode.wall) * 1e3:.2f} ms"
    )
    print(
        f"       one call after another, plain and ours alternating: ours"
        f" {statistics.median(cold_ours.wall) * 1e3:.2f} ms"
        f" ({cold_ours.faults // len(cold_ours.wall):,} page faults/call), plain"
        f" {statistics.median(cold_plain.wall) * 1e3:.2f} ms: {cold_wall:.1f}x"
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
