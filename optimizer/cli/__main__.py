"""``python -m optimizer.cli``: the ``scepsy`` command."""

from optimizer.cli.main import main

raise SystemExit(main())
