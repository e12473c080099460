"""Command-line interface: one `astrai` entry point with tyro subcommands (see main.py)."""
