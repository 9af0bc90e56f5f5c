"""GPU cost of a paper-scale reproduction, measured on randomly initialised models of the paper's
shapes (nothing comes from the hub; the tokenizer is a saved SmolLM2 one, --tokenizer, or the
embedded GGUF's).

- policy: Llama-3.2-1B-Instruct's exact architecture; judge: Mistral-7B-Instruct-v0.2's, its
  vocabulary grown from 32,000 to the tokenizer's 49,152 ids (2% more weights) so that a server can
  run it. The policy's 128,256 ids hold the tokenizer's; it writes only ids the tokenizer has.
- collect: the paper's tree (--branching 4,4,4; --tiny: 2,2,2) and PrivacyLens judge through privact.rollout_chunk, the
  function `collect` runs. Random weights never write a parseable action, so every leaf is judged
  (its output as the action): the worst case, and every output runs to its budget. One warm-up case
  first (at --warmup-tokens: transformers compiles the static-cache forward for the shapes it
  meets), reported apart; then the steady state over --cases cases in chunks of --chunk-cases, with
  torch.compile's recompiles during it counted. Where the time goes comes from the records collect
  writes (generate_batched's own clocks): the policy's and the judge's seconds per case, each split
  into prefill and decode, tokens/s of each, and the share of outputs cut at the budget.
- eval: the same at K = 10 (branching 10,1,1, then the judge) on test cases.
- served: the leaves of the steady collect cases judged again through
  --judge-url against `transformers serve --continuous-batching` on the same device (the same
  weights, saved), seconds per case beside the in-process judge's on the same leaves.
- decode: ms per decoding step at --rows rows of --decode-prompt-tokens tokens, privact's engine
  (shared prefill into a static cache) beside plain `generate`, and the share of the card's memory
  bandwidth a step would need at its weights + KV bytes (--peak-bandwidth).
- peers: on the same trees (--peer-cases cases), one plain `generate(num_return_sequences=B)` per
  tree node and per judge prompt (the straightforward loop), and transformers' continuous-batching
  engine `generate_batch`, level by level; seconds per case beside privact's.
- train: DPO pairs/s and peak GPU memory at 8 pairs x max length 4096 per micro-batch, bf16
  autocast and gradient checkpointing, through `privact.py train` itself (TRL's DPOTrainer on the
  same pairs: benchmarks/bench_train.py).
Stages run in the order collect, eval, served, train, decode, peers; with --time-box, a stage that
would start after the box has run out is skipped and named in the JSON. The last line printed is a
JSON object with every figure and a table of the hours they imply (394-case collect, both
trainings, a 99-case eval); --json writes the same object to a file.

    python benchmarks/bench_gpu.py --paper --tokenizer DIR   # the paper's budgets in about 8 minutes on a GPU
    python benchmarks/bench_gpu.py --tiny --paper            # the same code on tiny models, on a CPU (a test runs it)
    benchmarks/gpu_run.sh                                    # installs carried wheels, runs --paper, keeps JSON + log
"""

import collections
import contextlib
import statistics
import dataclasses
import functools
import itertools
import json
import os
import resource
import sys
import tempfile
import time
import types

import torch
import transformers

import common  # noqa: E402  (puts privact.py on the path)
import privact  # noqa: E402

# config.json of meta-llama/Llama-3.2-1B-Instruct and mistralai/Mistral-7B-Instruct-v0.2, written out
LLAMA_3_2_1B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
}
MISTRAL_7B_V0_2 = {
    "model_type": "mistral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}  # sliding_window null: set in random_model
TINY_SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}
TINY_POLICY, TINY_JUDGE = (
    dict(TINY_SHAPE, model_type="llama", vocab_size=49152),
    dict(TINY_SHAPE, model_type="mistral", vocab_size=32000),
)
TRAIN_CASES, TEST_CASES, EPOCHS = 394, 99, {"verifier": 12, "refiner": 4}


