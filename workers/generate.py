"""`hybridserve generate`: run prompts through one engine and print JSON per run.

    hybridserve generate --model DIR --token-ids 1,2,3 --max-tokens 16 --repeat 2

`--repeat 2` sends the same prompt cold, then warm, on one engine: the second run's
`hit_tokens` is the prefix-cache hit and its `token_ids` must equal the first run's.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from workers.engine.errors import EngineConfigError, InvalidRequestError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        print(f"hybridserve generate: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hybridserve generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--token-ids", required=True, help="comma-separated prompt token ids")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-spec-tokens", type=int, default=3)
    p.add_argument("--eagle-mode", default="lossless", choices=["drop", "lossless"])
    p.add_argument("--retention", default="latest")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--prefix-cache", default="on", choices=["on", "off"])
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--kernels", default="auto", choices=["auto", "torch", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        tokens = [int(t) for t in args.token_ids.split(",") if t.strip()]
    except ValueError:
        print("hybridserve generate: error: --token-ids must be comma-separated integers", file=sys.stderr)
        return 2
    if args.repeat < 1:
        print("hybridserve generate: error: --repeat must be >= 1", file=sys.stderr)
        return 2
    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine
    from workers.engine.sampling_params import SamplingParams
    from workers.model.errors import ModelError

    try:
        config = EngineConfig(
            max_model_len=args.max_model_len, num_spec_tokens=args.num_spec_tokens, eagle_mode=args.eagle_mode,
            retention=args.retention, enable_prefix_caching=args.prefix_cache == "on", kernels=args.kernels,
            dtype=args.dtype, device=args.device,
        )
        engine = LLMEngine.from_checkpoint(args.model, config)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
        for run in range(args.repeat):
            t0 = time.perf_counter()
            (out,) = engine.generate([tokens], params)
            print(json.dumps({
                "run": run, "token_ids": list(out.token_ids), "hit_tokens": out.num_cached_tokens,
                "ttft_s": round(out.ttft_s, 6), "total_s": round(time.perf_counter() - t0, 6),
                "finish_reason": out.finish_reason, "num_prompt_tokens": out.num_prompt_tokens,
                "num_draft_proposed": out.num_draft_proposed, "num_draft_accepted": out.num_draft_accepted,
            }), flush=True)
    except (InvalidRequestError, EngineConfigError, ModelError) as exc:
        print(f"hybridserve generate: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
