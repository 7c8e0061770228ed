"""A model-free engine for load tests and for checking Kafka plumbing without a GPU."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
import numpy as np

from schemas import Completion, Job, RoutedExperts, VersionSpan, WeightReload
from worker.core.config import Settings
from worker.core.errors import (
    EngineDeadError,
    InvalidJobError,
    WeightsLostError,
    WeightUpdateError,
)
from worker.engines.protocol import EngineOutput

__all__ = [
    "MOCK_BLOCK_SIZE",
    "MockEngine",
    "MockEngineSettings",
    "MockSampler",
    "mock_engine_settings",
]

logger = logging.getLogger(__name__)


class MockEngineSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Shape and speed of the simulated model (defaults look like Qwen3-30B-A3B)."""

    per_token_latency_ms: float = 0.0
    num_layers: int = 48
    top_k: int = 8
    num_experts: int = 128
    vocab_size: int = 32_000
    max_model_len: int = 32_768
    max_num_seqs: int = 256
    #: A job whose prompt holds this token id kills the process, as an engine crash would.
    crash_token_id: int | None = None
    #: The weight version it starts with.
    weight_version: int = 0
    #: Weight loads keep running requests (an in-place reload) rather than needing none.
    in_place_updates: bool = False


def mock_engine_settings(settings: Settings) -> MockEngineSettings:
    """The mock engine's settings from the worker's: setting `mock_x` is field `x`."""
    prefix = "mock_"
    values = {
        name[len(prefix) :]: getattr(settings, name)
        for name in settings.__struct_fields__
        if name.startswith(prefix)
    }
    values["weight_version"] = settings.weight_version
    return msgspec.convert(values, MockEngineSettings)


#: Tokens per block of the simulated prefix cache (vLLM's GPU default; its CPU one is 128).
MOCK_BLOCK_SIZE: Final = 16
# Blocks the simulated prefix cache holds before it forgets the least recently used.
_CACHED_BLOCKS: Final = 1 << 16

# How much simulated time passes between the points where a request can be interrupted, frozen
# or see new weights.
_STEP_S: Final = 0.01


class _Chunk(msgspec.Struct, frozen=True):
    """Output tokens `[start, end)` sampled with one set of weights."""

    weights_seed: int
    version: int
    start: int
    end: int


class _PrefixCache:
    """vLLM's prefix cache as far as a result can see it: full blocks of a sequence, each named
    by its tokens and every block before it, hit only as a whole prefix, and at most the
    prompt's tokens but its last (vLLM computes at least one to sample from)."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def clear(self) -> None:
        self._blocks.clear()

    def hit(self, salt: int, prompt: Sequence[int]) -> int:
        cached = 0
        for name in _block_names(salt, prompt[: len(prompt) - 1]):
            if name not in self._blocks:
                break
            self._blocks.move_to_end(name)
            cached += MOCK_BLOCK_SIZE
        return cached

    def add(self, salt: int, prompt: Sequence[int], outputs: Sequence[Sequence[int]]) -> None:
        """The KV of the prompt and each output but its last token (sampled, never fed
        forward) is cached. The prompt's blocks are named once for all the outputs."""
        whole = len(prompt) // MOCK_BLOCK_SIZE * MOCK_BLOCK_SIZE
        shared = _block_names(salt, prompt[:whole])
        head = shared[-1] if shared else salt
        names = list(shared)
        for output in outputs:
            rest = [*prompt[whole:], *output][:-1]
            names += _block_names(head, rest)
        for name in names:
            self._blocks[name] = None
            self._blocks.move_to_end(name)
        while len(self._blocks) > _CACHED_BLOCKS:
            self._blocks.popitem(last=False)


def _block_names(salt: int, tokens: Sequence[int]) -> list[int]:
    """Each whole block's name: its tokens and the name of the block before it (`salt` for
    the first)."""
    names = []
    name = salt
    for end in range(MOCK_BLOCK_SIZE, len(tokens) + 1, MOCK_BLOCK_SIZE):
        name = hash((name, tuple(tokens[end - MOCK_BLOCK_SIZE : end])))
        names.append(name)
    return names


