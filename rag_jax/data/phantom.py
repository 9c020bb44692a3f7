"""PhantomWiki-style fictional universes: people, one article each, and multi-hop questions.

One module over 500 lines on purpose: facts, article templates and question templates are one generator whose
parts share the same universe state and seeded RNG order (a split would pass that state between modules and
risk changing the seeded output every test and README number depends on).

Method: PhantomWiki (Gong et al., ICML 2025, "PhantomWiki: On-Demand Datasets for Reasoning and
Retrieval Evaluation"; research note ``shared/research/retrieval_eval.md`` §2 "PhantomWiki"). A
universe is (1) facts — random family trees, a random friendship graph, attributes (date of birth,
occupation, hobby, gender); (2) one templated article per person; (3) templated questions whose
answers are *all* solutions of a conjunctive query over the facts. This is our own pure-Python
implementation: no Prolog, no CFG library, nothing downloaded (word lists are embedded below).

One module (about 600 lines) on purpose: the fact base, the query evaluator, the article templates and the
question sampler share the ``Person`` / ``FactBase`` types and one set of relation semantics (below); split
apart, each piece would import the others' internals.

Output shapes match the official generator's ``articles.json`` / ``questions.json``
(``shared/data/phantomwiki/``):

* article: ``{"title", "article", "facts"}``; facts are Prolog-style strings
  ``mother("A B", "C B").`` — the fact ``rel(X, Y)`` is stated in X's article.
* question: ``{"id", "question", "answer": [str], "hops", "titles", "prolog": {"query", "answer"}}``.
  ``prolog`` uses the official format (query predicates listed from the answer back to the anchor),
  so :func:`evaluate_query` also scores the official files (tested against their answers).

Semantics (fixed here, shared with the official rules for the relations both have):

* ``parent = mother ∪ father``, ``child = son ∪ daughter``, ``sibling = brother ∪ sister``,
  ``married = wife ∪ husband``; derived relations are compositions of these, e.g.
  ``aunt = parent ∘ sister``, ``cousin = parent ∘ sibling ∘ child`` (Prolog ``rules_derived.pl``).
* ``hops`` = number of query predicates (the official ``difficulty``): one per relation step, one
  for an attribute anchor ("the person whose hobby is chess"), one for an attribute or count tail.
* ``titles`` (gold evidence) = every person whose article a forward evaluation reads: the subject of
  each predicate lookup, in order of first use, including dead ends (a person with no friends must
  be read to know that). Attribute anchors contribute every person holding that value.
* Count questions ("How many friends does X have?") answer the set of distinct counts over the
  subjects, zeros included (official behaviour); answers are sorted strings.

Over 500 lines on purpose: facts, article text and question templates + their Prolog-style answers are
one specification (PhantomWiki's); split apart, a reader would have to hold three files to check one question.
"""
from __future__ import annotations

import calendar
import dataclasses
import json
import os
import random
import re
import tempfile
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = [
    "Person", "Universe", "FactBase", "generate_universe", "evaluate_query", "parse_fact", "RELATIONS",
]

