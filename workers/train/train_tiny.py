"""`hybridserve train-tiny`: train the tiny hybrid (base + MTP head) on the Python stdlib's source, on CPU.

    hybridserve train-tiny --out DIR [--steps N] [--seed S] [--threads T]

Seeded and deterministic on CPU for a fixed step count and thread count: the shipped checkpoint's
train_log.json records its command and the loss at steps 10/20/30 (`check_losses`), which a from-scratch
run with `--stop-after 30` reproduces (tests/train). `--minutes M` trains to a wall-clock budget instead
(not reproducible under CPU contention).

The base model trains as transformers' NemotronHForCausalLM (same tensor names as ours); the MTP head is a
small training twin of workers/model/mtp.py (same mtp.* names and shapes) predicting t_{p+2} from
(h_p, embed(t_{p+1})). Both are saved into one safetensors file that load_model and transformers read.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from workers.model.config import HybridModelConfig
from workers.model.init_model import _load_yaml, write_checkpoint
from workers.train import byte_tokenizer

DEFAULT_CONFIG = "configs/models/tiny-nemotron-h.yaml"
DEFAULT_STEPS = 1000  # ~0.55 s/step on 2 uncontended cores: ~10 min with the evals
CHECK_STEPS = (10, 20, 30)  # train_log.json's check_losses: what a from-scratch run must reproduce


def load_corpus(seed: int, max_files: int = 400, holdout_frac: float = 0.1) -> tuple[list[int], list[int]]:
    """Sorted stdlib *.py files, a seeded sample; the last holdout_frac of the sample is held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    files = random.Random(seed).sample(files, min(max_files, len(files)))
    num_hold = max(1, int(len(files) * holdout_frac))
    def ids(ps):
        out: list[int] = []
        for p in ps:
            out += byte_tokenizer.encode(p.read_text(errors="replace")[:20000]) + [byte_tokenizer.EOS_ID]
        return out
    return ids(files[:-num_hold]), ids(files[-num_hold:])


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Attn(nn.Module):
    def __init__(self, c: HybridModelConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)

    def forward(self, x):  # [B, S, H], causal, no positional embedding
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.nkv, self.hd).transpose(1, 2)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class Mlp(nn.Module):
    def __init__(self, c: HybridModelConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.relu(self.up_proj(x)).pow(2))


class TrainMTP(nn.Module):
    """Training twin of workers.model.mtp.MTPHead for mtp_hybrid_override_pattern '*-' (names match)."""

    def __init__(self, c: HybridModelConfig) -> None:
        super().__init__()
        eps, h = c.layer_norm_epsilon, c.hidden_size
        l0, l1 = nn.Module(), nn.Module()
        l0.enorm, l0.hnorm, l0.norm = RMSNorm(h, eps), RMSNorm(h, eps), RMSNorm(h, eps)
        l0.eh_proj = nn.Linear(2 * h, h, bias=False)
        l0.mixer = Attn(c)
        l1.norm, l1.final_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        l1.mixer = Mlp(c)
        self.layers = nn.ModuleList([l0, l1])

    def forward(self, h, e):  # h_p [B,S,H] after final norm, e = embed(t_{p+1})
        l0, l1 = self.layers
        x = l0.eh_proj(torch.cat([l0.enorm(e), l0.hnorm(h)], dim=-1))
        x = x + l0.mixer(l0.norm(x))
        x = x + l1.mixer(l1.norm(x))
        return l1.final_layernorm(x)


def losses(model, mtp, batch):
    """batch [B, S+1] -> (next-token loss, MTP loss for t+2)."""
    inp, tgt = batch[:, :-1], batch[:, 1:]
    h = model.model(input_ids=inp).last_hidden_state  # [B, S, H] after norm_f
    logits = model.lm_head(h)
    base = F.cross_entropy(logits.flatten(0, 1), tgt.flatten())
    e = model.get_input_embeddings()(tgt[:, :-1])  # t_{p+1}
    d = model.lm_head(mtp(h[:, :-1], e))
    draft = F.cross_entropy(d.flatten(0, 1), tgt[:, 1:].flatten())
    return base, draft


def sample_batch(ids: torch.Tensor, batch: int, seq: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=g)
    return torch.stack([ids[s : s + seq + 1] for s in starts.tolist()])


