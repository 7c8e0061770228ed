"""The trainer's half of the simulation: the real `RolloutClient` on simulated clients, driven by
a GRPO-shaped RL loop, among the things a trainer meets on a shared fleet.

Each trainer is a `Process` of its own; its client is `worker.client.rollout.RolloutClient`,
unchanged, given a `SimKafkaClients` (`worker.core.clients.KafkaClients`) that builds
`SimProducer`s and `SimConsumer`s for that process. The loop is `worker.client.rl_loop`'s
shape: steps of groups, each group one job of `n` samples, or, with turns, one `Conversation`
per sample, every turn through `RolloutClient.turn`. A call that fails or expires is run again
(a turn with another tool response, a group with a shorter `max_tokens`), so every step ends.
Between some steps the first trainer updates the fleet's weights through
`RolloutClient.update_weights` (a checkpoint the simulated workers load, now and then one they
refuse, a forced rollback), and asks the next steps' jobs for that version
(`min_weight_version`); a `RolloutError` is recorded and the loop goes on. The client offers
no transfer, so none is sent here.

What a trainer meets, drawn from the seed (`TrainerPlan`):

- a `timeout_s` short enough that some calls expire, and jobs slow enough to outlast it, so
  answers to earlier askings of a job id arrive while a re-run of it waits;
- `reply_to` a topic of its own, or the fleet's results topic shared with the raw trainer;
- a second trainer on the results topic without `reply_to`, sending the same job ids or not;
- a restart of the loop (its process killed, or its client closed) and a new client that sends
  the same job ids from step 0 on the same topics;
- an echo: a process that appends answers of the trainers' jobs to their topic again, some
  after the trainer's timeout (a worker answering twice, an answer that comes late);
- an outage of the broker while calls are made, beside the fault schedule's own.

Every call and what it ended with is recorded in the history (`rl_call`, `rl_return`,
`rl_error`; `rl_update`, `rl_updated`, `rl_update_error` for weight updates), with each job's
asking (its `submission_id` and a tag in its metadata, new for
every asking and every run); `worker.dev.sim.trainer_checks` judges them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import msgspec
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from schemas import (
    Completed,
    ErrorCode,
    ErrorInfo,
    Failed,
    InflightMode,
    Job,
    Result,
    SamplingSpec,
    decode_job,
    encode,
)
from worker.client.conversation import Conversation, ConversationError, new_submission_id
from worker.client.rollout import RolloutClient, RolloutError
from worker.core.clock import Clock
from worker.dev.sim.clients import Process, SimConsumer, SimProducer
from worker.dev.sim.cluster import Cluster
from worker.dev.sim.history import History
from worker.dev.sim.kafka_clients import SimKafkaClients

__all__ = [
    "ASK_KEY",
    "JOB_PREFIX",
    "TrainerPlan",
    "TrainerTopics",
    "drawn_plans",
    "run_trainers",
    "seeded_uuids",
]

#: Every job id of a client-driven trainer starts so (the raw trainer's are `j<n>`).
JOB_PREFIX: Final = "rl-"
#: The metadata key naming one asking of a job: new for every asking, in every run.
ASK_KEY: Final = "ask"
#: Seconds between the tries of a call the client refused (not started, a send refused).
RETRY_CALL_S: Final = 0.5
#: How long a loop waits for the fleet's heartbeats before it asks a failed turn again.
STATUS_TIMEOUT_S: Final = 5.0
#: Tokens of a toy tool response between turns.
TOOL_TOKENS: Final = 12
#: How a weight update treats the jobs in flight, drawn for each update.
UPDATE_MODES: Final[tuple[InflightMode, ...]] = ("wait", "keep", "abort", "restart")

#: A mock checkpoint the fleet can load, by name (`v<n>`; `other-architecture-...` is refused).
Checkpoint = Callable[[str], str]


@dataclass(frozen=True)
class TrainerTopics:
    jobs: str
    results: str
    #: The topic a trainer with `reply_to` reads its answers from.
    reply: str
    #: The fleet's control and status topics and consumer group, which weight updates go to.
    control: str = "vkw.control"
    status: str = "vkw.status"
    group: str = "vllm-kafka-worker"


@dataclass(frozen=True)
class TrainerPlan:
    """One trainer's loop and what happens to it, drawn from the seed."""

    name: str
    #: The stem of every job id: a restarted loop, and a second trainer that shares it, send
    #: the same ids.
    run_id: str
    reply_to: bool
    timeout_s: float
    #: The client's producer gives up a send after this (aiokafka's `request_timeout_ms`).
    request_timeout_ms: int
    max_retries: int
    steps: int
    groups: int
    n: int
    turns: int
    start_at: float
    #: Seconds each step's training takes, between its rollouts and the next step's.
    train_s: float
    #: Share of first askings that generate for longer than the timeout.
    slow_share: float
    #: When the loop dies (None: never), whether by a kill (else its client is closed), and
    #: after how long a new client starts it again.
    restart_at: float | None = None
    restart_by_kill: bool = True
    restart_after_s: float = 1.0
    #: Updates the fleet's weights after every this many steps (None: never).
    update_every: int | None = None
    #: Bounds each `update_weights` call.
    update_timeout_s: float = 30.0


