"""``python -m trainer.recsys`` runs `trainer.recsys.train.main` (see that module for flags)."""

import sys

from trainer.recsys.train import main

sys.exit(main())
