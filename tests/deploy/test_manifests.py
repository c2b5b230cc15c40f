"""The Kubernetes manifests (``deploy/kustomize``): rendered with ``kubectl kustomize`` (kustomize is built into
kubectl), validated offline against the Kubernetes OpenAPI schemas that the ``kubernetes-validate`` package ships
(strict: unknown fields are errors), checked for what a platform team relies on (probes, non-root read-only pods,
selectors that match, autoscaling), and then tried for real: the rendered container's command, environment,
Secret and ConfigMap run ``thinkgate serve`` on loopback, and its probe and scrape paths answer as the manifests
expect. No cluster is involved (none can be reached here)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench._lib.process import stop_process
from tests.fixtures.gateway import cleanup
from tests.fixtures.upstream import SimProcess

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kustomize"
TARGETS = {"base": KUSTOMIZE / "base", "redis-cluster": KUSTOMIZE / "overlays" / "redis-cluster",
           "redis-sentinel": KUSTOMIZE / "overlays" / "redis-sentinel"}
#: the oldest Kubernetes minor the manifests target (autoscaling/v2, policy/v1, unhealthyPodEvictionPolicy) and
#: the newest schema kubernetes-validate ships
K8S_VERSIONS = ("1.30.0", None)

SCRAPE = "tg-k8s-scrape-0000000000000000"  # Prometheus' key in the served pod's Secret
needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                                   reason="kubectl (which has kustomize built in) is not installed")


def render(target: str) -> list[dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(TARGETS[target])], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, [d["kind"] for d in docs]
    return found[0]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert len(pod["containers"]) == 1
    return pod["containers"][0]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (which has kustomize built in) is not installed")
    return {t: render(t) for t in TARGETS}


@needs_kubectl
@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(
    rendered: dict[str, list[dict[str, Any]]], target: str, version: str | None
) -> None:
    import kubernetes_validate

    v = version or kubernetes_validate.latest_version()
    docs = rendered[target]
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "Deployment", "HorizontalPodAutoscaler",
                                              "PodDisruptionBudget", "Secret", "Service", "ServiceAccount"]
    for doc in docs:
        kubernetes_validate.validate(doc, v, strict=True)  # raises ValidationError naming the field


@needs_kubectl
def test_the_validator_refuses_a_broken_manifest(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The check can fail: a misspelt field and a wrong type are both refused."""
    import kubernetes_validate

    dep = json.loads(json.dumps(one(rendered["base"], "Deployment")))
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/ready"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, kubernetes_validate.latest_version(), strict=True)
    dep = json.loads(json.dumps(one(rendered["base"], "Deployment")))
    dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, kubernetes_validate.latest_version(), strict=True)