def drawn_plans(rng: random.Random, duration_s: float) -> list[TrainerPlan]:
    """The trainers of one run: `a` always, `b` (on the results topic, without `reply_to`)
    in half the runs, sending `a`'s job ids in half of those."""
    first = _plan(rng, "a", duration_s, reply_to=rng.random() < 0.5)
    # One trainer owns the weights: two would refuse each other's versions.
    first = replace(
        first, update_every=rng.choice([1, 1, 2]), update_timeout_s=rng.uniform(5.0, 40.0)
    )
    plans = [first]
    if rng.random() < 0.5:
        second = _plan(rng, "b", duration_s, reply_to=False)
        if rng.random() < 0.5:
            second = replace(second, run_id=first.run_id)
        plans.append(second)
    return plans


def _plan(rng: random.Random, name: str, duration_s: float, *, reply_to: bool) -> TrainerPlan:
    turns = rng.choice([1, 2, 3])
    start_at = rng.uniform(0.0, duration_s / 5)
    restart = rng.random() < 0.5
    return TrainerPlan(
        name=name,
        run_id=f"{JOB_PREFIX}{name}",
        reply_to=reply_to,
        timeout_s=rng.uniform(1.0, 5.0),
        request_timeout_ms=rng.randrange(1_000, 10_000),
        max_retries=rng.choice([0, 1, 2]),
        steps=rng.randrange(2, 6),
        groups=rng.randrange(1, 4),
        n=rng.randrange(1, 5),
        turns=turns,
        start_at=start_at,
        train_s=rng.uniform(0.2, 3.0),
        slow_share=rng.uniform(0.05, 0.3),
        restart_at=start_at + rng.uniform(1.0, duration_s / 3) if restart else None,
        restart_by_kill=rng.random() < 0.5,
        restart_after_s=rng.uniform(0.5, 5.0),
    )


@contextlib.contextmanager
def seeded_uuids(rng: random.Random) -> Iterator[None]:
    """`uuid.uuid4` drawn from `rng` while inside: submission ids are part of what a run
    appends, and a run must replay byte for byte. Only the project's own calls draw from
    `rng`; a library's draw from a stream of their own, since a module imported for the first
    time during a run draws at import (OpenTelemetry's context keys: four ids), and would
    otherwise shift the project's ids in the first run of a process only."""
    real = uuid.uuid4
    others = random.Random("library ids")  # noqa: S311 - a replayable run

    def drawn() -> uuid.UUID:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        source = rng if caller.split(".", 1)[0] in {"worker", "schemas"} else others
        return uuid.UUID(int=source.getrandbits(128), version=4)

    uuid.uuid4 = drawn
    try:
        yield
    finally:
        uuid.uuid4 = real


