"""Offline instruction prompts for self-distillation: code tasks derived from the Python
standard library (function heads, docstrings, short sources) and chat requests built from
templates and topics.

Every prompt is assigned to ``train`` or ``heldout`` by a hash of its text, so the split is
the same on every machine. The benchmark prompts (``bench_prompts``) are written separately
and never produced here.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "turtledemo"}

CODE_TEMPLATES = [
    "Write a Python function `{sig}` that {doc}",
    "Implement `{sig}` in Python. It should {doc}",
    "Explain what the Python function `{qual}` does.",
    "Give a short example of how to use `{qual}` in Python.",
    "What does this Python code do?\n\n```python\n{src}\n```",
    "Add a docstring and comments to this function:\n\n```python\n{bare}\n```",
    "{head}",
    "Complete this Python function:\n\n```python\n{head}\n```",
    "Rewrite this function to be easier to read:\n\n```python\n{src}\n```",
    "Write unit tests for this function:\n\n```python\n{src}\n```",
]

MODULE_TEMPLATES = [
    "What is the Python `{mod}` module used for?",
    "Show me how to use the `{mod}` module in Python with a small example.",
    "What are the most useful functions in Python's `{mod}` module?",
]

CHAT_TEMPLATES = [
    "Explain {t} in simple terms.",
    "What is {t}?",
    "Give me three tips about {t}.",
    "Write a short poem about {t}.",
    "Why is {t} important?",
    "Write a short story about {t}.",
    "What are the pros and cons of {t}?",
    "How does {t} work?",
    "Summarize what people should know about {t} in a few sentences.",
    "Write a friendly email to a colleague about {t}.",
    "Describe {t} to a ten-year-old.",
    "What are common mistakes people make with {t}?",
    "List five facts about {t}.",
    "Write a short blog introduction about {t}.",
    "How can I learn more about {t}?",
    "Compare {t} and {u}.",
    "What is the difference between {t} and {u}?",
    "Write a tweet about {t}.",
    "Give me a step-by-step guide to getting started with {t}.",
    "What questions should I ask an expert about {t}?",
]

TOPICS = """
photosynthesis; black holes; the water cycle; climate change; volcanoes; earthquakes; the moon;
the solar system; gravity; electricity; magnetism; the human heart; the immune system; sleep;
vaccines; DNA; evolution; bees; rainforests; the ocean tides; recycling; solar power;
wind energy; nuclear power; electric cars; bicycles; trains; airplanes; the internet; email;
social media; smartphones; artificial intelligence; machine learning; databases; encryption;
passwords; cloud computing; open source software; version control; unit testing; recursion;
sorting algorithms; binary search; hash tables; linked lists; regular expressions; JSON;
web servers; operating systems; compilers; the Python language; the C language; JavaScript;
spreadsheets; budgeting; saving money; investing; inflation; taxes; credit cards; job interviews;
writing a resume; public speaking; time management; teamwork; leadership; remote work;
learning a new language; reading books; writing essays; poetry; music theory; playing the guitar;
painting; photography; cooking pasta; baking bread; making coffee; brewing tea; healthy breakfast;
vegetarian diets; drinking water; running; yoga; swimming; chess; football; basketball; tennis;
the Olympic Games; ancient Rome; ancient Egypt; the Renaissance; the printing press;
the industrial revolution; the French Revolution; World War II; the Cold War; democracy;
human rights; the United Nations; Paris; Tokyo; New York; the Amazon river; the Sahara desert;
Mount Everest; the Great Wall of China; penguins; elephants; dolphins; cats; dogs; gardening;
houseplants; composting; camping; hiking; travel planning; packing for a trip; birthdays;
friendship; kindness; stress; meditation; happiness; motivation; habits; procrastination;
the scientific method; statistics; probability; prime numbers; fractions; geometry; calculus;
the Pythagorean theorem; money; banks; the stock market; small businesses; marketing;
customer service; negotiation; online shopping; cybersecurity; phishing; backups; keyboards;
video games; board games; movies; museums; libraries; volunteering; city parks; public transport;
weather forecasts; rain; snow; autumn; spring; the seasons; rivers; forests; deserts; islands;
mushrooms; chocolate; pizza; rice; apples; bananas; honey; salt; sugar; vitamins; first aid;
washing hands; dental care; eyesight; hearing; memory; dreams; emotions; empathy; curiosity
"""


def topics() -> list[str]:
    """The chat topics, one per entry."""
    return [t.strip() for t in TOPICS.replace("\n", " ").split(";") if t.strip()]


def is_heldout(text: str, percent: int = 4) -> bool:
    """Deterministic held-out split by a hash of the prompt text."""
    digest = hashlib.sha1(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < percent


def _stdlib_files(root: Path) -> Iterator[Path]:
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if not _SKIP_DIRS.intersection(rel) and not rel[0].startswith(("config-", "_")):
            yield p


def _first_sentence(doc: str) -> str:
    line = " ".join(doc.strip().split("\n\n")[0].split())
    cut = line.find(". ")
    line = line if cut < 0 else line[: cut + 1]
    if not line:
        return ""
    return line[0].lower() + line[1:] if not line[:2].isupper() else line


def _functions(path: Path, root: Path):
    """(qualified name, signature, docstring, source, head) of documented short functions."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    mod = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
    lines = text.splitlines()
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 20:
            continue
        src = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        if len(src.splitlines()) > 30 or "\t" in src:
            continue
        body0 = node.body[0]
        head = "\n".join(lines[node.lineno - 1 : body0.end_lineno])
        bare = "\n".join(lines[node.lineno - 1 : body0.lineno - 1] + lines[body0.end_lineno :])
        sig = f"{node.name}({ast.unparse(node.args)})"
        yield f"{mod}.{node.name}", sig, doc, src, head, bare, mod


