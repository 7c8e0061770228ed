"""Where a job's answers go: its `reply_to` when `--reply-topics` allows it and the broker has
that topic, else the results topic.

A `reply_to` is written by whoever produced the job, so it is checked before anything is
answered there: once per topic, with one bounded metadata lookup whose outcome is kept. A topic
the broker does not have (auto-creation off) would otherwise be retried until
`--publish-timeout-s` and stop the worker, and the producer's own metadata wait for it would
hold up every other answer meanwhile. Such a job is answered `invalid_job` on the results topic.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Final

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from schemas import Job
from worker.core.clients import KafkaClients
from worker.core.clock import Clock
from worker.core.config import Settings
from worker.core.kafka import TopicConfigReader, broker_has_topic

__all__ = ["AnswerTopics", "TopicLimitLookup", "TopicLookup"]

logger = logging.getLogger(__name__)

#: Whether the broker has a topic: True or False, or a KafkaError when no broker answers.
TopicLookup = Callable[[str], Awaitable[bool]]
#: A topic's `max.message.bytes`, None when it cannot be read.
TopicLimitLookup = Callable[[str], Awaitable[int | None]]


def broker_lookups(
    settings: Settings,
    producer: AIOKafkaProducer,
    kafka_clients: KafkaClients,
    topic_lookup: TopicLookup | None,
    topic_limit_lookup: TopicLimitLookup | None,
) -> tuple[TopicLookup, TopicLimitLookup | None, TopicConfigReader | None]:
    """The lookups given, or the broker's: whether it has a topic (one metadata request on the
    producer's connections) and, with that default, the topic's `max.message.bytes` (one
    DescribeConfigs request on an admin client from `kafka_clients`, kept open for the next:
    returned, for its owner to close)."""
    if topic_lookup is not None:
        return topic_lookup, topic_limit_lookup, None
    lookup = functools.partial(broker_has_topic, producer)
    if topic_limit_lookup is not None:
        return lookup, topic_limit_lookup, None
    reader = TopicConfigReader(settings, kafka_clients)
    return lookup, reader.max_message_bytes_of, reader


#: The longest a job waits for the metadata of its reply topic.
REPLY_TOPIC_CHECK_S: Final = 5.0
#: How long a topic found missing stays refused before it is looked up again (it may be
#: created meanwhile); a topic found is kept while it is among the last `_MAX_PRESENT` found.
MISSING_TOPIC_TTL_S: Final = 60.0
# Topics found missing, and topics found present, that are remembered at once; hostile jobs
# naming ever new topics the pattern allows cost a lookup each beyond it, not memory.
_MAX_MISSING: Final = 1024
_MAX_PRESENT: Final = 1024


class AnswerTopics:
    """Where a job's answer goes. `check(reply_to)` looks the topic up (at most once per topic
    and `MISSING_TOPIC_TTL_S`); `of`, `answer_topic` and `refusal` then say, without waiting,
    where it is answered and why not on its `reply_to`.

    Without `lookup` an allowed `reply_to` is taken as it is named, unchecked. With
    `limit_lookup`, a topic found also has its `max.message.bytes` read (`limit_of`), so its
    answers are shaped to fit it before they are sent: a record the broker refuses breaks the
    idempotent producer's sequence for that partition.
    """

    def __init__(
        self,
        settings: Settings,
        lookup: TopicLookup | None = None,
        *,
        limit_lookup: TopicLimitLookup | None = None,
        clock: Clock,
    ) -> None:
        self.results = settings.results_topic
        self.dead_letter = settings.dead_letter_topic
        self._reply_topics = (
            re.compile(settings.reply_topics) if settings.reply_topics is not None else None
        )
        self._lookup = lookup
        self._limit_lookup = limit_lookup
        self._clock = clock
        # Reply topics found, by their max.message.bytes (None: not read), oldest first.
        self._limits: dict[str, int | None] = {}
        # Topic -> (when it may be looked up again, why it is refused meanwhile).
        self._missing: dict[str, tuple[float, str]] = {}
        self._checks: dict[str, asyncio.Task[None]] = {}

    @property
    def allowed_replies(self) -> str:
        """The `--reply-topics` pattern, for error details ("unset" when none is allowed)."""
        return self._reply_topics.pattern if self._reply_topics is not None else "unset"

    def allowed(self, reply_to: str | None) -> bool:
        """Whether `--reply-topics` lets a job be answered on `reply_to`."""
        return (
            reply_to is not None
            and self._reply_topics is not None
            and self._reply_topics.fullmatch(reply_to) is not None
        )

    async def check(self, reply_to: str | None) -> None:
        """Look `reply_to` up on the broker unless its outcome is known; waits at most
        `REPLY_TOPIC_CHECK_S`. Jobs asking for the same topic at once share one lookup."""
        if self._lookup is None or reply_to is None or not self.allowed(reply_to):
            return
        if reply_to in self._limits or self._missing_reason(reply_to) is not None:
            return
        task = self._checks.get(reply_to)
        if task is None:
            task = asyncio.create_task(self._look_up(reply_to), name=f"check {reply_to}")
            self._checks[reply_to] = task
            task.add_done_callback(lambda _: self._checks.pop(reply_to, None))
        # Shielded: a cancelled job leaves the lookup to the others waiting on it.
        await asyncio.shield(task)

    def answer_topic(self, reply_to: str | None) -> str:
        """The topic an answer to a job with this `reply_to` goes to."""
        if reply_to is None or self.refusal(reply_to) is not None:
            return self.results
        return reply_to

    def of(self, job: Job) -> str:
        """The topic the answers to `job` go to."""
        return self.answer_topic(job.reply_to)

    def refusal(self, reply_to: str) -> str | None:
        """Why a job's `reply_to` is not answered on (its answer goes to the results topic
        instead), or None when it is."""
        if not self.allowed(reply_to):
            return (
                f"reply_to {reply_to!r} is not a topic this worker answers to "
                f"(--reply-topics {self.allowed_replies})"
            )
        if self._lookup is None or reply_to in self._limits:
            return None
        reason = self._missing_reason(reply_to)
        if reason is None:
            # Not checked (or the check was cut short): never answered on unchecked.
            reason = "it has not been checked on the broker"
        return f"reply_to {reply_to!r} cannot be answered on: {reason}"

    def refuse_writes(self, topic: str, reason: str) -> None:
        """The broker refused this worker's write to reply topic `topic`: its jobs are answered
        on the results topic instead, until it is looked up again."""
        self._limits.pop(topic, None)
        self._refuse(topic, reason)

    def limit_of(self, topic: str) -> int | None:
        """The `max.message.bytes` of a reply topic found on the broker, when it was read."""
        return self._limits.get(topic)

    def _missing_reason(self, topic: str) -> str | None:
        missing = self._missing.get(topic)
        if missing is None:
            return None
        if missing[0] <= self._clock.monotonic():
            del self._missing[topic]
            return None
        return missing[1]

    async def _look_up(self, topic: str) -> None:
        assert self._lookup is not None  # noqa: S101 - check() returns first without one
        # One bound for the whole check: the limit's read gets what the lookup left of it.
        deadline = asyncio.get_running_loop().time() + REPLY_TOPIC_CHECK_S
        try:
            async with asyncio.timeout_at(deadline):
                present = await self._lookup(topic)
        except TimeoutError:
            self._refuse(topic, f"no metadata for it within {REPLY_TOPIC_CHECK_S:.0f}s")
            return
        except KafkaError as exc:
            self._refuse(topic, f"its metadata could not be read ({type(exc).__name__})")
            return
        except Exception as exc:  # A lookup's bug must not leave a job unanswered.
            logger.exception("looking up reply topic %s failed", topic)
            self._refuse(topic, f"its metadata could not be read ({type(exc).__name__})")
            return
        if present:
            limit = await self._read_limit(topic, deadline)
            if len(self._limits) >= _MAX_PRESENT:
                # The topic found first is looked up again when a job next names it.
                del self._limits[next(iter(self._limits))]
            self._limits[topic] = limit
            logger.info(
                "reply topic %s exists: answering jobs on it (max.message.bytes %s)",
                topic,
                "unknown" if limit is None else limit,
            )
        else:
            self._refuse(topic, "the broker has no such topic (and does not create it)")

    async def _read_limit(self, topic: str, deadline: float) -> int | None:
        """The topic's `max.message.bytes`, or None when it cannot be read by `deadline` (the
        loop's time; its records are then bounded by the producer's limit, and a refusal is
        answered)."""
        if self._limit_lookup is None:
            return None
        try:
            async with asyncio.timeout_at(deadline):
                return await self._limit_lookup(topic)
        except Exception as exc:  # noqa: BLE001 - an unknown limit is what a failed lookup means
            logger.warning("cannot read max.message.bytes of reply topic %s: %r", topic, exc)
            return None

    def _refuse(self, topic: str, reason: str) -> None:
        if len(self._missing) >= _MAX_MISSING:
            now = self._clock.monotonic()
            self._missing = {t: m for t, m in self._missing.items() if m[0] > now}
            if len(self._missing) >= _MAX_MISSING:
                self._missing.pop(next(iter(self._missing)))
        self._missing[topic] = (self._clock.monotonic() + MISSING_TOPIC_TTL_S, reason)
        logger.warning("reply topic %s refused for %.0fs: %s", topic, MISSING_TOPIC_TTL_S, reason)
