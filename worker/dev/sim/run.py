"""One simulated run: a cluster, a fleet, a trainer and a fault schedule, all drawn from one
seed, on the virtual clock; then the checker. `run(Scenario(seed=...))` twice gives the same
history, so a failing seed replays exactly (`bench/sim.py --seed N` prints its trace)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import random
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from schemas import Job, SamplingSpec, encode
from worker.core.config import Settings
from worker.delivery.offset_map import OffsetMapError, decode_offset_map
from worker.dev.sim.checker import Bounds, Kind, Ledger, Violation, check, wedged_from
from worker.dev.sim.clients import Process, SimProducer
from worker.dev.sim.clock import VirtualClock, VirtualLoop, virtual_time
from worker.dev.sim.cluster import Cluster, Flavour, Group, GroupState, Member
from worker.dev.sim.control import CONTROL_KEY, START_VERSION, Trainer, weight_updates
from worker.dev.sim.control_checks import ControlBounds, check_control
from worker.dev.sim.fleet import Fleet
from worker.dev.sim.history import History
from worker.dev.sim.mutants import MUTANTS
from worker.dev.sim.paths import observed
from worker.dev.sim.restart_checks import check_restarts
from worker.dev.sim.trainer import TrainerTopics, run_trainers
from worker.dev.sim.trainer_checks import check_trainers
from worker.engines.mock import MockEngineSettings

__all__ = [
    "FAULTS",
    "FLAG_SETS",
    "FLEET_SIZES",
    "HOSTILE_SHARES",
    "Outcome",
    "Scenario",
    "drawn",
    "flag_set_scenario",
    "replay_command",
    "run",
]

JOBS: Final = "sim.jobs"
RESULTS: Final = "sim.results"
DLQ: Final = "sim.dlq"
CONTROL: Final = "sim.control"
STATUS: Final = "sim.status"
REPLY_SMALL: Final = "sim.replies.small"
REPLY_LOCKED: Final = "sim.replies.locked"
#: The reply topic of the client-driven trainer that asks for one (`Scenario.trainer`).
REPLY_TRAINER: Final = "sim.replies.trainer"
CRASH_TOKEN: Final = 31_999
#: Mock checkpoints the control plane's updates name; their contents are fixed, so a run does
#: not depend on where they live.
WEIGHTS_ROOT: Final = Path(tempfile.gettempdir()) / "vkw-sim-weights"

#: Shares of the trainer's records of each hostile kind, for a run that sends them all
#: (`bench/sim.py --hostile`).
HOSTILE_SHARES: Final = {
    Kind.INVALID: 0.02,
    Kind.CRASH: 0.003,
    Kind.LONG: 0.005,
    Kind.REPLY_SMALL: 0.005,
    Kind.REPLY_LOCKED: 0.005,
}

#: How many times a normal job's tokens a slow one generates (`Kind.SLOW`): 0.6 s to 6 s at
#: the default 5 ms a token, about the revoke grace (3 s), so that a rebalance finds jobs
#: still running when the grace ends (parked, then adopted or moved) without long rollouts.
SLOW_FACTOR: Final = 30
#: The share of slow jobs the net's flag sets send (`FLAG_SETS`).
SLOW_SHARE: Final = 0.02
#: The workers' map cap of the `capped_maps` flag set: at the default (2048) a worker holds a
#: partition back before its map must leave anything out, so no seed degrades one.
CAPPED_MAP_BYTES: Final = 48
#: The share of late hand-overs that a coordinator outage follows in the net's flag sets.
LATE_HAND_OVER_OUTAGES: Final = 0.5
#: The share of hand-overs during a rebalance whose member a SIGTERM reaches in the net's
#: flag sets.
STOPS_IN_HAND_OVERS: Final = 0.3

#: The longest a run settles after its faults, in settle periods, however late deaths go on.
MAX_SETTLE_ROUNDS: Final = 3

#: Every fault the schedule can draw.
FAULTS: Final = (
    "kill",
    "sigterm",
    "sigterm_short",
    "scale_out",
    "scale_in",
    "coordinator_outage",
    "broker_outage",
    "leaderless",
    "slow_acks",
    "lost_acks",
)


@dataclass(frozen=True)
class Scenario:
    """What one run simulates; everything not given here is drawn from `seed`."""

    seed: int
    workers: int = 3
    partitions: int = 6
    #: Virtual seconds during which jobs arrive and faults happen.
    duration_s: float = 60.0
    #: Virtual seconds after the last fault, or the last process death if later, for everything
    #: to be answered.
    settle_s: float = 90.0
    jobs_per_s: float = 10.0
    faults: tuple[str, ...] = FAULTS
    #: Mean virtual seconds between faults.
    fault_every_s: float = 8.0
    #: Share of records of each hostile kind.
    hostile: dict[Kind, float] = field(default_factory=dict)
    flavour: Flavour = Flavour.KAFKA
    static_members: bool = False
    #: The broker's offset.metadata.max.bytes.
    offset_metadata_max_bytes: int = 4096
    offset_map_max_bytes: int = 2048
    max_in_flight: int = 16
    progress_bound_s: float = 60.0
    #: Ms of engine time per generated token, and the tokens of a normal and a long job.
    per_token_ms: float = 5.0
    tokens: tuple[int, int] = (4, 40)
    long_tokens: int = 4_000
    #: Mean virtual seconds between weight updates on the control topic (0: none).
    weight_update_every_s: float = 0.0
    #: Shares of updates whose checkpoint is another architecture (refused by every worker)
    #: and whose load kills the engine.
    bad_update_share: float = 0.0
    engine_killing_update_share: float = 0.0
    #: A planted defect (`worker.dev.sim.mutants.MUTANTS`) to run instead of the real worker.
    mutant: str | None = None
    #: Run beside the fleet from its start, with the fleet: a test's own sequence of faults
    #: and observers (`worker.dev.sim.scrape`), on top of those drawn from the seed.
    script: Callable[[Fleet], Coroutine[Any, Any, None]] | None = field(default=None, compare=False)
    #: The trainer's whole control plane and its faults (`worker.dev.sim.control.Trainer`)
    #: instead of forward updates only; judged by `worker.dev.sim.control_checks`.
    control: bool = False
    #: Trainers on the real `RolloutClient` beside the raw one (`worker.dev.sim.trainer`),
    #: judged by `worker.dev.sim.trainer_checks`.
    trainer: bool = False
    #: Share of hand-overs landed after their rebalance (by a member the group no longer
    #: assigns the partition to) that a coordinator outage follows at once
    #: (`_LateHandOverOutages`), drawn from a generator of its own.
    late_hand_over_outages: float = 0.0
    #: Share of hand-overs made as the group prepares a rebalance whose answer comes late while
    #: a SIGTERM reaches their member (`_StopsInHandOvers`), drawn from a generator of its own.
    stops_in_hand_overs: float = 0.0


#: The flag sets of `bench/sim.py` the net is proved on (`bench/mutants.py`, and the fresh
#: seeds every commit runs): the default fleet; hostile records with weight updates, some of
#: which kill the engine; static members on noida-db's rules; the trainer's whole control plane
#: and its faults (`worker.dev.sim.control.Trainer`); trainers on the real client
#: (`worker.dev.sim.trainer`); static members on noida-db's rules with coordinator outages
#: just after late hand-overs (`_LateHandOverOutages`); hostile records with updates and
#: SIGTERMs while a revoke's hand-over is answered late (`_StopsInHandOvers`). Each sends slow
#: jobs too: without them only the hostile set's long rollouts outlast a revoke's grace, and
#: the paths of parked partitions (adopted, moved, answers held for the verdict) ran in few
#: seeds. The last two are flag sets of their own, after the others, so that the seeds
#: recorded on the others replay as they did.
_HOSTILE: Final = (
    "--slow-jobs",
    str(SLOW_SHARE),
    "--hostile",
    "invalid,crash,long,reply_small,reply_locked",
    "--weight-update-every-s",
    "8",
    "--engine-killing-updates",
    "0.3",
)
_NOIDA: Final = ("--slow-jobs", str(SLOW_SHARE), "--flavour", "noida", "--static")
FLAG_SETS: Final[dict[str, tuple[str, ...]]] = {
    "default": ("--slow-jobs", str(SLOW_SHARE)),
    "hostile": _HOSTILE,
    "noida": _NOIDA,
    "control": ("--slow-jobs", str(SLOW_SHARE), "--control"),
    "trainer": ("--slow-jobs", str(SLOW_SHARE), "--trainer"),
    "late_hand_overs": (*_NOIDA, "--late-hand-over-outages", str(LATE_HAND_OVER_OUTAGES)),
    "stopped_hand_overs": (*_HOSTILE, "--stops-in-hand-overs", str(STOPS_IN_HAND_OVERS)),
    "capped_maps": (*_HOSTILE, "--offset-map-max-bytes", str(CAPPED_MAP_BYTES)),
}
#: The fleet sizes those runs take in turn.
FLEET_SIZES: Final = (3, 5, 1)


def drawn(k: int) -> tuple[str, int]:
    """The flag set and fleet size of the `k`th run of a sweep over `FLAG_SETS`."""
    names = list(FLAG_SETS)
    return names[k % len(names)], FLEET_SIZES[(k // len(names)) % len(FLEET_SIZES)]


def flag_set_scenario(flags: str, seed: int, workers: int, mutant: str | None = None) -> Scenario:
    """What `bench/sim.py --seed SEED --workers WORKERS` with the flags of `FLAG_SETS[flags]`
    runs (its defaults: 8 partitions and 4 jobs a second per worker)."""
    hostile = flags in {"hostile", "stopped_hand_overs", "capped_maps"}
    noida = flags in {"noida", "late_hand_overs"}
    return Scenario(
        seed=seed,
        workers=workers,
        partitions=max(6, 8 * workers),
        jobs_per_s=4.0 * workers,
        hostile={**(HOSTILE_SHARES if hostile else {}), Kind.SLOW: SLOW_SHARE},
        weight_update_every_s=8.0 if hostile else 0.0,
        bad_update_share=0.2 if hostile else 0.0,
        engine_killing_update_share=0.3 if hostile else 0.0,
        flavour=Flavour.NOIDA if noida else Flavour.KAFKA,
        static_members=noida,
        mutant=mutant,
        control=flags == "control",
        trainer=flags == "trainer",
        late_hand_over_outages=LATE_HAND_OVER_OUTAGES if flags == "late_hand_overs" else 0.0,
        stops_in_hand_overs=STOPS_IN_HAND_OVERS if flags == "stopped_hand_overs" else 0.0,
        offset_map_max_bytes=CAPPED_MAP_BYTES
        if flags == "capped_maps"
        else Scenario.offset_map_max_bytes,
    )


def replay_command(flags: str, seed: int, workers: int, mutant: str | None = None) -> str:
    """The command that replays a run of `flag_set_scenario`, printing its trace."""
    return " ".join(
        [
            "python bench/sim.py --seed",
            str(seed),
            "--workers",
            str(workers),
            *FLAG_SETS[flags],
            *(["--mutant", mutant] if mutant else []),
        ]
    )


@dataclass
class Outcome:
    scenario: Scenario
    history: History
    violations: list[Violation]
    answered: int
    virtual_s: float
    wall_s: float
    ledger: Ledger
    cluster: Cluster
    #: When the group began to wait for ever for a member that could not leave, on a broker
    #: that evicts nobody (`worker.dev.sim.checker.wedged_from`): liveness is not judged.
    wedged_at: float | None = None
    #: What the checker judged the run by.
    bounds: Bounds | None = None

    @property
    def digest(self) -> str:
        return self.history.digest()

    def trace(self) -> list[str]:
        """The history up to the first violation (all of it when none)."""
        until = min((v.at for v in self.violations), default=None)
        return list(self.history.lines(until))


def settings_for(scenario: Scenario) -> Settings:
    # The control flag set's workers: signed commands, transfers taken, a start version for
    # rollbacks to go below, and heartbeats at the default interval (the status topic's
    # tail is then mostly heartbeats, which retention deletes as it would).
    control: dict[str, object] = (
        {
            "control_hmac_key": CONTROL_KEY,
            "allow_weight_transfer": True,
            "weight_version": START_VERSION,
            "status_interval_s": 5.0,
        }
        if scenario.control
        # The trainer flag set's client waits for every worker it hears from (its heartbeats).
        else {"status_interval_s": 5.0 if scenario.trainer else 3600.0}
    )
    return Settings(
        bootstrap_servers="sim:9092",
        jobs_topic=JOBS,
        results_topic=RESULTS,
        dead_letter_topic=DLQ,
        control_topic=CONTROL,
        status_topic=STATUS,
        reply_topics=r"sim\.replies\..*",
        weights_root=(str(WEIGHTS_ROOT),),
        group_id="sim",
        group_instance_id="static" if scenario.static_members else None,
        leave_group_on_stop=True,
        engine="mock",
        mock_per_token_latency_ms=scenario.per_token_ms,
        mock_num_layers=2,
        mock_top_k=2,
        mock_num_experts=8,
        mock_crash_token_id=CRASH_TOKEN,
        max_in_flight=scenario.max_in_flight,
        enable_idempotence=scenario.flavour is not Flavour.TANSU,
        offset_map_max_bytes=scenario.offset_map_max_bytes,
        session_timeout_ms=6_000,
        heartbeat_interval_ms=1_000,
        max_poll_interval_ms=60_000,
        rebalance_timeout_ms=20_000,
        commit_interval_ms=500,
        commit_timeout_s=5.0,
        close_timeout_s=5.0,
        publish_timeout_s=30.0,
        shutdown_grace_s=10.0,
        revoke_grace_s=3.0,
        metrics_port=0,
        **control,  # type: ignore[arg-type]
    )


def run(scenario: Scenario) -> Outcome:
    """Run `scenario` on a fresh virtual loop and check it."""
    clock = VirtualClock()
    loop = VirtualLoop(clock)
    history = History(lambda: clock.now)
    started = time.perf_counter()
    previous_disable = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    # No cyclic garbage collection during a run. A killed process's tasks wait on nothing and
    # nothing refers to them: the collector closes them when it runs, and their `finally`
    # blocks then act (a generation recorded as over, at that virtual moment). When it runs
    # depends on the allocations before, the process's earlier runs included: seed 700001 of
    # the hostile flag set, one worker, gave a different history on its second run in one
    # process, and a seed found in a sweep need not have replayed alone. Reference counting,
    # which frees everything else, is the same on every run.
    gc.collect()
    gc.disable()
    try:
        planted = MUTANTS[scenario.mutant]() if scenario.mutant else contextlib.nullcontext()
        # Observed inside the planted defect: a path the mutant replaces is counted as run.
        with virtual_time(clock), planted, observed(history):
            outcome = loop.run_until_complete(_simulate(scenario, clock, history))
    finally:
        logging.disable(previous_disable)
        _close(loop)
        gc.enable()
    outcome.wall_s = time.perf_counter() - started
    return outcome


def _close(loop: VirtualLoop) -> None:
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    # Tasks of killed processes wait on nothing that will ever come; cancelled, they end.
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


async def _simulate(  # noqa: PLR0912 - a branch per optional part of a run
    scenario: Scenario, clock: VirtualClock, history: History
) -> Outcome:
    rng = random.Random(scenario.seed)  # noqa: S311 - a replayable run, not a secret
    cluster = Cluster(
        history,
        flavour=scenario.flavour,
        offset_metadata_max_bytes=scenario.offset_metadata_max_bytes,
    )
    settings = settings_for(scenario)
    big = 8 << 20
    cluster.create_topic(JOBS, scenario.partitions, max_message_bytes=big)
    cluster.create_topic(RESULTS, scenario.partitions, max_message_bytes=big)
    cluster.create_topic(DLQ, scenario.partitions, max_message_bytes=big)
    cluster.create_topic(CONTROL, 1)
    cluster.create_topic(STATUS, 1)
    # A reply topic whose max.message.bytes is below a result's size, and one the workers may
    # not write to.
    cluster.create_topic(REPLY_SMALL, 1, max_message_bytes=400)
    cluster.create_topic(REPLY_LOCKED, 1, writers=frozenset({"trainer"}))
    engine = MockEngineSettings(
        per_token_latency_ms=scenario.per_token_ms,
        num_layers=2,
        top_k=2,
        num_experts=8,
        crash_token_id=CRASH_TOKEN,
        weight_version=settings.weight_version,
    )
    fleet = Fleet(cluster, rng, clock, settings, engine)
    ledger = Ledger()
    faults_end = scenario.duration_s
    history.add(
        "scenario",
        seed=scenario.seed,
        workers=scenario.workers,
        offset_map_max_bytes=scenario.offset_map_max_bytes,
    )
    for index in range(scenario.workers):
        await fleet.start(f"w{index}")
    background = [
        asyncio.create_task(_trainer(scenario, cluster, rng, ledger), name="trainer"),
        asyncio.create_task(_faults(scenario, fleet, rng), name="faults"),
        asyncio.create_task(_coordinator_timers(cluster), name="coordinator"),
        asyncio.create_task(_progress(cluster, settings, fleet), name="progress"),
        asyncio.create_task(
            Trainer(scenario, fleet, _checkpoint, CONTROL, STATUS, settings.group_id).run()
            if scenario.control
            else weight_updates(scenario, cluster, rng, _checkpoint, CONTROL),
            name="control",
        ),
    ]
    _watch_commits(scenario, fleet)
    if scenario.script is not None:
        background.append(asyncio.create_task(scenario.script(fleet), name="script"))
    trainers_done = asyncio.Event()
    if scenario.trainer:
        background.append(_client_trainers(scenario, cluster, trainers_done, clock))
    await asyncio.sleep(faults_end)
    _heal(cluster, fleet)
    for worker_id in sorted(fleet.processes):
        if not fleet.processes[worker_id].alive and worker_id not in fleet.stopping:
            await fleet.start(worker_id)
    if not fleet.alive():
        await fleet.start("w0")
    history.add("faults_end")
    end = await _settle(scenario, history, clock)
    if scenario.trainer:
        end = await _trainers_settle(scenario, trainers_done, clock)
    for task in background:
        task.cancel()
    for result in await asyncio.gather(*background, return_exceptions=True):
        if isinstance(result, Exception):
            raise result  # a bug of the simulation itself, not a finding
    bounds = Bounds(
        faults_end=faults_end,
        end=end,
        progress_bound_s=scenario.progress_bound_s,
        max_in_flight=scenario.max_in_flight,
        offset_map_max_bytes=scenario.offset_map_max_bytes,
        answer_topics=(RESULTS, REPLY_SMALL, REPLY_LOCKED),
        dead_letter_topic=DLQ,
        jobs_topic=JOBS,
        status_topic=STATUS,
        never_evicts=scenario.flavour is Flavour.NOIDA,
        leave_budget_s=settings.shutdown_grace_s + settings.close_timeout_s / 2,
        idempotent=settings.enable_idempotence,
        max_crash_attempts=settings.max_crash_attempts,
        weights_judged_elsewhere=scenario.control,
    )
    for worker_id in fleet.alive():
        history.add(
            "serving",
            worker=fleet.processes[worker_id].name,
            weight_version=fleet.services[worker_id].engine.weight_version,
        )
        if scenario.control:
            _control_state(history, fleet, worker_id)
    history.closed = True
    fleet.ended = True
    violations = check(history, cluster, ledger, bounds)
    if scenario.control:
        violations += check_control(
            history,
            cluster,
            ControlBounds(
                CONTROL, STATUS, settings.group_id, end, settings.stale_weights_at_start == "hold"
            ),
        )
    violations += check_trainers(history, end, cluster.topics[STATUS].logs)
    violations += check_restarts(
        history,
        cluster,
        answer_topics=bounds.answer_topics,
        status_topic=STATUS,
        control_topic=CONTROL,
    )
    answered = sum(len(log) for log in cluster.topics[RESULTS].logs)
    return Outcome(
        scenario,
        history,
        violations,
        answered,
        clock.now,
        0.0,
        ledger,
        cluster,
        wedged_at=wedged_from(history, bounds),
        bounds=bounds,
    )


def _client_trainers(
    scenario: Scenario, cluster: Cluster, finished: asyncio.Event, clock: VirtualClock
) -> asyncio.Task[None]:
    """The client-driven trainers' task, on a reply topic of their own and a generator of
    their own: the rest of the run draws what it would without them."""
    cluster.create_topic(REPLY_TRAINER, 4)
    rng = random.Random(f"trainer-{scenario.seed}")  # noqa: S311 - a replayable run
    topics = TrainerTopics(
        jobs=JOBS,
        results=RESULTS,
        reply=REPLY_TRAINER,
        control=CONTROL,
        status=STATUS,
        group=settings_for(scenario).group_id,
    )
    return asyncio.create_task(
        run_trainers(
            cluster, topics, rng, scenario.duration_s, finished, clock=clock, checkpoint=_checkpoint
        ),
        name="client trainers",
    )


async def _trainers_settle(
    scenario: Scenario, finished: asyncio.Event, clock: VirtualClock
) -> float:
    """Wait, at most one more settle period, for the trainers' loops to run every step: a loop
    restarted late runs all its steps again, each turn as long as its timeout when it is slow.
    The end, for the checks."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(scenario.settle_s):
            await finished.wait()
    return clock.now


