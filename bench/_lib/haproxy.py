"""An HAProxy config for ThinkGate replicas on loopback: round robin over ``GET /ready`` health checks.

Shared by ``bench/replicas.py`` (throughput) and ``tests/fixtures/haproxy.py`` (failover); the test fleet adds
faster checks, retries on connection failures, an ``x-served-by`` header and a stats frontend.
"""

from __future__ import annotations

from pathlib import Path


def write_haproxy_cfg(path: Path, port: int, ports: list[int], *, inter: str = "1s", fall: int = 3,
                      retry_on: str | None = None, served_by_header: bool = False,
                      stats_port: int | None = None) -> Path:
    """Write a config to ``path``: frontend on ``127.0.0.1:port``, servers ``gw0``… on ``127.0.0.1:ports[i]``
    checked every ``inter`` (down after ``fall`` failures, up after 2 passes); ``retry_on``: HAProxy's
    ``retry-on`` list; ``served_by_header``: ``x-served-by: gw<i>`` on every response; ``stats_port``: a stats
    frontend (``/stats``, CSV at ``/stats;csv``). Returns ``path``."""
    servers = "\n".join(f"    server gw{i} 127.0.0.1:{p} check" for i, p in enumerate(ports))
    lines = ["global",
             "    maxconn 4096",
             "defaults",
             "    mode http",
             "    timeout connect 2s",
             "    timeout client 60s",
             "    timeout server 60s",
             # /ready pings Redis and every tier's upstream: on a loaded 2-core box that can take a second (the
             # default check timeout is the interval, and the fleet would flap DOWN under load)
             "    timeout check 3s",
             "    retries 3",
             "    option redispatch 1"]
    if retry_on:
        lines.append(f"    retry-on {retry_on}")
    lines += ["frontend thinkgate",
              f"    bind 127.0.0.1:{port}",
              "    default_backend gateways",
              "backend gateways",
              "    balance roundrobin",
              "    option httpchk GET /ready",
              "    http-check expect status 200",
              f"    default-server inter {inter} fall {fall} rise 2"]
    if served_by_header:
        lines.append("    http-response set-header x-served-by %s")
    lines.append(servers)
    if stats_port is not None:
        lines += ["frontend stats", f"    bind 127.0.0.1:{stats_port}", "    stats enable", "    stats uri /stats"]
    path.write_text("\n".join(lines) + "\n")
    return path