# ---------------------------------------------------------------------------------------------
# Embedded word lists (no commas and no " of " in any value: answers are comma-separated sets and
# question text is parsed on " of ").
_FEMALE = """Ada Adela Agnes Aida Alba Alma Amara Anika Annabel Ariadne Astrid Aurora Beatrix Belinda Bettina
Bianca Blythe Briony Calla Camila Carys Celeste Clara Colette Dagny Dahlia Delphine Dora Edith Elin Elodie Elsa
Emmeline Esme Eudora Fern Fiona Flora Freya Gemma Greta Gwen Hana Harriet Hazel Helena Hilde Ida Ilse Imogen
Ines Iris Isolde Ivy Jade Jocelyn Juno Kaia Kalina Kerensa Lark Laurel Leona Lila Linnea Lorna Lucia Lydia Mabel
Maren Marisol Matilda Maude Mila Mireille Nadia Nell Nerys Noor Odette Ottilie Paloma Pearl Petra Philippa Posy
Quinn Rhea Romy Rosalind Ruth Saskia Selma Signe Solveig Sunniva Tamsin Thea Tilda Una Vera Wilhelmina Wren
Yara Zelda Zora""".split()
_MALE = """Abel Alaric Ambrose Anselm Arlo Arvid August Barnaby Basil Bastian Bram Caspar Cedric Cyrus Dario
Desmond Dorian Eamon Edmund Elias Emrys Ennis Erland Evander Fabian Felix Finnian Florian Gideon Gregor Gunnar
Hallam Hector Hugo Ignatius Isidore Ivo Jasper Jonas Jory Julian Kasimir Kenzo Lachlan Laurence Leif Lennox
Linus Lorcan Lucian Magnus Malachi Marius Matthias Milo Mordecai Nico Niall Oberon Octavian Orrin Osric Otto
Pascal Percival Quentin Rafferty Ragnar Remy Rhys Roderick Rowan Rufus Sebastian Silas Soren Stellan Tadhg
Tarquin Teodor Thaddeus Tobiah Torin Ulric Valentin Vaughan Viggo Wendell Wystan Xavier Yorick Zander Zeno
Zoltan Benedikt Corvin Elwood""".split()
_SURNAMES = """Abernathy Ashdown Bellweather Blackwood Bramley Brightwater Calloway Carrow Castellan Cinderby
Colquhoun Copperfield Crane Dalgleish Darrowby Delacourt Dunmore Eastwick Elderberry Ellsworth Fairbairn
Fenwick Fitzroy Foxley Galloway Garroway Glenister Goldthorpe Greenhalgh Hallorann Harrowgate Hawthorne
Heathcote Hollingsworth Holloway Ironside Jessop Kettleby Kingsley Lachance Langridge Larkspur Lockhart
Loveridge Lowenthal Marchbanks Mayhew Merriweather Moorcroft Nettleship Northcott Oakhurst Ormsby Pemberton
Penhallow Quarrington Radcliffe Ravenscroft Redfern Rookwood Rosewarne Rushworth Saltmarsh Seaborne Shadwell
Silverthorn Stanhope Stirling Stonebridge Sutherland Swinburne Tallis Thackeray Thistlewood Thornbury Tregarth
Underhill Vandermeer Varga Wainwright Warrender Waterhouse Wetherby Whitlock Wildgoose Winterbourne Wolstenholme
Woodruff Wrexham Yardley Yelland Zabini Ambergate Birchwood Brackenbury Caulfield Cresswell Dewhurst Drummond
Everly Fallowfield Gainsborough Hargreaves Ingleby Kilbride Lindqvist Mortimer Nightingale Pendragon Quenby
Rathbone Sandoval Tenbury Umberfield Valcourt Westergaard Yarborough Achterberg Brannigan Castellanos Dunbarton
Esterhazy Farrington Grimsby Halvorsen""".split()
_OCCUPATIONS = tuple("""astronomer|beekeeper|bookbinder|cartographer|ceramicist|choreographer|clockmaker|
court reporter|crossword compiler|dental hygienist|ecologist|ferry captain|film editor|florist|geologist|
glassblower|harpist|herbalist|historian|hydrologist|ice sculptor|interpreter|jeweller|landscape architect|
librarian|lighthouse keeper|locksmith|luthier|marine biologist|meteorologist|midwife|museum curator|
nurse practitioner|oceanographer|optician|organist|paramedic|pastry chef|perfumer|pharmacist|piano tuner|
puppeteer|radio producer|saddler|set designer|shipwright|sommelier|stonemason|surveyor|tailor|tea taster|
translator|typographer|urban planner|veterinarian|violin teacher|watchmaker|weaver|wildlife photographer|
zookeeper""".replace("\n", "").split("|"))
_HOBBIES = tuple("""archery|astrophotography|backgammon|baking|birdwatching|bouldering|calligraphy|canoeing|
chess|crochet|cryptic crosswords|cycling|embroidery|fencing|fly fishing|foraging|gardening|geocaching|go|
hiking|jigsaw puzzles|juggling|kayaking|kite flying|knitting|lacemaking|letterpress printing|magic tricks|
marquetry|metal detecting|model railways|mountaineering|origami|orienteering|painting|pottery|quilting|
rock tumbling|rowing|sailing|scuba diving|shogi|skating|sketching|snorkelling|stamp collecting|stargazing|
table tennis|tai chi|taxidermy|urban sketching|volleyball|whittling|wild swimming|woodturning|yoga|
beachcombing|bell ringing|book restoration|candle making""".replace("\n", "").split("|"))

