"""The ``kvblend`` command line: the entry point, the cache administration commands and
their shared connection flags.

`main` builds the parser from a table of commands (each module exposes ``add_arguments``
and ``run``); `server`, `status`, `stop` and `clear` administer the Ray-hosted cache;
`config_show` prints the effective config; `docs` regenerates the config table of docs/configuration.md.
Workload and benchmark commands live in :mod:`cluster.workloads` and :mod:`cluster.bench`.
"""