async def _settle(scenario: Scenario, history: History, clock: VirtualClock) -> float:
    """Wait until `settle_s` has passed since the faults ended and since the last process
    death, at most `MAX_SETTLE_ROUNDS` settle periods after the faults; return that end.

    Deaths go on after the faults end: a job that kills the engine is, by the breaker's rule,
    in flight at `max_crash_attempts` deaths before it is answered, and each death costs the
    group a rebalance (a dynamic member's restart waits out the dead member's session). A
    bound counted from the last injected fault alone would flag jobs that no correct worker
    could have answered yet, such as a killer whose first death comes just before it. A
    worker that never stops dying still ends at the cap, and what it left unanswered is
    flagged.
    """
    settled_from = scenario.duration_s
    latest_start = settled_from + (MAX_SETTLE_ROUNDS - 1) * scenario.settle_s
    while True:
        await asyncio.sleep(settled_from + scenario.settle_s - clock.now)
        last_death = max((e.at for e in history.of("kill")), default=settled_from)
        if last_death <= settled_from or settled_from >= latest_start:
            return clock.now
        settled_from = min(last_death, latest_start)


def _heal(cluster: Cluster, fleet: Fleet) -> None:
    cluster.coordinator_down = cluster.broker_down = cluster.lose_acks = False
    cluster.leaderless.clear()
    cluster.ack_delay_s = 0.0
    cluster.coordinator_back(fleet.clock.now)
    fleet.history.add("fault_over", fault="all")