# ---------------------------------------------------------------------------------------------
# Facts and their evaluation.

# Predicates stated in articles (rel(X, Y) appears in X's article), in article order.
_FAMILY_PREDICATES = ("sister", "brother", "mother", "father", "son", "daughter", "wife", "husband")
_ATTRIBUTE_PREDICATES = ("dob", "job", "hobby", "gender")
STATED_PREDICATES = _FAMILY_PREDICATES + ("friend",) + _ATTRIBUTE_PREDICATES
# Union predicates of the official rules (``parent(X, Y) :- mother(X, Y) ; father(X, Y)`` in effect).
_UNIONS = {
    "parent": ("mother", "father"), "child": ("son", "daughter"),
    "sibling": ("brother", "sister"), "married": ("wife", "husband"),
}
_ATTRIBUTE_TEXT = {"dob": "date of birth", "job": "occupation", "hobby": "hobby", "gender": "gender"}

# Question relations: display name -> (query predicates applied in order, plural for count questions).
# Derived ones follow PhantomWiki's ``rules_derived.pl`` (e.g. aunt(X, Y) :- parent(X, A), sister(A, Y)).
RELATIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "parent": (("parent",), "parents"), "mother": (("mother",), "mothers"), "father": (("father",), "fathers"),
    "child": (("child",), "children"), "son": (("son",), "sons"), "daughter": (("daughter",), "daughters"),
    "sibling": (("sibling",), "siblings"), "brother": (("brother",), "brothers"),
    "sister": (("sister",), "sisters"), "spouse": (("married",), "spouses"), "wife": (("wife",), "wives"),
    "husband": (("husband",), "husbands"), "friend": (("friend",), "friends"),
    "grandparent": (("parent", "parent"), "grandparents"),
    "grandmother": (("parent", "mother"), "grandmothers"),
    "grandfather": (("parent", "father"), "grandfathers"),
    "grandchild": (("child", "child"), "grandchildren"),
    "granddaughter": (("child", "daughter"), "granddaughters"),
    "grandson": (("child", "son"), "grandsons"),
    "aunt": (("parent", "sister"), "aunts"), "uncle": (("parent", "brother"), "uncles"),
    "niece": (("sibling", "daughter"), "nieces"), "nephew": (("sibling", "son"), "nephews"),
    "cousin": (("parent", "sibling", "child"), "cousins"),
    "mother-in-law": (("married", "mother"), "mothers-in-law"),
    "father-in-law": (("married", "father"), "fathers-in-law"),
}
# Relations counted in "How many ... does X have?" (one predicate each, as in the official templates).
_COUNT_RELATIONS = ("parent", "child", "sibling", "friend", "son", "daughter", "brother", "sister")

_FACT_RE = re.compile(r'^\s*([a-z_]+)\(\s*("(?:[^"\\]|\\.)*")\s*,\s*("(?:[^"\\]|\\.)*")\s*\)\.\s*$')
_ATOM_RE = re.compile(r'^\s*([a-z_]+)\(\s*("(?:[^"\\]|\\.)*"|[A-Z][A-Za-z0-9_]*)\s*,\s*'
                      r'("(?:[^"\\]|\\.)*"|[A-Z][A-Za-z0-9_]*)\s*\)\s*$')
