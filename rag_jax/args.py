"""Argument parsing for the eval and bench scripts: one-line errors naming the argument, before any compute.

``ScriptParser`` is an ``argparse.ArgumentParser`` whose errors are one line on stderr
(``rag-jax eval rag_qa: error: argument --limit: must be an integer >= 0; got '-3'``) with exit
status 2, instead of the usage block. The types below check each value while it is parsed, so a bad
number, name or path stops the script before it loads a model or data:

- ``integer(lo, hi)``: an integer in ``[lo, hi]`` ("2.5", "nan" and "1e3" are refused);
- ``real(lo, hi, ...)``: a finite float in a range (NaN and inf are refused);
- ``int_list(lo, hi)`` / ``real_list``: comma-separated numbers; ``names(choices)``: a subset of ``choices``;
- ``input_file`` / ``input_dir`` / ``input_path``: an existing file / folder / either;
- ``output_file``: a path a JSON or npz file can be written to (not a folder, no file standing where a
  parent folder must be);
- ``model_source``: an embedded model name, a .gguf file, an HF folder or a run folder
  (``rag_jax.model.load.resolve_model``), resolved without loading it.

String defaults go through the same types (argparse converts them), so an absent default data file is
reported the same way.

Every list option has one grammar: values separated by commas, spaces or both (``--lengths 4096,8192`` =
``--lengths 4096 8192``), whether it was declared with a list type or with ``nargs="+"`` and an item type or
``choices``.
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any
from pathlib import Path

from rag_jax.model.load import resolve_model


class ScriptParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with one-line errors: ``PROG: error: MESSAGE`` on stderr, exit status 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")

    def add_argument(self, *flags, **kwargs):
        """``argparse``'s, with the one list grammar (module docstring) for options with a list type or
        ``nargs`` ``"+"`` / ``"*"`` (argument groups of this parser too)."""
        return super().add_argument(*flags, **_one_grammar(flags, kwargs))

    def add_argument_group(self, *args, **kwargs):
        return _with_grammar(super().add_argument_group(*args, **kwargs))

    def add_mutually_exclusive_group(self, **kwargs):
        return _with_grammar(super().add_mutually_exclusive_group(**kwargs))

    def check(self, flag: str, parse: Callable[[str], object], value: str):
        """``parse(value)`` for an argument checked after parsing (e.g. only in some modes); a bad value is
        the same one-line error as at parse time."""
        try:
            return parse(value)
        except argparse.ArgumentTypeError as e:
            self.error(f"argument {flag}: {e}")


def _one_grammar(flags, kwargs: dict) -> dict:
    """``add_argument`` keyword arguments with the one list grammar applied (module docstring)."""
    item = kwargs.get("type")
    listed = getattr(item, "is_list", False)
    if flags and flags[0].startswith("-") and (listed or kwargs.get("nargs") in ("+", "*")):
        kwargs = dict(kwargs)
        if not listed:
            choices = kwargs.pop("choices", None)
            if choices is not None:
                kwargs.setdefault("metavar", "{" + ",".join(map(str, choices)) + "}")
                item = names(choices) if item is None else _listed(_one_of(item, choices), "values")
            else:
                item = _listed(item or str, "values")
        kwargs.update(type=item, nargs=kwargs.get("nargs", "+"), action=_Flatten)
    return kwargs


def _with_grammar(group):
    """An argument group whose ``add_argument`` applies the one list grammar."""
    add = group.add_argument
    group.add_argument = lambda *flags, **kwargs: add(*flags, **_one_grammar(flags, kwargs))
    return group


class _Flatten(argparse.Action):
    """Stores the values of a list option (each a list, from one comma-separated token) as one flat list."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [x for v in values for x in v])


def _one_of(item: Callable[[str], Any], choices) -> Callable[[str], Any]:
    def parse(text: str):
        value = item(text)
        if value not in choices:
            raise argparse.ArgumentTypeError(f"invalid choice {text!r}; valid: {', '.join(map(str, choices))}")
        return value
    return parse