class _Calls:
    """Records each call a trainer's loop makes on its client, and how it ended."""

    def __init__(self, history: History, trainer: str, timeout_s: float) -> None:
        self._history = history
        self._trainer = trainer
        self._timeout_s = timeout_s
        self._numbers = itertools.count()

    def called(self, op: str, jobs: Sequence[Job]) -> int:
        number = next(self._numbers)
        self._history.add(
            "rl_call",
            trainer=self._trainer,
            call=number,
            op=op,
            timeout_s=self._timeout_s,
            jobs=[_asked(job) for job in jobs],
        )
        return number

    def returned(self, number: int, results: Sequence[Result]) -> None:
        self._history.add(
            "rl_return",
            trainer=self._trainer,
            call=number,
            results=[_answered(result) for result in results],
        )

    def dropped(self, conversation: str, floor: int, served: list[int]) -> None:
        self._history.add(
            "rl_conversation_dropped",
            trainer=self._trainer,
            conversation=conversation,
            floor=floor,
            served=served,
        )

    def raised(self, number: int, error: BaseException) -> None:
        self._history.add(
            "rl_error",
            trainer=self._trainer,
            call=number,
            error=f"{type(error).__name__}: {error}",
        )


def _asked(job: Job) -> dict[str, Any]:
    return {
        "job": job.job_id,
        "submission": job.submission_id,
        "ask": job.metadata.get(ASK_KEY),
        "prompt": len(job.prompt_token_ids or ()),
        "n": job.sampling.n,
        "max_tokens": job.sampling.max_tokens,
        "min_version": job.min_weight_version,
    }


def _answered(result: Result) -> dict[str, Any]:
    submission = result.submission_id if isinstance(result.submission_id, str) else None
    common = {
        "job": result.job_id,
        "submission": submission,
        "ask": result.metadata.get(ASK_KEY),
    }
    if isinstance(result, Failed):
        return {**common, "failed": result.error.code.value}
    return {
        **common,
        "prompt": result.prompt_token_count,
        "indices": [c.index for c in result.completions],
        "longest": max((len(c.token_ids) for c in result.completions), default=0),
        "part": result.is_part,
        "version": result.weight_version if isinstance(result.weight_version, int) else None,
    }


class _Weights:
    """The weights one trainer puts on the fleet, across the restarts of its loop (a restarted
    trainer resumes from its last checkpoint's version)."""

    def __init__(self, rng: random.Random, checkpoint: Checkpoint) -> None:
        self.rng = rng
        self.checkpoint = checkpoint
        #: The newest version asked for.
        self.version = 0
        #: The version every live worker acknowledged last: the jobs of the steps after it ask
        #: for it (`min_weight_version`), as an on-policy trainer does.
        self.floor: int | None = None
        self.calls = itertools.count()


