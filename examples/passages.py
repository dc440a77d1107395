"""A generated passage collection and questions about it, for the RAG example.

Role: stand in for FlashRAG's Wikipedia passages (100 words each) without shipping data: a
seeded generator writes passages about a few dozen topics, each passage mixing one topic's
vocabulary with general prose, and questions that use the same topic vocabulary. A retriever
that works (embedding similarity, reranking) therefore finds passages of the question's topic.

Invariants: pure functions of (count, seed); every passage has exactly ``words`` words; topic
``i`` of a question is recoverable (``Question.topic``) so tests can check retrieval quality.
Plain Python (no imports from the Scepsy packages), as a user's helper module would be.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TOPICS: dict[str, tuple[str, ...]] = {
    "volcano": ("volcano", "lava", "magma", "eruption", "crater", "ash", "tectonic", "basalt"),
    "orchestra": (
        "orchestra",
        "violin",
        "conductor",
        "symphony",
        "cello",
        "score",
        "brass",
        "concert",
    ),
    "glacier": (
        "glacier",
        "ice",
        "moraine",
        "fjord",
        "meltwater",
        "crevasse",
        "snowfield",
        "polar",
    ),
    "railway": (
        "railway",
        "locomotive",
        "station",
        "track",
        "signal",
        "freight",
        "carriage",
        "timetable",
    ),
    "coral": ("coral", "reef", "polyp", "lagoon", "bleaching", "algae", "atoll", "snorkel"),
    "chess": ("chess", "bishop", "rook", "gambit", "checkmate", "opening", "pawn", "endgame"),
    "bakery": ("bread", "dough", "yeast", "oven", "flour", "crust", "sourdough", "baker"),
    "satellite": (
        "satellite",
        "orbit",
        "antenna",
        "launch",
        "payload",
        "telemetry",
        "rocket",
        "geostationary",
    ),
    "vineyard": (
        "vineyard",
        "grape",
        "harvest",
        "wine",
        "cellar",
        "barrel",
        "vintage",
        "fermentation",
    ),
    "honeybee": ("bee", "hive", "honey", "pollen", "queen", "nectar", "swarm", "beekeeper"),
    "castle": ("castle", "moat", "keep", "siege", "rampart", "drawbridge", "knight", "tower"),
    "desert": ("desert", "dune", "oasis", "camel", "sandstorm", "cactus", "arid", "mirage"),
    "printing": (
        "printing",
        "press",
        "typeface",
        "ink",
        "gutenberg",
        "paper",
        "publisher",
        "movable",
    ),
    "submarine": ("submarine", "sonar", "periscope", "ballast", "torpedo", "hull", "depth", "dive"),
    "rainforest": (
        "rainforest",
        "canopy",
        "jaguar",
        "orchid",
        "humidity",
        "amazon",
        "vine",
        "biodiversity",
    ),
    "telescope": (
        "telescope",
        "lens",
        "mirror",
        "galaxy",
        "observatory",
        "nebula",
        "astronomer",
        "aperture",
    ),
    "cheese": ("cheese", "milk", "rennet", "curd", "aging", "cheddar", "whey", "dairy"),
    "bridge": ("bridge", "suspension", "cable", "span", "pier", "girder", "arch", "engineer"),
    "marathon": ("marathon", "runner", "race", "finish", "pace", "endurance", "athlete", "course"),
    "vaccine": ("vaccine", "immune", "antibody", "virus", "dose", "trial", "pathogen", "immunity"),
    "lighthouse": ("lighthouse", "beacon", "keeper", "coast", "lamp", "shipwreck", "fog", "harbor"),
    "origami": ("origami", "fold", "crease", "paper", "crane", "sheet", "pleat", "model"),
    "tornado": ("tornado", "funnel", "storm", "wind", "supercell", "radar", "damage", "vortex"),
    "silk": ("silk", "silkworm", "cocoon", "loom", "weaver", "thread", "mulberry", "fabric"),
}
_FILLER = tuple(
    """history region century people known early modern many large small built used common
    during later several important since often first famous local world public study began
    area period found among produced developed described became major nearby long""".split()
)
_QUESTIONS = (
    "What is the role of the {a} in a {t}?",
    "How does the {a} relate to the {b}?",
    "Why is the {a} important for {b}?",
    "When was the first {a} used with a {b}?",
    "Who described the {a} of the {t}?",
)


@dataclass(frozen=True)
class Question:
    text: str
    topic: str


def passages(count: int = 2000, *, words: int = 100, seed: int = 0) -> list[str]:
    """``count`` passages of ``words`` words, topics assigned round-robin."""
    rng = random.Random(seed)
    names = sorted(TOPICS)
    out = []
    for i in range(count):
        vocab = TOPICS[names[i % len(names)]]
        chosen = [
            rng.choice(vocab) if rng.random() < 0.35 else rng.choice(_FILLER) for _ in range(words)
        ]
        chosen[0] = chosen[0].capitalize()
        out.append(" ".join(chosen) + ".")
    return out


def questions(count: int, *, seed: int = 0) -> list[Question]:
    """``count`` questions, each about one topic's vocabulary."""
    rng = random.Random(seed + 1_000_003)
    names = sorted(TOPICS)
    out = []
    for _ in range(count):
        topic = rng.choice(names)
        a, b = rng.sample(TOPICS[topic], 2)
        out.append(Question(rng.choice(_QUESTIONS).format(a=a, b=b, t=topic), topic))
    return out


def topic_of(passage: str) -> str | None:
    """The topic whose vocabulary a passage uses most (for checking retrieval)."""
    words = passage.lower().rstrip(".").split()
    best = max(TOPICS, key=lambda t: sum(w in TOPICS[t] for w in words))
    return best if any(w in TOPICS[best] for w in words) else None
