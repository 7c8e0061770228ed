"""A model-free engine for load tests and for checking Kafka plumbing without a GPU."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import zlib
from typing import Final

import msgspec
import numpy as np

from schemas import Completion, Job, RoutedExperts
from worker.config import Settings
from worker.engine import EngineOutput
from worker.errors import EngineDeadError, InvalidJobError

__all__ = ["MockEngine", "MockEngineSettings", "mock_engine_settings"]

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


def mock_engine_settings(settings: Settings) -> MockEngineSettings:
    """The mock engine's settings from the worker's: setting `mock_x` is field `x`."""
    prefix = "mock_"
    return msgspec.convert(
        {
            name[len(prefix) :]: getattr(settings, name)
            for name in settings.__struct_fields__
            if name.startswith(prefix)
        },
        MockEngineSettings,
    )


class MockEngine:
    """Deterministic tokens from the job's seed (or its id), synthetic routed experts.

    The routed experts follow vLLM's row rule (rows = prompt_len + len(token_ids) - 1 - start)
    and hold `top_k` distinct ids per row, so every consumer-side check a real model would pass
    also passes here. Latency is simulated per token, so concurrent jobs overlap as in a batch.
    """

    def __init__(self, settings: MockEngineSettings | None = None) -> None:
        self._settings = settings or MockEngineSettings()
        self._running: dict[str, asyncio.Task[EngineOutput]] = {}
        self._dead = False
        self._pool: _Pools | None = None
        s = self._settings
        self._model_name = f"mock-{s.num_layers}L-{s.num_experts}E-top{s.top_k}"

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_concurrency(self) -> int:
        return self._settings.max_num_seqs

    @property
    def supports_routed_experts(self) -> bool:
        return True

    async def start(self) -> None:
        logger.info("mock engine ready: %s", self.model_name)

    async def generate(self, job: Job, request_id: str) -> EngineOutput:
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
        if s.per_token_latency_ms > 0:
            await asyncio.sleep(max_tokens * s.per_token_latency_ms / 1000)
        seed = sampling.seed if sampling.seed is not None else _stable_seed(job.job_id)
        completions = [
            self._completion(job, index, seed, prompt_len, max_tokens)
            for index in range(sampling.n)
        ]
        return EngineOutput(prompt_token_ids=prompt_ids, completions=completions)

    def _completion(
        self, job: Job, index: int, seed: int, prompt_len: int, max_tokens: int
    ) -> Completion:
        # Outputs are slices of pools drawn once, at an offset derived from (seed, index): as
        # deterministic as drawing per job, and cheap enough that a load test measures the
        # worker and the broker rather than the mock.
        pools = self._pools()
        offset = (seed * _MIX + index * _POOL_STEP) % _POOL_VARIETY
        end = offset + max_tokens
        finish_reason = "length"
        stop_ids = job.sampling.stop_token_ids
        if stop_ids:
            hits = np.flatnonzero(np.isin(pools.tokens[offset:end], stop_ids))
            if hits.size:
                end = offset + int(hits[0]) + 1
                finish_reason = "stop"
        logprobs: list[float | None] | None = None
        cumulative: float | None = None
        if job.sampling.logprobs is not None:
            logprobs = pools.logprob_list[offset:end]
            cumulative = float(pools.logprobs[offset:end].sum())
        routed = None
        if job.return_routed_experts:
            start = job.routed_experts_prompt_start
            rows = prompt_len + (end - offset) - 1 - start
            routed = RoutedExperts.from_array(pools.routing(offset, rows), start=start)
        return Completion(
            index=index,
            token_ids=pools.token_list[offset:end],
            text=pools.text[offset:end],
            finish_reason=finish_reason,
            logprobs=logprobs,
            cumulative_logprob=cumulative,
            routed_experts=routed,
        )

    def _pools(self) -> _Pools:
        if self._pool is None:
            self._pool = _Pools(self._settings)
        return self._pool

    async def check_health(self) -> None:
        if self._dead:
            raise EngineDeadError("mock engine was closed")

    async def close(self) -> None:
        self._dead = True


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


def _stable_seed(job_id: str) -> int:
    # The same in every process (unlike hash()), and a tenth of a cryptographic hash's cost.
    return zlib.crc32(job_id.encode())
