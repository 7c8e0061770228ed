"""Workers as real processes on a real broker, and the clients that feed and read them: what the
tests and the benchmarks drive a fleet with. Development tooling: no runtime module imports it.

- `topics`: the topics a run uses (`Topics`, `Fleet`), made fresh.
- `processes`: `python -m worker serve` as a process (`WorkerProcess`), stopped as a user would.
- `clients`: produce, collect, assemble results, read committed offsets.
- `waiting`: wait for a condition, with an error that says what did not happen.
- `fleet`: readers of a steered fleet's control, status and results topics.
- `metrics`, `rss`: a worker's /metrics and resident memory.
- `answers`: every answer read back, and the check that nothing was lost.
- `runs`: named worker processes under load, what `chaos` and `elastic` share.
- `chaos`: workers killed at random while they serve; `elastic`: workers joining and leaving.
"""
