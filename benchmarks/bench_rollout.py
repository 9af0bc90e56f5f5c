"""Rollout throughput, side by side in one run: one chunk of PrivacyLens cases rolled out and judged by
privact.rollout_chunk (what collect and eval run on each chunk: the agents level by level, then every leaf judged
with the release's protocol), several ways, on the same model, seed and budgets:

- generate-batched:     what a user writes first: a level's prompts sorted by length, left-padded, one
                        model.generate(num_return_sequences=B) per batch of --batch-size sequences;
- generate-per-prompt:  one model.generate(num_return_sequences=B) per prompt (per tree node, per judge prompt);
- privact-per-prompt:   privact.generate with every prompt a family of its own: each prompt prefilled once,
                        its B samples sharing it;
- privact:              privact.generate as collect runs it: prompts that share a prefix (a case's prompts at
                        one level, a leaf's judge prompts) prefilled once per family, its keys and values
                        held once and read once a decode step for all its rows and samples, each prompt's rest
                        once for its samples (cascade attention);
- other:                the generation of another privact.py (--other FILE), e.g. the copying version of commit
                        ad6855c, which copies each family's prefix into every member's row and sample.

Each arm swaps privact.generate (or privact.prefix_families, or the module) and calls rollout_chunk, which clocks
the policy and the judge apart. Sampling draws other trees in each arm; their shapes and budgets are the same, so
the figures are per generated token. Also printed, per arm, from hooks on the model's forward: the seconds of
prefill (forwards of several tokens a row) and of decode (one token a row), and per decode step its rows, the
keys and values its attention reads, per role (a static cache's whole length; privact's, each prefix once, each
prompt's rest once and the generated columns) and the weights, against this CPU's memory bandwidth (a copy of 1
GiB); the processed tokens as a share of the most this CPU pushes through the model (one forward of [--batch-size,
256]) and the decode FLOPs against its matmul ceiling (a [2048, 2048] product in the model's dtype).

    python benchmarks/bench_rollout.py                          # 2 cases, branching 2,2,2, 64 tokens, judge 64
    git show ad6855c:privact.py > /tmp/copying.py               # the copying version
    python benchmarks/bench_rollout.py --arms privact,other --other /tmp/copying.py --split test --cases 4 \\
        --branching 13,1,1 --batch-size 64 --max-new-tokens 96 --temperature 0.7 --dtype bfloat16 --judge-verdict forced
    python benchmarks/bench_rollout.py --tiny DIR               # a tiny random model, seconds (the tests run it)
"""

import json
import math
import os
import platform
import sys
import time

import torch
from transformers import GenerationConfig

import common  # noqa: F401  (puts privact.py on the path)
import privact

ARMS = ("generate-batched", "generate-per-prompt", "privact-per-prompt", "privact")


class ForwardClock:
    """Hooks on a model's forward: seconds of prefill and of decode, and per decode step its rows, the keys and
    values its attention reads and its context (the cache's length)."""

    def __init__(self, model):
        self.weights = sum(p.numel() * p.element_size() for p in model.parameters())
        self.role = "judge"  # whom the model runs for: an agent role or the judge (run_arm sets it)
        model.clock = self
        self.reset()
        model.register_forward_pre_hook(self.before, with_kwargs=True)
        model.register_forward_hook(self.after, with_kwargs=True)

    def reset(self):
        self.seconds = {"prefill": 0.0, "decode": 0.0}
        self.steps = []
        self.processed = 0

    def before(self, module, args, kwargs):
        sync()
        self.start = time.perf_counter()
        self.step = None
        ids = kwargs["input_ids"]
        self.processed += ids.numel()
        cache = kwargs.get("cache")
        if ids.shape[1] == 1 and cache is not None:
            context = int(cache.get_seq_length())
            self.step = {"rows": ids.shape[0], "kv_bytes": kv_bytes(cache), "context": context, "role": self.role}

    def after(self, module, args, kwargs, output):
        sync()
        elapsed = time.perf_counter() - self.start
        self.seconds["decode" if self.step else "prefill"] += elapsed
        if self.step:
            self.steps.append({**self.step, "seconds": elapsed})

    def figures(self, bandwidth, flops_ceiling, flops_per_token):
        """Decode's figures: steps, mean rows, context, MB read a step, seconds a step and the shares of the CPU."""
        steps = self.steps or [{"rows": 0, "kv_bytes": 0, "context": 0, "seconds": 1.0}]
        n = len(self.steps)
        step_seconds = sum(s["seconds"] for s in steps) / len(steps)
        kv = sum(s["kv_bytes"] for s in steps) / len(steps)
        rows = sum(s["rows"] for s in steps) / len(steps)
        figures = {
            "prefill_seconds": round(self.seconds["prefill"], 1),
            "decode_seconds": round(self.seconds["decode"], 1),
        }
        figures.update(decode_steps=n, rows_a_step=round(rows, 1))
        figures["context_a_step"] = round(sum(s["context"] for s in steps) / len(steps))
        figures["kv_mb_a_step"] = round(kv / 2**20, 1)
        by_role = {}
        for step in self.steps:
            by_role.setdefault(step["role"], []).append(step["kv_bytes"])
        figures["kv_mb_a_step_by_role"] = {role: round(sum(b) / len(b) / 2**20, 1) for role, b in by_role.items()}
        figures["weights_mb_a_step"] = round(self.weights / 2**20, 1)
        figures["seconds_a_step"] = round(step_seconds, 4)
        figures["bandwidth_share"] = round((kv + self.weights) / step_seconds / bandwidth, 3)
        figures["flops_share"] = round(rows * flops_per_token / step_seconds / flops_ceiling, 3)
        return figures