def random_model(shape, tok, dtype, device):
    """A randomly initialised causal LM of `shape` (a config dict) over the tokenizer's ids: a vocabulary
    smaller than the tokenizer's is grown to it (the judge: then a plain model that a server can load);
    in a larger one (the policy), the ids the tokenizer lacks get logits -inf."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(shape, vocab_size=max(shape["vocab_size"], len(tok)))
    config = AutoConfig.for_model(
        shape.pop("model_type"),
        **shape,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    config.sliding_window = None  # Llama has none; Mistral-7B-Instruct-v0.2's config.json says null
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if config.vocab_size > len(tok):
        unknown = torch.arange(len(tok), config.vocab_size, device=device)
        model.get_output_embeddings().register_forward_hook(
            lambda _, args, out: out.index_fill(-1, unknown, float("-inf"))
        )
    model.generation_config.eos_token_id = tok.eos_token_id
    return model.eval()


ROLES = ("generator", "verifier", "refiner")
STAGES = ("collect", "eval", "served", "train", "decode", "peers")
PAPER = {  # --paper: the paper's budgets, sized to end within the time box on one H200
    "max_new_tokens": 1000,
    "judge_tokens": 1000,
    "warmup_tokens": 64,
    "batch_size": 128,
    "cases": 2,
    "chunk_cases": 2,
    "rows": "4,16,64",
    "decode_prompt_tokens": 1900,
    "decode_steps": 64,
    "max_length": 4096,
    "response_tokens": 300,
    "batch_size_train": 8,
    "train_steps": 4,
    "stages": "collect,eval,served,train,decode",
    "time_box": 330,
}
TINY = {  # --tiny: tiny budgets, on a CPU
    "max_new_tokens": 4,
    "judge_tokens": 4,
    "warmup_tokens": 4,
    "batch_size": 16,
    "rows": "2,4",
    "decode_prompt_tokens": 16,
    "decode_steps": 4,
    "max_length": 320,
    "response_tokens": 16,
    "batch_size_train": 2,
    "train_steps": 1,
    "branching": "2,2,2",  # 8 leaves a case: a CPU server judges them in seconds
}


def compiled_graphs():
    """torch.compile's count of graphs compiled so far in this process (dynamo's counters)."""
    from torch._dynamo.utils import counters

    return sum(counters["stats"].values()) and int(counters["stats"]["unique_graphs"])


def timed_chunk(cases, branching, models, args, budget):
    """One privact.rollout_chunk (the agents at `budget` tokens, the judge at --judge-tokens or `budget`,
    whichever is smaller) -> (seconds, records)."""
    cfg = privact.CollectConfig(
        max_new_tokens=budget,
        judge_max_new_tokens=min(budget, args.judge_tokens),
        batch_size=args.batch_size,
        temperature=1.0,
    )
    sync()
    start = time.perf_counter()
    records = privact.rollout_chunk(cases, privact.Chain(list(ROLES), branching), models, cfg)
    sync()
    return time.perf_counter() - start, records


def run_figures(cases, branching, models, args):
    """Warm-up on the first case at --warmup-tokens, then the steady state over the rest in chunks of
    --chunk-cases at --max-new-tokens -> (figures, the steady records)."""
    torch.manual_seed(0)
    warmup, _ = timed_chunk(cases[:1], branching, models, args, args.warmup_tokens)
    before, seconds, records, chunks = compiled_graphs(), 0.0, [], []
    for first in range(1, len(cases), args.chunk_cases):
        chunk = cases[first : first + args.chunk_cases]
        t, recs = timed_chunk(chunk, branching, models, args, args.max_new_tokens)
        seconds, records = seconds + t, records + recs
        chunks.append({"cases": len(chunk), "seconds": round(t, 2)})
    tokens = {k: round(sum(r[k] for r in records) / len(records)) for k in ("generated_tokens", "judge_tokens")}
    figures = {
        "warmup_seconds": round(warmup, 2),
        "warmup_tokens": args.warmup_tokens,
        "steady_seconds_per_case": round(seconds / len(records), 3),
        "steady_tokens_per_s": round(sum(tokens.values()) * len(records) / seconds, 1),
        "steady_cases": len(records),
        "chunks": chunks,
        "recompiles_after_warmup": compiled_graphs() - before,
        "tokens_per_case": tokens,
    }
    return {**figures, **time_split(records, seconds)}, records


def time_split(records, seconds):
    """Where a stage's steady time went, per case, from the records rollout_chunk writes: the policy's and
    the judge's seconds, each split into prefill and decode (generate_batched's clocks), tokens/s of
    each, and the share of outputs cut at the budget (agent outputs; verdicts); "other" is the rest of
    the wall time (tokenizing, tree bookkeeping, verdict parsing)."""
    roots = [privact.node_from_dict(r["tree"]) for r in records]
    judgments = [leaf.judgment for root in roots for leaf, _ in privact.leaves_with_paths(root)]
    cut = {"policy": privact.cut_share(roots), "judge": privact.judge_cut_rate(judgments)}
    decoded = {"policy": "generated_tokens", "judge": "judge_tokens"}
    split = {}

    def per_case(key):
        return sum(r.get(key, 0) for r in records) / len(records)

    for stage in ("policy", "judge"):
        prefill, decode = per_case(f"{stage}_prefill_seconds"), per_case(f"{stage}_decode_seconds")
        split[f"{stage}_s_per_case"] = round(prefill + decode, 3)
        split[f"{stage}_prefill_s_per_case"] = round(prefill, 3)
        split[f"{stage}_decode_s_per_case"] = round(decode, 3)
        split[f"{stage}_prefill_tokens_per_s"] = (
            round(per_case(f"{stage}_prefill_tokens") / prefill, 1) if prefill else None
        )
        split[f"{stage}_decode_tokens_per_s"] = round(per_case(decoded[stage]) / decode, 1) if decode else None
        split[f"{stage}_cut_share"] = None if cut[stage] is None else round(cut[stage], 3)
    split["other_s_per_case"] = round(
        seconds / len(records) - split["policy_s_per_case"] - split["judge_s_per_case"], 3
    )
    return split


def args_branching(args):
    return [int(width) for width in args.branching.split(",")]


def generation_stage(ctx, stage):
    """collect (--branching on train cases) or eval (10,1,1 on test cases): warm-up, steady state, time split."""

    def same_tool(cases):
        return [c for c in cases if c["trajectory"]["final_action"] == cases[0]["trajectory"]["final_action"]]

    split, branching = {"collect": ("train", args_branching(ctx.args)), "eval": ("test", [10, 1, 1])}[stage]
    cases = same_tool(privact.load_cases("", split))[: ctx.args.cases + 1]
    ctx.figures[stage], ctx.records[stage] = run_figures(cases, branching, ctx.models, ctx.args)
    f = ctx.figures[stage]
    print(
        f"{stage + ':':8} warm-up {f['warmup_seconds']} s, then {f['steady_seconds_per_case']} s per case: "
        f"policy {f['policy_s_per_case']} s (prefill {f['policy_prefill_s_per_case']}), judge {f['judge_s_per_case']} "
        f"s (prefill {f['judge_prefill_s_per_case']}); {f['recompiles_after_warmup']} recompiles after the warm-up",
        flush=True,
    )


def judged_again(records, judge, cfg, limit=None):
    """Fresh copies of the records' leaves (the first `limit`) judged by `judge` through privact.judge_leaves
    -> (seconds, the judge's tokens, each leaf's verdict texts)."""
    cases = {c["name"]: c for c in privact.load_cases("", "train")}
    leaves = [
        (leaf, cases[rec["case"]], path)
        for rec in records
        for leaf, path in privact.leaves_with_paths(privact.node_from_dict(rec["tree"]))
    ][:limit]
    start = time.perf_counter()
    n_tokens = privact.judge_leaves(leaves, judge, cfg, collections.Counter())
    return time.perf_counter() - start, n_tokens, [leaf.judgment["judge_outputs"] for leaf, _, _ in leaves]


def served_stage(ctx):
    """The steady collect cases' leaves judged again through `transformers serve --continuous-batching` on
    this device (privact's --judge-url client, judge_endpoint; the same weights, saved), after a one-leaf
    warm-up, beside the in-process judge's seconds on the same leaves."""
    common.serving_available()
    args, (judge, tok) = ctx.args, ctx.models["judge"]
    folder, cuda = os.path.join(ctx.tmp, "judge"), torch.cuda.is_available()
    judge.save_pretrained(folder)
    tok.save_pretrained(folder)
    records = ctx.records["collect"]
    if cuda:  # the server takes its KV cache from what this process leaves free
        torch.cuda.empty_cache()
    flags = ["--continuous-batching", *(["--cb-max-memory-percent", "0.3"] if cuda else []), *args.serve_flags.split()]
    start = time.perf_counter()
    with open(ctx.serve_log, "w") as log:
        proc, url = common.serve(folder, log, "cuda:0" if cuda else "cpu", "bfloat16", flags, wait_s=900)
        started = time.perf_counter() - start
        try:
            cfg = privact.CollectConfig(
                judge_url=url,
                judge_model=folder,
                judge_max_new_tokens=args.judge_tokens,
                judge_concurrency=args.judge_concurrency,
            )
            # tok: the release protocol renders the judge's chats here and posts them to /completions
            served = functools.partial(privact.judge_endpoint, cfg, tok)
            warm = dataclasses.replace(cfg, judge_max_new_tokens=args.warmup_tokens)
            judged_again(records, functools.partial(privact.judge_endpoint, warm, tok), warm, limit=1)  # warm-up
            seconds, n_tokens, texts = judged_again(records, served, cfg)
        finally:
            proc.kill()
            proc.wait()
    local = [
        leaf.judgment["judge_outputs"]
        for rec in records
        for leaf, _ in privact.leaves_with_paths(privact.node_from_dict(rec["tree"]))
    ]
    same = sum(a == b for mine, theirs in zip(texts, local, strict=True) for a, b in zip(mine, theirs, strict=True))
    in_process = ctx.figures["collect"]["judge_s_per_case"]  # the same leaves, judged in collect's chunks
    ctx.figures["served"] = {
        "server": f"transformers serve {' '.join(flags)}",
        "cases": len(records),
        "judge_calls": sum(map(len, local)),
        "server_start_seconds": round(started, 1),
        "served_judge_s_per_case": round(seconds / len(records), 3),
        "in_process_judge_s_per_case": round(in_process, 3),
        "served_over_in_process": round(seconds / len(records) / in_process, 2),
        "served_judge_tokens_per_case": round(n_tokens / len(records)),
        "in_process_judge_tokens_per_case": round(sum(r["judge_tokens"] for r in records) / len(records)),
        "verdict_texts_equal_to_in_process": f"{same}/{sum(map(len, local))}",
    }
    print(f"served:  {ctx.figures['served']}", flush=True)


def train_stage(ctx):
    with tempfile.TemporaryDirectory(dir=ctx.tmp) as folder, contextlib.redirect_stdout(sys.stderr):
        pairs_s, peak_gib = dpo_figures(ctx.policy_shape, ctx.tok, ctx.args, folder)
    print(
        f"train:   {pairs_s:.2f} pairs/s, peak {'GPU' if ctx.device == 'cuda' else 'RSS'} memory {peak_gib:.1f} GiB "
        f"(batch {ctx.args.batch_size_train} x {ctx.args.max_length} tokens, bf16 autocast, checkpointing)",
        flush=True,
    )
    ctx.figures.update(dpo_pairs_per_s=round(pairs_s, 3), dpo_peak_memory_gib=round(peak_gib, 2))


def decode_stage(ctx):
    ctx.figures["decode_ms_per_step"] = decode_figures(ctx.models["generator"][0], ctx.tok, ctx.args)


def peers_stage(ctx):
    by_name = {c["name"]: c for c in privact.load_cases("", "train")}
    peer_records = ctx.records["collect"][: ctx.args.peer_cases]  # steady-state trees: the peers replay their prompts
    ctx.figures["peers"] = peer_figures(
        peer_records,
        [by_name[r["case"]] for r in peer_records],
        ctx.models,
        ctx.args,
        ctx.args.max_new_tokens,
        ctx.figures["collect"]["steady_seconds_per_case"],
    )
    print(f"peers:   {ctx.figures['peers']}", flush=True)


STAGE_RUNS = {
    "collect": functools.partial(generation_stage, stage="collect"),
    "eval": functools.partial(generation_stage, stage="eval"),
    "served": served_stage,
    "train": train_stage,
    "decode": decode_stage,
    "peers": peers_stage,
}


def hours_table(figures, args):
    """The hours the figures imply, one row per job of a 1B reproduction, then their total; the collect
    with a served judge is an alternative row, outside the total."""

    def hours(seconds):
        return round(seconds / 3600, 3)

    rows = []
    for stage, cases, job in (
        ("collect", TRAIN_CASES, f"collect, {TRAIN_CASES} train cases"),
        ("eval", TEST_CASES, f"eval, {TEST_CASES} test cases (one configuration)"),
    ):
        if stage in figures:
            f = figures[stage]
            rows.append(
                {
                    "job": job,
                    "hours": hours(f["steady_seconds_per_case"] * cases),
                    "policy_hours": hours(f["policy_s_per_case"] * cases),
                    "judge_hours": hours(f["judge_s_per_case"] * cases),
                }
            )
    if "dpo_pairs_per_s" in figures:
        for role, n in EPOCHS.items():
            rows.append(
                {
                    "job": f"train {role}, {args.pairs} pairs x {n} epochs",
                    "hours": hours(args.pairs * n / figures["dpo_pairs_per_s"]),
                }
            )
    if rows:
        rows.append({"job": "total", "hours": round(sum(r["hours"] for r in rows), 3)})
    if "served" in figures:
        f, served = figures["collect"], figures["served"]
        seconds = f["steady_seconds_per_case"] - f["judge_s_per_case"] + served["served_judge_s_per_case"]
        rows.append(
            {
                "job": f"collect, {TRAIN_CASES} train cases, judge served (instead)",
                "hours": hours(seconds * TRAIN_CASES),
            }
        )
    return rows


class StepClock:
    """A logits processor that only reads the clock (after the device has finished), once per decoding step:
    the time between two consecutive steps' logits is one step, measured, never a difference of totals."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        sync()
        self.times.append(time.perf_counter())
        return scores


def decode_ms_per_step(model, tok, rows, prompt_tokens, steps, plain):
    """ms per decoding step at `rows` distinct prompts: the median of the steps' own durations (StepClock; the
    first step, which holds the prefill's last token, left out), the fastest of two runs after an untimed one
    (transformers compiles a static-cache forward on CUDA at the first). Never negative, whatever the load."""
    from transformers import GenerationConfig

    gen = GenerationConfig(
        max_new_tokens=steps + 1,
        min_new_tokens=steps + 1,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    seqs = [[3 + (r * 7919 + i * 104729) % 30000 for i in range(prompt_tokens)] for r in range(rows)]
    medians = []
    for run in range(3):
        clock = StepClock()
        with torch.inference_mode():
            if plain:
                ids = torch.tensor(seqs, device=model.device)
                mask = torch.ones_like(ids)
                model.generate(input_ids=ids, attention_mask=mask, generation_config=gen, logits_processor=[clock])
            else:
                privact.generate_shared_prefix(model, seqs, list(range(rows)), gen, 1, [clock])
        durations = [later - earlier for earlier, later in itertools.pairwise(clock.times)]
        if run:
            medians.append(statistics.median(durations))
    return 1000 * min(medians)


def step_bytes(model, rows, length):
    """Bytes a decoding step reads at least: every weight once, and each row's KV cache."""
    c = model.config
    kv = (
        2 * c.num_hidden_layers * c.num_key_value_heads * getattr(c, "head_dim", c.hidden_size // c.num_attention_heads)
    )
    return sum(p.numel() * p.element_size() for p in model.parameters()) + rows * length * kv * 2


def plain_loop(records, cases, models, args, budget):
    """The straightforward loop on privact's trees: one generate(num_return_sequences=B) per node, one per judge
    prompt."""
    from transformers import GenerationConfig

    for rec, case in zip(records, cases, strict=True):
        frontier = [privact.node_from_dict(rec["tree"])]
        for role, width in zip(ROLES, args_branching(args), strict=True):
            model, tok = models[role]
            for node in frontier:
                ids = torch.tensor(
                    [tok(privact.chat_text(tok, node.children[0].prompt), add_special_tokens=False)["input_ids"]],
                    device=model.device,
                )
                with torch.inference_mode():
                    model.generate(
                        input_ids=ids,
                        attention_mask=torch.ones_like(ids),
                        generation_config=sampling(tok, budget, width),
                    )
            frontier = [c for node in frontier for c in node.children]
        judge, jtok = models["judge"]
        for _, path in privact.leaves_with_paths(privact.node_from_dict(rec["tree"])):
            for chat in privact.judge_chats(case, privact.latest(path, privact.DRAFT_ROLES), "privacylens"):
                ids = torch.tensor(
                    [jtok(privact.chat_text(jtok, chat), add_special_tokens=False)["input_ids"]], device=judge.device
                )
                gen = GenerationConfig(
                    max_new_tokens=args.judge_tokens,
                    do_sample=False,
                    stop_strings="\n\n---",
                    pad_token_id=jtok.pad_token_id,
                    eos_token_id=jtok.eos_token_id,
                )
                with torch.inference_mode():
                    judge.generate(
                        input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen, tokenizer=jtok
                    )


def sampling(tok, budget, width):
    """The peers' agent sampling: `width` samples at plain temperature 1, as privact samples."""
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=budget,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        num_return_sequences=width,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )


def cb_config(args):
    """generate_batch's own sizing (its KV pages from the free memory) on a GPU; a small cache for --tiny."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=512) if args.tiny else None


def batch_engine_loop(records, cases, models, args, budget):
    """transformers' continuous batching (generate_batch) on privact's trees, level by level; the judge
    prompts in one call (it takes no custom logits processor or stop string: the judge runs to its budget)."""
    from transformers import GenerationConfig

    roots = [privact.node_from_dict(rec["tree"]) for rec in records]
    frontier = roots
    for role, width in zip(ROLES, args_branching(args), strict=True):
        model, tok = models[role]
        inputs = [
            tok(privact.chat_text(tok, n.children[0].prompt), add_special_tokens=False)["input_ids"] for n in frontier
        ]
        model.generate_batch(
            inputs=inputs,
            warmup=torch.cuda.is_available(),
            continuous_batching_config=cb_config(args),
            generation_config=sampling(tok, budget, width),
        )
        frontier = [c for n in frontier for c in n.children]
    judge, jtok = models["judge"]
    chats = [
        chat
        for root, case in zip(roots, cases, strict=True)
        for _, path in privact.leaves_with_paths(root)
        for chat in privact.judge_chats(case, privact.latest(path, privact.DRAFT_ROLES), "privacylens")
    ]
    judge.generate_batch(
        warmup=torch.cuda.is_available(),
        continuous_batching_config=cb_config(args),
        inputs=[jtok(privact.chat_text(jtok, c), add_special_tokens=False)["input_ids"] for c in chats],
        generation_config=GenerationConfig(
            max_new_tokens=args.judge_tokens,
            do_sample=False,
            pad_token_id=jtok.pad_token_id,
            eos_token_id=jtok.eos_token_id,
        ),
    )


def peer_figures(records, cases, models, args, budget, privact_s):
    """Seconds per case of the plain loop and of generate_batch on the same trees, and privact's ratio to each."""
    out = {"privact_seconds_per_case": round(privact_s, 3)}
    for name, loop in (("plain_generate_per_node", plain_loop), ("generate_batch", batch_engine_loop)):
        try:
            sync()
            start = time.perf_counter()
            loop(records, cases, models, args, budget)
            sync()
            out[f"{name}_seconds_per_case"] = round((time.perf_counter() - start) / len(cases), 3)
            out[f"{name}_over_privact"] = round(out[f"{name}_seconds_per_case"] / privact_s, 2)
        except Exception as e:  # a peer that fails here is reported, not fatal
            out[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def dpo_figures(policy_shape, tok, args, folder):
    """pairs/s and peak memory of `privact.py train` on synthetic pairs of the given lengths (on a GPU, the
    peak above what the generation models held before)."""
    prompt_len, response_len = args.max_length - 2 * args.response_tokens, args.response_tokens

    def words(n, salt):  # about 2-3 tokens each
        return " ".join(f"w{(i * 7919 + salt) % 5000}" for i in range(n))

    def context(i):  # an over-long pair loses the middle of its trajectory, as in privact
        return privact.P.CONTEXT.format(
            user_name="A",
            user_email="a@x.com",
            user_instruction="Send it.",
            toolkits="Gmail",
            trajectory=words(prompt_len // 3, i),
            final_action="GmailSendEmail",
            tool_args=privact.P.FINAL_TOOLS["GmailSendEmail"],
        )

    pairs = [
        {
            "case": f"c{i}",
            "role": "refiner",
            "prompt": [{"role": "user", "content": context(i)}],
            "chosen": words(response_len // 3, i + 1),
            "rejected": words(response_len // 3, i + 2),
        }
        for i in range(args.batch_size_train * (args.train_steps + 1))
    ]
    path = os.path.join(folder, "pairs_refiner.jsonl")
    privact.write_atomic(path, privact.jsonl(pairs))
    model = random_model(policy_shape, tok, torch.float32, "cpu")
    model.save_pretrained(os.path.join(folder, "policy"))
    tok.save_pretrained(os.path.join(folder, "policy"))
    del model
    baseline = 0  # the generation models this process may hold
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    code = privact.main(
        [
            "train",
            "--pairs",
            path,
            "--model",
            os.path.join(folder, "policy"),
            "--out",
            os.path.join(folder, "refiner"),
            "--batch-size",
            str(args.batch_size_train),
            "--grad-accum",
            "1",
            "--max-steps",
            str(args.train_steps),
            "--eval-fraction",
            "0",
            "--max-length",
            str(args.max_length),
            "--mixed-precision",
            "bf16",
            "--save-every",
            "0",
            "--epochs",
            "1",
        ]
    )
    assert code == 0, "train failed"
    metrics = privact.read_json_file(os.path.join(folder, "refiner", "train_metrics.json"))
    peak = (
        torch.cuda.max_memory_allocated() - baseline
        if torch.cuda.is_available()
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return metrics["train/pairs_per_s"], peak / 2**30


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_figures(policy, tok, args):
    """decode ms/step at each of --rows, privact's engine and plain generate, beside the bandwidth floor."""
    decode = {}
    for rows in map(int, args.rows.split(",")):
        ours, plain = (
            decode_ms_per_step(policy, tok, rows, args.decode_prompt_tokens, args.decode_steps, p)
            for p in (False, True)
        )
        floor = 1000 * step_bytes(policy, rows, args.decode_prompt_tokens + 8 + args.decode_steps) / args.peak_bandwidth
        decode[str(rows)] = {
            "privact_ms": round(ours, 2),
            "plain_generate_ms": round(plain, 2),
            "bandwidth_floor_ms": round(floor, 3),
            "share_of_bandwidth": round(floor / ours, 3),
        }
        print(
            f"decode:  {rows} rows: privact {ours:.1f} ms/step, plain generate {plain:.1f} "
            f"(bandwidth floor {floor:.2f})",
            flush=True,
        )
    return decode


def parse_args(argv=None):
    ap = common.parser(__doc__, max_new_tokens=1000, batch_size=64)
    ap.add_argument("--paper", action="store_true", help=f"the paper's budgets in a time box: {PAPER}")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and budgets, for a CPU (what the tests run)")
    ap.add_argument("--tokenizer", default="", help="a saved SmolLM2 tokenizer folder (default: the embedded GGUF's)")
    ap.add_argument("--json", default="", help="also write the JSON object to this file (the serve log beside it)")
    ap.add_argument("--time-box", type=float, default=0, help="seconds after which no further stage starts (0: none)")
    ap.add_argument(
        "--cases", type=int, default=8, help="steady-state cases timed for collect and for eval (after 1 warm-up)"
    )
    ap.add_argument("--chunk-cases", type=int, default=4, help="cases per rollout chunk (collect's --chunk-cases)")
    ap.add_argument("--warmup-tokens", type=int, default=1000, help="agent and judge budget of the warm-up case")
    ap.add_argument("--judge-tokens", type=int, default=256, help="judge output budget")
    ap.add_argument("--branching", default="4,4,4", help="collect's tree (the paper's B_1,B_2,B_3)")
    ap.add_argument("--judge-concurrency", type=int, default=256, help="requests in flight against the server")
    ap.add_argument("--serve-flags", default="", help="more flags for `transformers serve`, e.g. '--cb-use-cuda-graph'")
    ap.add_argument("--peer-cases", type=int, default=1, help="cases the peers (plain generate, generate_batch) replay")
    ap.add_argument("--rows", default="4,16,64", help="rows for the decode ms/step figures")
    ap.add_argument(
        "--decode-prompt-tokens", type=int, default=1900, help="prompt tokens per row for the decode figures"
    )
    ap.add_argument("--decode-steps", type=int, default=64, help="decoding steps timed per decode figure")
    ap.add_argument(
        "--peak-bandwidth", type=float, default=4.8e12, help="the card's memory bandwidth, bytes/s (H200: 4.8e12)"
    )
    ap.add_argument("--max-length", type=int, default=4096, help="DPO prompt + response tokens per pair")
    ap.add_argument("--response-tokens", type=int, default=300, help="DPO tokens per response")
    ap.add_argument("--batch-size-train", type=int, default=8, help="DPO pairs per micro-batch (paper: 8)")
    ap.add_argument("--train-steps", type=int, default=4, help="timed DPO steps")
    ap.add_argument("--pairs", type=int, default=5000, help="pairs per role assumed for the training hours")
    ap.add_argument(
        "--stages",
        default="collect,eval,decode,peers,train",
        help=f"stages to run, comma-separated, of {','.join(STAGES)} (served and peers use collect's trees)",
    )
    presets, _ = ap.parse_known_args(argv)
    if presets.paper:  # flags given on the command line still win over a preset
        ap.set_defaults(**PAPER)
    if presets.tiny:
        ap.set_defaults(**TINY, **({} if presets.paper else {"cases": 2, "chunk_cases": 1}))
    args = ap.parse_args(argv)
    args.stages = args.stages.split(",")
    needs_collect = {"served", "peers"} & set(args.stages)
    if not set(args.stages) <= set(STAGES) or (needs_collect and "collect" not in args.stages):
        ap.error(f"--stages {','.join(args.stages)}: choose from {','.join(STAGES)}; served and peers need collect")
    widths = args.branching.split(",")
    if len(widths) != len(ROLES) or not all(w.isdigit() and int(w) > 0 for w in widths):
        ap.error(f"--branching {args.branching}: one positive width per role of {','.join(ROLES)}")
    return args


def main():
    args = parse_args()
    start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from transformers import AutoTokenizer

    folder, gguf = (args.tokenizer, None) if args.tokenizer else privact.embedded_model_folder("smollm2")
    tok = AutoTokenizer.from_pretrained(folder, **({"gguf_file": gguf} if gguf else {}))
    policy_shape, judge_shape = (TINY_POLICY, TINY_JUDGE) if args.tiny else (LLAMA_3_2_1B, MISTRAL_7B_V0_2)
    ctx = types.SimpleNamespace(args=args, tok=tok, device=device, policy_shape=policy_shape, models={}, records={})
    ctx.figures = {}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    if set(args.stages) - {"train"}:
        policy = random_model(policy_shape, tok, torch.bfloat16, device)
        judge = random_model(judge_shape, tok, torch.bfloat16, device) if needs_judge(args) else None
        ctx.models = {**dict.fromkeys(ROLES, (policy, tok)), "judge": (judge, tok)}
    privact.judged_action = lambda case, output, protocol: (output or "x")[:2000]  # every leaf judged: the worst case
    with tempfile.TemporaryDirectory() as tmp:
        ctx.tmp = tmp
        ctx.serve_log = (
            os.path.join(os.path.dirname(args.json) or ".", "serve.log") if args.json else f"{tmp}/serve.log"
        )
        skipped, cut = run_stages(ctx, start)
    report(ctx, {"skipped_for_time": skipped, "cut_by_interrupt": cut}, time.perf_counter() - start)


def run_stages(ctx, start):
    """The stages asked, in STAGES order -> (those not run: started after --time-box or after an
    interrupt, the stage an interrupt cut). An interrupt (Ctrl-C, or gpu_run.sh's hard limit, SIGINT)
    ends the stage it meets; the figures measured until then are kept."""
    skipped, cut = [], None
    for stage in sorted(ctx.args.stages, key=STAGES.index):
        if cut or (ctx.args.time_box and time.perf_counter() - start > ctx.args.time_box):
            skipped.append(stage)
            print(f"{stage + ':':8} skipped: {'an interrupt' if cut else 'the --time-box'} came first", flush=True)
            continue
        try:
            STAGE_RUNS[stage](ctx)
        except KeyboardInterrupt:
            cut = stage
            print(f"{stage + ':':8} cut by an interrupt", flush=True)
    return skipped, cut


def needs_judge(args):
    return bool({"collect", "eval", "served", "peers"} & set(args.stages))


def report(ctx, not_run, seconds):
    """Print the hours table, then the JSON object (also to --json)."""
    figures, args = ctx.figures, ctx.args
    for stage in ("collect", "eval"):
        if stage in figures:
            figures[f"{stage}_seconds_per_case"] = figures[stage]["steady_seconds_per_case"]
    if "collect" in figures:
        figures["collect_tokens_per_case"] = figures["collect"]["tokens_per_case"]
    table = hours_table(figures, args)
    for row in table:
        print(f"  {row['job']}: {row['hours']:.2f} h")
    result = {
        "bench": "gpu",
        "device": torch.cuda.get_device_name() if ctx.device == "cuda" else "cpu",
        "args": vars(args),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        **figures,
        "hours": table,
        **not_run,
        "seconds": round(seconds, 1),
    }
    if args.json:
        privact.write_json(args.json, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