class _Loop:
    """One run of a trainer's RL loop on one client (a restarted loop is a new `_Loop`)."""

    def __init__(
        self,
        plan: TrainerPlan,
        client: RolloutClient,
        calls: _Calls,
        incarnation: str,
        weights: _Weights | None = None,
    ) -> None:
        self._plan = plan
        self._client = client
        self._calls = calls
        self._incarnation = incarnation
        self._askings = itertools.count()
        self._weights = weights

    @property
    def _floor(self) -> int | None:
        return None if self._weights is None else self._weights.floor

    def _ask(self) -> dict[str, str]:
        return {ASK_KEY: f"{self._incarnation}/{next(self._askings)}"}

    async def run(self, history: History) -> None:
        for step in range(self._plan.steps):
            if self._plan.turns == 1:
                await self._groups(step)
            else:
                await self._conversations(step)
            history.add("rl_step", trainer=self._incarnation, step=step)
            every = self._plan.update_every
            if self._weights is not None and every is not None and (step + 1) % every == 0:
                await self._update_weights(self._weights, history)
            await asyncio.sleep(self._plan.train_s)
        history.add("rl_loop_end", trainer=self._incarnation, in_flight=self._client.in_flight)

    async def _update_weights(self, weights: _Weights, history: History) -> None:
        """One weight update through the client, as a trainer sends it after a step: mostly
        the next version, now and then a checkpoint the fleet refuses, or a forced rollback to
        the version before."""
        draw = weights.rng.random()
        force = draw < 0.15 and weights.version > 1
        if force:
            version = weights.version - 1
        else:
            weights.version += 1
            version = weights.version
        name = f"other-architecture-v{version}" if draw > 0.9 else f"v{version}"
        mode = weights.rng.choice(UPDATE_MODES)
        number = next(weights.calls)
        timeout_s = self._plan.update_timeout_s
        if force and weights.floor is not None:
            # From the send on, some workers may serve the rollback, and a restarted one takes
            # it from the control topic: jobs asking for more would wait on them for ever,
            # whether the call fails, or never returns because the loop restarts meanwhile
            # (seed 7300052 at one worker: every turn of the restarted loop expired).
            weights.floor = min(weights.floor, version)
        history.add(
            "rl_update",
            trainer=self._incarnation,
            call=number,
            version=version,
            force=force,
            mode=mode,
            checkpoint=name,
            timeout_s=timeout_s,
        )
        try:
            acks = await self._client.update_weights(
                weights.checkpoint(name), version, mode=mode, timeout_s=timeout_s, force=force
            )
        except RolloutError as exc:
            history.add("rl_update_error", trainer=self._incarnation, call=number, error=str(exc))
            return
        history.add(
            "rl_updated",
            trainer=self._incarnation,
            call=number,
            command_id=next(iter(acks.values())).command_id,
            workers=sorted(acks),
        )
        weights.floor = version

    async def _groups(self, step: int) -> None:
        """Each group one job of `n` samples, in one `generate`; the groups that failed or
        expired are asked again, the slow ones shorter."""
        plan = self._plan
        waiting = list(range(plan.groups))
        asking = 0
        while waiting:
            jobs = [self._group_job(step, g, asking) for g in waiting]
            results = await self._generate(jobs)
            if results is None:
                await asyncio.sleep(RETRY_CALL_S)
                continue
            waiting = [
                g
                for g, result in zip(waiting, results, strict=True)
                if not isinstance(result, Completed)
            ]
            asking += 1

    def _group_job(self, step: int, group: int, asking: int) -> Job:
        plan = self._plan
        # The same prompt and first sampling in every run of the loop: deterministic ids and
        # contents, as a restarted trainer sends them.
        same = random.Random(f"{plan.run_id}/{step}/{group}")  # noqa: S311 - not a secret
        prompt = [same.randrange(20, 30_000) for _ in range(same.randrange(3, 9))]
        slow = same.random() < plan.slow_share and asking == 0
        return Job(
            job_id=f"{plan.run_id}-s{step}-g{group}",
            prompt_token_ids=prompt,
            sampling=SamplingSpec(
                n=plan.n,
                max_tokens=_slow_tokens(plan) if slow else same.randrange(4, 24),
                seed=step * 100 + group,
            ),
            return_routed_experts=True,
            metadata={"step": str(step), "group": str(group), **self._ask()},
            submission_id=new_submission_id(),
            min_weight_version=self._floor,
        )

    async def _generate(self, jobs: list[Job]) -> list[Result] | None:
        number = self._calls.called("generate", jobs)
        try:
            results = await self._client.generate(jobs)
        except RolloutError as exc:
            self._calls.raised(number, exc)
            return None
        self._calls.returned(number, results)
        return results

    async def _conversations(self, step: int) -> None:
        """Each sample a conversation of `turns` turns; a group's conversations share its
        session. A turn that failed or expired is asked again with another tool response."""
        plan = self._plan
        conversations = [
            (
                group,
                Conversation(
                    f"{plan.run_id}-s{step}-g{group}",
                    conversation_id=f"{plan.run_id}-s{step}-g{group}-c{i}",
                    sampling=SamplingSpec(max_tokens=8, seed=step * 100 + group * 10 + i),
                    metadata={"step": str(step), "group": str(group), "sample": str(i)},
                ),
            )
            for group in range(plan.groups)
            for i in range(plan.n)
        ]
        for turn in range(plan.turns):
            going_on = await asyncio.gather(
                *(self._turn(step, group, turn, c) for group, c in conversations)
            )
            conversations = [c for c, on in zip(conversations, going_on, strict=True) if on]

    async def _turn(self, step: int, group: int, turn: int, conversation: Conversation) -> bool:
        """Ask for the turn until it completes (True), or until the conversation is given up
        (False)."""
        plan = self._plan
        same = random.Random(f"{plan.run_id}/{step}/{group}")  # noqa: S311 - not a secret
        prompt = [same.randrange(20, 30_000) for _ in range(same.randrange(3, 9))]
        asking = 0
        while True:
            if turn == 0:
                new = prompt
            else:
                # A re-run asks with another tool response: another prompt under the same id.
                last = conversation.token_ids[-1]
                new = [
                    (last + 11 * turn + 7 * asking + 5 * i) % 400 + 20 for i in range(TOOL_TOKENS)
                ]
            slow = asking == 0 and same.random() < plan.slow_share
            sampling = SamplingSpec(
                max_tokens=_slow_tokens(plan) if slow else 8,
                seed=step * 100 + group * 10 + turn,
            )
            if await self._one_turn(conversation, new, sampling):
                return True
            if await self._rolled_back_below(conversation):
                return False
            asking += 1
            await asyncio.sleep(0)

    async def _rolled_back_below(self, conversation: Conversation) -> bool:
        """Whether every live worker serves weights older than the conversation's next turn
        may run on: a forced rollback (another trainer's, or this one's) went below the version
        its last turn ran on. Its next turn would wait for that version until it expires, and
        running it on the older policy would mix two policies in one sample: a trainer drops
        the sample (seed 7600039 at one worker: every later asking of such a turn expired)."""
        floor = conversation.weight_floor
        if floor is None:
            return False
        try:
            statuses = await self._client.status(timeout_s=STATUS_TIMEOUT_S)
        except RolloutError:
            return False
        served = sorted({status.weight_version for status in statuses.values()})
        if not served or served[-1] >= floor:
            return False
        self._calls.dropped(conversation.conversation_id, floor, served)
        return True

    async def _one_turn(
        self, conversation: Conversation, new: list[int], sampling: SamplingSpec
    ) -> bool:
        """Ask for the conversation's next turn; whether it completed."""
        expected = f"{conversation.conversation_id}-turn{len(conversation.turns)}"
        call = asyncio.ensure_future(
            self._client.turn(
                conversation,
                new,
                sampling=sampling,
                metadata=self._ask(),
                min_weight_version=self._floor,
            )
        )
        # The call runs up to its first wait: its job is built and submitted by then.
        await asyncio.sleep(0)
        asked = conversation.in_flight
        if asked is None:  # refused before anything was sent
            asked = Job(job_id=expected, prompt_token_ids=[0])
        number = self._calls.called("turn", [asked])
        try:
            result = await call
        except (RolloutError, ConversationError) as exc:
            self._calls.raised(number, exc)
            await asyncio.sleep(RETRY_CALL_S)
            return False
        self._calls.returned(number, [result])
        return isinstance(result, Completed)