class MockEngine:
    """Deterministic tokens from the job's seed (or its id) and the weights, synthetic routing
    (`MockSampler`). Latency is simulated per token, so concurrent jobs overlap as in a batch.

    "Weights" are a seed: `load_weights(dir)` reads the directory's `config.json` (its layer and
    top-k counts must match: another architecture is refused) and derives the seed from it, so
    outputs change with the checkpoint, as with a model. With latency, a request advances in
    steps of 10 ms of simulated time, between which it can be interrupted or frozen and sees
    new weights, and its completions carry one version span per set of weights.

    A simulated prefix cache (blocks of `MOCK_BLOCK_SIZE` tokens, salted by the weights, as
    vLLM salts its cache by weight version) reports each job's cached prompt tokens.
    """

    def __init__(self, settings: MockEngineSettings | None = None) -> None:
        self._settings = settings or MockEngineSettings()
        self._dead = False
        self._sampler = MockSampler(self._settings)
        s = self._settings
        self._model_name = f"mock-{s.num_layers}L-{s.num_experts}E-top{s.top_k}"
        self._weights_seed = 0
        self._version = s.weight_version
        # Running requests, each with the event its interrupt sets, and its tokens so far.
        self._running: dict[str, asyncio.Event] = {}
        self._generated: dict[str, int] = {}
        self._thawed = asyncio.Event()
        self._thawed.set()
        self.prefix_cache_resets = 0
        self._prefix_cache = _PrefixCache()
        self.loads: list[tuple[str, int]] = []

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_concurrency(self) -> int:
        return self._settings.max_num_seqs

    @property
    def supports_routed_experts(self) -> bool:
        return True

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def weight_reload(self) -> WeightReload:
        if self._settings.in_place_updates:
            return WeightReload(mode="in-place", reason="mock engine: in_place_updates")
        return WeightReload(mode="rebuild", reason="mock engine: in_place_updates off")

    @property
    def generated_tokens(self) -> dict[str, int]:
        """Tokens generated so far by each running request (with latency): what a caller
        waits on to know that a request is under way, instead of sleeping."""
        return dict(self._generated)

    async def interrupt(self, request_id: str) -> None:
        interrupted = self._running.get(request_id)
        if interrupted is not None:
            interrupted.set()

    async def freeze(self) -> None:
        self._thawed.clear()

    async def thaw(self) -> None:
        self._thawed.set()

    async def verify_checkpoint(self, path: str) -> None:
        _read_mock_checkpoint(Path(path), self._settings)

    async def load_weights(self, path: str, version: int) -> None:
        """Weights from the checkpoint's config.json. Its `mock_check` stands for what the
        check after a real load finds: `fails` (rolled back: the old weights serve again) or
        `fails_for_good` (the old weights cannot be put back either: `WeightsLostError`)."""
        config = _read_mock_checkpoint(Path(path), self._settings)
        if self._running and not self._settings.in_place_updates:
            raise WeightUpdateError(
                f"{len(self._running)} requests are running; this engine loads weights idle"
            )
        verdict = json.loads(config).get("mock_check")
        if verdict == "fails":
            raise WeightUpdateError(
                f"the update to {path} (version {version}) failed the check: mock_check fails; "
                f"rolled back (version {self._version})"
            )
        self._weights_seed = zlib.crc32(config)
        if verdict == "fails_for_good":
            raise WeightsLostError(
                f"the update to {path} (version {version}) failed the check: mock_check "
                "fails_for_good; the weights before it cannot be loaded again"
            )
        self._version = version
        self.loads.append((path, version))
        logger.info("mock engine: weights from %s, version %d", path, version)

    async def transfer_weights(
        self,
        backend: str,
        init_info: dict[str, Any] | None,
        update_info: dict[str, Any],
        version: int,
    ) -> None:
        raise WeightUpdateError(f"the mock engine has no {backend} weight-transfer backend")

    async def reset_prefix_cache(self) -> None:
        self.prefix_cache_resets += 1
        self._prefix_cache.clear()

    async def start(self) -> None:
        logger.info("mock engine ready: %s", self.model_name)

    async def generate(
        self, job: Job, request_id: str, *, trace_headers: Mapping[str, str] | None = None
    ) -> EngineOutput:
        if self._dead:
            raise EngineDeadError("mock engine was closed")
        s = self._settings
        prompt_ids = (
            list(job.prompt_token_ids)
            if job.prompt_token_ids is not None
            else list((job.prompt or "").encode("utf-8"))
        )
        prompt_len = len(prompt_ids)
        if s.crash_token_id is not None and s.crash_token_id in prompt_ids:
            logger.error(
                "job %s holds the crash token %d: killing the process", job.job_id, s.crash_token_id
            )
            os.kill(os.getpid(), signal.SIGKILL)
        if prompt_len == 0:
            raise InvalidJobError("the prompt is empty")
        if prompt_len >= s.max_model_len:
            raise InvalidJobError(
                f"prompt is {prompt_len} tokens; the model's context is {s.max_model_len}"
            )
        start = job.routed_experts_prompt_start
        if start > prompt_len:
            raise InvalidJobError(
                f"routed_experts_prompt_start={start} is beyond the prompt ({prompt_len} tokens)"
            )
        sampling = job.sampling
        max_tokens = sampling.max_tokens or s.max_model_len - prompt_len
        max_tokens = min(max_tokens, s.max_model_len - prompt_len)
        seed = sampling.seed if sampling.seed is not None else _stable_seed(job.job_id)
        # Looked up at prefill, as vLLM does, before any other request finishes meanwhile.
        cached = self._prefix_cache.hit(self._weights_seed, prompt_ids)
        if s.per_token_latency_ms > 0:
            chunks, interrupted = await self._steps(request_id, max_tokens)
        else:
            chunks = [_Chunk(self._weights_seed, self._version, 0, max_tokens)]
            interrupted = False
        completions = [
            self._sampler.completion(
                job, index, seed=seed, prompt_len=prompt_len, chunks=chunks, max_tokens=max_tokens
            )
            for index in range(sampling.n)
        ]
        self._prefix_cache.add(self._weights_seed, prompt_ids, [c.token_ids for c in completions])
        return EngineOutput(
            prompt_token_ids=prompt_ids,
            completions=completions,
            weight_version=self._version,
            interrupted=interrupted,
            cached_prompt_tokens=cached,
        )

    async def _steps(self, request_id: str, max_tokens: int) -> tuple[list[_Chunk], bool]:
        """Advance a request in steps; its chunks of tokens, and whether it was interrupted."""
        per_token_s = self._settings.per_token_latency_ms / 1000
        step = max(int(_STEP_S / per_token_s), 1)
        chunks: list[_Chunk] = []
        done = 0
        interrupted = self._running[request_id] = asyncio.Event()
        self._generated[request_id] = 0
        try:
            while done < max_tokens:
                if not self._thawed.is_set():
                    await _first(self._thawed, interrupted)  # an interrupt ends a frozen one too
                if interrupted.is_set():
                    return chunks, True
                count = min(step, max_tokens - done)
                await asyncio.sleep(count * per_token_s)
                if interrupted.is_set():
                    return chunks, True
                chunks.append(_Chunk(self._weights_seed, self._version, done, done + count))
                done += count
                self._generated[request_id] = done
            return chunks, False
        finally:
            del self._running[request_id]
            del self._generated[request_id]

    async def check_health(self) -> None:
        if self._dead:
            raise EngineDeadError("mock engine was closed")

    async def close(self) -> None:
        self._dead = True


