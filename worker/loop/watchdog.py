"""What stops the worker although no job failed: an engine that died while nothing ran on it,
and a broker that has not acknowledged an answer for too long."""

from __future__ import annotations

from worker.core.clock import Clock
from worker.core.config import Settings
from worker.core.errors import BrokerError, FatalError
from worker.delivery.publish import Delivery
from worker.engines.protocol import Engine

__all__ = ["Watchdog"]


class Watchdog:
    """Checked once per turn of the consume loop; each check is cheap until it is due."""

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        delivery: Delivery,
        *,
        clock: Clock,
    ) -> None:
        self._engine = engine
        self._delivery = delivery
        self._clock = clock
        self._health_interval_s = settings.health_check_interval_s
        self._publish_timeout_s = settings.publish_timeout_s
        self._last_health_check = clock.monotonic()

    async def check(self) -> tuple[FatalError, str] | None:
        """The fatal error found, and where; None when all is well."""
        waited = self._delivery.oldest_wait_s()
        if waited > self._publish_timeout_s:
            return BrokerError(
                f"no acknowledgement from the broker for {waited:.1f}s "
                f"(publish_timeout_s={self._publish_timeout_s})"
            ), "delivery"
        now = self._clock.monotonic()
        if now - self._last_health_check < self._health_interval_s:
            return None
        self._last_health_check = now
        try:
            # A dead engine must stop the worker even when no job is running to notice it.
            await self._engine.check_health()
        except FatalError as exc:
            return exc, "engine health check"
        return None