def _range_text(lo, hi, lo_open: bool = False, hi_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {hi}"
    return ""


def integer(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """Type: an integer in ``[lo, hi]`` (either bound optional)."""
    what = " ".join(filter(None, ["an integer", _range_text(lo, hi)]))

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}; got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {what}; got {text!r}")
        return value
    return parse


def real(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
         hi_open: bool = False) -> Callable[[str], float]:
    """Type: a finite float in the range (``lo_open``/``hi_open``: that bound excluded)."""
    what = " ".join(filter(None, ["a finite number", _range_text(lo, hi, lo_open, hi_open)]))

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}; got {text!r}") from None
        bad_lo = lo is not None and (value <= lo if lo_open else value < lo)
        bad_hi = hi is not None and (value >= hi if hi_open else value > hi)
        if not math.isfinite(value) or bad_lo or bad_hi:
            raise argparse.ArgumentTypeError(f"must be {what}; got {text!r}")
        return value
    return parse


def _listed(one: Callable[[str], Any], what: str) -> Callable[[str], list]:
    """Type: comma-separated values of type ``one`` (``what`` names them in errors), at least one."""
    def parse(text: str) -> list:
        parts = [p.strip() for p in text.split(",")]
        if not text.strip() or any(not p for p in parts):
            raise argparse.ArgumentTypeError(f"must be comma-separated {what}; got {text!r}")
        try:
            return [one(p) for p in parts]
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} (in {text!r})") from None
    parse.is_list = True
    return parse


def int_list(lo: int | None = None, hi: int | None = None) -> Callable[[str], list[int]]:
    """Type: comma-separated integers in ``[lo, hi]``, at least one ("1024,4096" -> [1024, 4096])."""
    return _listed(integer(lo, hi), "integers")


def real_list(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
              hi_open: bool = False) -> Callable[[str], list[float]]:
    """Type: comma-separated finite floats in the range of ``real``, at least one ("0,0.5" -> [0.0, 0.5])."""
    return _listed(real(lo, hi, lo_open=lo_open, hi_open=hi_open), "numbers")


def names(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """Type: a non-empty comma-separated subset of ``choices`` ("full,block" -> ["full", "block"])."""
    def parse(text: str) -> list[str]:
        picked = [p.strip() for p in text.split(",") if p.strip()]
        unknown = [p for p in picked if p not in choices]
        if unknown or not picked:
            raise argparse.ArgumentTypeError(f"unknown name(s) {', '.join(map(repr, unknown)) or '(none given)'}; "
                                             f"valid: {', '.join(choices)} (comma-separated)")
        return picked
    parse.is_list = True
    return parse


def input_file(text: str) -> Path:
    """Type: an existing file."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: {'is a folder, not a file' if path.is_dir() else 'no such file'}")
    return path


def input_dir(text: str) -> Path:
    """Type: an existing folder."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {'is a file, not a folder' if path.exists() else 'no such folder'}")
    return path


def input_path(text: str) -> Path:
    """Type: an existing file or folder."""
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or folder")
    return Path(text)


def output_file(text: str) -> Path:
    """Type: a file path that can be created or replaced: not a folder, and no parent is an existing file."""
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file path")
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise argparse.ArgumentTypeError(f"{text}: {parent} is a file, not a folder")
            break
    return path


def model_source(text: str) -> str:
    """Type: an embedded model name, a .gguf file, an HF folder or a run folder (resolved, not loaded)."""
    try:
        resolve_model(text)
    except FileNotFoundError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_model_dims(p: argparse.ArgumentParser) -> None:
    """The random-model dimensions the benchmarks share (``--hidden``, ``--intermediate``, ``--layers``,
    ``--heads``, ``--kv_heads``, ``--vocab``; defaults: ``rag-jax bench ttft``'s 4-layer toy model); read them
    back with :func:`model_dims`."""
    for flag, default in (("--hidden", 256), ("--intermediate", 768), ("--layers", 4), ("--heads", 4),
                          ("--kv_heads", 2), ("--vocab", 4096)):
        p.add_argument(flag, type=integer(1), default=default)


def model_dims(args: argparse.Namespace) -> dict[str, int]:
    """``ModelConfig`` keyword arguments from the flags of :func:`add_model_dims`."""
    return dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads)
