"""`hybridserve` console script: one subcommand per module, imported lazily.

Each subcommand lives in its own module exposing `main(argv: list[str]) -> int`, so that
`hybridserve explain` never pays for importing torch or Ray.
"""

from __future__ import annotations

import importlib
import os
import sys

# name -> (module, one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "explain": ("cache_service.explain", "simulate a cold request and a resend; print per-group hits as JSON"),
    "init-model": ("workers.model.init_model", "write a random-weight NemotronH-format checkpoint"),
    "serve": ("cluster.serve", "serve the OpenAI-compatible API: `serve MODEL` with vllm serve's flags, or a config"),
    "generate": ("workers.generate", "run prompts through one engine (cold, then warm with --repeat 2)"),
    "train-tiny": ("workers.train.train_tiny", "train the tiny hybrid checkpoint shipped in configs/models"),
    "simulate": ("cache_service.trace_sim.cli", "replay a Mooncake trace through R simulated replicas"),
    "gen-trace": ("cache_service.trace_sim.generate", "write a seeded multi-turn trace (chat, agent loops)"),
    "loadtest": ("cluster.loadtest", "drive a server with seeded workloads; TTFT cold vs warm, hit rates, --compare"),
}


def _usage() -> str:
    lines = ["usage: hybridserve <command> [options]", "", "commands:"]
    width = max(len(name) for name in COMMANDS)
    for name, (_, text) in COMMANDS.items():
        lines.append(f"  {name.ljust(width)}  {text}")
    lines.append("")
    lines.append("run `hybridserve <command> --help` for a command's options")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from cluster.serve_args import VERSION

        print(f"hybridserve {VERSION}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"hybridserve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        code = int(module.main(rest) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away (`hybridserve explain ... | head`): stop quietly, as `cat` does;
        # stdout now points at /dev/null so the interpreter's final flush cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by the pipe
    return code


if __name__ == "__main__":
    sys.exit(main())
