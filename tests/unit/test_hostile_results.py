"""Hostile records on the results topic, as a trainer's readers see them: `RolloutClient` and
`results`. Anyone who can write one record there must not end the reader, hang it, read files
outside the payload store, or learn about files from an error message. No broker: the client
reads from an in-memory consumer."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import (
    Completed,
    Completion,
    Failed,
    Part,
    PayloadError,
    RoutedExperts,
    RoutedExpertsError,
    encode,
)
from schemas.payloads import payload_root, read_payload
from tests.hypothesis_profiles import examples
from worker.cli.main import _ResultsReport
from worker.cli.replay_out import ReplayWriter
from worker.client.rollout import RolloutClient, RolloutError

ROWS = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
INLINE = RoutedExperts.from_array(ROWS, start=1)
SHA = hashlib.sha256(INLINE.data).hexdigest()


class _Sink:
    """Takes the client's job records and acknowledges each at once."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def send(
        self, topic: str, value: bytes, key: bytes, headers: list[tuple[str, bytes]] | None = None
    ) -> asyncio.Future[None]:
        self.sent.append(value)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def stop(self) -> None:
        return


class _Feed:
    """The results topic, in memory: what `put` adds, `getmany` returns once."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.offset = 0

    def put(self, value: bytes | None) -> None:
        self.queue.put_nowait(value)

    async def getmany(self, timeout_ms: int = 0) -> dict[str, list[Any]]:
        try:
            value = await asyncio.wait_for(self.queue.get(), timeout_ms / 1000)
        except TimeoutError:
            return {}
        self.offset += 1
        return {
            "results-0": [SimpleNamespace(topic="r", partition=0, offset=self.offset, value=value)]
        }

    async def stop(self) -> None:
        return


async def offline_client(root: Path | str | None, **options: Any) -> tuple[RolloutClient, _Feed]:
    """A client whose producer and results consumer are in memory; its reader and sweeper run
    as `start()` runs them."""
    client = RolloutClient(bootstrap_servers="unused:9092", payload_root=root, **options)
    feed = _Feed()
    # What `start()` does after connecting, on in-memory clients.
    client._producer = _Sink()
    client._consumer = feed
    client._tasks = [asyncio.create_task(client._read()), asyncio.create_task(client._sweep())]
    for task in client._tasks:
        task.add_done_callback(client._background_stopped)
    return client, feed


def reference(
    uri: str, *, sha256: str = SHA, nbytes: int | None = None, **fields: Any
) -> RoutedExperts:
    values: dict[str, Any] = {
        "data": b"",
        "shape": [2, 3, 4],
        "dtype": "uint8",
        "start": 1,
        "uri": uri,
        "sha256": sha256,
        "nbytes": len(INLINE.data) if nbytes is None else nbytes,
    }
    values.update(fields)
    return msgspec.convert(values, RoutedExperts, builtin_types=(bytes,))


def answer(job_id: str, routed: RoutedExperts | None = None, **fields: Any) -> bytes:
    c = Completion(index=0, token_ids=[1, 2], text="", finish_reason="stop", routed_experts=routed)
    return encode(Completed(job_id=job_id, completions=[c], prompt_token_count=1, **fields))


def echo(client: RolloutClient, job_id: str) -> str:
    """The submission of `job_id`'s sending in flight, which a worker's answer echoes."""
    return client._inflight.pending[job_id].submission


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "store"
    root.mkdir()
    (root / "good.bin").write_bytes(INLINE.data)
    yield root


async def outcome(future: asyncio.Future[Any]) -> Any:
    """The result, or the RolloutError, a job's future came to (a hang fails the test)."""
    try:
        return await asyncio.wait_for(future, 20)
    except RolloutError as exc:
        return exc