def kv_bytes(cache):
    """Bytes of keys and values a decode step's attention reads: of privact's CascadeLayer, each family's prefix
    once (padded to the batch's longest), each prompt's rest once (its samples share it) and the rows' generated
    tokens so far; of any other cache layer, its whole tensor (a static layer is read over its whole length)."""
    total = 0
    for layer in cache.layers:
        tensors = [layer.keys]
        if hasattr(layer, "prefix"):
            tensors = [layer.prefix.keys, layer.rest_keys]
            if layer.is_initialized:  # the generated tokens, appended each step
                tensors.append(layer.keys)
        total += 2 * sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bandwidth(gib=1):
    """Bytes/s of this machine's memory: a copy of `gib` GiB (read and written), the best of three."""
    x = torch.empty(gib * 2**28, dtype=torch.float32)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        x.clone()
        best = max(best, 2 * x.numel() * 4 / (time.perf_counter() - start))
    return best


def matmul_ceiling(dtype, n=2048):
    """FLOP/s of a [n, n] @ [n, n] product in `dtype`, the best of three."""
    a = torch.randn(n, n).to(dtype)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        a @ a
        best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


def load_other(path):
    """Another privact.py, loaded as a module of its own (its generation code as it is there)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("privact_other", path)
    module = importlib.util.module_from_spec(spec)
    # its dataclasses look their module up by name
    sys.modules["privact_other"] = module
    spec.loader.exec_module(module)
    # the bundled data (the judge's prompts) of this checkout
    module.HERE = privact.HERE
    return module


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


def run_arm(arm, cases, chain, models, cfg, other=None):
    """rollout_chunk with `arm`'s generation -> its counts (seconds and generated tokens of policy and judge);
    `other`: the privact module of the arm "other". A model's ForwardClock, if any, is told whom each call runs
    for."""
    real_generate, real_families = privact.generate, privact.prefix_families
    if arm == "generate-batched":
        privact.generate = plain_generate
    elif arm == "generate-per-prompt":
        privact.generate = lambda *a: plain_generate(*a, per_prompt=True)
    elif arm == "privact-per-prompt":
        privact.prefix_families = one_prompt_families
    module = other if arm == "other" else privact
    real_sample, real_judge = module.sample_role, module.judge

    def sample_role(models, cfg, role, chats, width):
        models[role][0].clock.role = role
        return real_sample(models, cfg, role, chats, width)

    def judge(models, cfg, chats, kind):
        models["judge"][0].clock.role = "judge"
        return real_judge(models, cfg, chats, kind)

    if hasattr(models["judge"][0], "clock"):
        module.sample_role, module.judge = sample_role, judge
    try:
        torch.manual_seed(cfg.seed)
        _, counts = module.rollout_chunk(cases, module.Chain(*chain), models, cfg)
    finally:
        privact.generate, privact.prefix_families = real_generate, real_families
        module.sample_role, module.judge = real_sample, real_judge
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


def parse_args():
    ap = common.parser(
        __doc__, model="smollm2", batch_size=16, max_new_tokens=64, judge_max_new_tokens=64, temperature=1.0
    )
    ap.add_argument("--dtype", default="auto", help="the policy's and judge's weights: auto (collect's), float32, ...")
    ap.add_argument("--split", default="train", help="the cases' split: train (collect's) or test (eval's)")
    ap.add_argument("--cases", type=int, default=2, help="cases in the chunk, the split's first (default: 2)")
    ap.add_argument(
        "--branching", default="2,2,2", help="children per node at each level (default: 2,2,2; eval: K,1,1)"
    )
    ap.add_argument("--judge-verdict", default="generated", help="generated (the release's) or forced (one token)")
    ap.add_argument("--arms", default=",".join(ARMS), help="the arms to run, comma separated, in this order")
    ap.add_argument("--other", default="", help="another privact.py, run as the arm 'other'")
    ap.add_argument("--tiny", metavar="DIR", help="a tiny model folder instead of --model: 1 case, 1,2,2, 8 tokens")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    if args.tiny:
        args.model, args.max_new_tokens, args.judge_max_new_tokens = args.tiny, 8, 8
        args.cases, args.branching = 1, "1,2,2"
    return args


def report(arm, counts, clock, args, ceilings):
    """One arm's figures: seconds per 1k tokens, per chain (the policy's: a leaf is a chain) and per case, prefill
    and decode, and the shares of the CPU's limits."""
    seconds = counts["policy_seconds"] + counts["judge_seconds"]
    tokens = counts["policy_tokens"] + counts["judge_tokens"]
    chains = args.cases * math.prod(privact.parse_branching(args.branching, ["generator", "verifier", "refiner"]))
    figures = {**counts, "seconds_per_1k_tokens": round(1000 * seconds / tokens, 2)}
    figures["policy_seconds_per_chain"] = round(counts["policy_seconds"] / chains, 3)
    figures["cases_per_hour"] = round(3600 * args.cases / seconds, 1)
    figures["processed_share_of_ceiling"] = round(clock.processed / seconds / ceilings["forward"], 3)
    figures.update(clock.figures(ceilings["bandwidth"], ceilings["matmul"], ceilings["flops_per_token"]))
    print(
        f"{arm:>19}: policy {counts['policy_tokens']} tokens in {counts['policy_seconds']:.1f} s "
        f"({figures['policy_seconds_per_chain']} s a chain), judge {counts['judge_tokens']} in "
        f"{counts['judge_seconds']:.1f} s: {figures['seconds_per_1k_tokens']} s per 1k tokens; prefill "
        f"{figures['prefill_seconds']} s, decode {figures['decode_seconds']} s in {figures['decode_steps']} steps of "
        f"{figures['rows_a_step']} rows at context {figures['context_a_step']}: {figures['seconds_a_step']} s a step "
        f"reading {figures['kv_mb_a_step']} MB of keys and values ({figures['kv_mb_a_step_by_role']}) and "
        f"{figures['weights_mb_a_step']} MB of weights "
        f"({figures['bandwidth_share']:.0%} of the memory bandwidth, {figures['flops_share']:.0%} of the matmul "
        f"ceiling)",
        flush=True,
    )
    return figures