def _slow_tokens(plan: TrainerPlan) -> int:
    """Tokens that take longer than the plan's timeout at the mock engine's 5 ms a token."""
    return min(int(plan.timeout_s / 0.005 * 1.5), 4_000)


async def run_trainers(
    cluster: Cluster,
    topics: TrainerTopics,
    rng: random.Random,
    duration_s: float,
    finished: asyncio.Event,
    *,
    clock: Clock,
    checkpoint: Checkpoint,
) -> None:
    """The trainers of one run (`drawn_plans`), the echo and the trainers' broker outage, until
    cancelled; `finished` is set once every trainer's last loop has run every step. Their
    clients read `clock`; the trainer that updates weights names checkpoints by `checkpoint`."""
    history = cluster.history
    plans = drawn_plans(rng, duration_s)
    for plan in plans:
        history.add(
            "rl_plan",
            **{k: v for k, v in plan.__dict__.items() if not k.startswith("_")},
        )
    echo_share = rng.uniform(0.05, 0.3)
    abort_share = rng.uniform(0.0, 0.15)
    outage_at = rng.uniform(0.0, duration_s) if rng.random() < 0.5 else None
    outage_s = rng.uniform(0.5, 4.0)
    with seeded_uuids(random.Random(rng.getrandbits(64))):  # noqa: S311 - a replayable run
        trainers = [
            asyncio.create_task(
                _trainer(plan, cluster, topics, rng, clock=clock, checkpoint=checkpoint),
                name=f"rl {plan.name}",
            )
            for plan in plans
        ]
        tasks = list(trainers)
        tasks.append(
            asyncio.create_task(_echo(cluster, topics, rng, echo_share, duration_s), name="echo")
        )
        tasks.append(
            asyncio.create_task(
                _aborter(cluster, topics, rng, abort_share, duration_s), name="aborter"
            )
        )
        if outage_at is not None:
            tasks.append(asyncio.create_task(_outage(cluster, outage_at, outage_s)))
        try:
            await asyncio.gather(*trainers)
            finished.set()
            await asyncio.gather(*tasks)
            await asyncio.get_running_loop().create_future()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _trainer(
    plan: TrainerPlan,
    cluster: Cluster,
    topics: TrainerTopics,
    rng: random.Random,
    *,
    clock: Clock,
    checkpoint: Checkpoint,
) -> None:
    """Run `plan`'s loop; at its restart, end that run and start another on a new client."""
    loop = asyncio.get_running_loop()
    weights = (
        None
        if plan.update_every is None
        else _Weights(random.Random(rng.getrandbits(64)), checkpoint)  # noqa: S311 - replayable
    )
    await asyncio.sleep(plan.start_at)
    incarnation = 1
    while True:
        name = f"trainer-{plan.name}#{incarnation}"
        process = Process(name, cluster, rng)
        client = RolloutClient(
            bootstrap_servers="sim:9092",
            jobs_topic=topics.jobs,
            results_topic=topics.reply if plan.reply_to else topics.results,
            control_topic=topics.control,
            status_topic=topics.status,
            group_id=topics.group,
            reply_to=plan.reply_to,
            timeout_s=plan.timeout_s,
            max_retries=plan.max_retries,
            kafka_clients=SimKafkaClients.of_process(process),
            clock=clock,
            client_id=f"rl-trainer-{plan.name}",
            request_timeout_ms=plan.request_timeout_ms,
        )
        cluster.history.add("rl_begin", trainer=name)
        calls = _Calls(cluster.history, name, plan.timeout_s)
        run = asyncio.create_task(_run_loop(plan, client, calls, name, cluster.history, weights))
        restart_at = plan.restart_at if incarnation == 1 else None
        if restart_at is None:
            await run
            return
        # The loop runs until its restart; `asyncio.wait` leaves it running past that.
        await asyncio.wait([run], timeout=max(restart_at - (loop.time() - 1_000.0), 0.0))
        if run.done():
            await run
            return
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        if plan.restart_by_kill:
            process.kill()
            cluster.history.add("rl_killed", trainer=name)
        else:
            cluster.history.add("rl_closing", trainer=name)
            await client.close()
            cluster.history.add("rl_closed", trainer=name)
        await asyncio.sleep(plan.restart_after_s)
        incarnation += 1


