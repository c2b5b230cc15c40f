"""``python -m gateway`` runs the ``thinkgate`` command line."""

from gateway.cli.main import main

main()
