"""``python -m fedhetero.cli``: the ``fedhetero`` command."""

import sys

from fedhetero.cli import main

sys.exit(main())
