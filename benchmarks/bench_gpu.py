"""The GPU cost of a paper-scale reproduction, measured on randomly initialised models of the paper's shapes
(nothing comes from the hub; the tokenizer is a saved SmolLM2 one, --tokenizer, or the embedded GGUF's).

- policy: Llama-3.2-1B-Instruct's architecture; judge: Mistral-7B-Instruct-v0.2's, its vocabulary grown
  from 32,000 to the tokenizer's 49,152 ids. The policy's 128,256 ids hold the tokenizer's; it writes only
  ids the tokenizer has. Random weights never stop early: every output runs to its budget (the worst case).
- collect: privact.rollout_chunk, what collect runs, on the paper's tree (--branching 4,4,4), every leaf
  judged as the release judges it. One warm-up case first at --warmup-tokens (a static cache makes
  transformers compile the forward for the shapes it meets), reported apart; then --cases cases in chunks
  of --chunk-cases: the policy's and the judge's seconds and tokens per case (collect's two clocks), and
  torch.compile's recompiles after the warm-up.
- eval: the same at K = 10 (branching 10,1,1) on test cases.
- peers: on --peer-cases cases, benchmarks/bench_rollout.py's arms: plain generate(num_return_sequences=B)
  over length-sorted batches (what a user writes) beside privact's generate, seconds per case.
- train: DPO pairs/s and peak memory at --batch-size-train pairs per micro-batch, each pair (a prompt and two
  responses) --max-length tokens, in sibling groups of four responses (4 pairs a group, as a 2-2 split at the
  paper's tree gives), bf16 autocast, through `privact.py train` itself; then the same pairs one pair a row, for
  the groups' speedup (TRL's DPOTrainer on collect-shaped pairs: bench_train.py).

Stages run in the order collect, eval, peers, train; with --time-box, a stage that would start after the
box has run out is skipped and named in the JSON, and an interrupt (Ctrl-C, gpu_run.sh's hard limit) ends
the stage in flight and keeps what was measured. The last line is a JSON object with every figure and the
hours they imply (a 394-case collect, both trainings, a 99-case eval); --json writes it to a file too.

    python benchmarks/bench_gpu.py --paper --tokenizer DIR   # the paper's budgets in a few minutes on a GPU
    python benchmarks/bench_gpu.py --tiny --paper            # the same code on tiny models, on a CPU
    benchmarks/gpu_run.sh run .carry runs/gpu                # installs carried wheels, runs --paper, keeps JSON + log
"""

import json
import os
import resource
import sys
import tempfile
import time

import torch

import common
import privact
from bench_rollout import run_arm

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
STAGES = ("collect", "eval", "peers", "train")
TRAIN_CASES, TEST_CASES = 394, 99
PAPER = {  # --paper: the paper's budgets, sized to end within the time box on one H200
    "max_new_tokens": 1000,
    "judge_tokens": 1000,
    "warmup_tokens": 64,
    "batch_size": 128,
    "cases": 2,
    "chunk_cases": 2,
    "peer_cases": 1,
    "max_length": 4096,
    "response_tokens": 300,
    "batch_size_train": 8,
    "train_steps": 4,
    "time_box": 330,
}
TINY = {  # --tiny: tiny shapes and budgets, on a CPU
    "max_new_tokens": 4,
    "judge_tokens": 4,
    "warmup_tokens": 4,
    "batch_size": 16,
    "branching": "2,2,2",
    "max_length": 320,
    "response_tokens": 16,
    "batch_size_train": 4,
    "train_steps": 1,
}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def compiled_graphs():
    """torch.compile's count of graphs compiled so far in this process (dynamo's counters)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def rollout_config(args, budget):
    """collect's flags: agents at `budget` tokens, the judge at the smaller of `budget` and --judge-tokens."""
    judge_budget = min(budget, args.judge_tokens)
    return privact.CollectConfig(max_new_tokens=budget, judge_max_new_tokens=judge_budget, batch_size=args.batch_size)