def evaluate(model, mtp, ids, seq, g, num_batches=4, batch=8):
    with torch.no_grad():
        vals = [losses(model, mtp, sample_batch(ids, batch, seq, g)) for _ in range(num_batches)]
    return sum(v[0].item() for v in vals) / len(vals), sum(v[1].item() for v in vals) / len(vals)


def save(model, mtp, config: HybridModelConfig, out: Path) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    state.update({f"mtp.{k}": v.detach().contiguous().clone() for k, v in mtp.state_dict().items()})
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = config.to_hf_dict()
    hf.setdefault("dtype", "float32")
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    byte_tokenizer.write_tokenizer(out)


def plot(log: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in log], [r["loss"] for r in log], label="train")
    ax.plot([r["step"] for r in log], [r["mtp_loss"] for r in log], label="train mtp (t+2)")
    ev = [r for r in log if "holdout_loss" in r]
    ax.plot([r["step"] for r in ev], [r["holdout_loss"] for r in ev], "o-", label="holdout")
    ax.set_xlabel("step"), ax.set_ylabel("cross-entropy (nats/byte)"), ax.legend()
    fig.tight_layout(), fig.savefig(path, dpi=80), plt.close(fig)


def train(out: Path, minutes: float | None, steps: int | None, seed: int, config_path: str, batch: int, seq: int,
          lr: float, stop_after: int | None = None, command: str = "") -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = HybridModelConfig.from_dict(_load_yaml(config_path))
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(config, tmp, seed)  # our seeded init, read back by transformers
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    model.train()
    mtp = TrainMTP(config)
    train_ids, hold_ids = (torch.tensor(x) for x in load_corpus(seed))
    params = list(model.parameters()) + list(mtp.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    g, g_eval = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    total = steps if steps is not None else None  # None: train to the minutes budget (cosine over time)
    budget_s = (minutes or 0.0) * 60
    last = min(total, stop_after) if total is not None and stop_after is not None else stop_after
    t0, log, step = time.time(), [], 0
    bar = tqdm(total=last or total, desc="train-tiny", unit="step", file=sys.stderr, mininterval=2.0)
    while (step < total) if total is not None else (time.time() - t0 < budget_s):
        if last is not None and step >= last:
            break
        frac = step / total if total else (time.time() - t0) / budget_s
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        base, draft = losses(model, mtp, sample_batch(train_ids, batch, seq, g))
        opt.zero_grad()
        (base + draft).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        rec = {"step": step, "time_s": round(time.time() - t0, 1), "loss": base.item(), "mtp_loss": draft.item()}
        if step % 25 == 0 or step == 1:
            model.eval()
            rec["holdout_loss"], rec["holdout_mtp_loss"] = evaluate(model, mtp, hold_ids, seq, g_eval)
            model.train()
            tqdm.write(json.dumps(rec), file=sys.stderr)
        bar.update(1)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", mtp=f"{rec['mtp_loss']:.3f}", refresh=False)
        log.append(rec)
    bar.close()
    model.eval()
    final = evaluate(model, mtp, hold_ids, seq, g_eval, num_batches=8)
    out.mkdir(parents=True, exist_ok=True)
    save(model, mtp, config, out)
    summary = {"command": command, "seed": seed, "steps": step, "schedule_steps": total,
               "torch_threads": torch.get_num_threads(), "train_time_s": round(time.time() - t0, 1),
               "s_per_step": round((time.time() - t0) / max(1, step), 3), "batch": batch, "seq_len": seq, "lr": lr,
               "num_train_tokens": len(train_ids), "num_holdout_tokens": len(hold_ids),
               "final_train_loss": sum(r["loss"] for r in log[-20:]) / len(log[-20:]),
               "final_holdout_loss": final[0], "final_holdout_mtp_loss": final[1],
               "check_losses": {str(r["step"]): r["loss"] for r in log if r["step"] in CHECK_STEPS}, "log": log}
    (out / "train_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(log, out / "loss.png")
    return summary


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hybridserve train-tiny", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="fixed step count (cosine schedule length)")
    parser.add_argument("--minutes", type=float, default=None, help="train to a wall-clock budget instead of --steps")
    parser.add_argument("--stop-after", type=int, default=None, help="stop early, keeping the --steps schedule")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (results depend on it)")
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = None if args.minutes is not None else args.steps
    command = "hybridserve train-tiny " + " ".join(argv)
    s = train(Path(args.out), args.minutes, steps, args.seed, args.config, args.batch, args.seq, args.lr,
              args.stop_after, command)
    print(json.dumps({k: v for k, v in s.items() if k != "log"}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
