"""The ``thinkgate`` command line: one entry point for serving and operating the gateway.

Command groups of this package are modules here (``serve``, ``config``, ``keys``, ``budgets``, ``usage``,
``eval``, ``redis``: ``redis_ops``). Groups
owned by other packages — ``router`` (router/cli.py), ``train`` (training/cli.py) and, in a source checkout,
``bench`` (bench/cli.py) — are plugged in through the ``thinkgate.cli`` entry-point group (as vLLM loads its
plugins), so this package never imports them; a group whose package is missing answers with one line saying
what to install. Heavy libraries (torch, transformers, vllm, scikit-learn) are imported inside the commands
so ``thinkgate --help`` stays fast.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

import typer

from gateway.cli.budgets import app as budgets_app
from gateway.cli.common import CONFIG_OPTION, MODEL_DIR_OPTION, load_settings
from gateway.cli.eval import app as eval_app
from gateway.cli.keys import app as keys_app
from gateway.cli.redis_ops import app as redis_app
from gateway.cli.serve import serve
from gateway.cli.usage import app as usage_app
from router.errors import install_hint

app = typer.Typer(
    name="thinkgate",
    help="ThinkGate: route, budget and meter reasoning-model traffic; train length-controlled models.",
    no_args_is_help=True,
    add_completion=False,
)
app.command()(serve)

config_app = typer.Typer(no_args_is_help=True)
app.add_typer(config_app, name="config", help="Inspect the effective configuration.")
app.add_typer(keys_app, name="keys", help="Create, list and revoke API keys in the Redis key store.")
app.add_typer(budgets_app, name="budgets",
              help="Spend limits (USD) of tags (team=a) and of the whole gateway: set, list, remove.")
app.add_typer(eval_app, name="eval", help="Evaluate a running gateway's tiers on held-out problems.")
app.add_typer(redis_app, name="redis",
              help="Operate the gateway's Redis: move the API keys' data between cluster placements.")
app.add_typer(usage_app, name="usage",
              help="Usage: export (csv, jsonl, parquet), the savings report, the quarantine file.")

#: Plug-in groups: name → (help, what to install when the group's package is missing).
PLUGIN_GROUPS: dict[str, tuple[str, str]] = {
    "router": ("Fit, calibrate, evaluate and label the difficulty router.", install_hint()),
    "train": ("Offline training jobs (tiny local model, GRPO).",
              "run it from a source checkout (the wheel ships no training code or models): make venv, then "
              ".venv/bin/thinkgate train …"),
    "bench": ("Benchmarks of the whole stack (savings, real traces).",
              "run it from a source checkout: make venv, then .venv/bin/thinkgate bench …"),
}


@config_app.command("show")
def config_show(config: Path | None = CONFIG_OPTION, model_dir: Path | None = MODEL_DIR_OPTION) -> None:
    """Print the effective configuration (file + THINKGATE_* environment + defaults, and ``--model-dir`` as
    ``serve`` applies it: ``make serve``'s is ``--model-dir models/thinkgate-tiny-dial``) as YAML."""
    import yaml

    from gateway.config.redis import shown_url
    from gateway.state.webhooks import redacted

    data = load_settings(config, model_dir).model_dump(mode="json")
    # secrets shown as ***: a tier's api_key, Redis's password, the alert webhook's path (Slack's is the secret), the
    # OTLP exporter's headers (an authorization token) — the output goes to terminals, tickets and CI logs
    for tier in data.get("tiers", []):
        if tier.get("api_key"):
            tier["api_key"] = "***"
    if isinstance(data.get("redis"), dict) and data["redis"].get("url"):
        data["redis"]["url"] = shown_url(str(data["redis"]["url"]))
    if isinstance(data.get("limits"), dict) and data["limits"].get("alert_webhook_url"):
        data["limits"]["alert_webhook_url"] = redacted(data["limits"]["alert_webhook_url"])
    tel = data.get("telemetry")
    if isinstance(tel, dict) and isinstance(tel.get("headers"), dict):
        tel["headers"] = dict.fromkeys(tel["headers"], "***")
    typer.echo(yaml.safe_dump(data, sort_keys=False), nl=False)


def _add_missing_group(root: typer.Typer, name: str, help_text: str, hint: str, exc: Exception) -> None:
    """Register ``name``, whose package is missing, as one command that takes any arguments and options
    (``train tiny``, ``bench --help``) and answers every invocation with the same line and exit code 2.

    A command, not an empty group: click resolves a group's subcommand before the group's callback runs, so
    ``thinkgate train tiny`` answered "No such command 'tiny'" instead of saying what to do."""

    @root.command(name, help=help_text, add_help_option=False,
                  context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _unavailable() -> None:
        typer.echo(f"thinkgate {name}: unavailable here ({exc}); {hint}", err=True)
        raise typer.Exit(2)


#: The gateway's own commands: a ``thinkgate``/``python -m gateway`` process started for one of them does not import
#: the plug-in groups (bench, router, training: most of the CLI's start-up, seconds on a loaded 2-core box — for
#: every ``thinkgate keys …`` call and every ``thinkgate serve`` start). ``eval`` is not one: plug-ins add to it.
CORE_COMMANDS = frozenset({"serve", "config", "keys", "budgets", "usage"})


def _needs_plugins(argv: list[str]) -> bool:
    """False when ``argv`` is this command line's own process running a core command (see
    :data:`CORE_COMMANDS`); True otherwise — for ``--help``, a plug-in group, and when the module is imported
    by another program (tests, ``typer.testing``), which gets every group."""
    if len(argv) < 2 or argv[1] not in CORE_COMMANDS:
        return True
    exe = Path(argv[0])
    ours = exe.name == "thinkgate" or (exe.name == "__main__.py" and exe.parent.name in ("gateway", "cli"))
    return not ours


def _attach_plugins(root: typer.Typer) -> None:
    if not _needs_plugins(sys.argv):
        return
    found = {ep.name: ep for ep in entry_points(group="thinkgate.cli")}
    for name, (help_text, hint) in PLUGIN_GROUPS.items():
        ep = found.get(name)
        try:
            if ep is None:
                raise ModuleNotFoundError("no 'thinkgate.cli' entry point")
            sub = ep.load()
        except ImportError as exc:
            _add_missing_group(root, name, help_text, hint, exc)
            continue
        if name == "router":  # reads the gateway's outcome stream, so it lives on this side of the imports
            from gateway.cli.retrain import retrain_command
            from gateway.cli.router_history import history_command

            sub.command("retrain")(retrain_command)
            sub.command("history")(history_command)
        # offline evaluations owned by a plug-in (``thinkgate eval dial`` from training) join ``eval``
        for cmd_name, fn in (getattr(sub, "eval_commands", None) or {}).items():
            eval_app.command(cmd_name)(fn)
        root.add_typer(sub, name=name, help=help_text)


_attach_plugins(app)


def main() -> None:
    """Console-script entry point. A command whose optional extra is missing ends with one line saying which
    extra to install (exit 2), not a traceback."""
    from router.errors import MissingExtra

    code: int = 0
    try:
        app()
    except MissingExtra as exc:
        msg = str(exc)
        typer.echo(msg if msg.startswith("thinkgate") else f"thinkgate: {msg}", err=True)
        code = 2
    except SystemExit as exc:  # typer ends every command with one
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if "torch" in sys.modules:
        # A training command ran: Python's module teardown after torch/transformers/TRL is seconds of CPU
        # (3-10 s measured on 2 cores) after the cost ledger's last row, never billed — run the exit handlers,
        # flush and leave now, as ``python -m training.grpo`` does.
        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
    sys.exit(0)
