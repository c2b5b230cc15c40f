"""``thinkgate serve`` and ``thinkgate config show`` as a user runs them: real processes, real config files."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from tests.fixtures.upstream import wait_for, wait_http_ok

REPO = Path(__file__).resolve().parents[2]


def thinkgate(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def write_config(path: Path, sim_base: str, redis_url: str, **extra: Any) -> Path:
    cfg = {
        "engine": {"enabled": False},
        "redis": {"url": redis_url, "start_if_missing": False},
        "tiers": [
            {"name": "short", "base_url": sim_base, "model": "sim-model", "thinking_budget": 8, "max_tokens": 64,
             "api_key": "upstream-secret"},
            {"name": "long", "base_url": sim_base, "model": "sim-model"},
        ],
        "routing": {"router_path": None, "effort_tiers": {"low": "short", "high": "long"}},
        **extra,
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_config_show_prints_effective_yaml(tmp_path: Path, redis_url: str) -> None:
    cfg = write_config(tmp_path / "c.yaml", "http://127.0.0.1:9/v1", redis_url)
    r = thinkgate("config", "show", "--config", str(cfg), env={"THINKGATE_SERVER__PORT": "9123"})
    assert r.returncode == 0, r.stderr
    shown = yaml.safe_load(r.stdout)
    assert [t["name"] for t in shown["tiers"]] == ["short", "long"]
    assert shown["server"]["port"] == 9123  # environment override applied
    assert shown["tiers"][0]["api_key"] == "***" and "upstream-secret" not in r.stdout
    assert shown["tiers"][0]["prices"]["output_usd_per_mtok"] == "0"
    # the other secrets a config carries are not printed either (a security review found them in the output)
    r = thinkgate("config", "show", "--config", str(cfg), env={
        "THINKGATE_REDIS__URL": "redis://:REDISPASS@127.0.0.1:6399/0",
        "THINKGATE_LIMITS__ALERT_WEBHOOK_URL": "https://hooks.example/services/T0/B0/WEBHOOKSECRET",
        "THINKGATE_TELEMETRY__HEADERS": '{"authorization": "Bearer OTLPSECRET"}'})
    assert r.returncode == 0, r.stderr
    assert "REDISPASS" not in r.stdout and "WEBHOOKSECRET" not in r.stdout and "OTLPSECRET" not in r.stdout
    shown = yaml.safe_load(r.stdout)
    assert shown["redis"]["url"].startswith("redis://:***@127.0.0.1:6399")
    assert shown["telemetry"]["headers"] == {"authorization": "***"}


def test_config_show_model_dir_shows_what_serve_runs(tmp_path: Path) -> None:
    # `make serve` is `thinkgate serve --model-dir models/thinkgate-tiny-dial`: config show takes the same option, with
    # the same meaning (the dial model's name, its tiers as prompted budgets, its router)
    dial = REPO / "models" / "thinkgate-tiny-dial"
    r = thinkgate("config", "show", "--model-dir", str(dial), env={"THINKGATE_CONFIG": ""})
    assert r.returncode == 0, r.stderr
    shown = yaml.safe_load(r.stdout)
    assert shown["engine"]["model_path"] == str(dial.resolve())
    assert shown["engine"]["served_model_name"] == "thinkgate-tiny-dial"
    tiers = {t["name"]: t for t in shown["tiers"]}
    assert {n: (t["budget_mode"], t["thinking_budget"], t["model"]) for n, t in tiers.items()} == {
        "none": ("off", 0, "thinkgate-tiny-dial"), "short": ("prompted", 32, "thinkgate-tiny-dial"),
        "long": ("prompted", None, "thinkgate-tiny-dial")}
    assert shown["routing"]["router_path"] == str((dial / "router.skops").resolve())
    # without it: the embedded defaults (plain `thinkgate serve`)
    plain = yaml.safe_load(thinkgate("config", "show", env={"THINKGATE_CONFIG": ""}).stdout)
    assert {t["name"]: t["thinking_budget"] for t in plain["tiers"]} == {"none": 0, "short": 32, "long": 320}
    assert plain["engine"]["served_model_name"] == "thinkgate-tiny"
    # not a model directory: exit 2 and one line, as serve
    r = thinkgate("config", "show", "--model-dir", str(tmp_path))
    assert r.returncode == 2 and "not a model directory" in r.stderr and "Traceback" not in r.stderr


def test_invalid_config_exits_2_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"tiers": [{"name": "short", "max_tokens": -5}], "server": {"port": "x"}}))
    for args in (["config", "show"], ["serve"]):
        r = thinkgate(*args, "--config", str(bad))
        assert r.returncode == 2, r.stderr
        assert "tiers.0.max_tokens" in r.stderr and "server.port" in r.stderr
        assert "Traceback" not in r.stderr
    r = thinkgate("serve", "--config", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "config file not found" in r.stderr


def test_serve_creates_dev_key_and_answers(tmp_path: Path, upstream_sim: Any, redis_url: str,
        port_lease: Callable[[], int]) -> None:
    key_file = tmp_path / "state" / "dev-key"
    cfg = write_config(tmp_path / "c.yaml", upstream_sim.base_url, redis_url,
                       auth={"dev_key_file": str(key_file)}, redis={"url": redis_url, "start_if_missing": True})
    port = port_lease()
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(cfg), "--port", str(port)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=30, proc=proc)
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        secret = key_file.read_text().strip()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=secret, max_retries=0, timeout=10)
        c = client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "hello"}])
        assert c.choices[0].message.content == "echo: hello"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="nope", max_retries=0).models.list()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        log.seek(0)
        output = log.read()
        log.close()
    assert f"cat {key_file}" in output
    # the config's tiers have no prices: every token is metered at $0, and serve says so at start
    assert "warning: no prices on tier(s) short, long" in output
    # the test Redis was already answering: serve says it uses that one, and that it may be shared
    assert f"Redis: using the server already answering at {redis_url} (key prefix 'tg:'" in output


def test_only_tiers_without_prices_are_named() -> None:
    from gateway.config import Prices, TierConfig, unpriced_tiers

    tiers = [TierConfig(name="free", base_url="http://a/v1"),
             TierConfig(name="paid", base_url="http://b/v1", prices=Prices(output_usd_per_mtok="0.6")),
             TierConfig(name="cached-only", base_url="http://c/v1", prices=Prices(cached_input_usd_per_mtok="0.1"))]
    assert unpriced_tiers(tiers) == ["free"]


def test_sigterm_stops_what_serve_started(tmp_path: Path, upstream_sim: Any, port_lease: Callable[[], int]) -> None:
    """SIGTERM ends ``serve`` through its clean-up: the private redis-server it started (as it would the local
    engine) is stopped too, not orphaned."""
    from gateway.engine.redis_server import ping

    redis_url = f"redis://127.0.0.1:{port_lease()}/0"
    cfg = write_config(tmp_path / "c.yaml", upstream_sim.base_url, redis_url,
                       redis={"url": redis_url, "start_if_missing": True, "data_dir": str(tmp_path / "redis")},
                       auth={"dev_key_file": str(tmp_path / "dev-key")})
    port = port_lease()
    log = (tmp_path / "serve.log").open("w+")
    # without the suite's REDIS_URL: it would override the config's redis.url (its documented alias)
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(cfg), "--port", str(port)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=30, proc=proc)
        assert ping(redis_url), "serve started a private Redis"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        log.seek(0)
        output = log.read()
        log.close()
    assert f"Redis: started a private redis-server at {redis_url}" in output
    assert proc.returncode == 128 + signal.SIGTERM
    assert wait_for(lambda: not ping(redis_url), timeout_s=10), "the private Redis outlived serve"


def _private_redis_serve(tmp_path: Path, upstream_sim: Any,
        port_lease: Callable[[], int]) -> tuple[str, Path, int, Path, dict[str, str]]:
    """(Redis URL, config, gateway port, log, CLI environment) of a ``serve`` that starts its own persisted Redis
    on a free port, as ``make serve`` does (data under ``tmp_path/redis``)."""
    redis_url = f"redis://127.0.0.1:{port_lease()}/0"
    cfg = write_config(tmp_path / "c.yaml", upstream_sim.base_url, redis_url,
                       redis={"url": redis_url, "start_if_missing": True, "data_dir": str(tmp_path / "redis")},
                       auth={"dev_key_file": str(tmp_path / "dev-key")})
    cli_env = {"THINKGATE_CONFIG": str(cfg), "THINKGATE_REDIS__URL": redis_url,
               "THINKGATE_REDIS__START_IF_MISSING": "false"}
    return redis_url, cfg, port_lease(), tmp_path / "serve.log", cli_env


def _serve_in_own_group(cfg: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """``thinkgate serve`` as a terminal runs a foreground job: the leader of a process group of its own, the group
    a Ctrl-C is sent to (without the suite's REDIS_URL: it would override the config's redis.url)."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    return subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(cfg), "--port", str(port)],
                            cwd=REPO, stdout=log.open("a"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _ctrl_c_timeline(proc: subprocess.Popen[bytes], redis_url: str, log: Path) -> list[str]:
    """Send SIGINT to ``proc``'s whole process group, as a terminal's Ctrl-C does, and wait for it to exit;
    the log lines that were written when the private Redis was first seen not answering (empty: it answered until
    the gateway had exited)."""
    from gateway.engine.redis_server import ping

    os.killpg(proc.pid, signal.SIGINT)
    seen_when_down: list[str] | None = None
    deadline = time.monotonic() + 30
    while proc.poll() is None:
        assert time.monotonic() < deadline, "serve did not stop on Ctrl-C"
        # ping first, then read the log: a line in the log read after a failed ping was written before that ping.
        # A stopped Redis refuses the connection at once; a 0.2 s bound also read a live one on a loaded box as gone
        if seen_when_down is None and not ping(redis_url, timeout_s=5.0):
            seen_when_down = log.read_text(errors="replace").splitlines()
        time.sleep(0.02)
    return seen_when_down or []


def test_ctrl_c_stops_the_private_redis_after_the_gateway_and_a_restart_finds_its_data(
        tmp_path: Path, upstream_sim: Any, port_lease: Callable[[], int]) -> None:
    """``make serve``'s private Redis persists (keys, usage) under ``redis.data_dir``, and a terminal's Ctrl-C
    reaches the gateway only: the Redis, in a session of its own, is stopped by the gateway once its shutdown is
    done — it got the SIGINT too and went first, so the shutdown logged "redis unreachable, breaker open" and a
    restart found no key (a fresh server: the old key answered 401)."""
    import redis

    redis_url, cfg, port, log, cli_env = _private_redis_serve(tmp_path, upstream_sim, port_lease)
    proc = _serve_in_own_group(cfg, port, log)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=30, proc=proc)
        client = redis.Redis.from_url(redis_url)
        redis_pid = int(client.info("server")["process_id"])
        client.close()
        made = thinkgate("keys", "create", "--id", "kept", env=cli_env)
        assert made.returncode == 0, made.stderr
        chat = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=made.stdout.strip(), max_retries=0,
                             timeout=10).chat.completions.create(model="long", messages=[{"role": "user",
                                                                                           "content": "hi"}])
        assert chat.choices[0].message.content == "echo: hi"
        assert os.getpgid(redis_pid) != os.getpgid(proc.pid), "the private Redis shares the terminal's process group"
        before_redis_went = _ctrl_c_timeline(proc, redis_url, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    output = log.read_text(errors="replace")
    assert "redis unreachable" not in output, output
    assert "Application shutdown complete" in output, output
    assert not before_redis_went or any("Application shutdown complete" in line for line in before_redis_went), (
        "the private Redis stopped answering before the gateway's shutdown was complete:\n"
        + "\n".join(before_redis_went))
    assert not Path(f"/proc/{redis_pid}").exists(), "the private Redis outlived serve"
    assert list((tmp_path / "redis").glob("*/appendonlydir/*.aof")), "no append-only file under redis.data_dir"

    # `make serve` again on the same port: a fresh private Redis that loads the same data
    proc = _serve_in_own_group(cfg, port, log)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=30, proc=proc)
        assert output.count("started a private redis-server") == 1
        keys = thinkgate("keys", "list", "--json", env=cli_env)
        assert keys.returncode == 0 and '"id":"kept"' in keys.stdout.replace(" ", ""), keys.stdout + keys.stderr
        usage = thinkgate("usage", "export", "--format", "jsonl", "--output", "-", env=cli_env)
        rows = [json.loads(line) for line in usage.stdout.splitlines() if line.strip()]
        assert [r["key_id"] for r in rows] == ["kept"], usage.stdout + usage.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    assert log.read_text(errors="replace").count("started a private redis-server") == 2