async def _coordinator_timers(cluster: Cluster) -> None:
    while True:
        await asyncio.sleep(0.25)
        cluster.expire(asyncio.get_running_loop().time() - 1_000.0)


async def _progress(cluster: Cluster, settings: Settings, fleet: Fleet) -> None:
    """Samples, every second, how long each partition with work has gone without a commit
    advance while the group is stable (the checker's `stalled`)."""
    last: dict[TopicPartition, tuple[int, float]] = {}
    topic = cluster.topics[settings.jobs_topic]
    while True:
        await asyncio.sleep(1.0)
        now = fleet.clock.now
        group = cluster.groups.get(settings.group_id)
        stable = group is not None and group.state is GroupState.STABLE and bool(group.members)
        for partition in range(len(topic.logs)):
            tp = TopicPartition(settings.jobs_topic, partition)
            committed = cluster.committed.get((settings.group_id, tp), (0, ""))[0]
            end = len(topic.logs[partition])
            seen = last.get(tp)
            if seen is None or seen[0] != committed or committed >= end or not stable:
                last[tp] = (committed, now)
                continue
            stalled_for = now - seen[1]
            if stalled_for > 0 and int(stalled_for) % 10 == 0:
                cluster.history.add(
                    "stall",
                    tp=f"{tp.topic}-{tp.partition}",
                    for_s=stalled_for,
                    committed=committed,
                    end=end,
                )


