"""``python -m gateway.cli`` runs the ``thinkgate`` command line."""

from gateway.cli.main import main

main()