@needs_kubectl
def test_probes_security_and_scrape_annotations(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["base"]
    dep = one(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    c = container(docs)
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert int(env["THINKGATE_SERVER__PORT"]) == port and env["THINKGATE_SERVER__HOST"] == "0.0.0.0"
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    # /ready waits up to 2 s per check (gateway/api/ops.py READY_TIMEOUT_S): the probe must wait longer
    from gateway.api.ops import READY_TIMEOUT_S

    assert c["readinessProbe"]["timeoutSeconds"] > READY_TIMEOUT_S

    # non-root (the image's own uid), nothing writable but the two emptyDirs, no privilege, no token
    uid = int(re.search(r"--uid (\d+)", (ROOT / "Dockerfile").read_text()).group(1))  # type: ignore[union-attr]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == uid
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and pod["automountServiceAccountToken"] is False
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in (env["THINKGATE_STATE_DIR"], env["TMPDIR"]):
        assert "emptyDir" in volumes[mounts[path]], path
    config_dir = str(Path(env["THINKGATE_CONFIG"]).parent)
    assert volumes[mounts[config_dir]]["configMap"]["name"] == one(docs, "ConfigMap")["metadata"]["name"]
    assert env["THINKGATE_ENGINE__ENABLED"] == "false" and env["THINKGATE_REDIS__START_IF_MISSING"] == "false"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]

    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == port
    from gateway.api import usage

    assert ann["prometheus.io/path"] == "/metrics" and '"/metrics"' in Path(usage.__file__).read_text()


@needs_kubectl
def test_selectors_autoscaling_and_disruption_budget_fit_together(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["base"]
    dep = one(docs, "Deployment")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert "replicas" not in dep["spec"]  # the HPA owns the count
    svc, pdb, hpa = one(docs, "Service"), one(docs, "PodDisruptionBudget"), one(docs, "HorizontalPodAutoscaler")
    assert svc["spec"]["selector"].items() <= labels.items()
    assert pdb["spec"]["selector"]["matchLabels"] and pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                              "name": dep["metadata"]["name"]}
    assert hpa["spec"]["minReplicas"] >= 2 and pdb["spec"]["maxUnavailable"] < hpa["spec"]["minReplicas"]
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"


@needs_kubectl
def test_overlays_point_redis_at_a_cluster_or_sentinel(rendered: dict[str, list[dict[str, Any]]]) -> None:
    import asyncio

    from gateway.config import RedisConfig
    from gateway.state.redis import connect

    urls = {t: one(d, "Secret")["stringData"]["THINKGATE_REDIS__URL"] for t, d in rendered.items()}
    kinds = {"base": "standalone", "redis-cluster": "cluster", "redis-sentinel": "sentinel"}

    async def kind_of(url: str) -> str:
        handle = connect(RedisConfig(url=url))  # the gateway's own client builder (no I/O until a command)
        try:
            return handle.kind
        finally:
            await handle.close()

    assert {t: asyncio.run(kind_of(u)) for t, u in urls.items()} == kinds
    # the cluster overlay is for a new cluster: each API key's own data in its own slot (docs/deploy.md §3)
    placements = {t: pod_env(d).get("THINKGATE_REDIS__CLUSTER_PLACEMENT") for t, d in rendered.items()}
    assert placements == {"base": None, "redis-cluster": "tenant", "redis-sentinel": None}
    # with replicas, a usage event is let go once a replica has it (a failover loses none)
    acks = {t: pod_env(d).get("THINKGATE_METERING__REPLICA_ACKS") for t, d in rendered.items()}
    assert acks == {"base": None, "redis-cluster": "1", "redis-sentinel": "1"}


def pod_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: ``env`` values, then the Secret's (``envFrom``)."""
    c = container(docs)
    env = {e["name"]: str(e["value"]) for e in c["env"]}
    secret = one(docs, "Secret")
    assert [s["secretRef"]["name"] for s in c["envFrom"]] == [secret["metadata"]["name"]]
    return {**secret["stringData"], **env}


@needs_kubectl
def test_the_configmap_and_secret_load_as_gateway_settings(rendered: dict[str, list[dict[str, Any]]],
                                                           tmp_path: Path) -> None:
    """The mounted config file and the Secret's variables are valid ThinkGate settings (the real loader)."""
    for target, docs in rendered.items():
        cfg = tmp_path / f"{target}.yaml"
        cfg.write_text(one(docs, "ConfigMap")["data"]["thinkgate.yaml"])
        env = {**pod_env(docs), "THINKGATE_CONFIG": str(cfg), "THINKGATE_STATE_DIR": str(tmp_path / "state")}
        code = ("from gateway.config import Settings; import json; s = Settings.load(); "
                "print(json.dumps([s.redis.url, [t.name for t in s.tiers], [k.id for k in s.auth.keys], "
                "s.engine.enabled, str(s.metering.spool_path)]))")
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        url, tiers, keys, engine, spool = json.loads(out.stdout)
        assert url == env["THINKGATE_REDIS__URL"] and tiers == ["short", "long"] and keys == ["team-a"]
        assert engine is False and spool.startswith(str(tmp_path / "state"))


@pytest.fixture()
def served(rendered: dict[str, list[dict[str, Any]]], upstream_sim: SimProcess, redis_url: str,
           tmp_path: Path, port_lease: Callable[[], int]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """``thinkgate serve`` run as the container runs it — its command, its environment and Secret, its mounted
    config — on loopback: the tiers' in-cluster URLs point at the upstream simulator, Redis at the test server
    (a private key prefix), and the Secret holds one key this test knows. Yields (base URL, key, container)."""
    docs = rendered["base"]
    c = container(docs)
    text = re.sub(r"http://vllm-[^\s]+/v1", upstream_sim.base_url, one(docs, "ConfigMap")["data"]["thinkgate.yaml"])
    cfg = tmp_path / "etc" / "thinkgate.yaml"
    cfg.parent.mkdir()
    cfg.write_text(text)
    secret = f"tg-k8s-{uuid.uuid4().hex}"
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    port = port_lease()
    env = {**pod_env(docs),
           "THINKGATE_CONFIG": str(cfg), "THINKGATE_STATE_DIR": str(tmp_path / "state"), "TMPDIR": str(tmp_path),
           "THINKGATE_SERVER__HOST": "127.0.0.1", "THINKGATE_SERVER__PORT": str(port),
           "THINKGATE_REDIS__URL": redis_url, "THINKGATE_REDIS__KEY_PREFIX": prefix,
           "THINKGATE_AUTH__KEYS": json.dumps([{"id": "team-a", "tags": {"team": "a"},
                                                "secret_sha256": hashlib.sha256(secret.encode()).hexdigest()}]),
           "THINKGATE_METRICS__SCRAPE_KEY_SHA256": hashlib.sha256(SCRAPE.encode()).hexdigest()}
    exe = Path(sys.executable).with_name(c["command"][0])
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen([str(exe), *c["command"][1:]], env={**os.environ, **env}, cwd=tmp_path,
                                stdout=sink, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(base + c["livenessProbe"]["httpGet"]["path"], timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield base, secret, c
    finally:
        stop_process(proc, timeout_s=20)
        cleanup(redis_url, prefix)


@needs_kubectl
def test_the_container_serves_its_probes_and_metrics(served: tuple[str, str, dict[str, Any]],
                                                     rendered: dict[str, list[dict[str, Any]]]) -> None:
    base, secret, c = served
    assert httpx.get(base + c["livenessProbe"]["httpGet"]["path"], timeout=5).status_code == 200
    ready = httpx.get(base + c["readinessProbe"]["httpGet"]["path"], timeout=10)
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"status": "ready", "redis": True, "redis_synced": True,
                            "upstreams": {"short": True, "long": True}}
    ann = one(rendered["base"], "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert httpx.get(base + ann["prometheus.io/path"], timeout=5).status_code == 401  # the scrape needs a key
    # the Secret's scrape key reads it; a tenant's key does not (the series name internal upstream hosts)
    assert httpx.get(base + ann["prometheus.io/path"], headers={"authorization": f"Bearer {secret}"},
                     timeout=5).status_code == 403
    m = httpx.get(base + ann["prometheus.io/path"], headers={"authorization": f"Bearer {SCRAPE}"}, timeout=5)
    assert m.status_code == 200 and "# TYPE" in m.text
    r = httpx.post(base + "/v1/chat/completions", headers={"authorization": f"Bearer {secret}"}, timeout=30,
                   json={"model": "auto", "messages": [{"role": "user", "content": "what is two plus two"}]})
    assert r.status_code == 200 and r.headers["x-thinkgate-tier"] in ("short", "long")


POD_PREFIX = "tgpod:"


def _start_pod(tmp_path: Path, name: str, upstream_url: str, redis_url: str, on_redis_down: str,
               port_lease: Callable[[], int], auth: dict[str, Any] | None = None,
               **env_extra: str) -> tuple[subprocess.Popen[bytes], str]:
    """``thinkgate serve`` as the chart runs it (engine off, Redis external), answering ``/health``. ``auth``: the
    config's keys (None: every key in the Redis store, made with ``thinkgate keys create``)."""
    home = tmp_path / name
    home.mkdir()
    cfg = home / "thinkgate.yaml"
    # Redis commands bounded at 2 s, not the product's 0.25 s: on a loaded CI box the first lookup of a key could time
    # out (a 503 before the outage this file tests); an unreachable Redis still fails at once (connection refused)
    cfg.write_text(yaml.safe_dump({"engine": {"enabled": False},
                                   "redis": {"start_if_missing": False, "socket_timeout_s": 2.0},
                                   "limits": {"on_redis_down": on_redis_down}, **({"auth": auth} if auth else {}),
                                   "tiers": [{"name": "short", "base_url": upstream_url},
                                             {"name": "long", "base_url": upstream_url}]}))
    port = port_lease()
    env = {"THINKGATE_CONFIG": str(cfg), "THINKGATE_STATE_DIR": str(home / "state"),
           "THINKGATE_SERVER__HOST": "127.0.0.1", "THINKGATE_SERVER__PORT": str(port),
           "THINKGATE_REDIS__URL": redis_url, "THINKGATE_REDIS__KEY_PREFIX": POD_PREFIX, **env_extra}
    proc = subprocess.Popen([str(Path(sys.executable).with_name("thinkgate")), "serve"], env={**os.environ, **env},
                            cwd=home, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)
    stop_process(proc, timeout_s=20)
    raise AssertionError(f"pod {name} did not answer /health")


UPSTREAMS_OK = {"short": True, "long": True}


@pytest.mark.parametrize("on_redis_down", ["fail_open", "fail_closed"])
def test_ready_with_redis_unreachable_says_what_the_pod_serves(tmp_path: Path, upstream_sim: SimProcess,
                                                                on_redis_down: str,
                                                                port_lease: Callable[[], int]) -> None:
    """The readiness probe's other side, Redis gone. A pod that was serving, ``fail_open`` (the default): it still
    answers requests, so ``/ready`` stays 200 (``degraded``) — Redis is shared by every pod, and a 503 here would
    take them all out of the Service at once. ``fail_closed``: the pod refuses what is under a budget or limit, so
    ``/ready`` is 503. A pod that *starts* during the outage with every key in the Redis store can answer nobody:
    503 in either mode (a rolling update then waits on the warm pods) until Redis answers; one with keys in its
    config serves those (``fail_open``: 200 ``degraded``). Either way ``/health`` (liveness) stays 200, so no pod
    is restarted for an outage it cannot fix."""
    from tests.fixtures.gateway import create_key, keys_config
    from tests.fixtures.redis_stack import persistent_redis

    chat_body = {"model": "short", "messages": [{"role": "user", "content": "two plus two"}]}
    (tmp_path / "redis").mkdir()
    with persistent_redis(tmp_path / "redis") as redis:
        secret = create_key(redis.url, POD_PREFIX, "team")  # a key of the Redis store, as a fleet's are
        auth = {"authorization": f"Bearer {secret}"}
        warm, warm_base = _start_pod(tmp_path, "warm", upstream_sim.base_url, redis.url, on_redis_down, port_lease)
        late = None
        with_keys = None
        try:
            ready = httpx.get(warm_base + "/ready", timeout=10)
            assert ready.status_code == 200 and ready.json() == {"status": "ready", "redis": True,
                                                                 "redis_synced": True, "upstreams": UPSTREAMS_OK}
            first = httpx.post(warm_base + "/v1/chat/completions", timeout=30, json=chat_body, headers=auth)
            assert first.status_code == 200, first.text  # the key seen: kept through an outage
            redis.stop()
            ready = httpx.get(warm_base + "/ready", timeout=10)
            chat = httpx.post(warm_base + "/v1/chat/completions", timeout=30, json=chat_body, headers=auth)
            if on_redis_down == "fail_open":
                assert ready.status_code == 200, ready.text
                assert ready.json() == {"status": "degraded", "redis": False, "redis_synced": True,
                                        "upstreams": UPSTREAMS_OK}
                assert chat.status_code == 200, chat.text  # what the probe promises: the pod serves
            else:
                assert ready.status_code == 503 and ready.json()["status"] == "not_ready", ready.text
                assert ready.json()["redis"] is False
            assert httpx.get(warm_base + "/health", timeout=5).status_code == 200
            # a new pod during the outage: not ready in either mode, alive, and ready once Redis is back
            late, late_base = _start_pod(tmp_path, "late", upstream_sim.base_url, redis.url, on_redis_down, port_lease)
            ready = httpx.get(late_base + "/ready", timeout=10)
            assert ready.status_code == 503, ready.text
            assert ready.json() == {"status": "not_ready", "redis": False, "redis_synced": False,
                                    "upstreams": UPSTREAMS_OK}
            assert httpx.get(late_base + "/health", timeout=5).status_code == 200
            if on_redis_down == "fail_open":  # a new pod with keys of its own config serves those: ready, degraded
                with_keys, keys_base = _start_pod(tmp_path, "late-keys", upstream_sim.base_url, redis.url,
                                                  on_redis_down, port_lease, auth=keys_config())
                ready = httpx.get(keys_base + "/ready", timeout=10)
                assert ready.status_code == 200 and ready.json()["status"] == "degraded", ready.text
                # ... unless the operator says its clients use keys of the store (config keys only for ops)
                strict, strict_base = _start_pod(tmp_path, "late-strict", upstream_sim.base_url, redis.url,
                                                 on_redis_down, port_lease, auth=keys_config(),
                                                 THINKGATE_SERVER__READY_REQUIRES_REDIS_SYNC="true")
                try:
                    assert httpx.get(strict_base + "/ready", timeout=10).status_code == 503
                finally:
                    stop_process(strict, timeout_s=20)
            redis.start()
            ready = httpx.get(late_base + "/ready", timeout=10)
            assert ready.status_code == 200 and ready.json()["status"] == "ready", ready.text
        finally:
            for proc in (warm, late, with_keys):
                if proc is not None:
                    stop_process(proc, timeout_s=20)
