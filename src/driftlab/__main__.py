"""`python -m driftlab` runs the CLI."""

from driftlab.cli import main

main()