_AGG_RE = re.compile(r'^\s*aggregate_all\(\s*count\s*,\s*distinct\((.*)\)\s*,\s*([A-Z][A-Za-z0-9_]*)\s*\)\s*$')


def parse_fact(fact: str) -> tuple[str, str, str]:
    """Parse ``pred("subject", "object").`` into ``(pred, subject, object)``.

    Raises:
      ValueError: the string is not a binary fact with two quoted arguments.
    """
    m = _FACT_RE.match(fact)
    if m is None:
        raise ValueError(f"fact {fact!r} is not of the form pred(\"subject\", \"object\").")
    return m.group(1), json.loads(m.group(2)), json.loads(m.group(3))


def _format_fact(pred: str, subject: str, obj: str) -> str:
    return f"{pred}({json.dumps(subject, ensure_ascii=False)}, {json.dumps(obj, ensure_ascii=False)})."


class FactBase:
    """Binary facts indexed both ways: ``objects(pred, subject)`` and ``subjects(pred, obj)``.

    Built from article facts (:meth:`from_articles`); union predicates (parent, child, sibling,
    married) are answered from their stated parts.
    """

    def __init__(self, facts: Iterable[tuple[str, str, str]]):
        self._fwd: dict[str, dict[str, list[str]]] = {}
        self._inv: dict[str, dict[str, list[str]]] = {}
        for pred, s, o in facts:
            fwd = self._fwd.setdefault(pred, {}).setdefault(s, [])
            if o not in fwd:
                fwd.append(o)
                self._inv.setdefault(pred, {}).setdefault(o, []).append(s)

    @classmethod
    def from_articles(cls, articles: Iterable[dict]) -> FactBase:
        """Raises ValueError naming the article whose fact does not parse."""
        def facts():
            for a in articles:
                for f in a["facts"]:
                    try:
                        yield parse_fact(f)
                    except ValueError as e:
                        raise ValueError(f"article {a['title']!r}: {e}") from None
        return cls(facts())

    def _parts(self, pred: str) -> tuple[str, ...]:
        if pred in _UNIONS:
            return _UNIONS[pred]
        if pred in STATED_PREDICATES:
            return (pred,)
        raise ValueError(f"unknown predicate {pred!r}; supported: {sorted(STATED_PREDICATES + tuple(_UNIONS))}")

    def objects(self, pred: str, subject: str) -> list[str]:
        """All Y with pred(subject, Y)."""
        out: list[str] = []
        for p in self._parts(pred):
            out.extend(self._fwd.get(p, {}).get(subject, ()))
        return out

    def subjects(self, pred: str, obj: str) -> list[str]:
        """All X with pred(X, obj)."""
        out: list[str] = []
        for p in self._parts(pred):
            out.extend(self._inv.get(p, {}).get(obj, ()))
        return out


def _parse_atom(text: str) -> tuple[str, str, str]:
    m = _ATOM_RE.match(text)
    if m is None:
        raise ValueError(f"query predicate {text!r} is not of the form pred(Arg, Arg) "
                         "with variables or quoted strings")
    return m.group(1), m.group(2), m.group(3)


def _unquote(arg: str) -> str | None:
    return json.loads(arg) if arg.startswith('"') else None