@pytest.mark.parametrize("argv", [["keys", "list"], ["usage", "export", "--format", "jsonl", "--output", "-"],
                                  ["budgets", "list"]])
def test_offline_commands_exit_3_when_redis_is_unreachable(argv: list[str], monkeypatch: pytest.MonkeyPatch,
        port_lease: Callable[[], int]) -> None:
    """``keys``, ``usage`` and ``budgets`` talk to Redis directly (gateway/cli_common.run_on_redis): a refused
    connection is a one-line error and exit code 3, not a traceback — ``budgets list`` printed an empty table and
    exited 0 ("no budgets set") — and the URL's password is not printed."""
    from typer.testing import CliRunner

    from gateway.cli.main import app

    monkeypatch.setenv("THINKGATE_REDIS__URL", f"redis://user:s3cretpw@127.0.0.1:{port_lease()}/0")
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 3, r.output
    assert "Redis unreachable" in r.output and "s3cretpw" not in r.output and "***" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_a_killed_serve_takes_its_private_redis_down_with_its_data_on_disk(tmp_path: Path, upstream_sim: Any,
                                                                           port_lease: Callable[[], int]) -> None:
    """``serve`` SIGKILLed (the OOM killer, ``kill -9``) runs no ``finally``: its private Redis, in a session of its
    own, used to live on as an orphan, serving a port no gateway owned (the local engine likewise held its port,
    and the next ``make serve`` refused to start). The kernel now sends it SIGTERM (PR_SET_PDEATHSIG), a graceful
    stop that flushes the append-only file: the key made before the kill is on disk."""
    import redis

    redis_url, cfg, port, log, cli_env = _private_redis_serve(tmp_path, upstream_sim, port_lease)
    proc = _serve_in_own_group(cfg, port, log)
    redis_pid = None
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=30, proc=proc)
        client = redis.Redis.from_url(redis_url)
        redis_pid = int(client.info("server")["process_id"])
        client.close()
        made = thinkgate("keys", "create", "--id", "kept-after-kill", env=cli_env)
        assert made.returncode == 0, made.stderr
        proc.kill()  # the gateway process alone, as the OOM killer does: no signal reaches its Redis's session
        proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while Path(f"/proc/{redis_pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{redis_pid}").exists(), "the private Redis outlived a SIGKILLed serve"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        if redis_pid is not None and Path(f"/proc/{redis_pid}").exists():
            os.kill(redis_pid, signal.SIGKILL)
    aof = b"".join(p.read_bytes() for p in (tmp_path / "redis").glob("*/appendonlydir/*.aof"))
    assert b"kept-after-kill" in aof, "the key made before the kill is not in the append-only file"


