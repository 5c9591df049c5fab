"""`python -m launcher` is `dtrain`."""

from launcher.cli import main

main()
