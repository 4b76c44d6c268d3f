"""The op library's sources, read from this folder: ops.cpp (the torch side), launchers.h, and every kernel .cu."""

import os

SOURCE_DIR = os.path.dirname(os.path.abspath(__file__))


def read_sources():
    names = sorted(n for n in os.listdir(SOURCE_DIR) if n.endswith(".cu")) + ["ops.cpp", "launchers.h"]
    sources = {}
    for name in names:
        with open(os.path.join(SOURCE_DIR, name), encoding="utf-8") as f:
            sources[name] = f.read()
    return sources
