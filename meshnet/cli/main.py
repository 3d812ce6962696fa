"""The meshnet command line: the click group, with the commands of each concern
(local.py, mesh.py, measure.py, serve.py; their shared options in options.py)."""

from __future__ import annotations

import click

from meshnet.cli.local import chat, run
from meshnet.cli.measure import accept, bench, drift, inspect, plan
from meshnet.cli.mesh import coordinator, keys, status, worker
from meshnet.cli.serve import serve


@click.group()
@click.version_option(package_name="meshnet")
def main():
    """Run one GGUF model across several processes and hosts, a layer range each."""


for command in (run, chat, worker, coordinator, keys, status, drift, bench, accept, plan, serve, inspect):
    main.add_command(command)


if __name__ == "__main__":
    main()
