"""``POST /v1/embeddings`` through the official ``openai`` SDK: passed through to the tier marked for
embeddings, metered on input tokens (one event, exact price), refused clearly where no tier serves it, and
admitted under the key's budget like chat."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from decimal import Decimal

import httpx
import openai
import pytest

from gateway.ledger.pricing import cost_micro_usd
from tests.fixtures.gateway import SECRETS, accounting_gateway, cleanup, keys_config
from tests.fixtures.metered import events_of
from tests.fixtures.upstream import GatewayServer, SimProcess, sim_tiers
from tests.fixtures.upstream_sim import embedding_of

EMBED_PRICES = {"input_usd_per_mtok": Decimal("0.02"), "cached_input_usd_per_mtok": Decimal("0.02"),
                "output_usd_per_mtok": Decimal("0")}


@pytest.fixture(scope="module")
def gw(upstream_sim: SimProcess, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    tiers = [*sim_tiers(upstream_sim.base_url),
             {"name": "embed", "base_url": upstream_sim.base_url, "model": "sim-embed", "embeddings": True,
              "max_tokens": 1, "prices": EMBED_PRICES}]
    # bob may spend 1 micro-USD a day
    auth = keys_config(bob={"budget_usd_day": "0.000001"})
    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path_factory.mktemp("embgw"), prefix,
                                tiers=tiers, auth=auth) as g:
            yield g
    finally:
        cleanup(redis_url, prefix)


def sdk(gw: GatewayServer, who: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=SECRETS[who], max_retries=0, timeout=30)


@pytest.mark.parametrize("model", ["embed", "text-embedding-3-small"])
def test_embeddings_pass_through_and_are_metered_on_input_tokens(gw: GatewayServer, model: str) -> None:
    texts = ["the quick brown fox", "jumps over the lazy dog today"]
    raw = sdk(gw).embeddings.with_raw_response.create(model=model, input=texts)  # SDK default: base64
    assert (raw.headers["x-thinkgate-tier"], raw.headers["x-thinkgate-route-reason"]) == ("embed", "forced")
    r = raw.parse()
    assert [d.embedding for d in r.data] == [embedding_of(t) for t in texts]
    assert r.usage.prompt_tokens == 10 and r.usage.total_tokens == 10
    rows = events_of(gw, raw.headers["x-request-id"])
    assert len(rows) == 1
    ev = rows[0]
    assert (ev["endpoint"], ev["tier"], ev["status"]) == ("embeddings", "embed", 200)
    assert (ev["prompt_tokens"], ev["completion_tokens"]) == (10, 0)
    from gateway.config import Prices

    assert ev["cost_micro_usd"] == cost_micro_usd(Prices(**EMBED_PRICES), prompt_tokens=10, cached_tokens=0,
                                                  completion_tokens=0)
    floats = sdk(gw).embeddings.create(model="embed", input="one two", encoding_format="float", dimensions=4)
    assert floats.data[0].embedding == embedding_of("one two", 4)


def test_an_upstream_failure_names_its_usage_record(gw: GatewayServer) -> None:
    r = httpx.post(gw.base_url + "/embeddings", json={"model": "embed", "input": "x", "sim": {"fail": "500"}},
                   headers={"authorization": f"Bearer {SECRETS['alice']}"}, timeout=30)
    assert r.status_code == 502
    rows = events_of(gw, r.headers["x-request-id"])  # the 502's own id: its usage record
    assert len(rows) == 1 and rows[0]["status"] == 502 and rows[0]["endpoint"] == "embeddings"


def test_a_tier_without_embeddings_is_refused(gw: GatewayServer) -> None:
    with pytest.raises(openai.NotFoundError) as err:  # OpenAI's status for a model it does not serve here
        sdk(gw).embeddings.create(model="long", input="hello")
    assert err.value.code == "model_not_found" and "does not serve embeddings" in str(err.value)
    r = httpx.post(gw.base_url + "/embeddings", json={"model": "embed", "input": []},
                   headers={"authorization": f"Bearer {SECRETS['alice']}"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert httpx.post(gw.base_url + "/embeddings", json={"model": "embed", "input": "x"}, timeout=10).status_code == 401


def test_embeddings_are_under_the_key_budget(gw: GatewayServer) -> None:
    # bob's budget (1 micro-USD a day) cannot cover the request's reserved estimate: refused before the upstream
    with pytest.raises(openai.RateLimitError) as err:
        sdk(gw, "bob").embeddings.create(model="embed", input="word " * 1000)
    assert err.value.code == "budget_exceeded"
    # the refusal is an audit event in the ledger, as on chat: no spend, the status and the code
    [row] = events_of(gw, err.value.response.headers["x-request-id"])
    assert (row["audit"], row["status"], row["error_code"], row["cost_micro_usd"]) == (True, 429, "budget_exceeded", 0)
    assert (row["endpoint"], row["tier"]) == ("embeddings", "embed")
    assert sdk(gw, "alice").embeddings.create(model="embed", input="word " * 1000).usage.prompt_tokens == 1000
