"""``python -m preft`` is the ``preft`` command; ``accelerate launch -m preft train CONFIG`` runs a recipe on
several processes."""

import sys

from preft.cli import main

sys.exit(main())