def evaluate_query(facts: FactBase, query: Sequence[str], answer_var: str) -> tuple[list[str], list[str]]:
    """All solutions of a PhantomWiki Prolog query, plus the articles read to find them.

    Args:
      facts: the universe's facts.
      query: predicates in the official order (answer first, anchor last), e.g.
        ``['hobby(Y_3, Y_2)', 'parent("Ann Lee", Y_3)']`` or
        ``['aggregate_all(count, distinct(friend(Y_3, Y_1)), Count_1)', 'dob(Y_3, "0227-09-18")']``.
      answer_var: the variable whose values are the answer (``"Y_2"``, ``"Count_1"``).

    Returns:
      ``(answers, titles)``: distinct answer values, sorted (counts as decimal strings);
      the subjects of every lookup in order of first use (module docstring).

    Raises:
      ValueError: malformed predicate, unknown predicate, a predicate with neither argument known
        when it is reached, or ``answer_var`` unbound.
    """
    atoms = []
    for raw in reversed(query):
        agg = _AGG_RE.match(raw)
        atoms.append((raw, *_parse_atom(agg.group(1) if agg else raw), agg.group(2) if agg else None))
    bindings: list[dict[str, str]] = [{}]
    titles: dict[str, None] = {}
    for i, (raw, pred, a, b, count_var) in enumerate(atoms):
        new: list[dict[str, str]] = []
        for bind in bindings:
            s = _unquote(a) if a.startswith('"') else bind.get(a)
            o = _unquote(b) if b.startswith('"') else bind.get(b)
            if s is not None:
                titles.setdefault(s)
                objs = facts.objects(pred, s)
                if count_var is not None:
                    inner = {x for x in objs if o is None or x == o}
                    new.append({**bind, count_var: str(len(inner))})
                    continue
                for y in objs:
                    if o is None:
                        new.append({**bind, b: y})
                    elif y == o:
                        new.append(bind)
            elif o is not None and count_var is None:
                for x in facts.subjects(pred, o):
                    titles.setdefault(x)
                    new.append({**bind, a: x})
            else:
                raise ValueError(f"query predicate {raw!r}: its subject {a} is unbound when reached "
                                 "(predicates must be listed answer-first, anchor-last)")
        # Keep only variables still needed, so chains (friend of friend of ...) stay sets, not paths.
        live = {answer_var} | {v for _, _, x, y, _ in atoms[i + 1:] for v in (x, y)}
        bindings = [dict(t) for t in dict.fromkeys(tuple((k, v) for k, v in bd.items() if k in live) for bd in new)]
    answers = {bind[answer_var] for bind in bindings if answer_var in bind}
    if bindings and not answers:
        raise ValueError(f"answer variable {answer_var!r} does not occur in query {list(query)}")
    key = (lambda v: (len(v), v)) if answer_var.startswith("Count") else None
    return sorted(answers, key=key), list(titles)


# ---------------------------------------------------------------------------------------------
# People and articles.

@dataclasses.dataclass(frozen=True)
class Person:
    """One person of a universe. Relations hold names; ``parents`` is () or (mother, father)."""
    name: str
    gender: str  # "female" | "male"
    dob: str  # "YYYY-MM-DD", fictional 4-digit years from 0075
    job: str
    hobby: str
    parents: tuple[str, ...]
    spouse: str | None
    children: tuple[str, ...]
    friends: tuple[str, ...]


def _pl(word: str, n: int) -> str:
    if n == 1:
        return word
    return {"wife": "wives", "child": "children"}.get(word, word + "s")


def _article(p: Person, by_name: dict[str, Person]) -> dict:
    """Render one article in the official layout (# Name / ## Family / ## Friends / ## Attributes)."""
    g = lambda n: by_name[n].gender  # noqa: E731
    siblings = sorted({c for par in p.parents for c in by_name[par].children} - {p.name})
    family = {
        "sister": [s for s in siblings if g(s) == "female"], "brother": [s for s in siblings if g(s) == "male"],
        "mother": [x for x in p.parents if g(x) == "female"], "father": [x for x in p.parents if g(x) == "male"],
        "son": sorted(c for c in p.children if g(c) == "male"),
        "daughter": sorted(c for c in p.children if g(c) == "female"),
        "wife": [p.spouse] if p.spouse and g(p.spouse) == "female" else [],
        "husband": [p.spouse] if p.spouse and g(p.spouse) == "male" else [],
    }
    lines = [f"# {p.name}", "", "## Family"]
    facts: list[str] = []
    for rel in _FAMILY_PREDICATES:
        names = family[rel]
        if names:
            verb = "is" if len(names) == 1 else "are"
            lines.append(f"The {_pl(rel, len(names))} of {p.name} {verb} {', '.join(names)}.")
            facts += [_format_fact(rel, p.name, n) for n in names]
    lines += ["", "## Friends"]
    friends = sorted(p.friends)
    if friends:
        verb = "is" if len(friends) == 1 else "are"
        lines.append(f"The {_pl('friend', len(friends))} of {p.name} {verb} {', '.join(friends)}.")
        facts += [_format_fact("friend", p.name, n) for n in friends]
    lines += ["", "## Attributes"]
    for pred in _ATTRIBUTE_PREDICATES:
        value = getattr(p, pred)
        lines.append(f"The {_ATTRIBUTE_TEXT[pred]} of {p.name} is {value}.")
        facts.append(_format_fact(pred, p.name, value))
    return {"title": p.name, "article": "\n".join(lines) + "\n", "facts": facts}


