"""``python -m ampscaler``: the command line of :mod:`ampscaler.cli`."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