async def _run_loop(  # noqa: PLR0917
    plan: TrainerPlan,
    client: RolloutClient,
    calls: _Calls,
    name: str,
    history: History,
    weights: _Weights | None,
) -> None:
    """Start `client` (again after a backoff while the broker cannot be reached), run the loop
    on it, close it."""
    while True:
        try:
            await client.start()
        except RolloutError as exc:
            history.add("rl_start_failed", trainer=name, error=str(exc))
            await asyncio.sleep(RETRY_CALL_S)
            continue
        break
    history.add("rl_started", trainer=name)
    await _Loop(plan, client, calls, name, weights).run(history)
    await client.close()


async def _echo(
    cluster: Cluster, topics: TrainerTopics, rng: random.Random, share: float, until: float
) -> None:
    """Appends `share` of the trainers' answer records to their topic again, each after a
    delay of up to 10 s: a worker that answers a job twice, an answer that comes late."""
    process = Process("rl-echo", cluster, rng)
    consumer = SimConsumer(process, client_id="rl-echo", group_id=None)
    producer = SimProducer(process, client_id="rl-echo")
    await consumer.start()
    await producer.start()
    tps = [
        TopicPartition(topic, p)
        for topic in (topics.results, topics.reply)
        for p in sorted(consumer.partitions_for_topic(topic) or ())
    ]
    consumer.assign(tps)
    later: set[asyncio.Task[None]] = set()
    while process.now() < until:
        batch = await consumer.getmany(timeout_ms=1_000)
        for tp, records in sorted(batch.items()):
            for record in records:
                if not (record.key or b"").startswith(JOB_PREFIX.encode()):
                    continue
                if rng.random() >= share:
                    continue
                delay = rng.uniform(0.0, 10.0)
                task = asyncio.create_task(
                    _append_later(producer, cluster, tp.topic, record.key, record.value, delay)
                )
                later.add(task)
                task.add_done_callback(later.discard)


