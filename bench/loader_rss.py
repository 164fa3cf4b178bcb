"""`python -m bench.loader_rss`: peak RSS of loading a ~1 GB multi-shard checkpoint, as JSON.

Writes a random-weight NemotronH checkpoint (fp32, ~1 GB in 4 safetensors shards), then loads it in
fresh subprocesses and reports each one's peak RSS (VmHWM, memory-mapped file pages included) minus
the RSS of the same process after importing torch and the model code:

    eager_fp32_to_bf16   the pre-issue-13 loader: read every shard into memory, then cast a copy
    stream_fp32          loader.load_model, dtype float32 (the result itself is ~1.1 GB)
    stream_bf16          loader.load_model, dtype bfloat16 (result ~0.55 GB)
    stream_bf16_tp2      loader.load_model, dtype bfloat16, tp_size=2 rank 1 (its share, no lm_head)

Streaming reads one tensor at a time from the memory-mapped shards, one shard open at a time, so its
peak should be about the result plus one shard.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = dict(
    hybrid_override_pattern="M-M*-M-", vocab_size=32000, hidden_size=2048, num_attention_heads=16,
    num_key_value_heads=4, head_dim=128, intermediate_size=4096, mamba_num_heads=64, mamba_head_dim=64,
    ssm_state_size=64, n_groups=8, conv_kernel=4, chunk_size=128,
)


SMALL = dict(CONFIG, vocab_size=4096, hidden_size=256, intermediate_size=512, mamba_num_heads=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)


def write_checkpoint(out: Path, shard_bytes: int, fields: dict = CONFIG) -> int:
    """Random weights, shard by shard (never more than one shard in memory); returns total bytes."""
    import torch
    from safetensors.torch import save_file

    from workers.model.config import HybridModelConfig
    from workers.model.hybrid import HybridForCausalLM

    config = HybridModelConfig.from_dict(fields)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in HybridForCausalLM(config).state_dict().items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config.to_hf_dict()))
    g = torch.Generator().manual_seed(0)
    shard, size, index, total = {}, 0, 1, 0
    for name, shape in shapes.items():
        shard[name] = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        size += shard[name].numel() * 4
        if size >= shard_bytes:
            save_file(shard, str(out / f"model-{index:05d}.safetensors"))
            total, shard, size, index = total + size, {}, 0, index + 1
    if shard:
        save_file(shard, str(out / f"model-{index:05d}.safetensors"))
        total += size
    return total


_CHILD = """
import sys, torch
sys.path.insert(0, {root!r})
import workers.model.loader as loader
mode, path = {mode!r}, {path!r}

def status(key):  # kB; VmHWM is this process's own peak (ru_maxrss would carry the parent's across exec)
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

base = status("VmRSS")
if mode == "eager_fp32_to_bf16":
    from safetensors.torch import load_file
    tensors = {{}}
    for shard in sorted(__import__("pathlib").Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    state = {{k: v.to(torch.bfloat16) for k, v in tensors.items()}}
elif mode == "stream_fp32":
    model = loader.load_model(path, dtype=torch.float32, kernels="torch")
elif mode == "stream_bf16":
    model = loader.load_model(path, dtype=torch.bfloat16, kernels="torch")
elif mode == "stream_bf16_tp2":
    model = loader.load_model(path, dtype=torch.bfloat16, kernels="torch", tp_size=2, tp_rank=1)
print(base, status("VmHWM"))
"""

MODES = ("eager_fp32_to_bf16", "stream_fp32", "stream_bf16", "stream_bf16_tp2")


def measure(path: Path, mode: str) -> dict:
    root = str(Path(__file__).resolve().parents[1])
    code = _CHILD.format(root=root, mode=mode, path=str(path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    base_kb, peak_kb = map(int, out.stdout.split()[-2:])
    return {"peak_rss_mib": round(peak_kb / 1024), "over_baseline_mib": round((peak_kb - base_kb) / 1024)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loader_rss", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="checkpoint dir (written if missing; default: a temp dir)")
    parser.add_argument("--shard-mib", type=float, default=250)
    parser.add_argument("--small", action="store_true", help="a ~17 MB checkpoint (smoke test)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.dir or Path(tmp) / "ckpt")
        fields = SMALL if args.small else CONFIG
        exists = (path / "config.json").exists()
        total = None if exists else write_checkpoint(path, int(args.shard_mib * 2**20), fields)
        shards = sorted(path.glob("*.safetensors"))
        result = {
            "checkpoint_mib": round(sum(s.stat().st_size for s in shards) / 2**20),
            "num_shards": len(shards),
            "largest_shard_mib": round(max(s.stat().st_size for s in shards) / 2**20),
            "written_bytes": total,
            "modes": {mode: measure(path, mode) for mode in MODES},
            "this_process_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