def _job(job_id: str, rng: random.Random, tokens: int, reply_to: str | None = None) -> bytes:
    prompt = [rng.randrange(1, 30_000) for _ in range(rng.randrange(2, 8))]
    sampling = SamplingSpec(max_tokens=tokens)
    job = Job(job_id=job_id, prompt_token_ids=prompt, sampling=sampling, reply_to=reply_to)
    return encode(job)


async def _trainer(
    scenario: Scenario, cluster: Cluster, rng: random.Random, ledger: Ledger
) -> None:
    """Produces jobs at `jobs_per_s` until the faults end, hostile ones at their shares."""
    process = Process("trainer", cluster, rng)
    producer = SimProducer(process, client_id="trainer")
    await producer.start()
    count = 0
    deadline = scenario.duration_s
    sends: set[asyncio.Task[None]] = set()
    kinds = list(scenario.hostile.items())
    while process.now() < deadline:
        await asyncio.sleep(rng.expovariate(scenario.jobs_per_s))
        job_id = f"j{count}"
        count += 1
        kind = Kind.VALID
        draw = rng.random()
        for candidate, share in kinds:
            if draw < share:
                kind = candidate
                break
            draw -= share
        low, high = scenario.tokens
        tokens = rng.randrange(low, high + 1)
        match kind:
            case Kind.VALID:
                value = _job(job_id, rng, tokens)
            case Kind.SLOW:
                value = _job(job_id, rng, tokens * SLOW_FACTOR)
            case Kind.LONG:
                value = _job(job_id, rng, scenario.long_tokens)
            case Kind.INVALID:
                value = rng.choice([b"not json", b'{"job_id": 3}', b"", b'{"job_id": "x"}'])
            case Kind.CRASH:
                value = encode(
                    Job(
                        job_id=job_id,
                        prompt_token_ids=[1, CRASH_TOKEN, 2],
                        sampling=SamplingSpec(max_tokens=tokens),
                    )
                )
            case Kind.REPLY_SMALL:
                value = _job(job_id, rng, 200, reply_to=REPLY_SMALL)
            case Kind.REPLY_LOCKED:
                value = _job(job_id, rng, tokens, reply_to=REPLY_LOCKED)
        sends.add(asyncio.create_task(_send_job(producer, cluster, ledger, job_id, kind, value)))


