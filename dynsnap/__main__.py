"""``python -m dynsnap``: the same entry point as the ``dynsnap`` console script."""

from dynsnap.cli import main

raise SystemExit(main())
