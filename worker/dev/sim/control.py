"""The trainer's side of the control topic in the simulation, and the faults that strike it.

Commands go out through a simulated producer of the trainer's own, signed under the key the
workers' settings name, as a trainer would send them (not through `RolloutClient`). Two
programs:

- `weight_updates` (every flag set with `--weight-update-every-s`): versions that only move
  forward, some naming a checkpoint no worker can load or one whose load kills the engine; an
  update that loads comes last.
- `Trainer` (the `control` flag set, `--control`): updates by checkpoint and by transfer (whose
  rendezvous the trainer keeps open a while: a worker started later cannot take it), forced
  rollbacks (also below the fleet's start `--weight-version`), commands for one worker, for the
  group and for another group, pauses and resumes; and the faults: records replayed byte for
  byte at any later time, the status topic's oldest records deleted (`retention.ms`), the whole
  fleet killed while commands go out, a command sent to one worker while it is down. The last
  command is an update every worker can load, forward or a rollback: every live worker must
  converge to it (`worker.dev.sim.control_checks`).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any, Final, Protocol

from aiokafka.errors import KafkaError

from schemas import Command, Pause, Resume, Target, UpdateWeights, encode, sign_command
from worker.dev.sim.clients import Process, SimProducer
from worker.dev.sim.cluster import Cluster
from worker.dev.sim.fleet import KILLS_ENGINE, Fleet

__all__ = [
    "CONTROL_KEY",
    "OTHER_GROUP",
    "START_VERSION",
    "TRANSFER_OPEN_S",
    "Trainer",
    "send_update",
    "weight_updates",
]


class ControlScenario(Protocol):
    """What of a run's `worker.dev.sim.run.Scenario` the trainer's control reads."""

    @property
    def seed(self) -> int: ...
    @property
    def duration_s(self) -> float: ...
    @property
    def weight_update_every_s(self) -> float: ...
    @property
    def bad_update_share(self) -> float: ...
    @property
    def engine_killing_update_share(self) -> float: ...


#: The key the `control` flag set's workers require commands to be signed with.
CONTROL_KEY: Final = "sim-control-key-0123456789abcdef"
#: The `--weight-version` the `control` flag set's workers start on: rollbacks go below it.
START_VERSION: Final = 10
#: How long the trainer keeps a transfer's rendezvous open after sending its command.
TRANSFER_OPEN_S: Final = 20.0
#: A group no simulated worker belongs to: commands for it are nobody's here.
OTHER_GROUP: Final = "elsewhere"

Checkpoint = Callable[[str], str]


async def weight_updates(
    scenario: ControlScenario,
    cluster: Cluster,
    rng: random.Random,
    checkpoint: Checkpoint,
    topic: str,
) -> None:
    """The trainer's weight updates, to the whole fleet, each version above the last; some
    name a checkpoint no worker can load, some one whose load kills the engine."""
    if not scenario.weight_update_every_s:
        return
    process = Process("trainer-control", cluster, rng)
    producer = SimProducer(process, client_id="trainer")
    version = 0
    while True:
        await asyncio.sleep(rng.expovariate(1 / scenario.weight_update_every_s))
        if process.now() >= scenario.duration_s:
            # As an operator would after a bad update: one that loads, above every other.
            version += 1
            await send_update(producer, cluster, version, checkpoint(f"v{version}"), topic)
            return
        version += 1
        draw = rng.random()
        if draw < scenario.engine_killing_update_share:
            name = f"v{version}-{KILLS_ENGINE}"
        elif draw < scenario.engine_killing_update_share + scenario.bad_update_share:
            name = f"other-architecture-v{version}"
        else:
            name = f"v{version}"
        on_inflight = rng.choice(["wait", "keep", "abort", "restart"])
        await send_update(
            producer, cluster, version, checkpoint(name), topic, on_inflight, name=name
        )


async def send_update(  # noqa: PLR0917
    producer: SimProducer,
    cluster: Cluster,
    version: int,
    path: str,
    topic: str,
    on_inflight: str = "wait",
    *,
    name: str | None = None,
) -> None:
    command = UpdateWeights(
        command_id=f"update-{version}",
        version=version,
        path=path,
        on_inflight=on_inflight,  # type: ignore[arg-type]
    )
    cluster.history.add("weight_update", version=version, checkpoint=name or f"v{version}")
    while True:
        try:
            await (await producer.send(topic, value=encode(command), key=b"update"))
        except KafkaError:
            await asyncio.sleep(1.0)
            continue
        return


#: How often the trainer takes each step (relative weights).
STEPS: Final = (
    ("update", 28),
    ("transfer", 12),
    ("rollback", 8),
    ("update_one", 6),
    ("update_group", 5),
    ("pause", 10),
    ("pause_one", 5),
    ("replay", 10),
    ("retention", 10),
    ("fleet_down", 4),
    ("target_down", 6),
)


#: The share of steps after which a stale, unforced update follows (`Trainer.stale_update`).
STALE_UPDATE_SHARE: Final = 0.1


class Trainer:
    """The `control` flag set's trainer (see the module's docstring). Its draws come from a
    generator of its own, so the other programs of a run draw as they would without it."""

    def __init__(  # noqa: PLR0917
        self,
        scenario: ControlScenario,
        fleet: Fleet,
        checkpoint: Checkpoint,
        topic: str,
        status_topic: str,
        group: str,
    ) -> None:
        self.scenario = scenario
        self.fleet = fleet
        self.cluster = fleet.cluster
        self.history = fleet.history
        self.rng = random.Random(f"control:{scenario.seed}")  # noqa: S311 - replayable
        self.checkpoint = checkpoint
        self.topic = topic
        self.status_topic = status_topic
        self.group = group
        self.version = START_VERSION
        self.process = Process("trainer-control", self.cluster, self.rng)
        self.producer = SimProducer(self.process, client_id="trainer")
        #: Every record sent (not replays), for replays.
        self.sent: list[bytes] = []
        self.paused = False
        #: Stale updates come from a generator of their own, so the steps above draw as they
        #: did before they were added (the recorded seeds' schedules stay as they were).
        self.stale_rng = random.Random(f"control-stale:{scenario.seed}")  # noqa: S311
        self._count = 0
        self._restarts: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        rng = self.rng
        names = [name for name, _ in STEPS]
        weights = [weight for _, weight in STEPS]
        every = self.scenario.weight_update_every_s or 4.0
        while True:
            await asyncio.sleep(rng.expovariate(1 / every))
            if self.fleet.clock.now >= self.scenario.duration_s:
                break
            await self.step(rng.choices(names, weights)[0])
            if self.stale_rng.random() < STALE_UPDATE_SHARE:
                await self.stale_update()
        await self.finish()

    async def step(self, name: str) -> None:  # noqa: PLR0912 - one branch per step
        rng = self.rng
        match name:
            case "update":
                await self.update()
            case "transfer":
                await self.transfer()
            case "rollback":
                await self.rollback()
            case "update_one":
                alive = self.fleet.alive()
                if alive:
                    await self.update(Target(workers=[rng.choice(alive)]))
            case "update_group":
                await self.update(Target(group=rng.choice([self.group, OTHER_GROUP])))
            case "pause":
                if self.paused:
                    await self.send(Resume(command_id=self._id("resume")))
                else:
                    mode = rng.choice(["wait", "keep", "abort"])
                    await self.send(Pause(command_id=self._id("pause"), mode=mode))  # type: ignore[arg-type]
                self.paused = not self.paused
            case "pause_one":
                alive = self.fleet.alive()
                if alive:
                    await self.pause_one(rng.choice(alive))
            case "replay":
                await self.replay()
            case "retention":
                self.retain()
            case "fleet_down":
                await self.fleet_down()
            case "target_down":
                await self.target_down()

    async def finish(self) -> None:
        """Resume the fleet, send the last update (forward, or a rollback every worker can
        load), then replay records long after."""
        rng = self.rng
        if self.paused:
            await self.send(Resume(command_id=self._id("resume")))
            self.paused = False
        if rng.random() < 0.3 and self.version > 0:
            await self.rollback()
        else:
            await self.update()
        self.history.add("control_last")
        for _ in range(rng.randint(1, 3)):
            await asyncio.sleep(rng.uniform(1.0, 20.0))
            if rng.random() < 0.3:
                self.retain()
            await self.replay()

    def _id(self, kind: str) -> str:
        self._count += 1
        return f"{kind}-{self._count}"

    async def send(self, command: Command) -> None:
        signed = sign_command(
            _replace(command, issued_at=self.fleet.clock.wall()), CONTROL_KEY.encode()
        )
        value = encode(signed)
        offset = await self._produce(value)
        self.sent.append(value)
        target = command.target
        self.history.add(
            "control_sent",
            id=command.command_id,
            offset=offset,
            command=type(command).__name__,
            version=getattr(command, "version", None),
            workers=target.workers,
            group=target.group,
        )

    async def _produce(self, value: bytes) -> int:
        while True:
            try:
                metadata = await (await self.producer.send(self.topic, value=value, key=b"c"))
            except KafkaError:
                # Maybe appended all the same (a lost acknowledgement): a copy, as a replay.
                await asyncio.sleep(1.0)
                continue
            return int(metadata.offset)

    async def update(self, target: Target | None = None) -> None:
        self.version += 1
        await self.send(
            UpdateWeights(
                command_id=self._id("update"),
                version=self.version,
                path=self.checkpoint(f"v{self.version}"),
                on_inflight=self.rng.choice(["wait", "keep", "abort", "restart"]),
                target=target or Target(),
            )
        )

    async def stale_update(self) -> None:
        """An update every worker refuses, not forced, and the trainer goes on as before: a
        late retry of an earlier step (older than the fleet's weights), or a checkpoint of
        another architecture. A worker started later must not take it for one the fleet
        applied."""
        if self.version <= 0:
            return
        if self.stale_rng.random() < 0.5:
            version = self.stale_rng.randrange(max(0, self.version - 3), self.version)
            path = self.checkpoint(f"v{version}")
        else:
            version = self.version + 1
            path = self.checkpoint(f"other-architecture-v{version}")
        await self.send(UpdateWeights(command_id=self._id("refused"), version=version, path=path))

    async def transfer(self) -> None:
        self.version += 1
        rendezvous = f"rendezvous-{self.version}-{self._count}"
        self.fleet.transfers[rendezvous] = self.fleet.clock.now + TRANSFER_OPEN_S
        await self.send(
            UpdateWeights(
                command_id=self._id("transfer"),
                version=self.version,
                backend=self.rng.choice(["nccl", "ipc"]),
                init_info={"master_address": "trainer", "master_port": 29500},
                update_info={"rendezvous": rendezvous},
                on_inflight=self.rng.choice(["wait", "keep", "abort", "restart"]),
            )
        )

    async def rollback(self, target: Target | None = None) -> None:
        """A forced update to an older version, at times below the start version. One for
        some workers leaves the trainer's version as it was: the fleet's next update brings
        them forward again."""
        low = max(0, START_VERSION - 4)
        if self.version <= low:
            await self.update(target)
            return
        version = self.rng.randrange(low, self.version)
        if target is None:
            self.version = version
        await self.send(
            UpdateWeights(
                command_id=self._id("rollback"),
                version=version,
                path=self.checkpoint(f"v{self.version}"),
                on_inflight=self.rng.choice(["wait", "keep", "abort", "restart"]),
                force=True,
                target=target or Target(),
            )
        )

    async def pause_one(self, worker: str) -> None:
        target = Target(workers=[worker])
        mode = self.rng.choice(["wait", "keep", "abort"])
        await self.send(Pause(command_id=self._id("pause"), mode=mode, target=target))  # type: ignore[arg-type]
        await asyncio.sleep(self.rng.uniform(0.5, 6.0))
        await self.send(Resume(command_id=self._id("resume"), target=target))

    async def replay(self) -> None:
        """One earlier record produced again byte for byte."""
        if not self.sent:
            return
        value = self.rng.choice(self.sent)
        offset = await self._produce(value)
        self.history.add("control_replayed", offset=offset)

    def retain(self) -> None:
        """The status topic's records older than a retention drawn now are deleted; the
        heartbeats of live workers within their last intervals stay."""
        age_s = self.rng.uniform(10.0, 60.0)
        self.cluster.retain(self.status_topic, int((self.fleet.clock.now - age_s) * 1000))

    async def fleet_down(self) -> None:
        """Every worker killed; commands go out; they come back later."""
        alive = self.fleet.alive()
        down = [w for w in alive if w not in self.fleet.stopping]
        for worker in alive:
            self.fleet.kill(worker, why="the whole fleet is down")
        for _ in range(self.rng.randint(1, 3)):
            await asyncio.sleep(self.rng.uniform(0.5, 5.0))
            await self.step(self.rng.choice(["update", "transfer", "rollback", "pause"]))
        await asyncio.sleep(self.rng.uniform(0.5, 20.0))
        for worker in down:
            self._start(worker)

    async def target_down(self) -> None:
        """One worker killed, a command for it alone sent while it is down; it comes back."""
        alive = [w for w in self.fleet.alive() if w not in self.fleet.stopping]
        if not alive:
            return
        worker = self.rng.choice(alive)
        self.fleet.kill(worker, why="down while a command for it goes out")
        await asyncio.sleep(self.rng.uniform(0.1, 2.0))
        target = Target(workers=[worker])
        match self.rng.choice(["update", "rollback", "pause"]):
            case "update":
                await self.update(target)
            case "rollback":
                await self.rollback(target)
            case _:
                await self.pause_one(worker)
        delay = self.rng.uniform(0.5, 10.0)
        asyncio.get_running_loop().call_later(delay, self._start, worker)

    def _start(self, worker: str) -> None:
        if self.fleet.ended:
            return
        task = asyncio.get_running_loop().create_task(self.fleet.start(worker))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)


def _replace(command: Command, **fields: Any) -> Command:
    import msgspec  # noqa: PLC0415

    return msgspec.structs.replace(command, **fields)
