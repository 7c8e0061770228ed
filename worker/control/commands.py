"""One control command applied to the engine, after the checks that it may be.

Checked before anything changes: that the command is fresh (`staleness`: its signed
`issued_at` within `--command-max-age-s` of now, so a record produced again after a trim of the
topic is not obeyed), that a weight update moves the version forward (only a fresh `force`
rolls back), and what it may load (`worker.control.policy`). The signature is checked by the
control plane, which reads the record and drops what is not signed. Besides the engine's own
pause, the runner keeps the `needs_weights` hold of a worker whose latest update at start was
a weight transfer: a `resume` leaves its jobs held; the next update that loads releases them
(unless the fleet is paused).
"""

from __future__ import annotations

import asyncio
from typing import Final, Protocol

from schemas import Abort, Command, Pause, ResetPrefixCache, Resume, UpdateWeights
from worker.control.policy import WeightsPolicy
from worker.core.clock import Clock
from worker.core.config import Settings
from worker.core.errors import FatalError, WeightUpdateError
from worker.core.metrics import Metrics
from worker.engines.steerable import SteerableEngine

__all__ = ["CommandRunner", "WorkerView", "staleness"]

# How long a `restart` update waits for the answers of jobs that finished on the old weights to
# be acknowledged before it acknowledges itself.
_SETTLE_TIMEOUT_S: Final = 30.0
# How long the checks of a checkpoint directory may take (storage that hangs is refused).
_POLICY_TIMEOUT_S: Final = 30.0


def staleness(command: Command, now: float, settings: Settings) -> str | None:
    """Why `command` is too old (or dated too far ahead) to be obeyed at `now`; None when it
    is fresh. Under a key every command must say when it was issued; without one, a command
    that does not say is taken, except a rollback (`force`), which must be fresh."""
    issued = command.issued_at
    if issued is None:
        if settings.control_hmac_key is not None:
            return "no issued_at: a signed command must say when it was issued"
        if isinstance(command, UpdateWeights) and command.force:
            return "no issued_at: a rollback (force) must say when it was issued"
        return None
    skew, max_age = settings.max_clock_skew_s, settings.command_max_age_s
    if issued > now + skew:
        return (
            f"issued {issued - now:.0f} s in the future, more than the {skew:.0f} s of clock "
            "skew allowed (--max-clock-skew-s)"
        )
    if issued < now - max_age - skew:
        return (
            f"stale: issued {now - issued:.0f} s ago, more than --command-max-age-s "
            f"{max_age:.0f} (a record produced again is not obeyed)"
        )
    return None


class WorkerView(Protocol):
    """What the control plane reads from, and tells, the worker it steers."""

    @property
    def jobs_in_flight(self) -> int: ...

    def lag(self) -> int | None: ...

    async def answers_acknowledged(self, timeout_s: float) -> bool: ...

    def fail(self, exc: FatalError, where: str) -> None: ...


class CommandRunner:
    """Applies commands to `engine` (see the module's docstring)."""

    def __init__(
        self,
        settings: Settings,
        engine: SteerableEngine,
        metrics: Metrics,
        worker: WorkerView,
        *,
        clock: Clock,
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._engine = engine
        self._metrics = metrics
        self._worker = worker
        self._policy = WeightsPolicy(settings)
        # The fleet's latest update at start was a transfer this worker cannot repeat: its id.
        self._lacking: str | None = None
        # The fleet's own pause state (a `needs_weights` hold keeps the gate closed anyway).
        self._fleet_paused = False

    async def run(self, command: Command, *, catching_up: bool = False) -> str:
        """Apply one command; a detail for the acknowledgement. `WeightUpdateError` (nothing
        changed, or the old weights still serve) says why it failed. `catching_up`: the fleet
        applied it before this worker started, so it is not checked for freshness again."""
        if not catching_up and (stale := staleness(command, self._clock.wall(), self._settings)):
            raise WeightUpdateError(stale)
        engine = self._engine
        if isinstance(command, Pause):
            self._fleet_paused = True
            await engine.pause(command.mode)
            return ""
        if isinstance(command, Resume):
            self._fleet_paused = False
            if self._holding:
                return "jobs stay held until the next update_weights (needs_weights)"
            await engine.resume()
            return ""
        if isinstance(command, ResetPrefixCache):
            await engine.reset_prefix_cache()
            return ""
        if isinstance(command, Abort):
            matched = await engine.abort(command)
            return f"aborted {len(matched)} jobs in flight" + (
                f": {', '.join(sorted(matched)[:20])}" if matched else ""
            )
        await self._check_update(command, catching_up=catching_up)
        t0 = self._clock.monotonic()
        if command.backend == "checkpoint":
            assert command.path is not None  # noqa: S101 - the schema requires it
            await engine.load_checkpoint(command.path, command.version, command.on_inflight)
        else:
            assert command.update_info is not None  # noqa: S101 - the schema requires it
            await engine.transfer(
                command.backend,
                command.init_info,
                command.update_info,
                command.version,
                command.on_inflight,
            )
        self._metrics.weight_update_time.observe(self._clock.monotonic() - t0)
        if self._lacking is not None:
            holding, self._lacking = self._holding, None
            if holding and not self._fleet_paused:
                await engine.resume()
        if command.on_inflight == "restart" and not catching_up:
            # Answers of jobs that finished on the old weights go out before this says done.
            settled = await self._settled_answers()
            if not settled:
                return "some answers of jobs finished on the old weights were still unacknowledged"
        return f"serving {command.path or command.backend} as version {command.version}"

    @property
    def needs_weights(self) -> bool:
        return self._lacking is not None

    @property
    def lacking(self) -> str | None:
        """The id of the fleet's update this worker could not repeat at start (None: none)."""
        return self._lacking

    @property
    def _holding(self) -> bool:
        return self.needs_weights and self._settings.stale_weights_at_start == "hold"

    async def lack_weights(self, command_id: str) -> bool:
        """The fleet's latest update, `command_id`, could not be repeated: report
        `needs_weights` until the next one, holding the jobs unless told to serve; whether
        they are held."""
        self._lacking = command_id
        if self._holding:
            await self._engine.pause("wait")
        return self._holding

    async def _check_update(self, command: UpdateWeights, *, catching_up: bool) -> None:
        """Raise `WeightUpdateError` when `command` may not be applied; nothing has changed.
        At catch-up the fleet's own outcome stands (a rollback it applied included)."""
        served = self._engine.weight_version
        if not catching_up and command.version < served and not command.force:
            raise WeightUpdateError(
                f"version {command.version} is older than the served version {served}: "
                "refused (an update with `force` rolls back)"
            )
        try:
            async with asyncio.timeout(_POLICY_TIMEOUT_S):
                await asyncio.to_thread(self._policy.check, command)
        except TimeoutError:
            raise WeightUpdateError(
                f"checkpoint {command.path} could not be checked in {_POLICY_TIMEOUT_S:.0f} s"
            ) from None

    async def _settled_answers(self) -> bool:
        worker = self._worker
        deadline = self._clock.monotonic() + _SETTLE_TIMEOUT_S
        # Jobs whose engine call has returned, with their answers still being built.
        while worker.jobs_in_flight > self._engine.inside and self._clock.monotonic() < deadline:  # noqa: ASYNC110 - a count, not an event: polled for a few ms
            await asyncio.sleep(0.01)
        return await worker.answers_acknowledged(max(deadline - self._clock.monotonic(), 0))
