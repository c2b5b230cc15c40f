"""What every ``thinkgate`` sub-command shares: the ``--config`` option and loading the settings with a clean
exit (code 2 and the ConfigError message, no traceback) on an invalid configuration."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from gateway.config import Settings

CONFIG_OPTION = typer.Option(None, "--config", "-c", help="YAML config file (default: $THINKGATE_CONFIG).")


def load_settings(config: Path | None, **overrides: Any) -> Settings:
    """``Settings.load(config, **overrides)``, or exit 2 with the ConfigError message."""
    from gateway.config import ConfigError, Settings

    try:
        return Settings.load(config, **overrides)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
