"""``python -m fedudp.audit``: the same command as ``fedudp-audit``."""

from fedudp.audit.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    raise SystemExit(main())
