"""GPU cost of a paper-scale reproduction, measured on randomly initialised models of the paper's
shapes (nothing comes from the hub; the tokenizer is a saved SmolLM2 one, --tokenizer, or the
embedded GGUF's).

- policy: Llama-3.2-1B-Instruct's exact architecture; judge: Mistral-7B-Instruct-v0.2's. Token ids
  from the 49,152-token SmolLM2 tokenizer are taken modulo a model's vocabulary on the way in.
- collect: the paper's settings (4,4,4, up to 1000 new tokens per agent output, judge up to 256,
  PrivacyLens protocol) through privact.rollout_chunk, the function `collect` runs. Random weights
  never write a parseable action, so every leaf is judged (its output as the action): the worst
  case. One warm-up case first (compiles, graph captures), reported apart; then the steady state
  over --cases cases in chunks of --chunk-cases (at least 2 chunks, so prompt widths change), with
  tokens/s and the torch.compile recompiles counted during it (dynamo's counters).
- eval: the same at K = 10 (branching 10,1,1, then the judge) on test cases.
- decode: ms per decoding step at --rows rows of --decode-prompt-tokens tokens, privact's engine
  (shared prefill into a static cache) beside plain `generate`, and the share of the card's memory
  bandwidth a step would need at its weights + KV bytes (--peak-bandwidth).
- peers: on the same trees (--peer-cases cases), one plain `generate(num_return_sequences=B)` per
  tree node and per judge prompt (the straightforward loop), and transformers' continuous-batching
  engine `generate_batch`, level by level; seconds per case beside privact's.
- train: DPO pairs/s and peak GPU memory at 8 pairs x max length 4096 per micro-batch, bf16
  autocast and gradient checkpointing, through `privact.py train` itself (TRL's DPOTrainer on the
  same pairs: benchmarks/bench_train.py).
It prints each figure and the hours they imply (394-case collect, two trainings, a 99-case eval);
the last line is a JSON object with all of them.

    python benchmarks/bench_gpu.py --tokenizer smollm2_tokenizer   # on a GPU
    python benchmarks/bench_gpu.py --tiny                          # a CPU: tiny shapes and budgets (the tests run this)
"""

import contextlib
import json
import os
import resource
import sys
import tempfile
import time

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
TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}
TINY_POLICY, TINY_JUDGE = (
    dict(TINY, model_type="llama", vocab_size=49152),
    dict(TINY, model_type="mistral", vocab_size=32000),
)
TRAIN_CASES, TEST_CASES, EPOCHS = 394, 99, {"verifier": 12, "refiner": 4}


