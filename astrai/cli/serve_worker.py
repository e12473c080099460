"""One replica of `astrai serve --data-parallel-size N` (started by `astrai.cli.serve_replicas`): a one-engine
`astrai serve` whose `ServeConfig` arrives on stdin as JSON (so no API key shows in `ps`)."""

from __future__ import annotations

import json
import sys

import cattrs

from astrai.cli.serve import ServeConfig, main
from astrai.cli.serve_replicas import pin_and_follow_parent

if __name__ == "__main__":
    pin_and_follow_parent()
    main(cattrs.Converter().structure(json.loads(sys.stdin.read()), ServeConfig))