def rollout_figures(ctx, split, branching):
    """A warm-up case, then --cases cases in chunks of --chunk-cases through rollout_chunk -> figures per case."""
    args = ctx.args
    chain = privact.Chain(list(ROLES), branching)
    cases = privact.load_cases("", split, args.cases + 1)
    sync()
    start = time.perf_counter()
    privact.rollout_chunk(cases[:1], chain, ctx.models, rollout_config(args, args.warmup_tokens))
    sync()
    warmup = time.perf_counter() - start
    graphs = compiled_graphs()
    totals = {}
    steady = cases[1:]
    start = time.perf_counter()
    for first in range(0, len(steady), args.chunk_cases):
        chunk = steady[first : first + args.chunk_cases]
        _, counts = privact.rollout_chunk(chunk, chain, ctx.models, rollout_config(args, args.max_new_tokens))
        for key, value in counts.items():
            totals[key] = totals.get(key, 0) + value
    sync()
    seconds = time.perf_counter() - start
    n = len(steady)
    figures = {"warmup_seconds": round(warmup, 1), "seconds_per_case": round(seconds / n, 2)}
    for side in ("policy", "judge"):
        figures[f"{side}_seconds_per_case"] = round(totals[f"{side}_seconds"] / n, 2)
        figures[f"{side}_tokens_per_s"] = round(totals[f"{side}_tokens"] / totals[f"{side}_seconds"], 1)
    figures["recompiles_after_warmup"] = compiled_graphs() - graphs
    return figures


def collect_stage(ctx):
    ctx.figures["collect"] = rollout_figures(ctx, "train", privact.parse_branching(ctx.args.branching, list(ROLES)))
    print(f"collect: {ctx.figures['collect']}", flush=True)


def eval_stage(ctx):
    ctx.figures["eval"] = rollout_figures(ctx, "test", [10, 1, 1])
    print(f"eval:    {ctx.figures['eval']}", flush=True)


def peers_stage(ctx):
    """bench_rollout's arms on --peer-cases train cases at collect's budgets: seconds per case each."""
    args = ctx.args
    chain = privact.Chain(list(ROLES), privact.parse_branching(args.branching, list(ROLES)))
    cases = privact.load_cases("", "train", args.peer_cases)
    cfg = rollout_config(args, args.max_new_tokens)
    figures = {}
    for arm in ("generate-batched", "privact"):
        sync()
        start = time.perf_counter()
        run_arm(arm, cases, chain, ctx.models, cfg)
        sync()
        figures[f"{arm}_seconds_per_case"] = round((time.perf_counter() - start) / len(cases), 2)
    figures["speedup"] = round(figures["generate-batched_seconds_per_case"] / figures["privact_seconds_per_case"], 2)
    ctx.figures["peers"] = figures
    print(f"peers:   {figures}", flush=True)


