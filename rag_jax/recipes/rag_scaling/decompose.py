"""IterDRAG's question decomposition (Yue et al., ICLR 2025, §3.2): the oracle one read off a PhantomWiki question's
template, and the self-ask format the model writes its own in.

PhantomWiki questions nest noun phrases around an anchor ("How many siblings does *the friend of* **Jasmine
Kindred** have?", "Who is *the friend of* **the person whose date of birth is 0227-09-18**?"). The oracle
decomposition resolves the innermost phrase first: each step is "Who is <phrase>?", and its answer replaces the
phrase in what is left, until one phrase is left ("Who is <phrase>?" or "What is <attribute> of <name>?" is the
final question, not a sub-query). So an h-hop question has h - 1 sub-queries (on both shared universes: every
one of their 600 questions).
Gold intermediate answers come from evaluating the question's Prolog query up to that step
(``rag_jax.data.phantom.evaluate_query``); they write the demonstrations, never the test questions' steps.

Self-ask format (Press et al. 2023, as IterDRAG's prompts): ``Follow up: <sub-query>`` / ``Intermediate answer:
<answer>`` lines, ending with ``So the final answer is: <answer>``.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from rag_jax.data.phantom import RELATIONS, FactBase, evaluate_query

_NAME = r"(?:#\d+|[A-Z][\w'.-]*(?: [A-Z][\w'.-]*)*)"          # a person's name, or an earlier step's placeholder
_END = r"(?= have\?$|\?$)"                                       # the phrase ends the question
_ATTRIBUTE_ANCHOR = re.compile(r"the person whose .+? is .+?" + _END)
_RELATION = re.compile(r"the [\w-]+ of " + _NAME + _END)
FOLLOW_UP, INTERMEDIATE, FINAL = "Follow up: ", "Intermediate answer: ", "So the final answer is: "


@dataclasses.dataclass(frozen=True)
class Decomposition:
    """``steps``: sub-queries, innermost first, with placeholders ``#1``, ``#2``, ... for earlier steps' answers;
    ``final``: the question left after them (placeholders inside); ``atoms``: per step, the Prolog atoms its phrase
    stands for (1 for an attribute anchor or a stated relation, 2 for a derived one such as grandparent)."""

    steps: tuple[str, ...]
    final: str
    atoms: tuple[int, ...] = ()

    def fill(self, text: str, answers: Sequence[str]) -> str:
        """``text`` with ``#i`` replaced by ``answers[i - 1]`` (from the last, so ``#1`` never eats ``#10``)."""
        for i in range(len(answers), 0, -1):
            text = text.replace(f"#{i}", answers[i - 1])
        return text


def _innermost(question: str) -> re.Match | None:
    m = _ATTRIBUTE_ANCHOR.search(question)
    return m if m is not None else _RELATION.search(question)


def oracle_decomposition(question: str) -> Decomposition:
    """The template decomposition of a PhantomWiki question (module docstring). A question with no nested phrase
    (1 hop) has no steps."""
    steps, atoms, rest = [], [], question
    while (m := _innermost(rest)) is not None and rest not in (f"Who is {m.group(0)}?", f"What is {m.group(0)}?"):
        steps.append(f"Who is {m.group(0)}?")
        relation = m.group(0).split(" ")[1]
        atoms.append(1 if m.re is _ATTRIBUTE_ANCHOR else len(RELATIONS.get(relation, ((relation,), ""))[0]))
        rest = rest[:m.start()] + f"#{len(steps)}" + rest[m.end():]
    return Decomposition(tuple(steps), rest, tuple(atoms))


def gold_intermediate_answers(facts: FactBase, query: Sequence[str], decomposition: Decomposition) -> list[list[str]]:
    """The gold answer set of each step: the Prolog ``query`` (answer-first, anchor-last, as PhantomWiki writes it)
    evaluated from the anchor up to the last atom of the step's phrase (``Decomposition.atoms``), answering that
    atom's object (its subject for an attribute anchor such as ``job(Y, "x")``). Raises ValueError (from
    ``evaluate_query``) for a malformed query."""
    atoms = list(reversed(query))
    out, end = [], 0
    for n in decomposition.atoms:
        end += n
        head = atoms[end - 1]
        args = [a.strip() for a in head[head.index("(") + 1:head.rindex(")")].split(",")]
        var = args[0] if args[1].startswith('"') else args[1]
        out.append(evaluate_query(facts, list(reversed(atoms[:end])), var)[0])
    return out


def self_ask_text(steps: Sequence[str], answers: Sequence[str], final: str | None = None) -> str:
    """Sub-queries and their answers in the self-ask format, then ``So the final answer is: final`` if given."""
    text = "".join(f"{FOLLOW_UP}{s}\n{INTERMEDIATE}{a}\n" for s, a in zip(steps, answers))
    return text + (f"{FINAL}{final}" if final is not None else "")


def parse_self_ask(reply: str) -> tuple[str, str]:
    """What the model wrote after a self-ask prefix: ``("follow_up", sub-query)``, ``("final", answer)``, or
    ``("final", reply)`` when it wrote neither marker (a direct answer)."""
    text = reply.strip()
    if FINAL.strip() in text:
        return "final", text.split(FINAL.strip(), 1)[1].strip().split("\n")[0].strip()
    if text.startswith(FOLLOW_UP.strip()):
        return "follow_up", text[len(FOLLOW_UP.strip()):].strip().split("\n")[0].strip()
    return "final", text.split("\n")[0].strip()