def code_prompts(root: Path | None = None) -> list[str]:
    """Code prompts from the standard library's documented top-level functions (parsed once
    per process and folder: ~700 files, ~3.5 s)."""
    return list(_code_prompts(str(root or sysconfig.get_paths()["stdlib"])))


@functools.lru_cache(maxsize=4)
def _code_prompts(folder: str) -> tuple[str, ...]:
    root = Path(folder)
    out, mods = [], set()
    for i, path in enumerate(_stdlib_files(root)):
        for j, (qual, sig, doc, src, head, bare, mod) in enumerate(_functions(path, root)):
            mods.add(mod.split(".")[0])
            fields = {"qual": qual, "sig": sig, "doc": _first_sentence(doc)}
            fields.update(src=src, head=head, bare=bare)
            # Two templates per function, rotating, so every template is used evenly.
            for k in (0, 1):
                tpl = CODE_TEMPLATES[(i + j * 3 + k * 5) % len(CODE_TEMPLATES)]
                if "{doc}" in tpl and not fields["doc"]:
                    continue
                out.append(tpl.format(**fields))
    for m in sorted(mods):
        out += [t.format(mod=m) for t in MODULE_TEMPLATES]
    return tuple(out)


def chat_prompts() -> list[str]:
    """Chat prompts: every template with every topic (pairs for the two-topic ones)."""
    ts, out = topics(), []
    for i, t in enumerate(ts):
        for j, tpl in enumerate(CHAT_TEMPLATES):
            u = ts[(i * 7 + j * 13 + 1) % len(ts)]
            out.append(tpl.format(t=t, u=u))
    return out


def build_prompts(split: str = "train", seed: int = 0) -> list[str]:
    """All prompts of a split, deduplicated and shuffled reproducibly.

    Args:
        split: "train" or "heldout". seed: shuffle seed.
    """
    want = split == "heldout"
    seen, out = set(), []
    for p in code_prompts() + chat_prompts():
        if p not in seen and is_heldout(p) == want:
            seen.add(p)
            out.append(p)
    random.Random(seed).shuffle(out)
    return out


LONG_REQUESTS = (
    "Explain what the code above does, function by function.",
    "Write unit tests for the first class or function in the code above.",
    "Find a bug or a weakness in the code above and show how to fix it.",
    "Summarize the code above in five bullet points.",
)


def long_prompts(
    split: str = "heldout", lengths=(2048, 4096, 7000), per_length: int = 2, root=None
) -> list[str]:
    """Long-context prompts: standard-library sources cut at a line to about ``n`` tokens
    (3.5 characters a token), then a request; per_length per length, from the files of
    ``split`` (a hash of each file's path, as ``is_heldout``), so training on the train
    files never sees a held-out one. Kept apart from ``pool`` (the ledger's held-out tau
    stays comparable across rounds).

    Args:
        split: "train" or "heldout". lengths: approximate prompt lengths in tokens.
        per_length: prompts per length. root: the standard library (default: this one's).
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    want = split == "heldout"
    files = [f for f in _stdlib_files(root) if is_heldout(str(f.relative_to(root))) == want]
    out, k = [], 0
    for n in lengths:
        for _ in range(per_length):
            text, chars = "", int(3.5 * n)
            while len(text) < chars and files:
                text += files[k % len(files)].read_text(encoding="utf-8", errors="replace")
                k += 1
            text = text[:chars].rsplit("\n", 1)[0]
            ask = LONG_REQUESTS[len(out) % len(LONG_REQUESTS)]
            out.append(f"```python\n{text}\n```\n\n{ask}")
    return out


def pool(split: str = "train", tokenizer=None) -> list:
    """Every prompt of a split in a fixed order that only ever grows at its end, so the
    slices that training rounds reserve (``rounds.round_prompts``) never move: the
    standard-library and topic prompts, then code instructions and chat requests
    (``instructions.extra_prompts``), then two-turn chats replaying each finished round's
    answers (``instructions.follow_ups``; a message list instead of a text), in ledger order.

    Args:
        split: "train" or "heldout". tokenizer: the target's (loaded when needed and None).
    """
    from dflash_mlx.train.instructions import extra_prompts

    held = split == "heldout"
    base = build_prompts(split)
    out = base + [p for p in extra_prompts(topics(), set(base)) if is_heldout(p) == held]
    for path in finished_rounds():
        if tokenizer is None:
            from dflash_mlx.loading.loader import load_target
            from dflash_mlx.train.common import default_target

            tokenizer = load_target(default_target(), quiet=True)[1]
        out += [c for c in replayed_chats(path, tokenizer) if is_heldout(str(c)) == held]
    return out


def finished_rounds() -> list:
    """The committed answer files of the rounds in the ledger, in ledger order (a round's
    file is frozen once its ledger row is written)."""
    import json

    data = Path(__file__).resolve().parents[2] / "train_data"
    ledger = data / "ledger.json"
    rows = json.loads(ledger.read_text()) if ledger.exists() else []
    rounds = dict.fromkeys(r["round"] for r in rows if r["round"] >= 1)
    return [data / f"r{r:02d}.npz" for r in rounds if (data / f"r{r:02d}.npz").exists()]


def replayed_chats(path: Path, tokenizer) -> list:
    """The two-turn chats built on one committed answer file (``instructions.follow_ups``)."""
    import numpy as np

    from dflash_mlx.train.instructions import follow_ups

    z = np.load(path)
    ends = np.cumsum(z["lengths"])
    seqs = []
    for e, n, p in zip(ends, z["lengths"], z["prompt_lens"]):
        t = z["tokens"][e - n : e]
        seqs.append((t[:p], t[p:]))
    return follow_ups(tokenizer, seqs, set(tokenizer.eos_token_ids))