async def _aborter(
    cluster: Cluster, topics: TrainerTopics, rng: random.Random, share: float, until: float
) -> None:
    """Answers `share` of the trainers' jobs with a failure at once, and leaves them to the
    fleet, which answers them again: as a worker that aborted a job (`aborted`, retryable) or
    whose engine failed it (`engine_error`) before the job ran again elsewhere. The failure
    echoes the job's submission and metadata, as a worker's does."""
    process = Process("rl-aborter", cluster, rng)
    consumer = SimConsumer(process, client_id="rl-aborter", group_id=None)
    producer = SimProducer(process, client_id="rl-aborter")
    await consumer.start()
    await producer.start()
    consumer.assign(
        [
            TopicPartition(topics.jobs, p)
            for p in sorted(consumer.partitions_for_topic(topics.jobs) or ())
        ]
    )
    later: set[asyncio.Task[None]] = set()
    while process.now() < until:
        batch = await consumer.getmany(timeout_ms=1_000)
        for _, records in sorted(batch.items()):
            for record in records:
                if not (record.key or b"").startswith(JOB_PREFIX.encode()) or rng.random() >= share:
                    continue
                job = decode_job(record.value or b"")
                retryable = rng.random() < 0.7
                failed = Failed(
                    job_id=job.job_id,
                    error=ErrorInfo(
                        code=ErrorCode.ABORTED if retryable else ErrorCode.ENGINE_ERROR,
                        detail="failed by the simulation's aborter",
                        retryable=retryable,
                    ),
                    metadata=job.metadata,
                    worker="rl-aborter",
                    submission_id=msgspec.UNSET if job.submission_id is None else job.submission_id,
                )
                task = asyncio.create_task(
                    _append_later(
                        producer,
                        cluster,
                        job.reply_to or topics.results,
                        job.job_id.encode(),
                        encode(failed),
                        rng.uniform(0.0, 0.5),
                    )
                )
                later.add(task)
                task.add_done_callback(later.discard)


async def _append_later(  # noqa: PLR0917
    producer: SimProducer,
    cluster: Cluster,
    topic: str,
    key: bytes | None,
    value: bytes | None,
    delay: float,
) -> None:
    await asyncio.sleep(delay)
    with contextlib.suppress(KafkaError):
        await (await producer.send(topic, value=value, key=key))
        cluster.history.add("rl_echoed", topic=topic, key=(key or b"").decode(errors="replace"))


async def _outage(cluster: Cluster, at: float, lasting_s: float) -> None:
    """The broker away for `lasting_s` from `at`, recorded as the fault schedule records its
    own (the checker's outage windows)."""
    await asyncio.sleep(at)
    if cluster.broker_down:
        return
    cluster.broker_down = True
    cluster.history.add("fault", fault="broker_outage", victim=None)
    await asyncio.sleep(lasting_s)
    cluster.broker_down = False
    cluster.coordinator_back(asyncio.get_running_loop().time() - 1_000.0)
    cluster.history.add("fault_over", fault="broker_outage")
