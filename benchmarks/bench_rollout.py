"""Rollout throughput, side by side in one run: one chunk of PrivacyLens cases rolled out and judged by
privact.rollout_chunk (what collect runs on each chunk: the agents level by level, then every leaf judged
with the release's protocol), four ways, on the same model, seed and budgets:

- generate-batched:     what a user writes first: a level's prompts sorted by length, left-padded, one
                        model.generate(num_return_sequences=B) per batch of --batch-size sequences;
- generate-per-prompt:  one model.generate(num_return_sequences=B) per prompt (per tree node, per judge prompt);
- privact-per-prompt:   privact.generate with every prompt a family of its own: each prompt prefilled once,
                        its B samples sharing that cache;
- privact:              privact.generate as collect runs it: prompts that share a prefix (a case's prompts at
                        one level, a leaf's judge prompts) prefilled once per family.

Each arm swaps privact.generate (or privact.prefix_families) and calls rollout_chunk, which clocks the policy
and the judge apart. Sampling draws other trees in each arm; their shapes and budgets are the same, so the
figures are per generated token. Also printed: every token the model processed per second (prompts,
padding and finished rows included, counted by a hook on the model's forward) as a share of the most this
CPU does, one forward of [--batch-size, 256] tokens.

    python benchmarks/bench_rollout.py                          # 2 cases, branching 2,2,2, 64 tokens, judge 64
    python benchmarks/bench_rollout.py --tiny                   # a tiny random model, seconds (the tests run it)
"""

import dataclasses
import json
import os
import platform
import time

import torch
from transformers import GenerationConfig

import common  # noqa: F401  (puts privact.py on the path)
import privact

ARMS = ("generate-batched", "generate-per-prompt", "privact-per-prompt", "privact")


