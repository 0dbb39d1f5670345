"""``python -m fedudp.report``: the ``fedudp-report`` command."""

from fedudp.report.cli import main

raise SystemExit(main())
