"""privact's pairs trained with TRL's DPOTrainer: the README's recipe ("Pairs in TRL's format") as a whole script.

    pip install trl
    python benchmarks/trl_dpo.py --pairs runs/quick/pairs_refiner.jsonl --out runs/quick/refiner_trl

The pairs go into TRL's conversational preference format (each response an assistant message), the model is the one
privact trains from (`privact.model_source` gives the embedded SmolLM2 as a plain transformers folder; a hub id or a
folder is passed through), its tokenizer privact's (`privact.load_tokenizer`: the pad token set). Each prompt is the
chat privact sampled and trains under: rendered on privact's CHAT_DATE (Llama-3.2's template would print today's
date), its system message folded into the first user message where the template refuses a system role
(Mistral-7B-Instruct-v0.2's, the release's policy model), as privact's chat_text folds it. The settings are privact's
train defaults, so the two trainers' curves can be laid side by side:

- max_length=None: TRL's default of 1024 tokens, with truncation_mode "keep_start", drops every pair whose prompt
  fills 1024 tokens and cuts the responses of the rest; privact's prompts run to 2.8k tokens. None trains on whole
  pairs, as privact's --max-length 4096 does.
- beta 0.4, learning rate 5e-7, linear warmup over 10% of the steps then cosine decay, AdamW without weight decay,
  gradient clipping at 1.0: the release's config, privact's defaults (TRL's own are beta 0.1, lr 1e-6, linear decay).
- epochs by role, as privact's train: the verifier 12, the refiner 4 (the release's scripts/train_MA.sh).
- bf16=False: float32, as privact trains by default on a CPU (TRL turns bf16 autocast on by default).
- precompute_ref_log_probs=False: a frozen copy of the model scores each micro-batch, as the release's run did.

TRL shuffles pairs, where privact shuffles sibling groups and packs each group's prompt once (README: "Groups, not
pairs, are shuffled").

Printed: each optimizer step's loss, reward margin and accuracy, then one JSON line with the steps. Step 1 sits at
log 2 (the policy is its reference); later steps move as far as one AdamW step at this learning rate moves the summed
log-probs of responses of a hundred tokens and more, the same distance privact's own steps move (the slow test runs
both on the same pairs).

TRL renders each response through the chat template, so every response ends with an end-of-turn token, also one that
was cut at --max-new-tokens, and is tokenized again from its text; privact trains on the sampled token ids.
"""

import argparse
import json
import os

import common  # noqa: F401  (puts privact.py on the path)
import privact


def conversational(path):
    """The README's recipe: a pairs_<role>.jsonl as TRL's conversational preference dataset."""
    import datasets

    ds = datasets.load_dataset("json", data_files=path, split="train")
    return ds.map(lambda p: {k: [{"role": "assistant", "content": p[k]}] for k in ("chosen", "rejected")})


def as_privact_renders(ds, tok):
    """Each prompt rendered as privact renders it: on privact.CHAT_DATE (TRL passes a row's chat_template_kwargs to
    the template), and its system message folded into the first user message after a blank line where the template
    refuses a system role."""
    from jinja2 import TemplateError

    def render(pair):
        chat = pair["prompt"]
        try:
            tok.apply_chat_template(chat, tokenize=False, date_string=privact.CHAT_DATE)
        except TemplateError:
            if chat[0]["role"] != "system":
                raise
            first = {"role": "user", "content": chat[0]["content"] + "\n\n" + chat[1]["content"]}
            chat = [first, *chat[2:]]
        return {"prompt": chat, "chat_template_kwargs": {"date_string": privact.CHAT_DATE}}

    return ds.map(render)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", required=True, help="a pairs_<role>.jsonl that privact's collect wrote")
    ap.add_argument("--model", default="smollm2", help="the model to train, as privact's --model (default: smollm2)")
    ap.add_argument("--out", required=True, help="TRL's output folder")
    ap.add_argument("--batch-size", type=int, default=8, help="pairs per micro-batch (privact's default 8)")
    ap.add_argument("--grad-accum", type=int, default=4, help="micro-batches per optimizer step (privact's 4)")
    ap.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (-1: --epochs)")
    ap.add_argument(
        "--epochs",
        type=float,
        default=0,
        help="epochs over the pairs; 0 for privact's per role (verifier 12, refiner 4)",
    )
    ap.add_argument("--lr", type=float, default=5e-7, help="peak learning rate (privact's 5e-7)")
    ap.add_argument("--warmup-ratio", type=float, default=0.1, help="share of steps warming up (privact's 0.1)")
    ap.add_argument("--seed", type=int, default=0, help="the data order's seed")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    tok = privact.load_tokenizer(args.model)
    role, _ = privact.load_pairs(args.pairs)
    epochs = args.epochs or privact.EPOCHS_BY_ROLE.get(role, 4)
    dataset = as_privact_renders(conversational(args.pairs), tok)
    model = AutoModelForCausalLM.from_pretrained(privact.model_source(args.model), dtype=torch.float32)
    config = DPOConfig(
        output_dir=args.out,
        max_length=None,
        beta=0.4,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_ratio,
        weight_decay=0.0,
        max_grad_norm=1.0,
        bf16=False,
        precompute_ref_log_probs=False,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        num_train_epochs=epochs,
        max_steps=args.max_steps,
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
    )
    trainer = DPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tok)
    trainer.train()
    trainer.save_model(args.out)
    steps = [row for row in trainer.state.log_history if "loss" in row]
    for row in steps:
        margin, accuracy = row.get("rewards/margins"), row.get("rewards/accuracies")
        print(f"step {row['step']}: loss {row['loss']:.4f}, reward margin {margin:.4f}, accuracy {accuracy:.2f}")
    print(json.dumps({"trainer": "trl", "role": role, "epochs": epochs, "steps": steps, "args": vars(args)}))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
