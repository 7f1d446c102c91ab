"""`python -m graphir` is the `graphir` command."""

from graphir.cli import main

main()
