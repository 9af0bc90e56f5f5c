"""GPU cost of a paper-scale reproduction, measured on randomly initialised models of the paper's
shapes (nothing comes from the hub; the tokenizer is the embedded SmolLM2 one).

- policy: Llama-3.2-1B-Instruct's exact architecture; judge: Mistral-7B-Instruct-v0.2's. Token ids
  from the 49,152-token SmolLM2 tokenizer are taken modulo a model's vocabulary on the way in.
- collect: seconds per case at the paper's settings (4,4,4, up to 1000 new tokens per agent
  output, judge up to 256, PrivacyLens protocol), through privact.rollout_chunk, the function `collect` runs. Random
  weights rarely stop early and never write a parseable action, so every leaf is treated as a
  valid action (its output as the judged action) and judged: the worst case on both counts.
- train: DPO pairs/s and peak GPU memory at 8 pairs x max length 4096 per micro-batch, bf16
  autocast and gradient checkpointing, through `privact.py train` itself.
- eval: seconds per case at K = 10 (branching 10,1,1, then the judge).
It prints each figure and the hours they imply (394-case collect, two trainings, a 99-case eval);
the last line is a JSON object with all of them.

    python benchmarks/bench_gpu.py            # on a GPU (about 10 minutes on one H100-class card)
    python benchmarks/bench_gpu.py --tiny     # seconds on a CPU: tiny shapes, tiny budgets (the tests run this)
"""
import argparse
import contextlib
import json
import os
import resource
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import privact  # noqa: E402

# config.json of meta-llama/Llama-3.2-1B-Instruct and mistralai/Mistral-7B-Instruct-v0.2, written out
LLAMA_3_2_1B = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                    hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                    rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                    tie_word_embeddings=True, attention_bias=False, mlp_bias=False)
MISTRAL_7B_V0_2 = dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
                       tie_word_embeddings=False)  # sliding_window null: set in random_model
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8)
TINY_POLICY, TINY_JUDGE = dict(TINY, model_type="llama", vocab_size=49152), dict(TINY, model_type="mistral", vocab_size=32000)
TRAIN_CASES, TEST_CASES, EPOCHS = 394, 99, {"verifier": 12, "refiner": 4}


def random_model(shape, tok, dtype, device):
    """A randomly initialised causal LM of `shape` (a config dict) that reads the tokenizer's ids
    (modulo its vocabulary) and gives logits over exactly the tokenizer's ids."""
    from transformers import AutoConfig, AutoModelForCausalLM
    shape = dict(shape)
    config = AutoConfig.for_model(shape.pop("model_type"), **shape, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id % shape["vocab_size"])
    config.sliding_window = None  # Llama has none; Mistral-7B-Instruct-v0.2's config.json says null
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    vocab = config.vocab_size
    model.get_input_embeddings().register_forward_pre_hook(lambda _, args: (args[0] % vocab,))
    if vocab < len(tok):  # logits for every id the tokenizer has (the judge's verdict words), the extra ones -inf
        model.get_output_embeddings().register_forward_hook(
            lambda _, args, out: torch.nn.functional.pad(out, (0, len(tok) - vocab), value=float("-inf")))
    if vocab > len(tok):
        model.get_output_embeddings().register_forward_hook(lambda _, args, out: out.index_fill(-1, unknown, float("-inf")))
        unknown = torch.arange(len(tok), vocab, device=device)
    model.generation_config.eos_token_id = tok.eos_token_id
    return model.eval()


def seconds_per_case(cases, branching, models, args, budget):
    roles = privact.parse_topology("generator,verifier,refiner")
    cfg = argparse.Namespace(max_new_tokens=budget, judge_max_new_tokens=args.judge_tokens,
                             batch_size=args.batch_size, temperature=1.0, judge_protocol="privacylens")
    privact.judged_action = lambda case, output, protocol: (output or "x")[:2000]  # every leaf judged: the worst case
    sync()
    start = time.perf_counter()
    records = privact.rollout_chunk(cases, roles, branching, models, {r: "naive" for r in roles}, cfg)
    sync()
    seconds = (time.perf_counter() - start) / len(cases)
    return seconds, {k: round(sum(r[k] for r in records) / len(records)) for k in ("generated_tokens", "judge_tokens")}


