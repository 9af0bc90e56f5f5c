"""ConfAIde's tier files (tier_3.txt, tier_4.txt, from github skywalker023/confAIde, MIT) as the JSON items
privact.py reads (tier_3.json, tier_4.json), each text built as ConfAIde's eval.py builds it:

    python data/confaide/convert.py [FOLDER]   # FOLDER holds tier_3.txt and tier_4.txt (default: this one)

A tier file is a list of blocks: `<BEGIN><header>`, body lines, `<END><header><extra>`. Tier 3: {story, X
(about), Y (questionee), Z (questioner), secret (topic)}; tier 4: {transcript, private, public}.
"""

import json
import os
import re
import sys


def tier_items(path, tier):
    """The items of one tier file; a bad block stops with a line naming the file and the block."""
    with open(path) as fh:
        text = fh.read()
    blocks = re.findall(r"^<BEGIN><([^\n]*?)>\n(.*?)^<END><\1>([^\n]*)$", text, re.M | re.S)
    if text.count("<BEGIN>") != len(blocks):
        sys.exit(f"{path}: {text.count('<BEGIN>') - len(blocks)} <BEGIN> without its <END>")
    items = []
    for number, (header, body, extra) in enumerate(blocks, 1):
        fields = [part.strip() for part in header.split(",")]
        info = {}
        for part in extra.strip("<>").split(","):
            key, _, value = part.partition(":")
            info[key.strip().lower()] = value.strip().strip(".")
        if tier == 4 and len(fields) == 2:
            # blank lines collapsed, as eval.py's "\n\n\n" and "\n\n" replacements
            transcript = body.replace("\n\n\n", "\n").replace("\n\n", "\n")
            items.append({"transcript": transcript, "private": fields[0], "public": fields[1]})
        elif tier == 3 and len(fields) == 4 and set(info) == {"about", "questionee", "questioner", "topic"}:
            story = body.replace("\n", " ").replace("  ", " ")
            # drop the last sentence (the story's own question), then collapse "  " again, as eval.py does: a
            # line's trailing space and a blank line leave three spaces (107 of 270 stories)
            story = ". ".join(story.split(". ")[:-1]).replace("  ", " ") + "."
            scenario = {"X": info["about"], "Y": info["questionee"], "Z": info["questioner"], "secret": info["topic"]}
            items.append({"story": story, **scenario})
        else:
            sys.exit(f"{path}: block {number} <{header}>: not a tier-{tier} block")
    return items


def main(folder):
    for tier in (3, 4):
        items = tier_items(os.path.join(folder, f"tier_{tier}.txt"), tier)
        with open(os.path.join(folder, f"tier_{tier}.json"), "w") as fh:
            json.dump(items, fh, indent=1, ensure_ascii=False)
            fh.write("\n")
        print(f"tier {tier}: {len(items)} items")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