class MockSampler:
    """What the simulated model samples: a completion's tokens, logprobs, text and routing for
    its chunks of weights, sliced from pools drawn once (at the first completion).

    The routed experts follow vLLM's row rule (rows = prompt_len + len(token_ids) - 1 - start)
    and hold `top_k` distinct ids per row, so every consumer-side check a real model would pass
    also passes here.
    """

    def __init__(self, settings: MockEngineSettings) -> None:
        self._settings = settings
        self._pool: _Pools | None = None

    def completion(
        self,
        job: Job,
        index: int,
        *,
        seed: int,
        prompt_len: int,
        chunks: list[_Chunk],
        max_tokens: int,
    ) -> Completion:
        """Completion `index` of `job`: the tokens of `chunks`, each sampled on its own weights,
        cut at a stop token, with routing for its `prompt_len` prompt tokens."""
        # Outputs are slices of pools drawn once, at an offset derived from (seed, index, the
        # weights): as deterministic as drawing per job, and cheap enough that a load test
        # measures the worker and the broker rather than the mock.
        pools = self._pools()
        if len(chunks) == 1 and not job.sampling.stop_token_ids:
            return self._whole_completion(
                job, index, seed, prompt_len, chunks[0], max_tokens=max_tokens
            )
        tokens: list[int] = []
        logprob_values: list[float | None] = []
        text: list[str] = []
        spans: list[VersionSpan] = []
        first_offset = None
        for chunk in chunks:
            offset = (seed * _MIX + index * _POOL_STEP + chunk.weights_seed) % _POOL_VARIETY
            first_offset = offset if first_offset is None else first_offset
            a, b = offset + chunk.start, offset + chunk.end
            tokens += pools.token_list[a:b]
            logprob_values += pools.logprob_list[a:b]
            text.append(pools.text[a:b])
            if spans and spans[-1].version == chunk.version:
                spans[-1] = VersionSpan(version=chunk.version, start=spans[-1].start, end=chunk.end)
            else:
                spans.append(VersionSpan(version=chunk.version, start=chunk.start, end=chunk.end))
        generated = chunks[-1].end if chunks else 0
        finish_reason = "length" if generated >= max_tokens else "abort"
        stop_ids = job.sampling.stop_token_ids
        if stop_ids:
            hits = np.flatnonzero(np.isin(np.asarray(tokens, dtype=np.int64), stop_ids))
            if hits.size:
                end = int(hits[0]) + 1
                tokens, logprob_values = tokens[:end], logprob_values[:end]
                text = ["".join(text)[:end]]
                spans = [
                    VersionSpan(version=v.version, start=v.start, end=min(v.end, end))
                    for v in spans
                    if v.start < end
                ]
                finish_reason = "stop"
        logprobs: list[float | None] | None = None
        cumulative: float | None = None
        if job.sampling.logprobs is not None:
            logprobs = logprob_values
            cumulative = float(sum(v for v in logprob_values if v is not None))
        routed = None
        if job.return_routed_experts:
            start = job.routed_experts_prompt_start
            rows = max(prompt_len + len(tokens) - 1 - start, 0)
            routed = RoutedExperts.from_array(
                pools.routing(first_offset or 0, rows),
                start=start,
                num_experts=self._settings.num_experts,
            )
        return Completion(
            index=index,
            token_ids=tokens,
            text="".join(text),
            finish_reason=finish_reason,
            logprobs=logprobs,
            cumulative_logprob=cumulative,
            routed_experts=routed,
            weight_versions=spans,
        )

    def _whole_completion(
        self, job: Job, index: int, seed: int, prompt_len: int, chunk: _Chunk, *, max_tokens: int
    ) -> Completion:
        """The common case, kept lean for load tests: one set of weights, no stop tokens (and
        a request interrupted in its first step)."""
        pools = self._pools()
        a = (seed * _MIX + index * _POOL_STEP + chunk.weights_seed) % _POOL_VARIETY
        b = a + chunk.end
        routed = None
        if job.return_routed_experts:
            start = job.routed_experts_prompt_start
            rows = max(prompt_len + chunk.end - 1 - start, 0)
            routed = RoutedExperts.from_array(
                pools.routing(a, rows), start=start, num_experts=self._settings.num_experts
            )
        with_logprobs = job.sampling.logprobs is not None
        return Completion(
            index=index,
            token_ids=pools.token_list[a:b],
            text=pools.text[a:b],
            finish_reason="length" if chunk.end >= max_tokens else "abort",
            logprobs=pools.logprob_list[a:b] if with_logprobs else None,
            cumulative_logprob=float(pools.logprobs[a:b].sum()) if with_logprobs else None,
            routed_experts=routed,
            weight_versions=[_span(chunk.version, chunk.end)],
        )

    def _pools(self) -> _Pools:
        if self._pool is None:
            self._pool = _Pools(self._settings)
        return self._pool