async def test_a_forged_payload_fails_its_job_and_the_reader_goes_on(store: Path) -> None:
    forged = np.arange(24, dtype=np.uint8).tobytes()
    (store / "forged.bin").write_bytes(forged)
    digest = hashlib.sha256(forged).hexdigest()  # the bytes match their sha256 ...
    client, feed = await offline_client(store)
    try:
        victim, good = client.submit(job("victim")), client.submit(job("good"))
        # ... but not their shape: 24 bytes named as [4, 3, 4] of uint16.
        ref = reference(
            (store / "forged.bin").as_uri(), sha256=digest, shape=[4, 3, 4], dtype="uint16"
        )
        feed.put(answer("victim", ref, submission_id=echo(client, "victim")))
        feed.put(
            answer(
                "good",
                reference((store / "good.bin").as_uri()),
                submission_id=echo(client, "good"),
            )
        )
        failed, whole = await outcome(victim), await outcome(good)
    finally:
        await client.close()
    assert isinstance(failed, RolloutError) and "job victim" in str(failed)
    assert "shape [4, 3, 4] of uint16 needs 96" in str(failed)
    assert isinstance(whole, Completed)
    routed = whole.completions[0].routed_experts
    assert routed is not None and not routed.is_reference
    np.testing.assert_array_equal(routed.to_array(), ROWS)


def job(job_id: str) -> dict[str, Any]:
    return {"job_id": job_id, "prompt": "hi", "sampling": {"max_tokens": 2}}


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("outside", "is outside the payload root"),
        ("symlink-out", "is outside the payload root"),
        ("fifo", "is not a regular file"),
        ("missing", "is missing"),
        ("wrong-size", "was altered: its size is not the record's 24"),
        ("wrong-sha", "was altered: its sha256 is not the record's"),
        ("relative", "the path must be absolute"),
        ("host", "must name a local path, not a host"),
        ("scheme", "only file:// references can be read here"),
        ("nul", "holds a NUL byte"),
    ],
)
async def test_each_hostile_reference_fails_its_job_clearly_without_reading(
    store: Path, tmp_path: Path, where: str, expected: str
) -> None:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"s" * 24)  # the record's nbytes, and a digest the record does not know
    (store / "link.bin").symlink_to(secret)
    os.mkfifo(store / "pipe.bin")
    (store / "big.bin").write_bytes(b"b" * 12345)
    uri = {
        "outside": secret.as_uri(),
        "symlink-out": (store / "link.bin").as_uri(),
        "fifo": (store / "pipe.bin").as_uri(),
        "missing": (store / "gone.bin").as_uri(),
        "wrong-size": (store / "big.bin").as_uri(),
        "wrong-sha": (store / "good.bin").as_uri(),
        "relative": "file:relative/x.bin",
        "host": "file://evil.example/x.bin",
        "scheme": "http://evil.example/x.bin",
        "nul": (store / "good.bin").as_uri() + "%00.txt",
    }[where]
    sha = "0" * 64 if where == "wrong-sha" else SHA
    client, feed = await offline_client(store)
    try:
        futures = [client.submit(job("hostile")), client.submit(job("good"))]
        feed.put(
            answer("hostile", reference(uri, sha256=sha), submission_id=echo(client, "hostile"))
        )
        feed.put(answer("good", submission_id=echo(client, "good")))
        failed, good = [await outcome(f) for f in futures]
    finally:
        await client.close()
    assert isinstance(failed, RolloutError), failed
    assert expected in str(failed)
    # Nothing about the file found: not its size, not its digest.
    for fact in (
        "12345",
        hashlib.sha256(b"s" * 24).hexdigest(),
        hashlib.sha256(b"b" * 12345).hexdigest(),
    ):
        assert fact not in str(failed)
    assert isinstance(good, Completed)


