"""Engine throughput vs concurrency: `python -m bench.engine --concurrency 1,4,16,32`.

For each level C, C requests (distinct windows of held-out text, `prompt_len` tokens each, greedy,
`num_tokens` outputs, EOS ignored) are submitted at once to one engine and run to completion; output
tokens/s = output tokens / wall time from submission to the last finish (prefill included). Levels run
interleaved over the repeats (order reversed every other repeat, a fresh cache salt each run, so no run
hits another's prefix) and times are summed per level, so load drift on a shared machine hits every level
alike. Ratios are against the first level of the same run. Besides wall time the process CPU time is
reported (`output_tokens_per_cpu_s`): with `--threads 1` it is what the run would take on an idle core,
which is the steadier number on a machine shared with other jobs.

Correctness rides along: prompt i's output must be the same at every level that ran it (a request's
tokens do not depend on what it was batched with).
"""

from __future__ import annotations

import time


def measure_concurrency(model, levels: list[int], prompts: list[list[int]], num_tokens: int, repeats: int,
                        num_spec_tokens: int = 0, eagle: str = "lossless") -> dict:
    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine
    from workers.engine.sampling_params import SamplingParams

    if not levels or min(levels) < 1:
        raise ValueError(f"concurrency levels must be positive integers, got {levels}")
    if len(prompts) < max(levels):
        raise ValueError(f"need {max(levels)} prompts for concurrency {max(levels)}, got {len(prompts)}")
    prompt_len = max(len(p) for p in prompts)
    config = EngineConfig(
        max_num_seqs=max(levels),  # every level runs all its requests at once
        num_spec_tokens=num_spec_tokens,
        eagle_mode=eagle,
        max_model_len=prompt_len + num_tokens + 64,
        cache_memory_bytes=1024 * 2**20,  # up-front reservation of max(levels) requests must fit
    )
    engine = LLMEngine(model, config)
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[: max(levels)], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                    cache_salt="warmup")  # one-time init costs at the largest batch shapes
    seconds = dict.fromkeys(levels, 0.0)
    cpu_seconds = dict.fromkeys(levels, 0.0)
    num_output = dict.fromkeys(levels, 0)
    outputs: dict[int, list[tuple[int, ...]]] = {}  # prompt index -> its output at each level
    for r in range(repeats):
        for level in levels if r % 2 == 0 else levels[::-1]:
            t0, c0 = time.perf_counter(), time.process_time()
            done = engine.generate(prompts[:level], params, cache_salt=f"c{level}-r{r}")
            seconds[level] += time.perf_counter() - t0
            cpu_seconds[level] += time.process_time() - c0
            num_output[level] += sum(len(o.token_ids) for o in done)
            for i, o in enumerate(done):
                outputs.setdefault(i, []).append(o.token_ids)
    base = levels[0]
    rate = {c: num_output[c] / seconds[c] for c in levels}
    cpu_rate = {c: num_output[c] / cpu_seconds[c] for c in levels}
    return {
        "prompt_len": prompt_len, "output_tokens": num_tokens, "repeats": repeats,
        "num_spec_tokens": num_spec_tokens,
        "levels": [{"concurrency": c, "output_tokens_per_s": round(rate[c], 1),
                    "seconds": round(seconds[c], 3), f"ratio_vs_{base}": round(rate[c] / rate[base], 2),
                    "output_tokens_per_cpu_s": round(cpu_rate[c], 1),
                    f"cpu_ratio_vs_{base}": round(cpu_rate[c] / cpu_rate[base], 2)}
                   for c in levels],
        "outputs_equal_across_levels": all(len(set(outs)) == 1 for outs in outputs.values()),
    }
