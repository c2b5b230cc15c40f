"""The settings are frozen once loaded: an override is a ``model_copy(update=…)``, never an assignment."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.config import ConfigError, KeyConfig, Settings


def test_settings_refuse_assignment() -> None:
    s = Settings.load(None, engine={"enabled": False})
    with pytest.raises(ValidationError, match="frozen"):
        s.server.port = 9  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        s.tiers[0].base_url = "http://elsewhere/v1"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        s.redis = s.redis  # type: ignore[misc]
    moved = s.model_copy(update={"server": s.server.model_copy(update={"port": 9})})
    assert (moved.server.port, s.server.port) == (9, 8080)


def test_key_secret_is_hashed_at_load_and_dropped() -> None:
    k = KeyConfig(id="a", secret="s3cret")
    assert k.secret is None and k.secret_sha256 == hashlib.sha256(b"s3cret").hexdigest()
    with pytest.raises(ValidationError, match="needs secret or secret_sha256"):
        KeyConfig(id="b")
    with pytest.raises(ConfigError, match="needs secret or secret_sha256"):
        Settings.load(None, auth={"keys": [{"id": "c"}]})



@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_redis_url_leaves_the_config_files(value: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``REDIS_URL`` is an alias of ``redis.url`` and overrides the file; exported but empty it is no URL (it made
    every command fail with "unsupported scheme ''")."""
    cfg = tmp_path / "thinkgate.yaml"
    cfg.write_text("redis:\n  url: redis://127.0.0.1:6399/2\n")
    monkeypatch.delenv("THINKGATE_REDIS__URL", raising=False)
    monkeypatch.setenv("REDIS_URL", value)
    assert Settings.load(cfg).redis.url == "redis://127.0.0.1:6399/2"
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6398/1")
    assert Settings.load(cfg).redis.url == "redis://127.0.0.1:6398/1"
