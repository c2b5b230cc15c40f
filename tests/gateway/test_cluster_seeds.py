"""Redis Cluster seeds on a real 3 + 3 cluster of this test's own (nodes are killed here): a dead seed is not a
dead cluster — ``/ready`` reads the cluster through the nodes the running client has found, and a URL may list
several seeds — and a malformed Redis URL is a configuration error at load, not a traceback at the first command.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from gateway.config import RedisConfig
from tests.fixtures.redis_cluster import ClusterSet, cluster_set
from tests.fixtures.upstream import TEST_KEY, GatewayServer, SimProcess, sim_settings


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterSet]:
    with cluster_set(tmp_path_factory.mktemp("seeds")) as c:
        yield c


def _redis(url: str) -> dict[str, object]:
    return {"url": url, "start_if_missing": False, "key_prefix": "tgseeds:"}


def test_a_dead_seed_is_not_a_dead_cluster(cluster: ClusterSet, upstream_sim: SimProcess) -> None:
    """The URL's only seed (a replica here: the cluster serves every slot without it) dies: ``/ready`` still
    reads Redis as up — under ``fail_closed`` it said ``redis: false`` and 503, taking every replica out."""
    replica = next(p for p in cluster.live_ports() if p not in cluster.masters())
    settings = sim_settings(upstream_sim.base_url, "", redis=_redis(f"redis+cluster://127.0.0.1:{replica}"),
                            limits={"on_redis_down": "fail_closed"})
    with GatewayServer(settings) as gw:
        auth = {"authorization": f"Bearer {TEST_KEY}"}
        body = {"model": "short", "max_tokens": 4, "messages": [{"role": "user", "content": "seed"}]}
        assert httpx.post(gw.base_url + "/chat/completions", json=body, headers=auth, timeout=30).status_code == 200
        assert httpx.get(gw.url + "/ready", timeout=10).json()["redis"] is True
        cluster.nodes.kill(replica)
        r = httpx.get(gw.url + "/ready", timeout=10)
        assert r.status_code == 200 and r.json()["redis"] is True, r.text


def test_a_url_may_list_several_seeds(cluster: ClusterSet, upstream_sim: SimProcess,
        port_lease: Callable[[], int]) -> None:
    """``redis+cluster://dead:port,live:port``: the gateway starts and serves on the first seed that answers (a
    comma list was a traceback: "Port could not be cast to integer")."""
    url = f"redis+cluster://127.0.0.1:{port_lease()},127.0.0.1:{cluster.masters()[0]}"
    with GatewayServer(sim_settings(upstream_sim.base_url, "", redis=_redis(url))) as gw:
        body = {"model": "short", "max_tokens": 4, "messages": [{"role": "user", "content": "seeds"}]}
        r = httpx.post(gw.base_url + "/chat/completions", json=body, timeout=30,
                       headers={"authorization": f"Bearer {TEST_KEY}"})
        assert r.status_code == 200, r.text
        ready = httpx.get(gw.url + "/ready", timeout=10)
        assert ready.status_code == 200 and ready.json()["redis"] is True


@pytest.mark.parametrize(("url", "says"), [
    ("redis+cluster://127.0.0.1:abc", "not a number"),
    ("redis+sentinel://127.0.0.1:26379", "service name"),
    ("redis+sentinel://127.0.0.1:xx/mymaster", "not a number"),
    ("rediscluster://127.0.0.1:7000", "unsupported scheme"),
    ("redis://127.0.0.1:7000,127.0.0.1:7001/0", "not a number"),
    ("redis://:s3cret@127.0.0.1:63a79/0", "not a number"),
])
def test_a_malformed_redis_url_is_a_config_error(url: str, says: str, tmp_path: Path) -> None:
    with pytest.raises(ValidationError) as info:
        RedisConfig(url=url)
    assert says in str(info.value)
    assert "s3cret" not in str(info.value).split("input_value=")[0]  # the message never shows the password
    for ok in ("redis://127.0.0.1:6379/0", "unix:///tmp/r.sock", "redis+cluster://a:7000,b:7001",
               "redis+sentinel://a:26379,b:26380/mymaster/1"):
        RedisConfig(url=ok)
