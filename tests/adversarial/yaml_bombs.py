"""Hostile policy texts: each is small, and each used to cost the service far more than its size."""

from __future__ import annotations

BILLION_LAUGHS = """\
a: &a ["x","x","x","x","x","x","x","x","x"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
"""

RECURSIVE_ALIAS = "a: &a [1, *a]\n"
"""Expanding it never ends (RecursionError at best)."""

DEEP_NESTING = "a: " + "[" * 5000 + "]" * 5000 + "\n"
"""Deep enough to exhaust the recursion of a tree walk."""

MANY_ALIASES = "a: &a x\nb: [" + ", ".join(["*a"] * 20_000) + "]\n"

# (name, text, the line the error names, the start of its message)
BOMBS = (
    ("billion laughs", BILLION_LAUGHS, 6, "expands to more than"),
    ("recursive alias", RECURSIVE_ALIAS, 1, "alias *a refers to itself"),
    ("deep nesting", DEEP_NESTING, 1, "nested deeper than"),
    ("many aliases", MANY_ALIASES, 2, "more than 10000 aliases"),
)
