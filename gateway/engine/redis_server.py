"""Make sure a Redis server answers: use the configured one, or start a private ``redis-server``.

Used by ``thinkgate serve`` (when ``redis.start_if_missing``) and by the test suite. A private server listens on
loopback only. The one ``serve`` starts keeps its data in an append-only file under ``redis.data_dir`` (fsync'd
every second), so keys, budgets and usage survive a restart on the same port, and runs in its own session, so a
terminal's Ctrl-C reaches the gateway only (which stops it after its own shutdown has flushed); a gateway killed
outright takes it down too (SIGTERM from the kernel, :mod:`gateway.engine.children`). The tests' servers
keep nothing on disk (``--save "" --appendonly no``) and share the caller's process group.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

from gateway.engine.children import popen_options
from router.errors import ThinkGateError


class RedisUnavailable(ThinkGateError, RuntimeError):
    """No Redis answers at the URL and none could be started (``redis-server`` missing or failed)."""


def _managed(url: str) -> bool:
    """A Redis Cluster or Sentinel URL (``redis+cluster://``, ``redis+sentinel://``, their ``rediss+`` forms)."""
    return "+" in urlparse(url).scheme


def ping(url: str, timeout_s: float = 0.5) -> bool:
    """True when a Redis server answers PING at ``url`` within ``timeout_s`` seconds (any URL form of
    ``gateway/state/redis.py``: for Cluster every primary answers, for Sentinel the master it names).

    Call it from synchronous code: a Cluster or Sentinel URL is checked with the gateway's own asyncio client
    factory in a short-lived event loop.
    """
    import redis

    if _managed(url):
        import asyncio

        from gateway.config import RedisConfig
        from gateway.state.redis import ping as ping_async

        try:
            cfg = RedisConfig(url=url, socket_timeout_s=timeout_s, start_if_missing=False)
        except ValueError:
            return False
        return asyncio.run(ping_async(cfg))
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return False


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (racy by nature; bind soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_dir(data_dir: Path, port: int) -> Path:
    """Where the private server on ``port`` keeps its files: ``data_dir/<port>``, absolute (redis-server chdirs
    into ``--dir``). One folder per port: two servers sharing an append-only file would corrupt it, and a restart on
    the same port is what finds the data again."""
    return Path(data_dir).resolve() / str(port)


def persistence_args(data_dir: Path | None, port: int) -> list[str]:
    """The ``redis-server`` arguments of what it keeps on disk: nothing when ``data_dir`` is None; else an
    append-only file fsync'd every second in :func:`port_dir` (created, mode 0700: it holds key hashes and usage).
    No RDB snapshots either way: the append-only file is the record.
    """
    if data_dir is None:
        return ["--save", "", "--appendonly", "no"]
    where = port_dir(data_dir, port)
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    return ["--save", "", "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(where)]


#: how long a private server that loads a persisted append-only file may take to answer, s: Redis answers
#: ``LOADING`` (no PING) until the file is read — about a second per few hundred MB here; a server without a file
#: answers within 10 s
LOAD_TIMEOUT_S = 120.0


def start_private(port: int | None = None, timeout_s: float | None = None, *, data_dir: Path | None = None,
                  own_session: bool = False) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``redis-server`` on 127.0.0.1:``port`` (a free one if None); return (process, url).

    ``data_dir``: persist there (:func:`persistence_args`); None keeps nothing on disk (the tests' servers).
    ``own_session``: start it in a session and process group of its own, so a signal sent to the caller's
    process group (a terminal's Ctrl-C) does not stop it before the caller has finished with it. ``timeout_s``:
    how long to wait for it to answer (default 10 s, :data:`LOAD_TIMEOUT_S` with a ``data_dir``: it reads its file
    before it answers).
    Raises :class:`RedisUnavailable` if the binary is missing or the server does not answer in time.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise RedisUnavailable("redis-server not found on PATH (Debian/Ubuntu: apt-get install redis-server)")
    port = port or free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", *persistence_args(data_dir, port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=own_session,
        **popen_options(),  # stops with its caller even when that is SIGKILLed (gateway/engine/children.py)
    )
    url = f"redis://127.0.0.1:{port}/0"
    if timeout_s is None:
        timeout_s = 10.0 if data_dir is None else LOAD_TIMEOUT_S
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ping(url):
            return proc, url
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.terminate()
    raise RedisUnavailable(f"redis-server did not answer on port {port} within {timeout_s} s")


def ensure(url: str, start_if_missing: bool = True, *, data_dir: Path | None = None,
           own_session: bool = False) -> tuple[subprocess.Popen[bytes] | None, str]:
    """Return (process or None, url of an answering Redis).

    If ``url`` answers it is used as is. Otherwise, when ``start_if_missing`` and the URL is a single server on
    loopback, a private server is started on that URL's port (``data_dir`` and ``own_session`` as
    :func:`start_private`: ``serve`` gives both, the tests and benches neither). A Cluster or Sentinel URL that does
    not answer is never replaced by a private single server (that would split the state). Raises
    :class:`RedisUnavailable` otherwise.
    """
    if ping(url):
        return None, url
    parsed = urlparse(url)
    if _managed(url):
        raise RedisUnavailable(f"no Redis {parsed.scheme.split('+')[1].title()} answers at {url}")
    if not start_if_missing or parsed.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise RedisUnavailable(f"no Redis answers at {url}")
    proc, started = start_private(parsed.port or 6379, data_dir=data_dir, own_session=own_session)
    db = parsed.path.lstrip("/") or "0"
    return proc, started.rsplit("/", 1)[0] + f"/{db}"
