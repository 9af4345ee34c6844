"""Write trainer/data/sample.txt: the small, learnable corpus the `tiny` run trains on.

Deterministic (fixed seed, no network): templated sentences, small arithmetic, counting and
day/month sequences, one document per line. About 200 KB, so a byte-level model's loss falls
visibly within a few dozen steps. Regenerate with `python trainer/data/make_sample.py`.
"""
from __future__ import annotations

import random
from pathlib import Path

NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"]
FRUITS = ["apples", "pears", "plums", "figs", "lemons", "cherries"]
ANIMALS = ["fox", "dog", "cat", "owl", "horse", "rabbit", "goat"]
COLORS = ["red", "brown", "black", "white", "grey", "golden"]
PLACES = ["the river", "the hill", "the barn", "the garden", "the old bridge", "the market"]
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
MONTHS = ["january", "february", "march", "april", "may", "june", "july", "august",
          "september", "october", "november", "december"]


def story(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    fruit = rng.choice(FRUITS)
    x, y = rng.randint(1, 9), rng.randint(1, 9)
    return f"{a} has {x} {fruit}. {b} gives {a} {y} more. now {a} has {x + y} {fruit}."


def animal(rng: random.Random) -> str:
    color, beast, place = rng.choice(COLORS), rng.choice(ANIMALS), rng.choice(PLACES)
    return f"the {color} {beast} walks to {place} and sleeps there until morning."


def arithmetic(rng: random.Random) -> str:
    x, y = rng.randint(0, 99), rng.randint(0, 99)
    op = rng.choice("+-*")
    value = {"+": x + y, "-": x - y, "*": x * y}[op]
    return f"{x} {op} {y} = {value}"


def counting(rng: random.Random) -> str:
    start = rng.randint(0, 90)
    return "count: " + " ".join(str(n) for n in range(start, start + rng.randint(4, 10)))


def calendar(rng: random.Random) -> str:
    if rng.random() < 0.5:
        i = rng.randrange(len(DAYS))
        return f"after {DAYS[i]} comes {DAYS[(i + 1) % len(DAYS)]}."
    i = rng.randrange(len(MONTHS))
    return f"after {MONTHS[i]} comes {MONTHS[(i + 1) % len(MONTHS)]}."


def make_lines(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    makers = [story, animal, arithmetic, counting, calendar]
    return [rng.choice(makers)(rng) for _ in range(n)]


def main() -> None:
    out = Path(__file__).with_name("sample.txt")
    out.write_text("\n".join(make_lines(4000)) + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
