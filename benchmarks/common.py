"""What the benchmarks share: the flags several of them take, declared once.

    ap = common.parser(__doc__, model="smollm2", batch_size=16, max_new_tokens=64)

gives an ArgumentParser with exactly those shared flags, at those defaults; each script adds its own.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# flag -> (type, help); the default is the script's
SHARED_FLAGS = {
    "data": (str, "PrivacyLens main_data.json path or hub id (default: the bundled copy)"),
    "model": (str, "model to benchmark: a short name (smollm2, the embedded SmolLM2-135M), a hub id or a folder"),
    "batch_size": (int, "privact's sequences per generate call"),
    "max_new_tokens": (int, "agent output budget, the same for every side"),
    "judge_max_new_tokens": (int, "tokens per verdict, the same for every side (PrivacyLens: 1000)"),
    "temperature": (float, "sampling temperature (paper: 1.0)"),
    "dtype": (str, "bfloat16 (privact's default on a GPU or a CPU with bf16 units) or float32"),
    "seed": (int, "sampling seed, the same for every side"),
}


def parser(doc, **defaults):
    """An ArgumentParser whose description is the script's docstring, with the shared flags named in
    `defaults` (as keyword names: batch_size for --batch-size) at those defaults."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in defaults.items():
        kind, text = SHARED_FLAGS[name]
        ap.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=f"{text} (default: {default})")
    return ap
