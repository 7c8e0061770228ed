"""Commands applied to this worker and acknowledged, and what is in force after them.

Each command is applied once (by `command_id`): `applied` holds every id taken, addressed to
this worker or not, so a later record under the same id is a duplicate. What heartbeats
report as in force (the update whose weights are served, the fleet's pause, the transfer the
worker lacks) is kept here, next to the outcomes that change it.
"""

from __future__ import annotations

import logging
from typing import Literal

from schemas import Command, CommandAck, Pause, Resume, UpdateWeights
from worker.control.commands import CommandRunner, WorkerView
from worker.control.status import StatusSender
from worker.core.clock import Clock
from worker.core.config import Settings
from worker.core.errors import FatalError, WeightUpdateError
from worker.core.metrics import Metrics
from worker.engines.steerable import SteerableEngine

__all__ = ["CommandApplier"]

logger = logging.getLogger(__name__)


class CommandApplier:
    """Runs commands on `engine` (`runner`) and acknowledges each through `status`."""

    def __init__(
        self,
        settings: Settings,
        engine: SteerableEngine,
        metrics: Metrics,
        worker: WorkerView,
        status: StatusSender,
        *,
        clock: Clock,
    ) -> None:
        self._settings = settings
        self._engine = engine
        self._metrics = metrics
        self._worker = worker
        self._status = status
        self._clock = clock
        self.runner = CommandRunner(settings, engine, metrics, worker, clock=clock)
        #: Ids of every command taken (applied, passed over, or not this worker's).
        self.applied: set[str] = set()
        #: The update whose weights are served (None: the start-up weights).
        self.weights_command_id: str | None = None
        #: The fleet's pause in force (None: none).
        self.pause_command_id: str | None = None

    def addressed(self, command: Command) -> bool:
        return command.target.matches(self._settings.group_id, self._settings.worker_id)

    @property
    def needs_weights(self) -> bool:
        # The engine's own: an update failed and the weights before it could not be put back.
        return self.runner.needs_weights or self._engine.needs_weights

    def publish_version(self) -> None:
        self._metrics.weight_version.set(self._engine.weight_version)
        self._metrics.paused.set(1 if self._engine.paused else 0)
        self._metrics.needs_weights.set(1 if self.needs_weights else 0)

    async def apply(
        self,
        command: Command,
        *,
        catching_up: bool = False,
        loaded: bool = False,
        offset: int | None = None,
    ) -> CommandAck:
        """Run `command` (at `offset` in the control topic) and acknowledge it; `loaded`: the
        engine was built on its checkpoint, so there is nothing to run."""
        t0 = self._clock.monotonic()
        outcome: Literal["ok", "failed"] = "ok"
        detail = ""
        try:
            if loaded:
                detail = "the engine was built on this checkpoint at start"
            else:
                detail = await self.runner.run(command, catching_up=catching_up)
        except WeightUpdateError as exc:
            outcome, detail = "failed", str(exc)
        except FatalError as exc:
            outcome, detail = "failed", f"the engine stopped: {exc}"
            self._worker.fail(exc, f"control command {command.command_id}")
        if outcome == "ok":
            if isinstance(command, UpdateWeights):
                self.weights_command_id = command.command_id
            elif isinstance(command, Pause):
                self.pause_command_id = command.command_id
            elif isinstance(command, Resume):
                self.pause_command_id = None
        return await self.acknowledge(
            command, outcome, detail, self._clock.monotonic() - t0, offset
        )

    async def acknowledge(
        self,
        command: Command,
        outcome: Literal["ok", "failed"],
        detail: str,
        duration: float,
        offset: int | None,
    ) -> CommandAck:
        ack = self._status.acknowledgement(command, outcome, detail, duration, offset)
        self.publish_version()
        await self._status.send(ack)
        return ack

    async def take_checkpoint(
        self,
        checkpoints: list[UpdateWeights],
        offsets: dict[str, int],
        *,
        built_on: str | None,
        passed_over: dict[str, str],
    ) -> None:
        """Serve the newest of `checkpoints` (the fleet's, newest first) that loads here,
        saying so loudly when that is not the newest one. `built_on`: the update the engine
        was built on (not loaded again); `passed_over`: those that did not start an engine
        here, with why (acknowledged `failed`, not tried again)."""
        failed: list[str] = []
        for update in checkpoints:
            offset = offsets.get(update.command_id)
            reason = passed_over.get(update.command_id)
            if reason is not None:
                failed.append(update.command_id)
                await self.acknowledge(
                    update, "failed", f"did not start an engine here: {reason}", 0.0, offset
                )
                continue
            ack = await self.apply(
                update,
                catching_up=True,
                loaded=update.command_id == built_on,
                offset=offset,
            )
            if ack.outcome == "ok":
                break
            failed.append(update.command_id)
        if failed:
            logger.error(
                "the fleet's checkpoint updates %s do not load on this worker: serving %s "
                "(version %d), older than the fleet's",
                ", ".join(failed),
                self.weights_command_id or "the start-up checkpoint",
                self._engine.weight_version,
            )
