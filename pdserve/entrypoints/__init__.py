"""The command-line entry points: `pdserve` and its subcommands (cli.py), `pdserve up`'s local
cluster launcher (launcher.py), and `pdserve scale` (scale_cli.py)."""
