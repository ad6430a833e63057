"""`oss-agent serve`: the HTTP server (Responses, Chat Completions) on one model.

With no --model it serves a tiny random-weight checkpoint written to the cache, so every
endpoint can be tried without a download (its text is noise).
"""

from __future__ import annotations

import argparse
import ast
import logging
import math
import os
from pathlib import Path

from agent_server import default_model
from agent_server.http_limits import HttpLimits
from inference.config import KV_CACHE_DTYPES, EngineConfig

log = logging.getLogger("oss_agent")

LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


def add_engine_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """Where and how the engine runs: the flags `oss-agent serve` and `oss-agent bench engine`
    share, so the engine benchmarked is the one served."""
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--max-model-len", type=positive_int, help="context length to serve (default: the engine's)")
    parser.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra keyword for LLMEngine.from_pretrained (value as a Python literal)",
    )
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the engine in a process of its own, so that HTTP work never holds the GIL it "
        "steps under (default: on with CUDA, off on CPU)",
    )


def engine_placement_argv(args: argparse.Namespace) -> list[str]:
    """The flags of `add_engine_placement_arguments` as parsed into `args`, back as command-line
    words: what a script that takes them hands on to `oss-agent bench engine`'s parser."""
    argv = [f"--engine-option={option}" for option in args.engine_option]
    if args.device:
        argv += ["--device", args.device]
    if args.max_model_len is not None:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.engine_process is not None:
        argv.append("--engine-process" if args.engine_process else "--no-engine-process")
    return argv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF gpt-oss checkpoint directory (default: a tiny random one)")
    parser.add_argument("--served-model-name", help="the model id clients use (default: the folder's name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OSS_AGENT_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $OSS_AGENT_API_KEY)",
    )
    parser.add_argument(
        "--api-keys-file",
        type=Path,
        metavar="PATH",
        help="file of API keys, one a line as NAME:KEY (or KEY); each key sees only the responses "
        "made with its name's keys (with --api-key too, whose name is 'default')",
    )
    parser.add_argument(
        "--tool-server",
        action="append",
        default=[],
        metavar="SPEC",
        help="start a tool server (browser, python, an MCP server, or 'demo'); repeatable",
    )
    parser.add_argument("--search-dir", help="folder of documents for the local browser backend")
    parser.add_argument("--exa-api-key", default=os.environ.get("EXA_API_KEY"), help="Exa key for web search")
    parser.add_argument(
        "--store",
        metavar="FILE|URL",
        help="SQLite file for stored responses (default: ~/.cache/oss-agent/responses.sqlite3, "
        "or responses.sqlite3 in $OSS_AGENT_CACHE; every server started without --store "
        "shares it), or a PostgreSQL database, postgresql://USER:PASSWORD@HOST:PORT/DB, that "
        "any number of servers share (responses, conversations, background runs)",
    )
    parser.add_argument(
        "--reasoning-key-file",
        type=Path,
        metavar="FILE",
        help="32-byte key that seals reasoning for store=false clients (include "
        "reasoning.encrypted_content); created if missing (default: reasoning.key beside the "
        "store)",
    )
    add_engine_placement_arguments(parser)
    parser.add_argument(
        "--gpu-memory-utilization",
        type=fraction,
        metavar="FRACTION",
        help="share of GPU memory the engine may use; the KV cache gets what the model and one "
        "step leave of it (default: 0.9)",
    )
    parser.add_argument(
        "--num-pages",
        type=positive_int,
        help="KV cache size in pages (16 tokens each by default), instead of sizing it from memory",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=positive_int,
        help=f"most sequences in one batch (default: {EngineConfig.max_num_seqs})",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        help="most tokens in one step, prompt chunks and decode rows together "
        f"(default: {EngineConfig.max_num_batched_tokens})",
    )
    parser.add_argument(
        "--max-prefill-tokens-decoding",
        type=positive_int_or_none,
        metavar="N|none",
        help="while sequences decode, a step takes at most N prompt tokens: bounds the pause a "
        f"joining prompt adds to every running stream (default: {EngineConfig.max_prefill_tokens_decoding}; "
        "smaller gives smoother streams for a little throughput; none: the whole step budget)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        help="how the KV cache stores keys and values: auto (the model's dtype, the default) or "
        "fp8 (float8 e4m3: twice the tokens in the same memory, half the bytes for decode "
        "attention, keys and values rounded to 4 significant bits)",
    )
    parser.add_argument(
        "--speculative",
        choices=["ngram", "eagle3"],
        help="speculative decoding: draft tokens by prompt lookup (ngram) or with an EAGLE-3 "
        "draft head (eagle3, needs --draft-model); the target verifies them, output unchanged",
    )
    parser.add_argument("--num-draft-tokens", type=positive_int, help="draft tokens per step (default: 4)")
    parser.add_argument("--draft-model", help="EAGLE-3 draft checkpoint directory (for --speculative eagle3)")
    parser.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        metavar="N",
        help="split the model over N GPUs (cuda:0..N-1 from --device on), one process each; "
        "N must divide the attention and KV head counts (default: 1)",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=positive_int,
        default=1,
        metavar="N",
        help="run N engine replicas, each in a process of its own on its own GPU (or group of "
        "--tensor-parallel-size GPUs), behind this one server; requests are routed by cached "
        "prefix and load (default: 1)",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch each step (decode rows, prompts joining) before the previous one's tokens are "
        "read, so host work overlaps the GPU (default: on with CUDA, off on CPU; never with a drafter or -tp)",
    )
    parser.add_argument(
        "--harmony-grammar",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="hold every generated turn to Harmony's structure with a grammar (headers, channels, "
        "the request's tools as recipients); off, only strict schemas, json_object and forced "
        "tools are enforced (default: on)",
    )
    parser.add_argument(
        "--tool-timeout", type=positive_float, default=300.0, help="seconds a built-in tool call may take"
    )
    parser.add_argument(
        "--python-timeout",
        type=float,
        metavar="SECONDS",
        help="seconds a python cell may run before it is interrupted, its session kept (default: "
        "60, or less to end before --tool-timeout)",
    )
    parser.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        help="allow this browser origin (CORS, off by default); repeatable, '*' for any",
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests for this host name (besides localhost, IP addresses and --host); "
        "repeatable, '*.example.com' for its subdomains, '*' for any",
    )
    parser.add_argument(
        "--max-request-bytes", type=positive_int, default=32 << 20, help="largest request body accepted"
    )
    parser.add_argument(
        "--max-header-bytes",
        type=positive_int,
        default=HttpLimits.max_head_bytes,
        help="largest request line and headers accepted (431 beyond)",
    )
    parser.add_argument(
        "--header-timeout",
        type=positive_float,
        default=HttpLimits.head_timeout,
        metavar="SECONDS",
        help="seconds a request's line and headers may take to arrive, and a new connection may "
        "stay silent (408, closed)",
    )
    parser.add_argument(
        "--body-timeout",
        type=positive_float,
        default=HttpLimits.body_timeout,
        metavar="SECONDS",
        help="seconds a request's body may take to arrive after its headers (closed)",
    )
    parser.add_argument(
        "--max-input-items",
        type=positive_int,
        default=2048,
        help="most items in a request's input (Responses) or messages (Chat Completions)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=30.0,
        help="seconds in-flight requests get to finish on shutdown before they are cancelled",
    )
    parser.add_argument(
        "--default-max-output-tokens",
        type=non_negative_int,
        metavar="N",
        help="output tokens a request gets when it sets no max_output_tokens / max_tokens; 0 for "
        "the rest of the context (default: 0, or %d for the tiny random model served "
        "without --model)" % default_model.MAX_OUTPUT_TOKENS,
    )
    parser.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)


