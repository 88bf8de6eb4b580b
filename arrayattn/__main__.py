"""``python -m arrayattn``: the main job (backends, op checks, timing table)."""

import sys

from ._selfcheck import main

sys.exit(main())
