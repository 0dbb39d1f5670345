"""``python -m fedudp``: the ``fedudp`` command line (``fedudp.cli``)."""

from fedudp.cli import main

main()
