"""`hybridserve init-model`: write a random-weight NemotronH-format checkpoint (config.json + safetensors).

    hybridserve init-model --config configs/models/tiny-nemotron-h.yaml --out DIR [--seed S] [--no-mtp]

The YAML holds config.json fields (transformers NemotronHConfig names). Weights are seeded and scaled so
activations stay O(1) through depth: embeddings ~N(0, 1), input projections ~N(0, 1/fan_in), residual
output projections additionally / sqrt(num_layers); A_log = log(1..nheads), D = 1, dt_bias = softplus^-1
of dt log-uniform in [time_step_min, time_step_max] (floored at time_step_floor), as transformers does.
Norm weights get a small jitter around 1 so parity tests exercise them. MoE layers (`E`, with the
NemotronH MoE fields) are written as NVIDIA ships them: one tensor per expert. The file loads both in
`workers.model.loader.load_model` and in transformers' `AutoModelForCausalLM.from_pretrained`
(which ignores the mtp.* tensors).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from workers.model.config import HybridModelConfig
from workers.model.errors import ConfigError
from workers.model.hybrid import HybridForCausalLM

_RESIDUAL_OUT = ("out_proj.weight", "o_proj.weight", "down_proj.weight")


def init_weights(model: HybridForCausalLM, seed: int) -> None:
    """Seeded in-place initialisation of every parameter (deterministic given seed and config)."""
    config = model.config
    g = torch.Generator().manual_seed(seed)
    depth_scale = 1.0 / math.sqrt(max(1, config.num_hidden_layers))

    def normal(shape: torch.Size, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embeddings.weight"):
                value = normal(p.shape, 1.0)
            elif name.endswith("A_log"):
                value = torch.log(torch.arange(1, p.numel() + 1, dtype=torch.float32))
            elif name.endswith(".D"):
                value = torch.ones(p.shape)
            elif name.endswith("dt_bias"):
                lo, hi = math.log(config.time_step_min), math.log(config.time_step_max)
                dt = torch.exp(torch.rand(p.shape, generator=g) * (hi - lo) + lo).clamp(
                    min=config.time_step_floor
                )
                value = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
            elif "conv1d" in name:
                bound = 1.0 / math.sqrt(config.conv_kernel)
                value = (torch.rand(p.shape, generator=g) * 2 - 1) * bound
            elif name.endswith("e_score_correction_bias"):  # MoE routing bias: large enough to matter
                value = normal(p.shape, 0.5)
            elif name.endswith("bias"):
                value = torch.zeros(p.shape)
            elif p.dim() == 1:  # RMSNorm / gated norm weights
                value = 1.0 + normal(p.shape, 0.1)
            else:  # Linear [out, in] or experts [E, out, in]
                std = 1.0 / math.sqrt(p.shape[-1])
                if name.endswith(_RESIDUAL_OUT):
                    std *= depth_scale
                value = normal(p.shape, std)
            p.copy_(value.to(p.dtype))


def write_checkpoint(config: HybridModelConfig, out_dir: str | Path, seed: int = 0) -> Path:
    """Build, initialise and save a model for `config` into out_dir; returns the directory."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = HybridForCausalLM(config, with_mtp=config.num_nextn_predict_layers > 0)
    init_weights(model, seed)
    state = {}
    for k, v in model.state_dict().items():
        if k.endswith(("experts.up_proj", "experts.down_proj")):  # per-expert tensors, as NVIDIA ships them
            for e in range(v.shape[0]):
                state[f"{k.rsplit('.', 1)[0]}.{e}.{k.rsplit('.', 1)[1]}.weight"] = v[e].contiguous()
        else:
            state[k] = v.contiguous()
    if model.tied:
        state.pop("lm_head.weight")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = config.to_hf_dict()
    hf.setdefault("dtype", "float32")
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return out


def _load_yaml(path: str) -> dict:
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: invalid YAML{where}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of config fields, got {type(raw).__name__}")
    return raw


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hybridserve init-model", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML file of NemotronH config fields")
    parser.add_argument("--out", required=True, help="output checkpoint directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-mtp", action="store_true", help="write no MTP head (num_nextn_predict_layers: 0)"
    )
    args = parser.parse_args(argv)
    try:
        raw = _load_yaml(args.config)
        if args.no_mtp:
            raw["num_nextn_predict_layers"] = 0
        config = HybridModelConfig.from_dict(raw)
    except ConfigError as exc:
        print(f"hybridserve init-model: {exc}", file=sys.stderr)
        return 2
    out = write_checkpoint(config, args.out, args.seed)
    print(
        f"wrote {out} (pattern {config.hybrid_override_pattern}, "
        f"mtp {'yes' if config.num_nextn_predict_layers else 'no'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
