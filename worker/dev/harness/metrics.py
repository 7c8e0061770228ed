"""A worker's /metrics, read as {series: value}."""

from __future__ import annotations

from typing import Self

import aiohttp


class Scraper:
    """Reads a worker's /metrics as {series: value}; `series` is the name with its labels."""

    def __init__(self, port: int) -> None:
        self._url = f"http://127.0.0.1:{port}/metrics"
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._http is not None
        await self._http.close()

    async def sample(self) -> dict[str, float]:
        assert self._http is not None
        async with self._http.get(self._url) as response:
            text = await response.text()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                series, _, value = line.rpartition(" ")
                out[series] = float(value)
        return out

    async def value(self, series: str) -> float | None:
        return (await self.sample()).get(series)


#: What a scrape of a worker that is going away (or not yet up) may raise.
SCRAPE_ERRORS: tuple[type[Exception], ...] = (TimeoutError, aiohttp.ClientError, OSError)
