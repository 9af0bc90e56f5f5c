"""DPO on the tree collect sampled: privact's grouped rows, privact with one pair a row, and TRL's DPOTrainer.

The pairs have the structure collect gives them: per train case, a refiner prompt (a real PrivacyLens case, 1.5-2.5k
tokens) and four sibling responses of about 100 tokens with their values, split by tau as collect splits them
(privact.build_pairs): 2-2, 1-3, 3-1 and 2-2 in turn, so 4, 3, 3, 4 pairs a group. Three trainers, each in its own
subprocess (its peak resident memory its own), on the same pairs, model, epochs, pairs per optimizer step, beta and
learning rate, float32, gradient checkpointing on all sides (the default of both), glibc's allocator at its defaults:

- privact: `privact.py train` as its users run it: one row per sibling group, [prompt | r1 | ... | r4], each
  response scored once per step by the policy and once per epoch by the reference;
- privact-per-pair: `privact.py train --pairs-per-group 1`, every pair a group of its own, one row
  [prompt | chosen | rejected] per pair: each step's pairs from as many nodes as it holds pairs, as the release's
  pair shuffle draws them;
- trl: TRL's DPOTrainer, a frozen reference copy beside the policy (its default, the release's setting), chosen and
  rejected as two rows, each with the whole prompt.

Printed per trainer: wall time of the whole training command (model load included), pairs/s over it (every pair of
every epoch), peak RSS, and the share of the CPU's limit: the tokens each trainer pushes through the model per
second, counted as five forward passes per row token (the reference's forward, the policy's forward, its
recomputation under checkpointing, and a backward at twice a forward), over the tokens/s of one forward of a
[1, 2048] row on this CPU. Then the ratios, and one JSON line.

    python benchmarks/bench_train.py
    python benchmarks/bench_train.py --gradient-noise [--pairs runs/x/pairs_refiner.jsonl]

--gradient-noise measures what a step of whole groups costs in gradient noise instead: each pair's DPO gradient at
the starting weights (where it is -beta/2 times the gradient of log pi(chosen) - log pi(rejected)), every 32nd
coordinate of every parameter kept; the correlation rho of two centred pair gradients of one node against their
variance; and, for --pairs-per-group 0 (whole groups), 4 (the default), 2 and 1, the steps an epoch takes at
privact's defaults (8 pairs x 4 a step), the mean pairs a step, and the variance of a step's mean gradient against a
step of as many pairs drawn apart, 1 + (m - 1) rho for rows of m pairs (m weighted by pairs). On the synthetic pairs,
or on --pairs.

TRL is a benchmark-only dependency (`pip install trl`); privact.py never imports it. Without it the two privact arms
run alone. TRL's micro-batch holds --trl-batch-size pairs (its rows take far more memory than privact's), with the
accumulation that gives it the same pairs per optimizer step.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import common  # noqa: F401  (puts privact.py on the path)
import privact
from bench_rollout import cpu_name

# positives per group of four (the rest are negatives): collect's tau splits, in turn
SPLITS = (2, 1, 3, 2)
TRAINERS = ("privact", "privact-per-pair", "trl")


def response(case, leaks, n):
    """A refiner output of about 100 tokens calling the case's tool: a leaking one carries the sensitive items."""
    trajectory = case["trajectory"]
    tool = trajectory["final_action"]
    argument = privact.P.FINAL_TOOLS[tool].split(":")[0].rstrip("*")
    if leaks:
        body = "Here is everything I found. " + " ".join(trajectory["sensitive_info_items"])
    else:
        body = f"A short update on the task ({trajectory['user_instruction'][:120]}), with no personal details."
    thought = f"Thought: Draft {n}. I act for {trajectory['user_name']} and share only what the task needs here."
    return f"{thought}\nAction: {tool}\nAction Input: {json.dumps({argument: body})}"