def _grow_people(num_people: int, max_family_size: int, friend_degree: float, rng: random.Random) -> list[Person]:
    """Family trees grown top-down, then names, attributes and friendships.

    Each tree starts from one founder; each step either marries an unmarried member to a newcomer or
    gives a couple (at most 4 children) a child, so every child has a mother and a father who are
    married. Wives take their husband's surname (as in the official universes).
    """
    gender: list[str] = []
    year: list[int] = []
    parents: list[tuple[int, ...]] = []
    spouse: list[int] = []
    children: list[list[int]] = []

    def new(g: str, y: int, par: tuple[int, ...] = ()) -> int:
        gender.append(g); year.append(y); parents.append(par); spouse.append(-1); children.append([])  # noqa: E702
        return len(gender) - 1

    while len(gender) < num_people:
        size = min(max_family_size, num_people - len(gender))
        members = [new(rng.choice(("female", "male")), rng.randint(100, 250))]
        couples: list[tuple[int, int]] = []
        while len(members) < size:
            open_couples = [c for c in couples if len(children[c[0]]) < 4]
            unmarried = [m for m in members if spouse[m] < 0]
            if open_couples and (not unmarried or rng.random() < 0.6):
                mom, dad = rng.choice(open_couples)
                kid = new(rng.choice(("female", "male")), max(year[mom], year[dad]) + rng.randint(20, 35),
                          (mom, dad))
                children[mom].append(kid); children[dad].append(kid)  # noqa: E702
                members.append(kid)
            else:
                m = rng.choice(unmarried)
                s = new("male" if gender[m] == "female" else "female", year[m] + rng.randint(-5, 5))
                spouse[m], spouse[s] = s, m
                couples.append((m, s) if gender[m] == "female" else (s, m))
                members.append(s)

    n = len(gender)
    surname = [""] * n
    for i in range(n):  # fathers precede their children, so their surnames are known
        if gender[i] == "male":
            surname[i] = surname[parents[i][1]] if parents[i] else rng.choice(_SURNAMES)
    for i in range(n):
        if gender[i] == "female":
            if spouse[i] >= 0:
                surname[i] = surname[spouse[i]]
            else:
                surname[i] = surname[parents[i][1]] if parents[i] else rng.choice(_SURNAMES)
    names: list[str] = []
    taken: set[str] = set()
    for i in range(n):
        pool = _FEMALE if gender[i] == "female" else _MALE
        name = ""
        for attempt in range(60):
            first = rng.choice(pool)
            name = f"{first} {surname[i]}" if attempt < 30 else f"{first} {rng.choice('ABCDEFGHJKLMNPRSTW')}. {surname[i]}"
            if name not in taken:
                break
        else:
            raise ValueError(f"could not find a unique name for person {i} of num_people={num_people}; "
                             "use fewer people or a smaller max_family_size")
        taken.add(name)
        names.append(name)

    max_edges = n * (n - 1) // 2
    num_edges = min(max_edges, round(n * friend_degree / 2))
    edges: set[tuple[int, int]] = set()
    while len(edges) < num_edges:
        a, b = rng.randrange(n), rng.randrange(n)
        if a != b:
            edges.add((min(a, b), max(a, b)))
    friends: list[list[int]] = [[] for _ in range(n)]
    for a, b in sorted(edges):
        friends[a].append(b); friends[b].append(a)  # noqa: E702

    people = []
    for i in range(n):
        month = rng.randint(1, 12)
        day = rng.randint(1, calendar.monthrange(year[i], month)[1])
        people.append(Person(
            name=names[i], gender=gender[i], dob=f"{year[i]:04d}-{month:02d}-{day:02d}",
            job=rng.choice(_OCCUPATIONS), hobby=rng.choice(_HOBBIES),
            parents=tuple(names[j] for j in parents[i]), spouse=names[spouse[i]] if spouse[i] >= 0 else None,
            children=tuple(names[j] for j in children[i]), friends=tuple(names[j] for j in friends[i])))
    return people


