"""``python -m quack_build`` = the ``quack`` console script (for machines where
the package is on PYTHONPATH but not installed)."""

from quack_build.cli.main import main

main()