def engine_options(args: argparse.Namespace) -> dict:
    options = {}
    for item in args.engine_option:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-option wants KEY=VALUE, got {item!r}")
        try:
            options[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            options[key] = raw
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    # The dedicated flags map onto EngineConfig fields of the same name (and win over --engine-option).
    for name in (
        "gpu_memory_utilization",
        "num_pages",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_prefill_tokens_decoding",
        "kv_cache_dtype",
        "speculative",
        "num_draft_tokens",
        "draft_model",
        "tensor_parallel_size",
        "async_scheduling",
    ):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if options.get("max_prefill_tokens_decoding") == UNCAPPED:  # (the flag, or --engine-option ...=none)
        options["max_prefill_tokens_decoding"] = None
    drafter = options.get("speculative")  # (the flag, or --engine-option speculative=...)
    if drafter is None and (args.draft_model or args.num_draft_tokens is not None):
        raise SystemExit("--draft-model and --num-draft-tokens take effect only with --speculative ngram|eagle3")
    if drafter == "ngram" and args.draft_model:
        raise SystemExit("--draft-model is for --speculative eagle3 (ngram drafts from the prompt, with no model)")
    if drafter == "eagle3" and not options.get("draft_model"):
        raise SystemExit("--speculative eagle3 needs --draft-model DIR (an EAGLE-3 draft checkpoint)")
    return options


def engine_in_process_of_its_own(args: argparse.Namespace) -> bool:
    """--engine-process, or by default whether the engine runs on CUDA (on CPU the engine's own
    work is the bottleneck, and a process of its own only adds start-up time)."""
    if args.engine_process is not None:
        return args.engine_process
    if getattr(args, "data_parallel_size", 1) > 1:  # (`bench engine` shares this, without the flag)
        return True
    if args.device is not None:
        return args.device.startswith("cuda")
    import torch

    return torch.cuda.is_available()


def fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def python_limits(tool_timeout: float, cell_seconds: float | None = None):
    """The python tool's limits under `--tool-timeout`: a cell is interrupted (its session kept)
    before the server gives up on the call (which ends the session), and the model is told so.
    cell_seconds: `--python-timeout`; None: the sandbox's default, shortened to fit. A given
    value that does not fit is a ValueError. A session's CPU time allows 5 cells of that length."""
    from dataclasses import replace

    from tools.python.sandbox import SandboxLimits

    limits = SandboxLimits()
    before_the_cancel = tool_timeout - limits.interrupt_grace_seconds - 1.0
    if cell_seconds is None:
        return replace(limits, wall_seconds=min(limits.wall_seconds, max(1.0, before_the_cancel)))
    if not 1.0 <= cell_seconds <= before_the_cancel:
        raise ValueError(
            f"--python-timeout must be between 1 and {before_the_cancel:g} seconds (--tool-timeout "
            f"minus {tool_timeout - before_the_cancel:g}), got {cell_seconds:g}"
        )
    return replace(limits, wall_seconds=cell_seconds, cpu_seconds=max(limits.cpu_seconds, 5 * math.ceil(cell_seconds)))


def unusable_device(device: str | None) -> str | None:
    """Why torch cannot run on --device here (one line), or None."""
    if device is None:
        return None
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        return f"{device}: not a device (cpu, cuda or cuda:N)"
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return f"{device}: this machine has no CUDA device torch can use (leave --device out to run on the CPU)"
        if parsed.index is not None and parsed.index >= count:
            return f"{device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
    elif parsed.type != "cpu":
        return f"{device}: not a device this server runs on (cpu, cuda or cuda:N)"
    return None


def default_model_name(model_dir: Path) -> str:
    """The id clients use when --served-model-name is not given: the folder's name, with `.`
    and `..` resolved (`--model .` is served under the folder's name, not ""), and a Hugging
    Face cache snapshot (`.../models--openai--gpt-oss-20b/snapshots/<commit>`) named after its
    repository, not the commit hash. (os.path.abspath: a symlinked folder keeps its own name.)"""
    path = Path(os.path.abspath(model_dir))
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.split("--")[-1]
    return path.name or str(path)


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:  # (the socket layer would take 70000 as 70000 - 65536)
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0 to 65535, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def is_database_url(store: str) -> bool:
    """--store names a PostgreSQL database (else a SQLite file)."""
    return store.startswith(("postgresql://", "postgres://"))


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


UNCAPPED = "none"  # --max-prefill-tokens-decoding none: the engine's None (no cap)


def positive_int_or_none(text: str) -> int | str:
    return UNCAPPED if text.strip().lower() == UNCAPPED else positive_int(text)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from agent_server.app import create_app
    from agent_server.http_limits import uvicorn_options
    from agent_server.request_ids import RequestIdFilter
    from agent_server.state import ServerConfig, default_store_path

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
    api_keys: dict[str, str] = {}
    if args.api_keys_file:
        from agent_server.auth import read_keys_file

        keys_file = args.api_keys_file.expanduser()
        try:
            api_keys = read_keys_file(keys_file)
        except (OSError, ValueError, UnicodeDecodeError) as e:
            log.error("--api-keys-file: %s", e)
            return 2
        if keys_file.stat().st_mode & 0o077:
            log.warning("--api-keys-file %s can be read by other users: chmod 600 it", keys_file)
    if not (args.api_key or api_keys) and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("Listening on %s without --api-key: anyone who can reach this port can use the model.", args.host)
    if args.model:
        model_dir = Path(args.model).expanduser()  # (the shell leaves `--model=~/...` alone)
        name = args.served_model_name or default_model_name(model_dir)
        from inference.model.checkpoint import checkpoint_folder_problem

        problem = checkpoint_folder_problem(model_dir)
        if problem:
            log.error("--model %s", problem)
            return 2
    else:
        from inference.model.tiny_checkpoint import default_tiny_checkpoint

        model_dir = default_tiny_checkpoint()
        name = args.served_model_name or default_model.NAME
    random_weights = not args.model
    aliases = [str(model_dir), *(default_model.STAND_IN_FOR if random_weights else ())]
    max_output_tokens = args.default_max_output_tokens
    if max_output_tokens is None:
        max_output_tokens = default_model.MAX_OUTPUT_TOKENS if random_weights else 0
    if random_weights:
        log.warning("%s", default_model.notice(max_output_tokens))
        log.info("the tiny checkpoint is in %s", model_dir)
    try:
        cell_limits = python_limits(args.tool_timeout, args.python_timeout)
    except ValueError as e:
        log.error("%s", e)
        return 2
    from tools.servers import ToolServerError, check_specs, split_specs

    device_problem = unusable_device(args.device)
    if device_problem:
        log.error("--device %s", device_problem)
        return 2
    if args.data_parallel_size > 1:
        if args.engine_process is False:
            log.error("--data-parallel-size runs each replica in a process of its own; drop --no-engine-process")
            return 2
        from inference.engine.replicas import replica_devices

        try:
            replica_devices(args.device, args.data_parallel_size, args.tensor_parallel_size or 1)
        except ValueError as e:
            log.error("--data-parallel-size: %s", e)
            return 2
    try:  # before uvicorn starts: a typo or a server that is not up is one line, not a traceback
        check_specs(args.tool_server)
    except ToolServerError as e:
        log.error("--tool-server: %s", e)
        return 2
    if args.search_dir and not {"demo", "browser"} & set(split_specs(args.tool_server)):
        log.error(
            "--search-dir is the browser tool's backend, and no browser was asked for: add "
            "--tool-server browser (or --tool-server demo, the browser and python)"
        )
        return 2
    search_dir = Path(args.search_dir).expanduser() if args.search_dir else None
    if search_dir is not None and not search_dir.is_dir():
        log.error("--search-dir %s is not a folder", args.search_dir)
        return 2
    store_url = args.store if args.store and is_database_url(args.store) else None
    store_path = Path(args.store).expanduser() if args.store and not store_url else default_store_path()
    if store_url:
        from agent_server.app import redacted_url

        try:
            import asyncpg  # noqa: F401
        except ImportError:
            log.error("--store %s needs the asyncpg package: pip install asyncpg", redacted_url(store_url))
            return 2
        log.info("stored responses: PostgreSQL at %s (shared by every server given it)", redacted_url(store_url))
    elif args.store and store_path.is_dir():
        log.error("--store %s is a folder; give the path of the SQLite file to keep responses in", args.store)
        return 2
    else:
        log.info(
            "stored responses: %s%s",
            store_path,
            "" if args.store else " (shared by every server started without --store; --store FILE for one of its own)",
        )
    options = engine_options(args)

    def build_engine():
        from inference.engine.process import EngineSpec, start_engine_client

        spec = EngineSpec(
            model_dir=str(model_dir), options={"device": args.device, **options}, log_level=args.log_level
        )
        if args.data_parallel_size > 1:
            from inference.engine.replicas import start_replicas

            return start_replicas(spec, args.data_parallel_size)
        return start_engine_client(spec, engine_in_process_of_its_own(args))

    tool_servers = None
    if args.tool_server:

        async def tool_servers():
            from tools.servers import start_tool_servers

            return await start_tool_servers(
                args.tool_server,
                search_dir=search_dir,
                exa_api_key=args.exa_api_key,
                python_limits=cell_limits,
                mcp_timeout=args.tool_timeout,
            )

    config = ServerConfig(
        model_name=name,
        aliases=aliases,
        default_max_output_tokens=max_output_tokens or None,
        random_weights=random_weights,
        api_key=args.api_key,
        api_keys=api_keys,
        store_path=store_path,
        store_url=store_url,
        reasoning_key_file=args.reasoning_key_file.expanduser() if args.reasoning_key_file else None,
        tool_timeout=args.tool_timeout,
        cors_origins=args.cors_origin,
        allowed_hosts=[args.host, *args.allowed_host],
        max_request_bytes=args.max_request_bytes,
        max_input_items=args.max_input_items,
        shutdown_timeout=args.shutdown_timeout,
        harmony_grammar=args.harmony_grammar,
    )
    failed: list[str] = []

    def stop_on_load_error(message: str) -> None:  # a server that cannot serve exits, non-zero
        failed.append(message)
        server.should_exit = True

    app = create_app(config, build_engine, tool_servers=tool_servers, on_load_error=stop_on_load_error)
    # Our access log (with request ids) replaces uvicorn's. On SIGTERM/SIGINT uvicorn stops
    # accepting, gives open connections the shutdown timeout, then the app drains its runs.
    # log_config=None: uvicorn's own lines go through the root handler, in the server's format.
    limits = HttpLimits(
        max_head_bytes=args.max_header_bytes, head_timeout=args.header_timeout, body_timeout=args.body_timeout
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=args.shutdown_timeout,
            **uvicorn_options(limits),
        )
    )
    server.run()
    if failed:
        log.error("exiting: startup failed: %s", failed[0])
        return 1
    return 0
