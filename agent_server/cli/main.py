"""`oss-agent`: the command line. One subcommand per module of `agent_server/cli/`, each with
`add_arguments(parser)` and `run(args) -> exit code`."""

from __future__ import annotations

import argparse

from agent_server.cli import bench, generate, serve

SUBCOMMANDS = {
    "serve": (serve, "serve the Responses and Chat Completions APIs"),
    "generate": (generate, "generate one answer to a prompt, no server"),
    "bench": (bench, "benchmark a server over HTTP (bench serve) or the engine in-process (bench engine)"),
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
