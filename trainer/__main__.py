"""``python -m trainer`` is ``python -m trainer.train`` (see that module for the flags)."""

import sys

from trainer.train import main

sys.exit(main())