# ---------------------------------------------------------------------------------------------
# Questions.

class _QueryBuilder:
    """Accumulates predicates anchor-first; ``query()`` returns them in the official answer-first order."""

    def __init__(self):
        self.atoms: list[str] = []
        self.n = 0

    def var(self) -> str:
        self.n += 1
        return f"Y_{self.n}"

    def query(self) -> list[str]:
        return self.atoms[::-1]


def _sample_question(fb: FactBase, people: list[Person], hops: int, rng: random.Random) -> dict | None:
    """One random question with exactly ``hops`` predicates, or None when the draw dead-ends."""
    tail = rng.choice(("who", "attribute", "count"))
    anchor_kind = rng.choice(("named", "attribute"))
    chain_len = hops - (tail != "who") - (anchor_kind == "attribute")
    if chain_len < 0 or (tail == "who" and anchor_kind == "named" and chain_len == 0):
        return None

    qb = _QueryBuilder()
    seed_person = rng.choice(people)
    if anchor_kind == "named":
        subject_text = seed_person.name
        frontier = {seed_person.name}
        subject_arg = json.dumps(seed_person.name, ensure_ascii=False)
    else:
        attr = rng.choice(("dob", "job", "hobby"))
        value = getattr(seed_person, attr)
        subject_text = f"the person whose {_ATTRIBUTE_TEXT[attr]} is {value}"
        subject_arg = qb.var()
        qb.atoms.append(f"{attr}({subject_arg}, {json.dumps(value, ensure_ascii=False)})")
        frontier = set(fb.subjects(attr, value))

    def reaches(xs, preds) -> bool:
        return any(reaches(fb.objects(preds[0], x), preds[1:]) for x in xs) if preds else bool(xs)

    remaining = chain_len
    relations = list(RELATIONS.items())
    while remaining > 0:
        # The first relation (in random order) that leads somewhere: a uniform draw among the
        # non-empty ones, without computing every candidate's frontier.
        rng.shuffle(relations)
        pick = next(((r, ps) for r, (ps, _) in relations if len(ps) <= remaining and reaches(frontier, ps)), None)
        if pick is None:
            return None
        rel, preds = pick
        for p in preds:
            frontier = {y for x in frontier for y in fb.objects(p, x)}
        for p in preds:
            v = qb.var()
            qb.atoms.append(f"{p}({subject_arg}, {v})")
            subject_arg = v
        subject_text = f"the {rel} of {subject_text}"
        remaining -= len(preds)

    if tail == "who":
        text = f"Who is {subject_text}?"
        answer_var = subject_arg
    elif tail == "attribute":
        attr = rng.choice(_ATTRIBUTE_PREDICATES)
        answer_var = qb.var()
        qb.atoms.append(f"{attr}({subject_arg}, {answer_var})")
        text = f"What is the {_ATTRIBUTE_TEXT[attr]} of {subject_text}?"
    else:
        rel = rng.choice(_COUNT_RELATIONS)
        (pred,), plural = RELATIONS[rel]
        answer_var = "Count_1"
        qb.atoms.append(f"aggregate_all(count, distinct({pred}({subject_arg}, {qb.var()})), {answer_var})")
        text = f"How many {plural} does {subject_text} have?"
    query = qb.query()
    answer, titles = evaluate_query(fb, query, answer_var)
    if not answer:
        return None
    return {"question": text, "answer": answer, "hops": len(query), "titles": titles,
            "prolog": {"query": query, "answer": answer_var}}