def dpo_figures(policy_shape, tok, args, folder):
    """pairs/s and peak memory of `privact.py train` on synthetic pairs of the given lengths."""
    prompt_len, response_len = args.max_length - 2 * args.response_tokens, args.response_tokens
    words = lambda n, salt: " ".join(f"w{(i * 7919 + salt) % 5000}" for i in range(n))  # noqa: E731 (about 2-3 tokens each)
    pairs = [{"case": f"c{i}", "role": "refiner", "prompt": [{"role": "user", "content": words(prompt_len // 3, i)}],
              "chosen": words(response_len // 3, i + 1), "rejected": words(response_len // 3, i + 2)}
             for i in range(args.batch_size_train * (args.train_steps + 1))]
    path = os.path.join(folder, "pairs_refiner.jsonl")
    privact.write_atomic(path, privact.jsonl(pairs))
    model = random_model(policy_shape, tok, torch.float32, "cpu")
    model.save_pretrained(os.path.join(folder, "policy"))
    tok.save_pretrained(os.path.join(folder, "policy"))
    del model
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    code = privact.main(["train", "--pairs", path, "--model", os.path.join(folder, "policy"), "--out",
                         os.path.join(folder, "refiner"), "--batch-size", str(args.batch_size_train), "--grad-accum", "1",
                         "--max-steps", str(args.train_steps), "--eval-fraction", "0", "--max-length", str(args.max_length),
                         "--mixed-precision", "bf16", "--save-every", "0", "--epochs", "1"])
    assert code == 0, "train failed"
    metrics = privact.read_json_file(os.path.join(folder, "refiner", "train_metrics.json"))
    peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return metrics["train/pairs_per_s"], peak / 2 ** 30


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and budgets, for a CPU (what the tests run)")
    ap.add_argument("--cases", type=int, default=1, help="train cases timed for collect, test cases for eval")
    ap.add_argument("--max-new-tokens", type=int, default=1000, help="agent output budget (paper: 1000)")
    ap.add_argument("--judge-tokens", type=int, default=256, help="judge output budget (paper: 256)")
    ap.add_argument("--batch-size", type=int, default=64, help="sequences per generate call")
    ap.add_argument("--max-length", type=int, default=4096, help="DPO prompt + response tokens per pair")
    ap.add_argument("--response-tokens", type=int, default=300, help="DPO tokens per response")
    ap.add_argument("--batch-size-train", type=int, default=8, help="DPO pairs per micro-batch (paper: 8)")
    ap.add_argument("--train-steps", type=int, default=4, help="timed DPO steps")
    ap.add_argument("--pairs", type=int, default=5000, help="pairs per role assumed for the training hours")
    args = ap.parse_args()
    if args.tiny:
        args.max_new_tokens, args.judge_tokens, args.batch_size = 4, 4, 16
        args.max_length, args.response_tokens, args.batch_size_train, args.train_steps = 96, 16, 2, 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    folder, gguf = privact.embedded_model_folder("smollm2")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    policy_shape, judge_shape = (TINY_POLICY, TINY_JUDGE) if args.tiny else (LLAMA_3_2_1B, MISTRAL_7B_V0_2)
    policy = random_model(policy_shape, tok, torch.bfloat16, device)
    judge = random_model(judge_shape, tok, torch.bfloat16, device)
    models = {"generator": (policy, tok), "verifier": (policy, tok), "refiner": (policy, tok), "judge": (judge, tok)}
    same_tool = lambda cases: [c for c in cases if c["trajectory"]["final_action"] == cases[0]["trajectory"]["final_action"]]  # noqa: E731
    train_cases = same_tool(privact.load_cases("", "train"))[:args.cases]
    test_cases = same_tool(privact.load_cases("", "test"))[:args.cases]
    torch.manual_seed(0)
    collect_s, collect_tokens = seconds_per_case(train_cases, [4, 4, 4], models, args, args.max_new_tokens)
    print(f"collect: {collect_s:.1f} s per case at 4,4,4 ({collect_tokens})", flush=True)
    eval_s, _ = seconds_per_case(test_cases, [10, 1, 1], models, args, args.max_new_tokens)
    print(f"eval:    {eval_s:.1f} s per case at K = 10", flush=True)
    del models, policy, judge
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        pairs_s, peak_gib = dpo_figures(policy_shape, tok, args, tmp)
    print(f"train:   {pairs_s:.2f} pairs/s, peak {'GPU' if device == 'cuda' else 'RSS'} memory {peak_gib:.1f} GiB "
          f"(batch {args.batch_size_train} x {args.max_length} tokens, bf16 autocast, checkpointing)", flush=True)
    hours = {"collect_394_cases": collect_s * TRAIN_CASES / 3600, "eval_99_cases_per_configuration": eval_s * TEST_CASES / 3600,
             **{f"train_{role}_{args.pairs}_pairs_{n}_epochs": args.pairs * n / pairs_s / 3600 for role, n in EPOCHS.items()}}
    for name, h in hours.items():
        print(f"  {name}: {h:.2f} h")
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(json.dumps({"bench": "gpu", "device": device_name, "args": vars(args),
                      "collect_seconds_per_case": round(collect_s, 2), "collect_tokens_per_case": collect_tokens,
                      "eval_seconds_per_case": round(eval_s, 2), "dpo_pairs_per_s": round(pairs_s, 3),
                      "dpo_peak_memory_gib": round(peak_gib, 2), "hours": {k: round(v, 3) for k, v in hours.items()}}))


if __name__ == "__main__":
    main()
