"""``python -m ate_devplugd``."""

import sys

from ate_devplugd.cli import main

sys.exit(main())
