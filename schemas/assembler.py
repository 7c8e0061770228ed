"""Reader side of split results: parts in, whole results out, each submission of a job once."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable
from typing import TypeAlias

import msgspec

from schemas.errors import SchemaError
from schemas.results import Completed, Result

__all__ = ["Incomplete", "ResultAssembler", "merge_parts"]

# What one answer answers: a job id and the submission of it (None: the job named none, or a
# worker older than submissions answered it).
_Key: TypeAlias = tuple[str, str | None]


class Incomplete(msgspec.Struct, frozen=True, kw_only=True):
    """An attempt of a job with some of its parts still missing."""

    job_id: str
    attempt: str
    received: list[int]
    count: int
    #: Seconds since its first part arrived.
    age_s: float


class _Attempt:
    __slots__ = ("count", "first_seen", "parts")

    def __init__(self, count: int, now: float) -> None:
        self.count = count
        self.first_seen = now
        self.parts: dict[int, Completed] = {}


class ResultAssembler:
    """Feed it decoded results in any order, duplicates included; `add` returns the result of
    each submission of a job once, when it is whole.

    A job is identified by its `job_id` and `submission_id`: a job id sent again under a new
    submission (a re-run, a restarted trainer) is a new job here, whose answer is not taken
    for a duplicate of the earlier one's. A whole record (no `part`) or a `Failed` is returned
    as it comes. Parts are grouped by job and `part.attempt`; when every part of one attempt is
    in, the completions are merged in `index` order into one `Completed` without `part`, and
    the parts of the job's other attempts (a first run cut short by a crash) are dropped.
    Whatever arrives for a job after its result was returned is a duplicate and returns None.
    The `remember` most recent finished jobs are kept for that; older ones are forgotten.

    Anyone who can write to the results topic can send parts under attempt names of their
    choosing, so at most `max_attempts` attempts are held per job: a new one beyond that pushes
    out the attempt that began first (a legitimate job has one attempt per crash of the worker
    running it, far fewer). With a part's `count` capped by the wire type, what is held per job
    stays bounded whatever arrives.
    """

    def __init__(
        self,
        *,
        remember: int = 1_000_000,
        max_attempts: int = 8,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if remember < 1:
            raise ValueError(f"remember must be >= 1, got {remember}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self._remember = remember
        self._max_attempts = max_attempts
        self._clock = clock
        self._done: collections.OrderedDict[_Key, None] = collections.OrderedDict()
        self._pending: dict[_Key, dict[str, _Attempt]] = {}

    def add(self, result: Result) -> Result | None:
        """The job's whole result if `result` completes it, else None (a part or a duplicate).

        Raises `SchemaError` for parts of one attempt that disagree on their count.
        """
        job_id = result.job_id
        if job_id is None:  # an unreadable job's answer: nothing to assemble or deduplicate
            return result
        key = _key(job_id, result.submission_id)
        if key in self._done:
            return None
        if not isinstance(result, Completed) or isinstance(result.part, msgspec.UnsetType):
            self._finish(key)
            return result
        part = result.part
        attempts = self._pending.setdefault(key, {})
        attempt = attempts.get(part.attempt)
        if attempt is None:
            if len(attempts) >= self._max_attempts:
                # Dicts keep insertion order: the first key is the attempt that began first.
                del attempts[next(iter(attempts))]
            attempt = attempts[part.attempt] = _Attempt(part.count, self._clock())
        elif attempt.count != part.count:
            raise SchemaError(
                f"job {job_id} attempt {part.attempt}: part {part.index} says {part.count} parts, "
                f"an earlier one said {attempt.count}"
            )
        attempt.parts.setdefault(part.index, result)
        if len(attempt.parts) < attempt.count:
            return None
        self._finish(key)
        return merge_parts([attempt.parts[i] for i in range(attempt.count)])

    def add_all(self, results: Iterable[Result]) -> list[Result]:
        """`add` each one; the whole results, in the order they became whole."""
        return [whole for r in results if (whole := self.add(r)) is not None]

    def incomplete(self, older_than_s: float = 0.0) -> list[Incomplete]:
        """Attempts still missing parts whose first part arrived over `older_than_s` ago."""
        now = self._clock()
        return [
            Incomplete(
                job_id=job_id,
                attempt=name,
                received=sorted(attempt.parts),
                count=attempt.count,
                age_s=now - attempt.first_seen,
            )
            for (job_id, _), attempts in self._pending.items()
            for name, attempt in attempts.items()
            if now - attempt.first_seen > older_than_s
        ]

    def discard(self, job_id: str, submission_id: str | None = None) -> None:
        """Forget the parts held for that submission of `job_id` (after giving up on it); later
        ones start afresh."""
        self._pending.pop((job_id, submission_id), None)

    def forget(self, job_id: str, submission_id: str | None = None) -> None:
        """Forget that submission of `job_id` altogether, its parts and that it was answered:
        for a reader that sends the job again and wants its next answer."""
        key = (job_id, submission_id)
        self._pending.pop(key, None)
        self._done.pop(key, None)

    @property
    def pending_jobs(self) -> int:
        """Jobs with parts held and no whole result yet."""
        return len(self._pending)

    def _finish(self, key: _Key) -> None:
        self._pending.pop(key, None)
        done = self._done
        done[key] = None
        if len(done) > self._remember:
            done.popitem(last=False)


def _key(job_id: str, submission_id: str | msgspec.UnsetType) -> _Key:
    return (job_id, None if isinstance(submission_id, msgspec.UnsetType) else submission_id)


def merge_parts(parts: list[Completed]) -> Completed:
    """One `Completed` from all the parts of one attempt, completions in `index` order."""
    completions = sorted((c for p in parts for c in p.completions), key=lambda c: c.index)
    return msgspec.structs.replace(parts[0], completions=completions, part=msgspec.UNSET)