def main():
    args = parse_args()
    arms = args.arms.split(",")
    other = load_other(args.other) if "other" in arms else None
    branching = privact.parse_branching(args.branching, ["generator", "verifier", "refiner"])
    # collect's --dtype auto
    dtype = args.dtype if args.dtype != "auto" else "bfloat16" if torch.cuda.is_available() else "float32"
    cfg = privact.CollectConfig(
        model=args.model,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        judge_max_new_tokens=args.judge_max_new_tokens,
        temperature=args.temperature,
        judge_verdict=args.judge_verdict,
        branching=args.branching,
        dtype=dtype,
    )
    cases = privact.load_cases("", args.split, args.cases)
    chain = privact.Chain(privact.parse_topology(cfg.topology), branching)
    paths = dict.fromkeys((*chain.roles, "judge"), args.model)
    tokenizers = privact.load_tokenizers(paths, "")
    models = privact.load_models(paths, tokenizers, cfg.dtype, "")
    model = models["judge"][0]
    ceilings = {"forward": forward_ceiling(model, args.batch_size), "bandwidth": bandwidth()}
    ceilings["matmul"] = matmul_ceiling(model.dtype)
    # a decode step's FLOPs per row: a matmul per weight, two per key and value (the context's share left out)
    ceilings["flops_per_token"] = 2 * sum(p.numel() for p in model.parameters())
    clock = ForwardClock(model)
    # an untimed call wakes the process up (allocator, threads, kernels)
    run_arm("privact", cases[:1], privact.Chain(chain.roles, [1, 1, 1]), models, cfg)
    results = {}
    for arm in arms:
        clock.reset()
        counts = run_arm(arm, cases, chain, models, cfg, other)
        results[arm] = report(arm, counts, clock, args, ceilings)
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
    result.update(ceilings={key: round(value) for key, value in ceilings.items()}, arms=results, speedups=ratios)
    result["versions"] = privact.provenance()["versions"]
    if args.json:
        privact.write_json(args.json, result)
    print(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