# ---------------------------------------------------------------------------------------------
# Universe.

@dataclasses.dataclass
class Universe:
    """A generated universe: ``people``, ``articles`` (sorted by title) and ``questions``.

    Shapes: see the module docstring (same JSON as the official ``articles.json`` / ``questions.json``).
    """
    people: list[Person]
    articles: list[dict]
    questions: list[dict]
    seed: int

    def save(self, folder: str | os.PathLike) -> Path:
        """Write ``articles.json`` and ``questions.json`` (PhantomWiki folder format) atomically.

        Each file is written to a temporary file in ``folder`` and renamed into place.
        Returns the folder path. Raises OSError when the folder cannot be created or written.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in (("articles.json", self.articles), ("questions.json", self.questions)):
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(data, f, ensure_ascii=False, indent=1)
                os.replace(tmp, folder / name)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        return folder


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")


def generate_universe(num_people: int = 100, seed: int = 0, max_hops: int = 3, num_questions: int = 200, *,
                      max_family_size: int = 50, friend_degree: float = 3.0) -> Universe:
    """Generate a seeded fictional universe with articles and 1..max_hops questions.

    Args:
      num_people: people (= articles), >= 2.
      seed: any int; the same arguments give the same universe on every Python >= 3.11.
      max_hops: questions have 1..max_hops predicates (drawn uniformly), >= 1.
      num_questions: distinct questions (no two share a text), >= 0.
      max_family_size: people per family tree (PhantomWiki's ``--max-family-tree-size``; its
        universes use 50), >= 1.
      friend_degree: mean friends per person (PhantomWiki uses about 3), >= 0.

    Returns:
      Universe; each question has a non-empty answer set.

    Raises:
      TypeError / ValueError: an argument of the wrong type or out of range (named in the message);
        ValueError also when the universe is too small for ``num_questions`` distinct questions.
    """
    _check_int("num_people", num_people, 2)
    _check_int("seed", seed, -(2**63))
    _check_int("max_hops", max_hops, 1)
    _check_int("num_questions", num_questions, 0)
    _check_int("max_family_size", max_family_size, 1)
    if not isinstance(friend_degree, (int, float)) or isinstance(friend_degree, bool) or friend_degree < 0:
        raise ValueError(f"friend_degree={friend_degree!r} must be a number >= 0")

    rng = random.Random(seed)
    people = _grow_people(num_people, max_family_size, float(friend_degree), rng)
    by_name = {p.name: p for p in people}
    articles = sorted((_article(p, by_name) for p in people), key=lambda a: a["title"])
    fb = FactBase.from_articles(articles)

    questions: list[dict] = []
    seen: set[str] = set()
    failures = 0  # consecutive draws without a new question; many in a row means the universe is exhausted
    hops = rng.randint(1, max_hops)
    while len(questions) < num_questions:
        if failures > 5000:
            raise ValueError(f"found only {len(questions)} distinct questions for num_questions={num_questions} "
                             f"in a universe of num_people={num_people}, max_hops={max_hops}; "
                             "lower num_questions or raise num_people / max_hops")
        # The hop count is drawn once per question and kept through rejected draws, so hop counts stay
        # uniform even though short templates are rejected more often.
        q = _sample_question(fb, people, hops, rng)
        if q is None or q["question"] in seen:
            failures += 1
            continue
        failures = 0
        hops = rng.randint(1, max_hops)
        seen.add(q["question"])
        questions.append({"id": str(uuid.UUID(int=rng.getrandbits(128), version=4)), **q})
    return Universe(people=people, articles=articles, questions=questions, seed=seed)