def synthetic_pairs(args):
    """Refiner pairs in sibling groups as collect builds them at the paper's tree: four responses of about
    --response-tokens to a prompt, two above tau and two below, so 4 pairs a group (--batch-size-train x
    --train-steps pairs in all). A pair, the prompt and two responses, is just under --max-length tokens (a word
    "w1234" is up to 4 tokens; the chat template takes under 64)."""

    def words(n, salt):
        return " ".join(f"w{(i * 7919 + salt) % 5000}" for i in range(n))

    prompt_words = (args.max_length - 2 * args.response_tokens - 64) // 4
    pairs = []
    for group in range(args.batch_size_train * args.train_steps // 4):
        prompt = [{"role": "user", "content": words(prompt_words, group)}]
        responses = [words(args.response_tokens // 4, 4 * group + n + 1) for n in range(4)]
        for chosen in responses[:2]:
            for rejected in responses[2:]:
                pair = {
                    "case": f"c{group}",
                    "role": "refiner",
                    "prompt": prompt,
                    "chosen": chosen,
                    "rejected": rejected,
                }
                pairs.append(pair)
    return pairs


def train_run(ctx, name, path, policy, *more):
    """`privact.py train` on the pairs at `path` -> (its train_metrics.json, its peak memory in bytes: on a GPU the
    peak above what this process held before, on a CPU the process's)."""
    args = ctx.args
    baseline = 0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    out = os.path.join(ctx.tmp, name)
    flags = ["--pairs", path, "--model", policy, "--out", out]
    flags += ["--batch-size", str(args.batch_size_train), "--grad-accum", "1", "--epochs", "1"]
    flags += ["--max-length", str(args.max_length), "--mixed-precision", "bf16", "--save-every", "0", *more]
    if privact.main(["train", *flags]) != 0:
        raise SystemExit("bench_gpu: train failed")
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() - baseline
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return privact.read_json(os.path.join(out, "train_metrics.json")), peak


def train_stage(ctx):
    """pairs/s and peak memory of `privact.py train` on sibling groups (a row per group, as privact trains), then on
    the same pairs one pair a row (the per-pair arm, --pairs-per-group 1): the speedup at the paper's lengths."""
    folder = ctx.tmp
    path = os.path.join(folder, "pairs_refiner.jsonl")
    privact.write_text(path, "".join(json.dumps(pair) + "\n" for pair in synthetic_pairs(ctx.args)))
    policy = os.path.join(folder, "policy")
    model = random_model(ctx.policy_shape, ctx.tok, torch.float32, "cpu")
    model.save_pretrained(policy)
    ctx.tok.save_pretrained(policy)
    del model
    metrics, peak = train_run(ctx, "grouped", path, policy)
    figures = {"pairs_per_s": round(metrics["history"][-1]["train/pairs_per_s"], 3), "peak_gib": round(peak / 2**30, 1)}
    figures["steps"] = metrics["step"]
    metrics, peak = train_run(ctx, "per_pair", path, policy, "--pairs-per-group", "1")
    figures["per_pair_pairs_per_s"] = round(metrics["history"][-1]["train/pairs_per_s"], 3)
    figures["per_pair_peak_gib"] = round(peak / 2**30, 1)
    figures["speedup_over_per_pair"] = round(figures["pairs_per_s"] / figures["per_pair_pairs_per_s"], 2)
    ctx.figures["train"] = figures
    print(f"train:   {figures}", flush=True)


STAGE_RUNS = {"collect": collect_stage, "eval": eval_stage, "peers": peers_stage, "train": train_stage}


def hours_table(figures, args):
    """The hours the figures imply for a 1B reproduction, one row per job, then their total."""
    rows = []
    for stage, cases in (("collect", TRAIN_CASES), ("eval", TEST_CASES)):
        if stage in figures:
            hours = figures[stage]["seconds_per_case"] * cases / 3600
            rows.append({"job": f"{stage}, {cases} cases", "hours": round(hours, 2)})
    if "train" in figures:
        for role, epochs in privact.EPOCHS_BY_ROLE.items():
            if role != "generator":
                hours = args.pairs * epochs / figures["train"]["pairs_per_s"] / 3600
                rows.append({"job": f"train {role}, {args.pairs} pairs x {epochs} epochs", "hours": round(hours, 2)})
    if rows:
        rows.append({"job": "total", "hours": round(sum(row["hours"] for row in rows), 2)})
    return rows


def parse_args(argv=None):
    ap = common.parser(__doc__, max_new_tokens=1000, batch_size=64)
    ap.add_argument("--paper", action="store_true", help=f"the paper's budgets in a time box: {PAPER}")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and budgets, for a CPU (what the tests run)")
    ap.add_argument("--tokenizer", default="", help="a saved SmolLM2 tokenizer folder (default: the embedded GGUF's)")
    ap.add_argument("--json", default="", help="also write the JSON object to this file")
    ap.add_argument("--time-box", type=float, default=0, help="seconds after which no further stage starts (0: none)")
    ap.add_argument("--cases", type=int, default=8, help="cases timed for collect and for eval (after 1 warm-up)")
    ap.add_argument("--chunk-cases", type=int, default=4, help="cases per rollout chunk (collect's --chunk-cases)")
    ap.add_argument("--warmup-tokens", type=int, default=1000, help="agent and judge budget of the warm-up case")
    ap.add_argument("--judge-tokens", type=int, default=256, help="judge output budget")
    ap.add_argument("--branching", default="4,4,4", help="collect's tree (the paper's B_1,B_2,B_3)")
    ap.add_argument("--peer-cases", type=int, default=1, help="cases the peers stage runs each arm on")
    ap.add_argument("--max-length", type=int, default=4096, help="DPO prompt + response tokens per pair")
    ap.add_argument("--response-tokens", type=int, default=300, help="DPO tokens per response")
    ap.add_argument("--batch-size-train", type=int, default=8, help="DPO pairs per micro-batch (paper: 8)")
    ap.add_argument("--train-steps", type=int, default=4, help="timed DPO steps")
    ap.add_argument("--pairs", type=int, default=5000, help="pairs per role assumed for the training hours")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"stages to run, comma separated, of {','.join(STAGES)}")
    presets, _ = ap.parse_known_args(argv)
    if presets.paper:  # flags given on the command line still win over a preset
        ap.set_defaults(**PAPER)
    if presets.tiny:
        ap.set_defaults(**TINY, **({} if presets.paper else {"cases": 2, "chunk_cases": 1}))
    args = ap.parse_args(argv)
    args.stages = args.stages.split(",")
    if not set(args.stages) <= set(STAGES):
        ap.error(f"--stages {','.join(args.stages)}: choose from {','.join(STAGES)}")
    return args


def run_stages(ctx, start):
    """The stages asked, in STAGES order -> (those skipped: started after --time-box or an interrupt, the stage an
    interrupt cut). An interrupt ends the stage it meets; the figures measured until then are kept."""
    skipped, cut = [], None
    for stage in sorted(ctx.args.stages, key=STAGES.index):
        if cut or (ctx.args.time_box and time.perf_counter() - start > ctx.args.time_box):
            skipped.append(stage)
            print(f"{stage}: skipped: {'an interrupt' if cut else 'the --time-box'} came first", flush=True)
            continue
        try:
            STAGE_RUNS[stage](ctx)
        except KeyboardInterrupt:
            cut = stage
            print(f"{stage}: cut by an interrupt", flush=True)
    return skipped, cut


class Context:
    """What the stages share: the flags, the tokenizer, the models, a scratch folder, the figures."""

    def __init__(self, args, tok, policy_shape, models, tmp):
        self.args, self.tok, self.policy_shape, self.models, self.tmp = args, tok, policy_shape, models, tmp
        self.figures = {}


def main():
    args = parse_args()
    start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer or privact.model_source("smollm2"))
    tok.pad_token = tok.pad_token or tok.eos_token
    policy_shape, judge_shape = (TINY_POLICY, TINY_JUDGE) if args.tiny else (LLAMA_3_2_1B, MISTRAL_7B_V0_2)
    models = {}
    if set(args.stages) - {"train"}:
        policy = random_model(policy_shape, tok, torch.bfloat16, device)
        judge = random_model(judge_shape, tok, torch.bfloat16, device)
        models = {**dict.fromkeys(ROLES, (policy, tok)), "judge": (judge, tok)}
    with tempfile.TemporaryDirectory() as tmp:
        ctx = Context(args, tok, policy_shape, models, tmp)
        skipped, cut = run_stages(ctx, start)
    table = hours_table(ctx.figures, args)
    for row in table:
        print(f"  {row['job']}: {row['hours']:.2f} h")
    result = {"bench": "gpu", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    result.update(args=vars(args), versions=privact.provenance()["versions"], **ctx.figures, hours=table)
    result.update(skipped_for_time=skipped, cut_by_interrupt=cut, seconds=round(time.perf_counter() - start, 1))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        privact.write_json(args.json, result)
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