async def test_a_device_under_the_root_is_not_read(tmp_path: Path) -> None:
    """`/dev/zero` would be read for ever; with the root at /dev it is refused as not a
    regular file (and a huge nbytes in the record changes nothing)."""
    tracemalloc.start()
    try:
        with pytest.raises(PayloadError, match="is not a regular file"):
            read_payload("file:///dev/zero", SHA, 1 << 40, root=payload_root("/dev"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


async def test_references_without_a_payload_root_are_refused(store: Path) -> None:
    client, feed = await offline_client(None)
    try:
        future = client.submit(job("ref"))
        feed.put(
            answer(
                "ref",
                reference((store / "good.bin").as_uri()),
                submission_id=echo(client, "ref"),
            )
        )
        failed = await outcome(future)
    finally:
        await client.close()
    assert isinstance(failed, RolloutError) and "no payload_root" in str(failed)


def test_a_bad_payload_root_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="must be absolute"):
        RolloutClient(bootstrap_servers="x:1", payload_root="relative/dir")
    with pytest.raises(ValueError, match="not a host"):
        RolloutClient(bootstrap_servers="x:1", payload_root="file://host/dir")


# ---- fuzzing -------------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=30,
)
_URIS = st.sampled_from(
    [
        "STORE/good.bin",
        "STORE/pipe.bin",
        "STORE/gone.bin",
        "STORE/../outside.bin",
        "file:///dev/zero",
        "file:///etc/passwd",
        "file:relative",
        "file://host/x",
        "s3://bucket/key",
        "STORE/good.bin%00",
        "",
    ]
)


@st.composite
def _references(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "data": "",
        "shape": draw(st.lists(st.integers(-2, 1 << 40), min_size=0, max_size=4)),
        "dtype": draw(
            st.sampled_from(["uint8", "uint16", "int64", "float32", "object", "<U4", ""])
        ),
        "start": draw(st.integers(-1, 10)),
        "uri": draw(_URIS),
        "sha256": draw(st.sampled_from([SHA, "0" * 64, "zz", ""])),
        "nbytes": draw(st.sampled_from([24, 0, -1, 1 << 40, 2**70])),
    }


@st.composite
def _results(draw: st.DrawFn) -> dict[str, Any]:
    completion: dict[str, Any] = {
        "index": draw(st.integers(-1, 3)),
        "token_ids": draw(st.lists(st.integers(-1, 2**40), max_size=3)),
        "text": "",
        "finish_reason": draw(st.sampled_from(["stop", "length", "nope"])),
    }
    if draw(st.booleans()):
        completion["routed_experts"] = draw(_references())
    result: dict[str, Any] = {
        "type": draw(st.sampled_from(["completed", "failed", "other"])),
        "job_id": draw(st.sampled_from(["victim", "stranger", "", None])),
        "completions": [completion],
        "prompt_token_count": draw(st.integers(-1, 5)),
    }
    if draw(st.booleans()):
        result["part"] = {
            "index": draw(st.integers(-1, 3)),
            "count": draw(st.integers(0, 3)),
            "attempt": draw(st.sampled_from(["a", "b", ""])),
        }
    if result["type"] == "failed":
        result["error"] = {"code": draw(st.sampled_from(["expired", "bogus"])), "detail": "x"}
    if draw(st.booleans()):
        result[draw(st.text(max_size=8))] = draw(_json)
    return result


def _hostile_values(store: Path) -> st.SearchStrategy[bytes]:
    def as_bytes(value: Any) -> bytes:
        return json.dumps(value).replace("STORE", store.as_uri()).encode()

    return st.one_of(
        st.binary(max_size=300),
        _json.map(as_bytes),
        _results().map(as_bytes),
        st.integers(1, 5000).map(lambda n: b"[" * n),
    )


