"""``python -m ltmp`` (what torchrun runs) is the ``ltmp`` command."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
