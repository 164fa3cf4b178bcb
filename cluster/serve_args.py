"""`hybridserve serve`'s command line, shaped like `vllm serve`'s: flags -> config settings.

Each flag maps to one config key (`SETTINGS`); a flag left out leaves the YAML's value. The
settings are typed values (not YAML text), applied after `--config` and `--set`.
"""

from __future__ import annotations

import argparse
import errno
import socket
from pathlib import Path

from cluster.config import ConfigError

DEFAULT_CONFIG = "configs/local.yaml"
VERSION = "0.1.0"

# flag dest -> config key path
SETTINGS = {
    "host": "http.host",
    "port": "http.port",
    "api_key": "http.api_key",
    "served_model_name": "model.served_model_name",
    "dtype": "model.dtype",
    "chat_template": "model.chat_template",
    "generation_config": "model.generation_config",
    "tensor_parallel_size": "cluster.tp_size",
    "max_model_len": "engine.max_model_len",
    "num_speculative_tokens": "engine.num_spec_tokens",
    "enable_prefix_caching": "engine.enable_prefix_caching",
    "max_num_seqs": "engine.max_num_seqs",
    "max_num_batched_tokens": "engine.max_num_batched_tokens",
    "cuda_graphs": "engine.cuda_graphs",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridserve serve",
                                description="Serve the OpenAI-compatible API (flags as in `vllm serve`).")
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="checkpoint directory (sets model.path)")
    p.add_argument("--model", dest="model_flag", metavar="MODEL", help="same as the positional MODEL")
    p.add_argument("--config", default=None,
                   help=f"YAML config (default: {DEFAULT_CONFIG} if it exists, else built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override one config value, e.g. --set router.policy=round_robin (repeatable)")
    p.add_argument("--host", help="bind address (http.host)")
    p.add_argument("--port", type=int, help="port (http.port)")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1 (http.api_key)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the checkpoint dir's name)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, help="TP ranks per replica (cluster.tp_size)")
    p.add_argument("--dtype", choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
                   help="weights and activations dtype (model.dtype)")
    p.add_argument("--max-model-len", type=int, help="prompt + output tokens per request (engine.max_model_len)")
    p.add_argument("--num-speculative-tokens", type=int, help="MTP draft tokens per step, 0 = off")
    p.add_argument("--max-num-seqs", type=int, help="running requests per replica (engine.max_num_seqs)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="tokens per engine step, decodes first (engine.max_num_batched_tokens)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse cached prefixes (engine.enable_prefix_caching)")
    p.add_argument("--host-cache-gib", type=float, metavar="GIB",
                   help="host memory per replica for KV blocks and Mamba states the device evicts, promoted back "
                        "on a hit; 0 = none (engine.host_cache_bytes)")
    p.add_argument("--cuda-graphs", choices=["on", "off"], help="decode steps as CUDA graphs (engine.cuda_graphs)")
    p.add_argument("--chat-template", help="a Jinja chat template file or inline string (model.chat_template)")
    p.add_argument("--generation-config", metavar="auto|vllm|FOLDER",
                   help="request defaults (temperature, top_p, top_k, repetition_penalty, max_new_tokens): "
                        "auto = the checkpoint's generation_config.json, vllm = none of them (OpenAI defaults), "
                        "FOLDER = that folder's generation_config.json (model.generation_config)")
    p.add_argument("--pd", metavar="P:D",
                   help="prefill/decode disaggregation: P prefill and D decode replicas (cluster.pd; "
                        "sets cluster.num_replicas to P + D). Each count may be a range LO-HI, e.g. 1-3:2-4: "
                        "the autoscaler keeps that role within it, starting at LO (min/max_prefill, "
                        "min/max_decode; cluster.min/max_replicas the sums)")
    p.add_argument("--version", action="version", version=f"hybridserve {VERSION}")
    return p


def parse_serve_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, object]]:
    """(args, settings): `settings` maps config key paths to the flags' values."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.model_tag and args.model_flag and args.model_tag != args.model_flag:
        p.error(f"two different models given: {args.model_tag!r} and --model {args.model_flag!r}")
    settings = {key: getattr(args, dest) for dest, key in SETTINGS.items() if getattr(args, dest) is not None}
    if args.host_cache_gib is not None:
        if not args.host_cache_gib >= 0:  # also refuses nan
            p.error(f"--host-cache-gib must be >= 0, got {args.host_cache_gib}")
        settings["engine.host_cache_bytes"] = int(args.host_cache_gib * 2**30)
    if args.pd is not None:
        settings.update(_pd_settings(p, args.pd))
    model = args.model_tag or args.model_flag
    if model:
        # a model named on the command line must exist: never stand a random checkpoint in for it
        settings["model.path"] = model
        settings["model.init_config"] = None
    if args.config is None and Path(DEFAULT_CONFIG).is_file():
        args.config = DEFAULT_CONFIG
    return args, settings


def _pd_settings(p: argparse.ArgumentParser, value: str) -> dict[str, object]:
    """`--pd P:D` as config settings, each of P and D a count N or a range LO-HI (the role starts
    at LO, the autoscaler keeps it within LO..HI). Only the shape is checked here; the counts
    themselves by `PDConfig` (named keys)."""
    parts = value.split(":")
    bounds = [_pd_range(part) for part in parts] if len(parts) == 2 else [None]
    if None in bounds:
        p.error(f"--pd takes P:D (prefill and decode replica counts, e.g. 1:1, or ranges LO-HI, e.g. 1-3:2-4), "
                f"got {value!r}")
    (min_prefill, max_prefill), (min_decode, max_decode) = bounds
    return {"cluster.pd.num_prefill": min_prefill, "cluster.pd.num_decode": min_decode,
            "cluster.pd.min_prefill": min_prefill, "cluster.pd.max_prefill": max_prefill,
            "cluster.pd.min_decode": min_decode, "cluster.pd.max_decode": max_decode,
            "cluster.num_replicas": min_prefill + min_decode,
            "cluster.min_replicas": min_prefill + min_decode, "cluster.max_replicas": max_prefill + max_decode}


def _pd_range(part: str) -> tuple[int, int] | None:
    """'N' -> (N, N), 'LO-HI' -> (LO, HI); None if neither."""
    ends = part.split("-")
    if len(ends) > 2 or not all(end.strip().isdigit() for end in ends):
        return None
    return int(ends[0]), int(ends[-1])


def check_port_free(host: str, port: int) -> None:
    """Raise `ConfigError` if `host:port` cannot be bound (in use, or not an address of this
    machine), before a cluster is started for nothing. Port 0 (any free port) always passes."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as exc:
            why = "is already in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
            raise ConfigError(f"port {port} on {host} {why}; choose another with --port") from None
