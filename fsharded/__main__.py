"""``python -m fsharded ...`` is the ``fsharded`` command (see ``fsharded.cli``)."""

import sys

from fsharded.cli import main

if __name__ == "__main__":
    sys.exit(main())
