"""The reader side of split results: any order, duplicates, attempts, timeouts."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import (
    Completed,
    Completion,
    ErrorCode,
    ErrorInfo,
    Failed,
    Part,
    ResultAssembler,
    SchemaError,
    decode_result,
    encode,
)
from tests.hypothesis_profiles import examples


def completion(index: int, attempt: str) -> Completion:
    return Completion(
        index=index, token_ids=[index], text=f"{attempt}:{index}", finish_reason="length"
    )


def parts(job_id: str, attempt: str, grouping: list[int]) -> list[Completed]:
    """The parts of one attempt; `grouping[i]` is how many completions part i holds."""
    out = []
    first = 0
    for index, size in enumerate(grouping):
        out.append(
            Completed(
                job_id=job_id,
                completions=[completion(i, attempt) for i in range(first, first + size)],
                prompt_token_count=3,
                metadata={"step": "1"},
                part=Part(index=index, count=len(grouping), attempt=attempt),
            )
        )
        first += size
    return out


def whole(job_id: str, attempt: str, n: int) -> Completed:
    return Completed(
        job_id=job_id,
        completions=[completion(i, attempt) for i in range(n)],
        prompt_token_count=3,
        metadata={"step": "1"},
    )


groupings = st.lists(st.integers(1, 3), min_size=1, max_size=6)


@settings(max_examples=examples(0.8), suppress_health_check=[HealthCheck.too_slow])
@given(
    first=groupings,
    second=groupings,
    cut=st.integers(0, 5),
    duplicates=st.lists(st.integers(0, 40), max_size=10),
    data=st.data(),
)
def test_any_order_with_duplicates_and_a_cut_short_attempt_yields_one_whole_attempt(
    first, second, cut, duplicates, data
):
    """A first attempt cut short by a crash (only some parts published), then a full one, in any
    interleaving and with duplicates: one result, all from one attempt."""
    cut_short = parts("j", "a1", first)[: min(cut, len(first) - 1)]
    full = parts("j", "a2", second)
    records: list[Completed] = cut_short + full
    records += [records[d % len(records)] for d in duplicates]
    order = data.draw(st.permutations(records))
    assembler = ResultAssembler()
    got = assembler.add_all(order)
    assert got == [whole("j", "a2", sum(second))]
    assert assembler.pending_jobs == 0
    # Late parts of either attempt change nothing.
    assert assembler.add_all(cut_short + full) == []


def test_two_complete_attempts_yield_the_first_to_complete_only():
    assembler = ResultAssembler()
    a, b = parts("j", "a", [1, 1]), parts("j", "b", [2])
    assert assembler.add(a[0]) is None
    assert assembler.add(b[0]) == whole("j", "b", 2)
    assert assembler.add(a[1]) is None


def test_whole_and_failed_results_pass_through_once():
    assembler = ResultAssembler()
    one = whole("w", "x", 2)
    failed = Failed(job_id="f", error=ErrorInfo(code=ErrorCode.EXPIRED, detail="late"))
    assert assembler.add(one) is one
    assert assembler.add(one) is None
    assert assembler.add(failed) is failed
    assert assembler.add(failed) is None
    unreadable = Failed(job_id=None, error=ErrorInfo(code=ErrorCode.INVALID_JOB, detail="?"))
    assert assembler.add(unreadable) is unreadable
    assert assembler.add(unreadable) is unreadable  # nothing to deduplicate it by


def test_a_failed_answer_after_some_parts_finishes_the_job():
    # A part the broker refused for its size is answered failed instead.
    assembler = ResultAssembler()
    a = parts("j", "a", [1, 1, 1])
    failed = Failed(job_id="j", error=ErrorInfo(code=ErrorCode.RESULT_TOO_LARGE, detail="big"))
    assert assembler.add(a[0]) is None
    assert assembler.add(failed) is failed
    assert assembler.add(a[1]) is None and assembler.add(a[2]) is None


def test_incomplete_attempts_are_reported_after_the_timeout_and_can_be_discarded():
    now = [100.0]
    assembler = ResultAssembler(clock=lambda: now[0])
    a = parts("j", "a", [1, 1, 1])
    assembler.add(a[0])
    assembler.add(a[2])
    now[0] = 105.0
    assert assembler.incomplete(older_than_s=10) == []
    now[0] = 120.0
    (late,) = assembler.incomplete(older_than_s=10)
    assert (late.job_id, late.attempt, late.received, late.count) == ("j", "a", [0, 2], 3)
    assert late.age_s == 20.0
    assembler.discard("j")
    assert assembler.incomplete() == [] and assembler.pending_jobs == 0


def test_parts_that_disagree_on_their_count_are_refused():
    assembler = ResultAssembler()
    assembler.add(parts("j", "a", [1, 1])[0])
    with pytest.raises(SchemaError, match="says 3 parts, an earlier one said 2"):
        assembler.add(parts("j", "a", [1, 1, 1])[1])


def test_finished_jobs_are_remembered_up_to_the_bound():
    assembler = ResultAssembler(remember=2)
    for job_id in ("a", "b", "c"):
        assembler.add(whole(job_id, "x", 1))
    assert assembler.add(whole("c", "x", 1)) is None
    assert assembler.add(whole("a", "x", 1)) is not None  # forgotten: delivered again
    with pytest.raises(ValueError, match="remember"):
        ResultAssembler(remember=0)


def test_a_part_round_trips_and_bad_parts_are_schema_errors():
    part = parts("j", "a", [1, 2])[1]
    assert decode_result(encode(part)) == part
    raw = msgspec.json.decode(encode(part))
    for bad, where in (
        ({"index": 2, "count": 2, "attempt": "a"}, "not below its count"),
        ({"index": 0, "count": 0, "attempt": "a"}, "part.count"),
        ({"index": 0, "count": 1, "attempt": ""}, "part.attempt"),
    ):
        raw["part"] = bad
        with pytest.raises(SchemaError, match=where):
            decode_result(encode(raw))
    # A whole result has no `part` on the wire at all, as before results could split.
    assert b'"part"' not in encode(whole("j", "a", 1))


def test_parts_under_many_invented_attempts_hold_a_bounded_number_and_the_real_one_completes():
    assembler = ResultAssembler(max_attempts=4)
    # Someone who can write to the results topic sends first parts under 1,000 attempt names.
    for n in range(1000):
        (first, _) = parts("job", f"forged-{n}", [1, 1])
        assert assembler.add(first) is None
    assert len(assembler.incomplete()) == 4
    # The worker's own attempt still assembles, and only it comes out.
    real = parts("job", "real", [1, 1])
    assert assembler.add(real[0]) is None
    assert len(assembler.incomplete()) == 4
    assembled = assembler.add(real[1])
    assert assembled == whole("job", "real", 2)
    assert assembler.pending_jobs == 0


def test_a_part_claiming_more_parts_than_a_job_can_have_completions_is_refused():
    (record,) = parts("job", "a", [1])
    wire = msgspec.json.decode(encode(record))
    wire["part"]["count"] = 129
    with pytest.raises(SchemaError, match="count"):
        decode_result(msgspec.json.encode(wire))


def test_each_submission_of_a_job_id_is_answered_once_and_forget_lets_it_be_answered_again():
    assembler = ResultAssembler()
    first = msgspec.structs.replace(whole("j", "a", 1), submission_id="s1")
    second = msgspec.structs.replace(whole("j", "b", 1), submission_id="s2")
    unnamed = whole("j", "c", 1)

    assert assembler.add(first) == first
    assert assembler.add(first) is None
    assert assembler.add(second) == second
    assert assembler.add(unnamed) == unnamed
    assert assembler.add(unnamed) is None
    assembler.forget("j")
    assert assembler.add(unnamed) == unnamed
    assert assembler.add(first) is None  # forgetting one submission leaves the others


def test_parts_of_two_submissions_of_one_job_id_are_never_merged():
    assembler = ResultAssembler()
    one = [msgspec.structs.replace(p, submission_id="s1") for p in parts("j", "a", [1, 1])]
    two = [msgspec.structs.replace(p, submission_id="s2") for p in parts("j", "a", [1, 1])]

    assert assembler.add(one[0]) is None
    assert assembler.add(two[1]) is None
    merged = assembler.add(two[0])

    assert isinstance(merged, Completed) and merged.submission_id == "s2"
    assert [c.index for c in merged.completions] == [0, 1]
    assert assembler.pending_jobs == 1  # s1's first part, still waiting for its second