async def _send_job(  # noqa: PLR0917
    producer: SimProducer, cluster: Cluster, ledger: Ledger, job_id: str, kind: Kind, value: bytes
) -> None:
    while True:
        try:
            metadata = await (await producer.send(JOBS, value=value, key=job_id.encode()))
        except KafkaError:
            # Maybe appended all the same (a lost acknowledgement): a resent job may be
            # answered twice.
            cluster.history.add("trainer_resend", job=job_id)
            await asyncio.sleep(1.0)
            continue
        ledger.records[(f"{JOBS}-{metadata.partition}", metadata.offset)] = (kind, job_id)
        return


async def _faults(  # noqa: PLR0912 - one branch per fault kind
    scenario: Scenario, fleet: Fleet, rng: random.Random
) -> None:
    """Draws a fault every `fault_every_s` on average until the faults end."""
    cluster = fleet.cluster
    history = fleet.history
    spare = scenario.workers
    loop = asyncio.get_running_loop()
    if not scenario.faults:
        return
    while True:
        await asyncio.sleep(rng.expovariate(1 / scenario.fault_every_s))
        if fleet.clock.now >= scenario.duration_s:
            return
        fault = rng.choice(scenario.faults)
        alive = fleet.alive()
        victim = rng.choice(alive) if alive else None
        history.add("fault", fault=fault, victim=victim)
        match fault:
            case "kill" if victim is not None:
                fleet.kill(victim, why="injected")
                _later(loop, rng.uniform(0.5, 10.0), fleet.start, victim)
            case "sigterm" | "sigterm_short" if victim is not None:
                grace = 60.0 if fault == "sigterm" else rng.uniform(0.05, 2.0)
                fleet.terminate(victim, grace)
                _later(loop, grace + rng.uniform(0.5, 5.0), fleet.start, victim)
            case "scale_out":
                _later(loop, 0.0, fleet.start, f"w{spare}")
                spare += 1
            case "scale_in" if victim is not None and _serving_beside(fleet, victim):
                fleet.terminate(victim, 60.0)
            case "coordinator_outage":
                cluster.coordinator_down = True
                _later_call(loop, rng.uniform(1.0, 12.0), _coordinator_back, fleet)
            case "broker_outage":
                cluster.broker_down = True
                _later_call(loop, rng.uniform(0.5, 5.0), _broker_back, fleet)
            case "leaderless":
                tp = TopicPartition(
                    JOBS if rng.random() < 0.5 else RESULTS, rng.randrange(scenario.partitions)
                )
                cluster.leaderless.add(tp)
                _later_call(loop, rng.uniform(1.0, 15.0), cluster.leaderless.discard, tp)
            case "slow_acks":
                cluster.ack_delay_s = rng.uniform(0.2, 2.0)
                _later_call(loop, rng.uniform(2.0, 8.0), _acks_prompt, fleet)
            case "lost_acks":
                cluster.lose_acks = True
                history.add("fault_lose_acks")
                _later_call(loop, rng.uniform(0.1, 1.0), setattr, cluster, "lose_acks", False)
            case _:
                pass