def test_fuzzed_results_fail_at_most_their_own_job_and_every_good_one_is_answered(
    store: Path,
) -> None:
    os.mkfifo(store / "pipe.bin")
    (store.parent / "outside.bin").write_bytes(INLINE.data)
    with asyncio.Runner() as runner:
        client, feed = runner.run(offline_client(store, timeout_s=60))
        count = 0

        @settings(
            max_examples=examples(1.5),
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(st.lists(_hostile_values(store), min_size=1, max_size=4))
        def check(values: list[bytes]) -> None:
            nonlocal count
            count += 1

            async def one_round() -> None:
                good = client.submit(job(f"good-{count}"))
                victim = client.submit(job("victim"))
                tracemalloc.start()
                try:
                    for value in values:
                        feed.put(value)
                    feed.put(answer(f"good-{count}", submission_id=echo(client, f"good-{count}")))
                    whole = await outcome(good)
                    _, peak = tracemalloc.get_traced_memory()
                finally:
                    tracemalloc.stop()
                # Memory follows the records, not what they claim (nbytes up to 2**70).
                assert peak < 200 * sum(map(len, values)) + (4 << 20), peak
                assert isinstance(whole, Completed), whole
                # The victim got an answer from a hostile record, or is still waiting.
                if victim.done():
                    got = victim.exception() or victim.result()
                    assert isinstance(got, (RolloutError, Completed, Failed)), got
                else:
                    victim.cancel()
                client._inflight.pending.pop("victim", None)
                assert client._stopped is None

            runner.run(one_round())

        try:
            check()
        finally:
            runner.run(client.close())


def test_fuzzed_references_raise_only_schema_errors(store: Path) -> None:
    os.mkfifo(store / "pipe.bin")
    root = payload_root(store)

    @settings(max_examples=examples(3))
    @given(_references())
    def check(fields: dict[str, Any]) -> None:
        fields["uri"] = fields["uri"].replace("STORE", store.as_uri())
        try:
            routed = msgspec.convert(fields, RoutedExperts, builtin_types=(bytes,))
        except msgspec.ValidationError:
            return
        try:
            inline = routed.resolved(root)
        except (PayloadError, RoutedExpertsError):
            return
        assert inline.to_array().nbytes == len(inline.data)

    check()


def test_the_results_command_reads_a_hostile_stream_and_counts_every_good_record(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.mkfifo(store / "pipe.bin")
    writer = ReplayWriter("slime", store.parent / "run.npz", None, store.as_uri())
    report = _ResultsReport(quiet=True, raw=False, sink=None, replay=writer)
    goods = 0

    @settings(max_examples=examples(2), suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(_hostile_values(store))
    def check(value: bytes) -> None:
        nonlocal goods
        good = answer(f"good-{goods}", reference((store / "good.bin").as_uri(), start=0))
        for v in (value, good):
            report.take(SimpleNamespace(topic="r", partition=0, offset=0, value=v))
        goods += 1

    check()
    assert report.counts["completed"] >= goods
    capsys.readouterr()
    assert report.finish() in (0, 1)
    with np.load(store.parent / "run.npz") as arrays:
        assert {f"good-{i}/0" for i in range(goods)} <= set(arrays.files)


def test_the_results_command_refuses_a_reference_outside_its_store(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(INLINE.data)
    writer = ReplayWriter("slime", tmp_path / "run.npz", None, store.as_uri())
    unconfined = ReplayWriter("slime", tmp_path / "other.npz", None, None)
    for w in (writer, unconfined):
        for job_id, uri in (("in", (store / "good.bin").as_uri()), ("out", outside.as_uri())):
            parsed = msgspec.json.decode(answer(job_id, reference(uri, start=0)), type=Completed)
            w.add(parsed)
    assert writer.finish() == 1
    err = capsys.readouterr().err
    assert "out/0: not replayable as slime: payload" in err and "is outside the payload root" in err
    assert unconfined.finish() == 2
    assert "pass --payload-store" in capsys.readouterr().err


def test_a_part_that_disagrees_with_its_attempt_is_skipped_not_fatal() -> None:
    async def run() -> Any:
        client, feed = await offline_client(None)
        try:
            future = client.submit(job("split"))
            for index, count in ((0, 2), (1, 3), (1, 2)):
                feed.put(
                    answer(
                        "split",
                        part=Part(index=index, count=count, attempt="a"),
                        submission_id=echo(client, "split"),
                    )
                )
            return await outcome(future)
        finally:
            await client.close()

    whole = asyncio.run(run())
    assert isinstance(whole, Completed) and len(whole.completions) == 2