_POOL_VARIETY: Final = 4096
# Spread (seed, index) over the pools without a hash per completion: an odd 64-bit multiplier
# (Knuth's golden-ratio constant) and a step coprime to the pool variety.
_MIX: Final = 0x9E37_79B9_7F4A_7C15
_POOL_STEP: Final = 2_654_435_761


class _Pools:
    """Random tokens, logprobs and routing drawn once; completions are slices of them."""

    def __init__(self, settings: MockEngineSettings) -> None:
        self._settings = settings
        rng = np.random.default_rng(0)
        size = settings.max_model_len + _POOL_VARIETY
        self.tokens = rng.integers(0, settings.vocab_size, size=size, dtype=np.int64)
        self.logprobs = -rng.exponential(1.0, size=size)
        # Python copies too: slicing a list or str costs a fraction of numpy's tolist().
        self.token_list: list[int] = self.tokens.tolist()
        self.logprob_list: list[float | None] = self.logprobs.tolist()
        self.text = (self.tokens % 26 + ord("a")).astype(np.uint8).tobytes().decode("ascii")
        self._routing: np.ndarray | None = None

    def routing(self, offset: int, rows: int) -> np.ndarray:
        if self._routing is None:
            s = self._settings
            rng = np.random.default_rng(1)
            size = s.max_model_len + _POOL_VARIETY
            # Distinct ids per (row, layer): a random first choice, the rest at fixed strides.
            # uint32 arithmetic cannot overflow (ids < 65536, stride * top_k <= num_experts).
            first = rng.integers(0, s.num_experts, size=(size, s.num_layers, 1), dtype=np.uint32)
            stride = max(s.num_experts // s.top_k, 1)
            first = first + np.arange(s.top_k, dtype=np.uint32) * stride
            first %= s.num_experts
            self._routing = first.astype(np.uint8 if s.num_experts <= 256 else np.uint16)
        return self._routing[offset : offset + rows]


@functools.lru_cache(maxsize=4096)
def _span(version: int, end: int) -> VersionSpan:
    # Frozen, so one object serves every completion of that length and version.
    return VersionSpan(version=version, start=0, end=end)


async def _first(*events: asyncio.Event) -> None:
    """Wait until one of `events` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def _read_mock_checkpoint(path: Path, settings: MockEngineSettings) -> bytes:
    """The bytes of a mock checkpoint's config.json, after checking it fits this model."""
    try:
        config = (path / "config.json").read_bytes()
    except FileNotFoundError:
        raise WeightUpdateError(
            f"no checkpoint at {path}: {path / 'config.json'} is missing"
        ) from None
    except OSError as exc:
        raise WeightUpdateError(f"checkpoint {path} cannot be read: {exc}") from None
    try:
        fields = json.loads(config)
    except ValueError as exc:
        raise WeightUpdateError(f"checkpoint {path}: config.json is not JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise WeightUpdateError(f"checkpoint {path}: config.json is not an object")
    for key, ours in (
        ("num_hidden_layers", settings.num_layers),
        ("num_experts_per_tok", settings.top_k),
        ("num_experts", settings.num_experts),
    ):
        if key in fields and fields[key] != ours:
            raise WeightUpdateError(
                f"checkpoint {path} is another architecture: {key} {fields[key]}, "
                f"the served model has {ours}"
            )
    return config


def _stable_seed(job_id: str) -> int:
    # The same in every process (unlike hash()), and a tenth of a cryptographic hash's cost.
    return zlib.crc32(job_id.encode())
