"""Fifty varied sentences for embedding tests, and a small similarity task with a known ranking."""

SENTENCES = [
    "A man is playing a guitar on stage.",
    "Someone performs music with a guitar in front of an audience.",
    "The stock market fell sharply on Monday.",
    "Shares dropped steeply at the start of the week.",
    "How do I reverse a list in Python?",
    "Use list.reverse() or slicing with [::-1] to reverse a Python list.",
    "The cat sleeps on the warm windowsill.",
    "A kitten is napping in the sun by the window.",
    "Quantum computers use qubits instead of bits.",
    "Photosynthesis converts light energy into chemical energy.",
    "The Eiffel Tower is in Paris.",
    "Paris is home to the Eiffel Tower.",
    "I love eating pizza with extra cheese!",
    "She ran 10 km in 48 minutes — a personal best.",
    "Please restart the server before 5 p.m.",
    "def add(a, b): return a + b",
    "SELECT name FROM users WHERE age > 30;",
    "¿Dónde está la biblioteca?",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Le chat est sur la table.",
    "東京は日本の首都です。",
    "Это предложение написано по-русски.",
    "Emoji test: 😀🚀🔥",
    "a",
    "",
    "   leading and trailing spaces   ",
    "UPPERCASE SENTENCE WITH NO PUNCTUATION",
    "numbers 1 2 3 4 5 6 7 8 9 10 and 3.14159",
    "The quick brown fox jumps over the lazy dog.",
    "Rain is expected tomorrow afternoon in the northern regions.",
    "The meeting was postponed until next Thursday.",
    "He forgot his umbrella and got soaked.",
    "Machine learning models need good data.",
    "Neural networks are trained with gradient descent.",
    "The recipe calls for two cups of flour and one egg.",
    "Mix the flour with an egg to make the dough.",
    "Mount Everest is the highest mountain above sea level.",
    "The river flooded the village after the storm.",
    "Can you recommend a good book about history?",
    "This product broke after two days; I want a refund.",
    "Customer support resolved my issue quickly.",
    "The violinist tuned her instrument carefully.",
    "Traffic was heavy on the highway this morning.",
    "Vaccines help the immune system recognise pathogens.",
    "The spacecraft entered orbit around Mars.",
    "Children were playing football in the park.",
    "The library closes at nine on weekdays.",
    "Tea or coffee? Neither, thanks.",
    "word " * 400,  # far beyond the 256-token limit: truncation must match
    "The end.",
]
assert len(SENTENCES) == 50

# (query, candidates in order from most to least similar), for ranking checks.
RANKING = [
    ("A person plays the guitar.", ["A man is playing a guitar on stage.", "The violinist tuned her instrument carefully.",
                                    "The stock market fell sharply on Monday."]),
    ("Where is the Eiffel Tower?", ["The Eiffel Tower is in Paris.", "Mount Everest is the highest mountain above sea level.",
                                    "I love eating pizza with extra cheese!"]),
    ("How to make dough", ["Mix the flour with an egg to make the dough.", "The recipe calls for two cups of flour and one egg.",
                           "The spacecraft entered orbit around Mars."]),
]


def docstring_sentences(limit: int = 400) -> list[str]:
    """Stdlib docstrings as calibration inputs: real English, on every machine, no download.

    First paragraphs give sentences; every fourth docstring also goes in whole (flattened to one
    line, up to the model's 256-token limit), so calibration sees long inputs too: ranges set on
    short sentences alone clip what long inputs produce.
    """
    import argparse
    import collections
    import http.client
    import inspect
    import json
    import logging
    import pathlib
    import shutil
    import subprocess
    import textwrap

    seen: list[str] = []
    for module in (textwrap, json, argparse, collections, http.client, logging, pathlib, shutil, subprocess):
        for name, obj in inspect.getmembers(module):
            # Submodules are attributes only once something imported them: skipping them keeps the
            # texts the same whatever else the test process (or its xdist worker) imported first.
            doc = None if inspect.ismodule(obj) else inspect.getdoc(obj)
            if not doc or name.startswith("_"):
                continue
            first = doc.strip().split("\n\n")[0].replace("\n", " ")
            if 20 < len(first) < 300 and first not in seen:
                seen.append(first)
                whole = " ".join(doc.split())
                if len(seen) % 4 == 0 and len(whole) > 400:
                    seen.append(whole[:1500])
    return seen[:limit]