def _watch_commits(scenario: Scenario, fleet: Fleet) -> None:
    """The faults that follow a commit the group took, each on a generator of its own."""
    if scenario.late_hand_over_outages and "coordinator_outage" in scenario.faults:
        fleet.cluster.commit_watchers.append(_LateHandOverOutages(scenario, fleet))
    if scenario.stops_in_hand_overs and "sigterm" in scenario.faults:
        fleet.cluster.commit_watchers.append(_StopsInHandOvers(scenario, fleet))


class _LateHandOverOutages:
    """A coordinator outage that begins just after a member lands the hand-over of a partition
    the group has assigned to another member (a hand-over the group refused during the
    rebalance, made again after rejoining: `RefusedHandOvers.land`), and outlasts the new
    owner's bounded reads of the committed offsets (`--commit-timeout-s`, and the wait for a
    live last owner's hand-over after it).

    The new owner looked the partition's position up as it joined, or read the map the hand-
    over replaced, before it landed; it cannot read again until the coordinator is back, so it
    fetches from there, behind what the last owner answered. Kafka's group coordinator moves
    at any moment (a broker restart, a leader change of `__consumer_offsets`), also in the
    milliseconds after a commit; at random times the schedule's own outages almost never fall
    in that window. Once the coordinator is back, the new owner's first commit finds the group
    ahead of it and takes that position over (`PartitionOffsets.overtaken`).

    Drawn from a generator of its own: the rest of a run draws what it would without it."""

    def __init__(self, scenario: Scenario, fleet: Fleet) -> None:
        self._scenario = scenario
        self._fleet = fleet
        self._rng = random.Random(f"{scenario.seed}-late-hand-over-outage")  # noqa: S311

    def __call__(
        self, group: Group, member: Member | None, _client_id: str, tps: list[TopicPartition]
    ) -> None:
        cluster, clock = self._fleet.cluster, self._fleet.clock
        if cluster.coordinator_down or clock.now >= self._scenario.duration_s or member is None:
            return
        others = [tp for tp in tps if tp not in member.assignment]
        if not others or self._rng.random() >= self._scenario.late_hand_over_outages:
            return
        tp, member_id = others[0], member.member_id
        loop = asyncio.get_running_loop()
        # Before the new owner's next read (it reads every 0.1 s while it waits for the
        # hand-over), for longer than its reads go on (5 s, or 2 s of waiting and 5 more).
        _later_call(loop, self._rng.uniform(0.0, 0.05), self._down, tp, member_id)
        self._back_after = self._rng.uniform(7.5, 12.0)

    def _down(self, tp: TopicPartition, member_id: str) -> None:
        cluster = self._fleet.cluster
        if cluster.coordinator_down:
            return
        cluster.coordinator_down = True
        self._fleet.history.add(
            "fault",
            fault="coordinator_outage",
            victim=None,
            after_hand_over_of=f"{tp.topic}-{tp.partition}",
            by=member_id,
        )
        _later_call(asyncio.get_running_loop(), self._back_after, _coordinator_back, self._fleet)


