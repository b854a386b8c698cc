"""``python -m fsharded ...`` is the ``fsharded`` command (see ``fsharded.tools.cli``)."""

import sys

from fsharded.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