def test_an_offline_command_prints_only_its_own_message_when_redis_is_unreachable(
        port_lease: Callable[[], int]) -> None:
    """As a user runs it (a process with no logging set up): the breaker's WARNING ("redis unreachable, breaker open
    for 1.0 s: …", the server's log line) was printed bare before the command's own message. In-process (above)
    pytest's log capture hides that line, so this runs the real command."""
    r = thinkgate("keys", "list", env={"THINKGATE_CONFIG": "",
                                       "THINKGATE_REDIS__URL": f"redis://127.0.0.1:{port_lease()}/0"})
    assert r.returncode == 3, r.stdout + r.stderr
    assert r.stdout == "" and r.stderr.startswith("thinkgate: Redis unreachable at redis://127.0.0.1:"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_an_unreachable_redis_says_what_to_do(port_lease: Callable[[], int], tmp_path: Path) -> None:
    """``make serve`` stopped (its private Redis with it), then ``thinkgate usage report`` as the README runs it: the
    one line said only "Connect call failed". It says that this Redis is the gateway's private one — its data
    folder is on disk — and runs only with it; a URL with no such folder asks whether the command gets the gateway's
    settings."""
    port = port_lease()
    env = {"THINKGATE_CONFIG": "", "THINKGATE_REDIS__URL": f"redis://127.0.0.1:{port}/0",
           "THINKGATE_REDIS__DATA_DIR": str(tmp_path / "redis")}
    (tmp_path / "redis" / str(port)).mkdir(parents=True)  # what the private server of an earlier serve left
    r = thinkgate("usage", "report", env=env)
    assert r.returncode == 3 and r.stdout == "", r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Connect call failed" in r.stderr and f"its data in {tmp_path / 'redis' / str(port)}" in r.stderr
    assert "runs only while the gateway does" in r.stderr, r.stderr
    r = thinkgate("keys", "list", env={**env, "THINKGATE_REDIS__DATA_DIR": str(tmp_path / "elsewhere")})
    assert r.returncode == 3 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "same --config / REDIS_URL" in r.stderr, r.stderr