class _StopsInHandOvers:
    """A SIGTERM that reaches a member while the answer to its revoke's hand-over is on its
    way: the coordinator stored the commit, made as the group prepares a rebalance, and
    answers it late (a slow follower of `__consumer_offsets`; the broker waits up to
    `offsets.commit.timeout.ms`, 5 s by default, `GroupCoordinatorConfig`), and a rolling
    restart stops the member meanwhile.

    The member parked the partitions whose jobs outlasted the revoke's grace; the stop decides
    their fate before the hand-over's answer comes back, and they are let go rather than kept
    (`Committer.drop_parked`, from `Rebalances.revoked`). At random times a SIGTERM almost
    never falls in the few milliseconds a hand-over takes.

    Drawn from a generator of its own: the rest of a run draws what it would without it."""

    def __init__(self, scenario: Scenario, fleet: Fleet) -> None:
        self._scenario = scenario
        self._fleet = fleet
        self._rng = random.Random(f"{scenario.seed}-stop-in-hand-over")  # noqa: S311

    def __call__(
        self, group: Group, member: Member | None, client_id: str, tps: list[TopicPartition]
    ) -> None:
        fleet = self._fleet
        if (
            member is None
            or group.state is not GroupState.PREPARING_REBALANCE
            or fleet.clock.now >= self._scenario.duration_s
            or not any(self._parks(group.group_id, tp) for tp in tps)
        ):
            return
        if self._rng.random() >= self._scenario.stops_in_hand_overs:
            return
        worker_id = fleet.process_of(client_id).name.split("#")[0]
        if not _serving_beside(fleet, worker_id):
            return
        # Within the hand-over's --commit-timeout-s (5 s), so that it lands.
        delay_s = self._rng.uniform(0.5, 4.0)
        fleet.cluster.commit_answer_delay_s[client_id] = delay_s
        loop = asyncio.get_running_loop()
        grace_s = 60.0
        _later_call(loop, self._rng.uniform(0.0, delay_s), fleet.terminate, worker_id, grace_s)
        _later(loop, grace_s + self._rng.uniform(0.5, 5.0), fleet.start, worker_id)

    def _parks(self, group_id: str, tp: TopicPartition) -> bool:
        """Whether the commit stored for `tp` is a hand-over naming jobs still running: its
        member parks the partition."""
        position, metadata = self._fleet.cluster.committed[(group_id, tp)]
        try:
            written = decode_offset_map(position, metadata)
        except OffsetMapError:
            return False
        return written.clean and bool(written.running - written.answered)