def random_model(shape, tok, dtype, device):
    """A randomly initialised causal LM of `shape` (a config dict) that reads the tokenizer's ids
    (modulo its vocabulary) and gives logits over exactly the tokenizer's ids."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(shape)
    config = AutoConfig.for_model(
        shape.pop("model_type"),
        **shape,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id % shape["vocab_size"],
    )
    config.sliding_window = None  # Llama has none; Mistral-7B-Instruct-v0.2's config.json says null
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    vocab = config.vocab_size
    model.get_input_embeddings().register_forward_pre_hook(lambda _, args: (args[0] % vocab,))
    if vocab < len(tok):  # logits for every id the tokenizer has (the judge's verdict words), the extra ones -inf
        model.get_output_embeddings().register_forward_hook(
            lambda _, args, out: torch.nn.functional.pad(out, (0, len(tok) - vocab), value=float("-inf"))
        )
    if vocab > len(tok):
        model.get_output_embeddings().register_forward_hook(
            lambda _, args, out: out.index_fill(-1, unknown, float("-inf"))
        )
        unknown = torch.arange(len(tok), vocab, device=device)
    model.generation_config.eos_token_id = tok.eos_token_id
    return model.eval()


ROLES = ("generator", "verifier", "refiner")
STAGES = ("collect", "eval", "decode", "peers", "train")


def compiled_graphs():
    """torch.compile's count of graphs compiled so far in this process (dynamo's counters)."""
    from torch._dynamo.utils import counters

    return sum(counters["stats"].values()) and int(counters["stats"]["unique_graphs"])


def timed_chunk(cases, branching, models, args, budget):
    """One privact.rollout_chunk -> (seconds, records)."""
    cfg = privact.CollectConfig(
        max_new_tokens=budget, judge_max_new_tokens=args.judge_tokens, batch_size=args.batch_size, temperature=1.0
    )
    sync()
    start = time.perf_counter()
    records = privact.rollout_chunk(cases, privact.Chain(list(ROLES), branching), models, cfg)
    sync()
    return time.perf_counter() - start, records


def run_figures(cases, branching, models, args, budget):
    """Warm-up on the first case, then the steady state over the rest in chunks of --chunk-cases."""
    torch.manual_seed(0)
    warmup, _ = timed_chunk(cases[:1], branching, models, args, budget)
    before, seconds, records, chunks = compiled_graphs(), 0.0, [], []
    for first in range(1, len(cases), args.chunk_cases):
        chunk = cases[first : first + args.chunk_cases]
        t, recs = timed_chunk(chunk, branching, models, args, budget)
        seconds, records = seconds + t, records + recs
        chunks.append({"cases": len(chunk), "seconds": round(t, 2)})
    tokens = {k: round(sum(r[k] for r in records) / len(records)) for k in ("generated_tokens", "judge_tokens")}
    return {
        "warmup_seconds": round(warmup, 2),
        "steady_seconds_per_case": round(seconds / len(records), 3),
        "steady_tokens_per_s": round(sum(tokens.values()) * len(records) / seconds, 1),
        "steady_cases": len(records),
        "chunks": chunks,
        "recompiles_after_warmup": compiled_graphs() - before,
        "tokens_per_case": tokens,
    }, records


def decode_ms_per_step(model, tok, rows, prompt_tokens, steps, plain):
    """ms per decoding step at `rows` distinct prompts: two greedy runs of different lengths, so prefill cancels;
    each run once untimed first, so a compile (transformers compiles a static-cache forward on CUDA) is not timed."""
    from transformers import GenerationConfig

    def gen(n):
        return GenerationConfig(
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )

    seqs = [[3 + (r * 7919 + i * 104729) % 30000 for i in range(prompt_tokens)] for r in range(rows)]
    times = []
    for n in (8, 8, 8 + steps, 8 + steps):
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            if plain:
                ids = torch.tensor(seqs, device=model.device)
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen(n))
            else:
                privact.generate_shared_prefix(model, seqs, list(range(rows)), gen(n), 1)
        sync()
        times.append(time.perf_counter() - start)
    times = times[1::2]
    return 1000 * (times[1] - times[0]) / steps


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
        for role, width in zip(ROLES, (4, 4, 4), strict=True):
            model, tok = models[role]
            for node in frontier:
                ids = torch.tensor(
                    [tok(privact.chat_text(tok, node.children[0].prompt), add_special_tokens=False)["input_ids"]],
                    device=model.device,
                )
                gen = GenerationConfig(
                    max_new_tokens=budget,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    num_return_sequences=width,
                    pad_token_id=tok.pad_token_id,
                    eos_token_id=tok.eos_token_id,
                )
                with torch.inference_mode():
                    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen)
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
    for role, width in zip(ROLES, (4, 4, 4), strict=True):
        model, tok = models[role]
        inputs = [
            tok(privact.chat_text(tok, n.children[0].prompt), add_special_tokens=False)["input_ids"] for n in frontier
        ]
        model.generate_batch(
            inputs=inputs,
            warmup=torch.cuda.is_available(),
            continuous_batching_config=cb_config(args),
            generation_config=GenerationConfig(
                max_new_tokens=budget,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                num_return_sequences=width,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            ),
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
    """pairs/s and peak memory of `privact.py train` on synthetic pairs of the given lengths."""
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
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
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
        torch.cuda.max_memory_allocated()
        if torch.cuda.is_available()
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return metrics["train/pairs_per_s"], peak / 2**30


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def parse_args():
    ap = common.parser(__doc__, max_new_tokens=1000, batch_size=64)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and budgets, for a CPU (what the tests run)")
    ap.add_argument("--tokenizer", default="", help="a saved SmolLM2 tokenizer folder (default: the embedded GGUF's)")
    ap.add_argument(
        "--cases", type=int, default=8, help="steady-state cases timed for collect and for eval (after 1 warm-up)"
    )
    ap.add_argument("--chunk-cases", type=int, default=4, help="cases per rollout chunk (collect's --chunk-cases)")
    ap.add_argument("--peer-cases", type=int, default=1, help="cases the peers (plain generate, generate_batch) replay")
    ap.add_argument("--judge-tokens", type=int, default=256, help="judge output budget")
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
        default=",".join(STAGES),
        help=f"stages to run, comma-separated, of {','.join(STAGES)} (peers replay collect's trees)",
    )
    args = ap.parse_args()
    args.stages = args.stages.split(",")
    if not set(args.stages) <= set(STAGES) or ("peers" in args.stages and "collect" not in args.stages):
        ap.error(f"--stages {','.join(args.stages)}: choose from {','.join(STAGES)}; peers needs collect")
    if args.tiny:
        args.max_new_tokens, args.judge_tokens, args.batch_size, args.cases, args.chunk_cases = 4, 4, 16, 2, 1
        args.rows, args.decode_prompt_tokens, args.decode_steps = "2,4", 16, 4
        args.max_length, args.response_tokens, args.batch_size_train, args.train_steps = 320, 16, 2, 1
    return args


def generation_figures(models, tok, args):
    """collect, eval, decode and peers (those in --stages) -> one dict of figures (printed as they come)."""

    def same_tool(cases):
        return [c for c in cases if c["trajectory"]["final_action"] == cases[0]["trajectory"]["final_action"]]

    privact.judged_action = lambda case, output, protocol: (output or "x")[:2000]  # every leaf judged: the worst case
    figures, records = {}, {}
    for stage, split, branching in (("collect", "train", [4, 4, 4]), ("eval", "test", [10, 1, 1])):
        if stage in args.stages:
            cases = same_tool(privact.load_cases("", split))[: args.cases + 1]
            figures[stage], records[stage] = run_figures(cases, branching, models, args, args.max_new_tokens)
            f = figures[stage]
            print(
                f"{stage + ':':8} warm-up {f['warmup_seconds']} s, then {f['steady_seconds_per_case']} s "
                f"per case ({f['recompiles_after_warmup']} recompiles)",
                flush=True,
            )
    if "decode" in args.stages:
        figures["decode_ms_per_step"] = decode_figures(models["generator"][0], tok, args)
    if "peers" in args.stages:
        by_name = {c["name"]: c for c in privact.load_cases("", "train")}
        peer_records = records["collect"][: args.peer_cases]  # steady-state trees: the peers replay their prompts
        figures["peers"] = peer_figures(
            peer_records,
            [by_name[r["case"]] for r in peer_records],
            models,
            args,
            args.max_new_tokens,
            figures["collect"]["steady_seconds_per_case"],
        )
        print(f"peers:   {figures['peers']}", flush=True)
    return figures


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


def main():
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from transformers import AutoTokenizer

    folder, gguf = (args.tokenizer, None) if args.tokenizer else privact.embedded_model_folder("smollm2")
    tok = AutoTokenizer.from_pretrained(folder, **({"gguf_file": gguf} if gguf else {}))
    policy_shape, judge_shape = (TINY_POLICY, TINY_JUDGE) if args.tiny else (LLAMA_3_2_1B, MISTRAL_7B_V0_2)
    figures, hours = {}, {}
    if set(args.stages) - {"train"}:
        policy = random_model(policy_shape, tok, torch.bfloat16, device)
        judge = (
            random_model(judge_shape, tok, torch.bfloat16, device)
            if set(args.stages) & {"collect", "eval", "peers"}
            else None
        )
        figures = generation_figures({**dict.fromkeys(ROLES, (policy, tok)), "judge": (judge, tok)}, tok, args)
        del policy, judge
    for stage, cases in (("collect", TRAIN_CASES), ("eval", TEST_CASES)):
        if stage in figures:
            figures[f"{stage}_seconds_per_case"] = figures[stage]["steady_seconds_per_case"]
            name = f"{stage}_{cases}_cases" + ("_per_configuration" if stage == "eval" else "")
            hours[name] = figures[stage]["steady_seconds_per_case"] * cases / 3600
    if "collect" in figures:
        figures["collect_tokens_per_case"] = figures["collect"]["tokens_per_case"]
    if "train" in args.stages:
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
            pairs_s, peak_gib = dpo_figures(policy_shape, tok, args, tmp)
        print(
            f"train:   {pairs_s:.2f} pairs/s, peak {'GPU' if device == 'cuda' else 'RSS'} memory {peak_gib:.1f} GiB "
            f"(batch {args.batch_size_train} x {args.max_length} tokens, bf16 autocast, checkpointing)",
            flush=True,
        )
        figures.update(dpo_pairs_per_s=round(pairs_s, 3), dpo_peak_memory_gib=round(peak_gib, 2))
        hours.update(
            {
                f"train_{role}_{args.pairs}_pairs_{n}_epochs": args.pairs * n / pairs_s / 3600
                for role, n in EPOCHS.items()
            }
        )
    for name, h in hours.items():
        print(f"  {name}: {h:.2f} h")
    print(
        json.dumps(
            {
                "bench": "gpu",
                "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                "args": vars(args),
                "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
                **figures,
                "hours": {k: round(v, 3) for k, v in hours.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