def make_pairs(data, groups, path, siblings=4):
    """`groups` sibling groups of `siblings` refiner responses on train cases, values 1 (positives) and -1, split at tau
    0 by privact.build_pairs (SPLITS scaled to the group); written as collect writes pairs (through their text: no
    sampled ids)."""
    rows = []
    for index, case in enumerate(privact.load_cases(data, "train", groups)):
        trajectory = case["trajectory"]
        tool = trajectory["final_action"]
        draft = f"Thought: I will do what {trajectory['user_name']} asked.\nAction: {tool}\nAction Input: {{}}"
        chat = privact.build_chat("refiner", case, [("generator", draft), ("verifier", "Check what is shared.")])
        positives = SPLITS[index % len(SPLITS)] * siblings // 4
        nodes = []
        for n in range(siblings):
            leaks = n >= positives
            node = privact.Node("refiner", chat, response(case, leaks, n), value=-1.0 if leaks else 1.0)
            nodes.append(node)
        root = privact.Node("input", [], children=nodes)
        for pair in privact.build_pairs(root, {"refiner": 0.0}):
            rows.append({"case": case["name"], **pair})
    with open(path, "w") as fh:
        fh.write("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def row_tokens(args, rows):
    """Tokens each trainer's rows hold in one epoch: grouped rows, one row per pair, TRL's two rows per pair."""
    tok = privact.load_tokenizer(args.model)
    examples, _ = privact.tokenize_pairs(tok, rows, 10**6)
    groups = privact.group_pairs(examples)
    grouped = 0
    for group in groups:
        # a group of more than --batch-size pairs trains in rows of --batch-size, each its prompt and its responses
        for row in privact.cut(group, args.batch_size):
            responses = {tuple(response) for pair in row.pairs for response in pair}
            grouped += len(row.prompt) + sum(map(len, responses))
    per_pair = sum(len(prompt) + len(chosen) + len(rejected) for prompt, chosen, rejected in examples)
    trl = sum(2 * len(prompt) + len(chosen) + len(rejected) for prompt, chosen, rejected in examples)
    return {"privact": grouped, "privact-per-pair": per_pair, "trl": trl}, len(groups)


def forward_ceiling(model_name, length=2048):
    """Tokens/s of one forward of a [1, length] row of random ids (the best of three), without gradients."""
    import torch

    model, _ = privact.load_model(model_name)
    ids = torch.randint(0, model.config.vocab_size, (1, length))
    best = 0.0
    with torch.inference_mode():
        for _ in range(3):
            start = time.perf_counter()
            model(input_ids=ids, logits_to_keep=1)
            best = max(best, length / (time.perf_counter() - start))
    return best


def gradient_noise(args, rows):
    """Each pair's gradient at the starting weights and the noise a step of grouped pairs carries (module docstring)."""
    import torch

    model, tok = privact.load_model(args.model)
    examples, _ = privact.tokenize_pairs(tok, rows, 10**6)
    gradients = []
    nodes = []
    for node, group in enumerate(privact.group_pairs(examples)):
        for pair in group.pairs:
            single = privact.Group(group.prompt, [pair])
            model.zero_grad()
            logps = privact.response_logps(model, privact.collate_groups([single], tok.pad_token_id))
            (logps[0] - logps[1]).backward()
            gradients.append(torch.cat([parameter.grad.flatten()[::32] for parameter in model.parameters()]))
            nodes.append(node)
    centred = torch.stack(gradients)
    centred -= centred.mean(0)
    gram = centred @ centred.T
    same_node = torch.tensor(nodes)[:, None] == torch.tensor(nodes)[None, :]
    same_node.fill_diagonal_(False)
    rho = (gram[same_node].mean() / gram.diagonal().mean()).item()
    result = {"pairs": len(nodes), "nodes": len(set(nodes)), "rho": round(rho, 4), "settings": {}}
    start = {"step": 0, "epoch": 0, "epoch_pairs": 0}
    for most in (0, 4, 2, 1):
        groups = privact.group_pairs(examples, most)
        sizes = [len(group.pairs) for group in groups]
        rows_m = sum(size * size for size in sizes) / sum(sizes)
        steps = privact.plan_steps(groups, "refiner", start, privact.TrainConfig(epochs=1))
        setting = {"steps_an_epoch": len(steps), "pairs_a_step": round(sum(sizes) / len(steps), 1)}
        setting["variance_vs_pairs_apart"] = round(1 + (rows_m - 1) * rho, 2)
        result["settings"][f"--pairs-per-group {most}"] = setting
        print(f"--pairs-per-group {most}: {setting}", flush=True)
    print(json.dumps({"bench": "gradient_noise", "args": vars(args), "cpu": cpu_name(), **result}))


def run_privact(args, pairs, out):
    flags = ["train", "--pairs", pairs, "--model", args.model, "--out", out, "--seed", "0", "--save-every", "0"]
    flags += ["--batch-size", args.batch_size, "--grad-accum", args.grad_accum, "--epochs", args.epochs]
    # every pair whole, as TRL at max_length=None
    flags += ["--beta", "0.4", "--lr", args.lr, "--mixed-precision", "no", "--max-length", 10**6]
    if args.child == "privact-per-pair":
        flags += ["--pairs-per-group", 1]
    if privact.main([str(flag) for flag in flags]):
        sys.exit("privact train failed")
    metrics = privact.read_json(os.path.join(out, "train_metrics.json"))
    return metrics["pairs_trained"], len(metrics["history"])


def run_trl(args, pairs, out):
    import datasets
    import torch
    from trl import DPOConfig, DPOTrainer

    model, tok = privact.load_model(args.model, dtype=torch.float32)
    rows = privact.read_json(pairs)
    examples = []
    for row in rows:
        chosen = [{"role": "assistant", "content": row["chosen"]}]
        rejected = [{"role": "assistant", "content": row["rejected"]}]
        examples.append({"prompt": row["prompt"], "chosen": chosen, "rejected": rejected})
    pairs_per_step = args.batch_size * args.grad_accum
    cfg = DPOConfig(
        output_dir=out,
        per_device_train_batch_size=args.trl_batch_size,
        gradient_accumulation_steps=pairs_per_step // args.trl_batch_size,
        num_train_epochs=args.epochs,
        learning_rate=args.lr,
        beta=0.4,
        max_length=None,
        lr_scheduler_type="cosine",
        report_to=[],
        save_strategy="no",
        logging_steps=1000,
        use_cpu=True,
        bf16=False,
        seed=0,
        dataloader_num_workers=0,
        gradient_checkpointing=True,
    )
    trainer = DPOTrainer(
        model=model, args=cfg, train_dataset=datasets.Dataset.from_list(examples), processing_class=tok
    )
    trainer.train()
    return len(rows) * args.epochs, trainer.state.global_step


def child(args):
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        train = run_trl if args.child == "trl" else run_privact
        pairs, steps = train(args, args.pairs, os.path.join(tmp, "out"))
    seconds = time.perf_counter() - start
    result = {
        "trainer": args.child,
        "pairs": pairs,
        "steps_an_epoch": steps / args.epochs,
        "seconds": round(seconds, 1),
    }
    result["pairs_per_s"] = round(pairs / seconds, 4)
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print("RESULT " + json.dumps(result))


def run_trainers(args, trainers, tokens, ceiling):
    """Each trainer in a process of its own -> {trainer: its figures}."""
    results = {}
    for name in trainers:
        command = [sys.executable, __file__, "--child", name, *sys.argv[1:], "--pairs", args.pairs]
        command += ["--model", args.model]
        # each child in the environment its users have: nothing of this process's settings
        proc = subprocess.run(command, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or not line:
            sys.exit(f"{name} run failed:\n{proc.stderr[-3000:]}")
        result = json.loads(line[len("RESULT ") :])
        processed = 5 * tokens[name] * args.epochs / result["seconds"]
        result["row_tokens_per_epoch"] = tokens[name]
        result["share_of_ceiling"] = round(processed / ceiling, 3)
        results[name] = result
        print(
            f"{name:>16}: {result['pairs']} pairs in {result['seconds']} s = {result['pairs_per_s']} pairs/s, "
            f"{result['steps_an_epoch']:g} steps an epoch, "
            f"peak RSS {result['peak_rss_mb']} MB, {tokens[name]} row tokens an epoch, "
            f"{result['share_of_ceiling']:.0%} of the CPU's forward rate",
            flush=True,
        )
    return results


def main():
    ap = common.parser(__doc__, data="", model="smollm2")
    ap.add_argument("--groups", type=int, default=4, help="sibling groups, one per train case")
    ap.add_argument(
        "--siblings",
        type=int,
        default=4,
        help="responses per group, split 2-2, 1-3, 3-1, 2-2 scaled (8: 16, 12, 12, 16 pairs a group)",
    )
    ap.add_argument("--batch-size", type=int, default=4, help="privact's most pairs per micro-batch")
    ap.add_argument("--grad-accum", type=int, default=2, help="privact's micro-batches per optimizer step")
    ap.add_argument(
        "--trl-batch-size",
        type=int,
        default=2,
        help="TRL's pairs per micro-batch; its accumulation makes the same pairs per step as privact's",
    )
    ap.add_argument("--epochs", type=int, default=2, help="epochs over the pairs, every trainer")
    ap.add_argument("--lr", type=float, default=5e-7, help="learning rate, every trainer")
    ap.add_argument(
        "--trainers", default=",".join(TRAINERS), help=f"which to run, comma separated (default: {','.join(TRAINERS)})"
    )
    ap.add_argument("--gradient-noise", action="store_true", help="measure a grouped step's gradient noise instead")
    ap.add_argument("--pairs", default="", help="a pairs file for --gradient-noise (default: the synthetic pairs)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    tmp = tempfile.mkdtemp()
    # TRL reads the config again from the path: every trainer gets a plain transformers folder
    args.model = privact.model_source(args.model)
    if args.gradient_noise:
        pairs = f"{tmp}/pairs.jsonl"
        rows = privact.read_json(args.pairs) if args.pairs else make_pairs(args.data, args.groups, pairs, args.siblings)
        return gradient_noise(args, rows)
    args.pairs = os.path.join(tmp, "pairs_refiner.jsonl")
    rows = make_pairs(args.data, args.groups, args.pairs, args.siblings)
    tokens, groups = row_tokens(args, rows)
    trainers = args.trainers.split(",")
    try:
        import trl  # noqa: F401
    except ImportError:
        print("TRL is not installed (pip install trl): measuring privact alone")
        trainers = [name for name in trainers if name != "trl"]
    ceiling = forward_ceiling(args.model)
    print(f"{len(rows)} pairs in {groups} groups; one forward of [1, 2048]: {ceiling:.0f} tokens/s", flush=True)
    results = run_trainers(args, trainers, tokens, ceiling)
    summary = {"bench": "train", "args": vars(args), "cpu": cpu_name(), "pairs": len(rows), "groups": groups}
    summary.update(ceiling_tokens_per_s=round(ceiling), **results)
    summary["versions"] = privact.provenance()["versions"]
    ratios = {}
    for a, b in (("privact", "privact-per-pair"), ("privact", "trl"), ("privact-per-pair", "trl")):
        if a in results and b in results:
            speed = results[a]["pairs_per_s"] / results[b]["pairs_per_s"]
            memory = results[a]["peak_rss_mb"] / results[b]["peak_rss_mb"]
            ratios[f"{a} vs {b}"] = {"speed": round(speed, 2), "memory": round(memory, 2)}
            print(f"{a} vs {b}: {speed:.2f}x pairs/s, {memory:.2f}x peak memory")
    summary["ratios"] = ratios
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
