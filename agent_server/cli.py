"""`oss-agent`: the command line. One subcommand per module (`<name>_command.py`), each with
`add_arguments(parser)` and `run(args) -> exit code`."""

from __future__ import annotations

import argparse
import sys

from . import bench_command, generate_command, serve_command

SUBCOMMANDS = {
    "serve": (serve_command, "serve the Responses and Chat Completions APIs"),
    "generate": (generate_command, "generate one answer to a prompt, no server"),
    "bench": (bench_command, "benchmark a server over HTTP (bench serve) or the engine in-process (bench engine)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oss-agent", description="Run OpenAI's gpt-oss models as an agent.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        module.add_arguments(subparsers.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module, _ = SUBCOMMANDS[args.command]
    return module.run(args)


if __name__ == "__main__":
    sys.exit(main())
