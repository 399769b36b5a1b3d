"""`python -m services.runner --ledger ADDR --kernel ADDR [--address HOST:PORT]`."""

from __future__ import annotations

import argparse
import asyncio

from services.common import telemetry
from services.common.config import Settings
from services.runner.config import RunnerConfig
from services.runner.server import run_runner


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m services.runner")
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--kernel", required=True)
    parser.add_argument("--address", default="127.0.0.1:0")
    args = parser.parse_args()
    settings = Settings.from_env()
    telemetry.configure("runner", settings)
    config = RunnerConfig.from_env(args.ledger, args.kernel)
    asyncio.run(run_runner(settings, config, args.address))


if __name__ == "__main__":
    main()
