"""Evaluation's memory plan: what evaluate.py holds on its GPU for each benchmark, from the model's
config alone (no weights are read).

    python evaluate.py --model deepseek-r1-distill-qwen-7b --benchmarks aime24,math500 --plan --gpu-mem 80

Per GPU, with N parameters (bf16 = 2 bytes); one benchmark's calls run one after another:
  weights         the bf16 model                                                    2 N
  generation      one call's static K/V (batch questions x n samples rows, positions prompt +
                  max_new_tokens - 1, bucketed: harness/staticcache.py) and the prompts' prefill
                  (one layer's forward); freed before the features (evaluation/confidence.py)
  features        one score_batch forward over prompt + response without a cache: one layer's
                  forward and the decoder's output
  early exit      a chunk of forced answers at the exit checkpoints: as many cuts (at most rows,
                  k = 1) as the memory left holds (plan.label_chunk), each its prefill cache row,
                  its static row and the tail prefill's expanded K/V of one layer
  runtime         CUDA context and allocator slack (1 GiB)
peak = weights + runtime + max(generation, features, early exit). The post-hoc probe's rollouts
have the generation's shape. The plan refuses, with the --batch-size that fits, a benchmark whose
peak exceeds the GPU.
"""
from harness import plan
from harness.files import UserError
from harness.staticcache import buffer_shape

GiB = plan.GiB


def estimate(config, s, mem, prompt_tokens=plan.PROMPT_TOKENS, early_exit=True):
    """Bytes per term (dict, in the order printed) for one benchmark's settings `s` (the settings of
    evaluation/benchmarks.py: batch, n, max_new_tokens, score_batch, rows) on a GPU of `mem` bytes; 'cuts':
    the early exit's chunk."""
    d, d_ff = config.hidden_size, config.intermediate_size
    layer = lambda tokens: tokens * (8 * d + 3 * d_ff) * 2  # noqa: E731  one layer's forward, bf16
    weights, runtime = 2 * plan.param_counts(config)[0], plan.RUNTIME["cuda"]
    shape = buffer_shape(s["batch"] * s["n"], prompt_tokens, s["max_new_tokens"])
    length = prompt_tokens + s["max_new_tokens"]
    t = {"weights": weights,
         "generation": shape[0] * shape[1] * plan.kv_bytes_per_token(config, 2) + layer(s["batch"] * prompt_tokens),
         "features": layer(s["score_batch"] * length) + s["score_batch"] * length * d * 2}
    width = length + plan.FORCED_SUFFIX
    left = 0.9 * (mem - weights - runtime)  # plan.free_bytes: a tenth kept for fragmentation
    t["cuts"] = plan.label_chunk(s["rows"], 1, width, config, left) if early_exit else 0
    t["early exit"] = t["cuts"] * plan.cut_bytes(1, width, config)
    t["runtime"] = runtime
    t["peak"] = weights + runtime + max(t["generation"], t["features"], t["early exit"])
    t["shape"] = shape
    return t


def check(model, benches, mem_gib, log=print, early_exit=True):
    """Print each benchmark's plan for `model` on one GPU of mem_gib GiB ([(name, settings)]);
    UserError on the first that cannot fit, naming the --batch-size that would."""
    config, mem = plan.model_config(model), mem_gib * GiB
    out = {}
    for name, s in benches:
        t = out[name] = estimate(config, s, mem, early_exit=early_exit)
        log(f"plan: {name} on 1 x {mem_gib:.0f} GiB GPU: weights {t['weights'] / GiB:.1f}, generation "
            f"{t['generation'] / GiB:.1f} ({t['shape'][0]} rows x {t['shape'][1]}), features {t['features'] / GiB:.1f}, "
            f"early exit {t['early exit'] / GiB:.1f} ({t['cuts']} cuts per chunk), runtime "
            f"{t['runtime'] / GiB:.1f}: peak {t['peak'] / GiB:.1f} GiB")
        if t["peak"] > mem:
            q = s["batch"]
            while q > 1 and estimate(config, dict(s, batch=q), mem, early_exit=early_exit)["peak"] > mem:
                q //= 2
            fix = f"--batch-size {q}" if estimate(config, dict(s, batch=q), mem, early_exit=early_exit)["peak"] <= mem \
                else "a GPU with more memory"
            raise UserError(f"plan: {name} needs a peak of {t['peak'] / GiB:.1f} GiB, more than {mem_gib:.0f}; fix: {fix}")
    return out
