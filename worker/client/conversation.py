"""A multi-turn rollout as jobs: each turn's prompt extends the conversation so far, its
routing starts where the turns before it end, and every turn carries one session key.

The session key is the jobs' Kafka key, so every turn lands on one partition and is served by
the worker that served the turns before it: its prefix cache still holds them, and the turn
prefills only its new tokens. After a rebalance the partition's next owner serves the session;
its first turn there computes the whole prompt once, and the turns after it hit that worker's
cache again.

    conversation = Conversation(sampling=SamplingSpec(max_tokens=64))
    first = await client.turn(conversation, prompt_ids)      # RolloutClient.turn
    second = await client.turn(conversation, tool_output_ids)
    tokens, prompt_len, routed = conversation.stitched()       # the whole sequence's routing
    arrays = replay_arrays([conversation.replay_sample()], RECIPES["prime-rl"])
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence

from msgspec import UnsetType

from schemas import (
    Completed,
    Failed,
    Job,
    ReplaySample,
    Result,
    RoutedExperts,
    SamplingSpec,
    Turn,
    as_job,
    stitch_turns,
)

__all__ = ["Conversation", "ConversationError", "new_submission_id"]


def new_submission_id() -> str:
    """A name for one sending of a job (`Job.submission_id`), unique across trainers and runs."""
    return uuid.uuid4().hex


class ConversationError(Exception):
    """A turn that cannot extend the conversation (one still in flight, an answer that does not
    belong to it or does not continue it)."""


class Conversation:
    """The turns of one multi-turn rollout and the job of its next turn.

    `session_id` is the jobs' record key (default: this conversation's own id); conversations
    that share a prefix, such as a group's samples of one prompt, may share one so they share a
    worker's cache. `sampling` must ask for one completion (`n` = 1): a conversation continues
    one sequence. `min_weight_version`: no turn runs on older weights; each turn also asks for
    at least the weights its previous turn ran on, so a session moved to another worker never
    steps back to an older policy. Jobs are named `<conversation_id>-turn<k>`, each asking of a
    turn under a new `submission_id`.
    """

    def __init__(
        self,
        session_id: str | None = None,
        *,
        conversation_id: str | None = None,
        sampling: SamplingSpec | None = None,
        return_routed_experts: bool = True,
        min_weight_version: int | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.conversation_id = conversation_id or uuid.uuid4().hex
        self.session_id = session_id or self.conversation_id
        self._sampling = sampling or SamplingSpec()
        _check_one_completion(self._sampling)
        self._routed = return_routed_experts
        self._min_version = min_weight_version
        self._metadata = dict(metadata or {})
        self._turns: list[Turn] = []
        self._results: list[Completed] = []
        self._asked: Job | None = None

    @property
    def turns(self) -> list[Turn]:
        """Every answered turn: the prompt it was sent and its completion."""
        return list(self._turns)

    @property
    def results(self) -> list[Completed]:
        """Every answered turn's result (its worker, weight version, cached prompt tokens)."""
        return list(self._results)

    @property
    def token_ids(self) -> list[int]:
        """The conversation so far: the last turn's prompt and output."""
        if not self._turns:
            return []
        last = self._turns[-1]
        return [*last.prompt_token_ids, *last.completion.token_ids]

    @property
    def weight_floor(self) -> int | None:
        """The oldest weights its next turn may run on: the conversation's `min_weight_version`
        or the version its last turn ran on, whichever is newer. After a forced rollback below
        it, no worker runs the next turn until the fleet serves it again."""
        floors = [v for v in (self._min_version, self._last_version()) if v is not None]
        return max(floors) if floors else None

    @property
    def in_flight(self) -> Job | None:
        """The job of the turn asked for and not yet answered, if any."""
        return self._asked

    def next_job(
        self,
        new_tokens: Sequence[int],
        *,
        sampling: SamplingSpec | None = None,
        min_weight_version: int | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Job:
        """The job of the next turn: the conversation so far followed by `new_tokens` (on the
        first turn, the prompt), its routing from where the previous turn's rows end, keyed by
        the session. Checked as a worker checks it (`SchemaError` names a bad field). Record
        its answer with `record` before asking for the turn after it."""
        if self._asked is not None:
            raise ConversationError(
                f"turn {self._asked.job_id} is still in flight: record its answer first"
            )
        if not self._turns and not new_tokens:
            raise ConversationError("the first turn needs its prompt's tokens")
        sampling = sampling or self._sampling
        _check_one_completion(sampling)
        history = self.token_ids
        floors = [v for v in (min_weight_version, self.weight_floor) if v is not None]
        job = as_job(
            Job(
                job_id=f"{self.conversation_id}-turn{len(self._turns)}",
                prompt_token_ids=[*history, *new_tokens],
                sampling=sampling,
                return_routed_experts=self._routed,
                # vLLM's rows of the previous turn end before its last token, which it sampled
                # and never fed forward: this turn's rows start there (NOTES: len(history) - 1).
                routed_experts_prompt_start=max(len(history) - 1, 0),
                session_id=self.session_id,
                metadata={**self._metadata, **(metadata or {})},
                min_weight_version=max(floors) if floors else None,
                # New for each asking, a re-run of the turn included: `record` takes only the
                # answer to this one, never a late answer to an earlier asking.
                submission_id=new_submission_id(),
            )
        )
        self._asked = job
        return job

    def record(self, result: Result) -> Turn | None:
        """Take the answer of the turn in flight: a completed one extends the conversation
        (the new turn is returned); a failed one leaves it where it was (None), so the same
        turn can be asked for again."""
        asked = self._asked
        if asked is None:
            raise ConversationError("no turn is in flight")
        if result.job_id != asked.job_id:
            raise ConversationError(
                f"the answer of {result.job_id} is not the turn in flight, {asked.job_id}"
            )
        if (mismatch := _not_asked(asked, result)) is not None:
            raise ConversationError(f"{asked.job_id}: the answer {mismatch}")
        self._asked = None
        if isinstance(result, Failed):
            return None
        if result.is_part or len(result.completions) != 1:
            raise ConversationError(
                f"{asked.job_id}: a turn's answer holds its one whole completion, not "
                f"{len(result.completions)}{' (a part)' if result.is_part else ''}"
            )
        completion = result.completions[0]
        routed = completion.routed_experts
        if self._routed and (routed is None or routed.start != asked.routed_experts_prompt_start):
            found = "none" if routed is None else f"rows from {routed.start}"
            raise ConversationError(
                f"{asked.job_id}: routing from position {asked.routed_experts_prompt_start} "
                f"was asked for, the answer has {found}"
            )
        turn = Turn(list(asked.prompt_token_ids or ()), completion)
        self._turns.append(turn)
        self._results.append(result)
        return turn

    def abandon(self) -> None:
        """Forget the turn in flight without an answer (its caller stopped waiting)."""
        self._asked = None

    def stitched(self) -> tuple[list[int], int, RoutedExperts]:
        """The whole conversation as one sequence: its tokens, the first prompt's length and
        the routing of every position (`schemas.stitch_turns`; `ReplayError` when a turn has
        no routing)."""
        if not self._turns:
            raise ConversationError("no turn answered yet")
        return stitch_turns(self._turns)

    def replay_sample(self) -> ReplaySample:
        """The conversation as one sample of `schemas.replay_arrays`, which builds it for each
        trainer's layout (`schemas.RECIPES`)."""
        if not self._turns:
            raise ConversationError("no turn answered yet")
        *earlier, last = self._turns
        return ReplaySample(
            last.completion,
            len(last.prompt_token_ids),
            list(earlier),
            list(last.prompt_token_ids),
        )

    def _last_version(self) -> int | None:
        if not self._results:
            return None
        version = self._results[-1].weight_version
        return version if isinstance(version, int) else None


def _not_asked(asked: Job, result: Result) -> str | None:
    """How `result` is not the answer to `asked` as sent, by what it echoes (its submission,
    its prompt); None when it is, or echoes too little to tell."""
    echoed = result.submission_id
    if not isinstance(echoed, UnsetType) and echoed != asked.submission_id:
        return (
            f"is to submission {echoed}, an earlier asking of the turn, not {asked.submission_id}"
        )
    if isinstance(result, Failed):
        return None
    prompt = asked.prompt_token_ids or []
    if result.prompt_token_count != len(prompt):
        return f"is to a prompt of {result.prompt_token_count} tokens, not {len(prompt)}"
    if result.prompt_token_ids is not None and result.prompt_token_ids != prompt:
        return "is to another prompt of the same length"
    return None


def _check_one_completion(sampling: SamplingSpec) -> None:
    if sampling.n != 1:
        raise ConversationError(
            f"a conversation continues one sequence: sampling.n must be 1, not {sampling.n} "
            "(sample a group as one conversation per member)"
        )
