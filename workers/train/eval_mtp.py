"""MTP acceptance of a checkpoint on held-out stdlib text; prints JSON.

    python -m workers.train.eval_mtp [--model configs/models/tiny-trained] [--num-prompts 8] [--max-tokens 64]

first_token_rate: on held-out windows (teacher forcing), how often the MTP head's greedy draft for t+2
equals the target's greedy next token at t+1 (computed with transformers + the saved mtp.* tensors).
engine_*: the real LLMEngine (num_spec_tokens=3, greedy): num_draft_accepted / num_draft_proposed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from workers.train import byte_tokenizer
from workers.train.train_tiny import TrainMTP, load_corpus


def first_token_rate(model_dir: str, hold: list[int], num_windows: int = 8, seq: int = 256) -> float:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from workers.model.config import HybridModelConfig

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = HybridModelConfig.from_dict(json.load(open(f"{model_dir}/config.json")))
    mtp = TrainMTP(config)
    state = load_file(f"{model_dir}/model.safetensors")
    mtp.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("mtp.")})
    ids = torch.tensor(hold)
    step = max(1, (len(ids) - seq) // num_windows)
    batch = torch.stack([ids[i * step : i * step + seq] for i in range(num_windows)])
    with torch.no_grad():
        h = hf.model(input_ids=batch).last_hidden_state
        target = hf.lm_head(h).argmax(-1)  # greedy t_{p+1}
        # drafter sees the target's greedy token at p+1, proposes t_{p+2}; compare with target's at p+1
        draft = hf.lm_head(mtp(h[:, :-1], hf.get_input_embeddings()(target[:, :-1]))).argmax(-1)
    return (draft == target[:, 1:]).float().mean().item()


def engine_rates(model_dir: str, hold: list[int], num_prompts: int, prompt_len: int, max_tokens: int) -> dict:
    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine
    from workers.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_checkpoint(model_dir, EngineConfig(num_spec_tokens=3, kernels="torch"))
    step = max(1, (len(hold) - prompt_len) // num_prompts)
    prompts = [hold[i * step : i * step + prompt_len] for i in range(num_prompts)]
    t0 = time.time()
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    proposed = sum(o.num_draft_proposed for o in outs)
    accepted = sum(o.num_draft_accepted for o in outs)
    return {"engine_num_draft_proposed": proposed, "engine_num_draft_accepted": accepted,
            "engine_acceptance": accepted / max(1, proposed), "engine_wall_s": round(time.time() - t0, 1),
            "sample": byte_tokenizer.decode(list(outs[0].token_ids))}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.train.eval_mtp", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="configs/models/tiny-trained")
    p.add_argument("--seed", type=int, default=0, help="the training seed (same holdout split)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    a = p.parse_args(argv)
    _, hold = load_corpus(a.seed)
    result = {"first_token_rate": first_token_rate(a.model, hold)}
    result.update(engine_rates(a.model, hold, a.num_prompts, a.prompt_len, a.max_tokens))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