def _checkpoint(name: str) -> str:
    """A mock checkpoint directory (created once; same contents every run). Written by a
    rename, never in place: runs side by side (`bench/sim.py --processes`) share the folder,
    and a config.json read while another run rewrote it read as empty, so one worker failed
    an update the rest applied (seed 95194 of `--weight-update-every-s 4
    --engine-killing-updates 0.3`, reported as `weights_diverged` in a two-process run only)."""
    directory = WEIGHTS_ROOT / name
    directory.mkdir(parents=True, exist_ok=True)
    layers = 99 if name.startswith("other-architecture") else 2
    config = {"num_hidden_layers": layers, "num_experts_per_tok": 2, "num_experts": 8}
    text = json.dumps(config, sort_keys=True)
    path = directory / "config.json"
    with contextlib.suppress(OSError):
        if path.read_text() == text:
            return str(directory)
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False) as staged:
        staged.write(text)
    Path(staged.name).replace(path)
    return str(directory)


def _control_state(history: History, fleet: Fleet, worker_id: str) -> None:
    """What a live worker's control plane holds at the end (the control flag set's
    convergence)."""
    service = fleet.services[worker_id]
    control = service.control
    applier = None if control is None else control._commands
    history.add(
        "control_state",
        worker=fleet.processes[worker_id].name,
        weight_version=service.engine.weight_version,
        weights_command_id=None if applier is None else applier.weights_command_id,
        paused=service.steerable.paused,
        needs_weights=applier is not None and applier.needs_weights,
    )


def _coordinator_back(fleet: Fleet) -> None:
    fleet.cluster.coordinator_down = False
    fleet.cluster.coordinator_back(fleet.clock.now)
    fleet.history.add("fault_over", fault="coordinator_outage")


def _broker_back(fleet: Fleet) -> None:
    fleet.cluster.broker_down = False
    fleet.cluster.coordinator_back(fleet.clock.now)
    fleet.history.add("fault_over", fault="broker_outage")


def _acks_prompt(fleet: Fleet) -> None:
    fleet.cluster.ack_delay_s = 0.0
    fleet.history.add("fault_over", fault="slow_acks")


def _serving_beside(fleet: Fleet, victim: str) -> bool:
    """Whether a worker that is not stopping would be left if `victim` were scaled in: a fleet
    scaled in to nothing answers nothing, which is no worker's defect."""
    return victim not in fleet.stopping and any(
        w != victim and w not in fleet.stopping for w in fleet.alive()
    )


def _later(
    loop: asyncio.AbstractEventLoop, delay: float, start: Callable[[str], object], worker_id: str
) -> None:
    def go() -> None:
        loop.create_task(start(worker_id))  # type: ignore[arg-type]

    loop.call_later(delay, go)


def _later_call(
    loop: asyncio.AbstractEventLoop, delay: float, func: Callable[..., object], *args: object
) -> None:
    loop.call_later(delay, func, *args)


_ = replace