def plain_generate(model, tok, chats, decoding, cfg, per_prompt=False):
    """privact.generate's contract (rendering, sampling, stops, Completions) through plain model.generate:
    one call per batch of length-sorted prompts (or per prompt), each prompt repeated B times by
    num_return_sequences, so every sample prefills its prompt."""
    texts = [privact.chat_text(tok, chat, not decoding.as_release) + decoding.prefix for chat in chats]
    prompts = tok(texts, add_special_tokens=decoding.as_release)["input_ids"]
    ends = model.generation_config.eos_token_id
    ends = ends if isinstance(ends, list) else [ends]
    sampling = {"do_sample": False}
    if decoding.temperature:
        sampling = {"do_sample": True, "temperature": decoding.temperature, "top_k": 0, "top_p": 1.0}
    gen = GenerationConfig(
        max_new_tokens=decoding.max_new_tokens,
        num_return_sequences=decoding.samples,
        pad_token_id=tok.pad_token_id,
        eos_token_id=sorted({tok.eos_token_id, *ends} - {None}),
        stop_strings=decoding.stop,
        **sampling,
    )
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    per_batch = 1 if per_prompt else max(1, cfg.batch_size // decoding.samples)
    results = [None] * len(prompts)
    for first in range(0, len(order), per_batch):
        batch = order[first : first + per_batch]
        padded = tok.pad({"input_ids": [prompts[i] for i in batch]}, padding_side="left", return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(
                **padded.to(model.device),
                generation_config=gen,
                tokenizer=tok,
                prefix_allowed_tokens_fn=decoding.allowed,
            )
        width = padded["input_ids"].shape[1]
        completions = privact.completions_of(tok, out, width, decoding, gen.eos_token_id)
        for j, i in enumerate(batch):
            results[i] = completions[j * decoding.samples : (j + 1) * decoding.samples]
    return results


def one_prompt_families(prompts):
    """privact.prefix_families' shape with every prompt alone: prefill once per prompt, no cross-prompt sharing."""
    return [[i] for i in range(len(prompts))]


def run_arm(arm, cases, chain, models, cfg):
    """rollout_chunk with `arm`'s generation -> its counts (seconds and generated tokens of policy and judge)."""
    real_generate, real_families = privact.generate, privact.prefix_families
    if arm == "generate-batched":
        privact.generate = plain_generate
    elif arm == "generate-per-prompt":
        privact.generate = lambda *a: plain_generate(*a, per_prompt=True)
    elif arm == "privact-per-prompt":
        privact.prefix_families = one_prompt_families
    try:
        torch.manual_seed(cfg.seed)
        _, counts = privact.rollout_chunk(cases, chain, models, cfg)
    finally:
        privact.generate, privact.prefix_families = real_generate, real_families
    return counts


def forward_ceiling(model, batch_size, length=256):
    """Tokens/s of one forward over [batch_size, length] random ids (the best of three): the most this machine
    pushes through the model per second, which decoding (a few tokens per row per pass) stays below."""
    ids = torch.randint(0, model.config.vocab_size, (batch_size, length), device=model.device)
    best = 0.0
    with torch.inference_mode():
        for _ in range(3):
            start = time.perf_counter()
            model(input_ids=ids, logits_to_keep=1)
            best = max(best, ids.numel() / (time.perf_counter() - start))
    return best


def cpu_name():
    """The CPU's model name (lscpu's), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main():
    ap = common.parser(__doc__, model="smollm2", batch_size=16, max_new_tokens=64, judge_max_new_tokens=64)
    ap.add_argument("--cases", type=int, default=2, help="train cases in the chunk (default: 2)")
    ap.add_argument("--branching", default="2,2,2", help="children per node at each level (default: 2,2,2)")
    ap.add_argument("--arms", default=",".join(ARMS), help="the arms to run, comma separated, in this order")
    ap.add_argument("--tiny", metavar="DIR", help="a tiny model folder instead of --model: 1 case, 1,2,2, 8 tokens")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    if args.tiny:
        args.model, args.max_new_tokens, args.judge_max_new_tokens = args.tiny, 8, 8
        args.cases, args.branching = 1, "1,2,2"
    arms = args.arms.split(",")
    branching = privact.parse_branching(args.branching, ["generator", "verifier", "refiner"])
    cfg = privact.CollectConfig(
        model=args.model,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        judge_max_new_tokens=args.judge_max_new_tokens,
        branching=args.branching,
    )
    cases = privact.load_cases("", "train", args.cases)
    chain = privact.Chain(privact.parse_topology(cfg.topology), branching)
    # collect's --dtype auto
    cfg = dataclasses.replace(cfg, dtype="bfloat16" if torch.cuda.is_available() else "float32")
    paths = dict.fromkeys((*chain.roles, "judge"), args.model)
    tokenizers = privact.load_tokenizers(paths, "")
    models = privact.load_models(paths, tokenizers, cfg.dtype, "")
    model = models["judge"][0]
    processed = [0]
    model.register_forward_pre_hook(
        lambda module, a, kw: processed.__setitem__(0, processed[0] + kw["input_ids"].numel()), with_kwargs=True
    )
    ceiling = forward_ceiling(model, args.batch_size)
    # an untimed call wakes the process up (allocator, threads, kernels)
    run_arm("privact", cases[:1], privact.Chain(chain.roles, [1, 1, 1]), models, cfg)
    results = {}
    for arm in arms:
        processed[0] = 0
        counts = run_arm(arm, cases, chain, models, cfg)
        seconds = counts["policy_seconds"] + counts["judge_seconds"]
        tokens = counts["policy_tokens"] + counts["judge_tokens"]
        results[arm] = {**counts, "seconds_per_1k_tokens": round(1000 * seconds / tokens, 2)}
        results[arm]["processed_share_of_ceiling"] = round(processed[0] / seconds / ceiling, 3)
        print(
            f"{arm:>19}: policy {counts['policy_tokens']} tokens in {counts['policy_seconds']:.1f} s, judge "
            f"{counts['judge_tokens']} in {counts['judge_seconds']:.1f} s: {1000 * seconds / tokens:.1f} s per 1k "
            f"tokens; the model processed {processed[0] / seconds:.0f} tokens/s, "
            f"{results[arm]['processed_share_of_ceiling']:.0%} of {ceiling:.0f}",
            flush=True,
        )
    # each arm against the first (what a user writes), and the prefix families against prefill-once-per-prompt
    comparisons = [(arms[0], arm) for arm in arms[1:]]
    if "privact" in arms and "privact-per-prompt" in arms:
        comparisons.append(("privact-per-prompt", "privact"))
    ratios = {}
    for slower, faster in comparisons:
        ratio = results[slower]["seconds_per_1k_tokens"] / results[faster]["seconds_per_1k_tokens"]
        ratios[f"{faster} over {slower}"] = round(ratio, 2)
        print(f"{faster} over {slower}: {ratio:.2f}x")
    result = {"bench": "rollout", "args": vars(args), "cpu": cpu_name(), "threads": torch.get_num_threads()}
    result.update(ceiling_tokens_per_s=round(ceiling), arms=results, speedups=ratios)
    result["versions"] = privact.provenance()["versions"]
    if args.json:
        privact.write_json(args.json, result)
    print(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
