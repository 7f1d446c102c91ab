"""The `graphir` command line: composes model building, passes, backends and dumps."""

import click


@click.group()
def main() -> None:
    """graphir: see and change what a language model computes."""
