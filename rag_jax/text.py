"""The one rule for turning prompt text into token ids: the template's markers are special, content never is.

A prompt is a sequence of pieces. ``Markup`` pieces are the prompt format's own text (chat-template turn
markers, ``<bos>``/``<eos>`` of a format, role tags): special-token text in them becomes the special token.
Every other piece is **content** (a user message, a retrieved passage, a document, a demonstration, a
corpus text): it is encoded with special-token parsing off (``tokenizers``' ``encode_special_tokens``, as
llama.cpp's ``parse_special=false`` and transformers' ``split_special_tokens=True``), so the literal text
``<|im_end|>`` in a passage is the ordinary tokens ``<``, ``|``, ``im``... and can never forge a turn.

The joined text is cut only at the markup's special tokens and each run between them is encoded whole,
which is what ``tokenizers`` itself does (it cuts at special tokens before its pre-tokenizer), so for
content without special-token text the ids equal those of ``tokenizer.encode(joined text)``.

The tokenizer-level prefix (BOS) is ``prefix_ids``: the ids the tokenizer's post-processor puts before a
single sequence. ``encode_prompt`` applies it to plain-text prompts; a chat-template prompt gets none
(the template writes its own ``bos_token``; transformers' ``apply_chat_template`` does the same).

``render_chat`` renders a Jinja chat template; ``chat_pieces`` renders it with the messages' contents
as content pieces. This module imports only ``tokenizers`` (and ``jinja2`` when rendering), so every
package can use it.
"""
from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple


class Markup(str):
    """Text of the prompt format itself: special-token text in it is parsed as the special token."""

    __slots__ = ()


class Encoded(NamedTuple):
    """Ids of a prompt and, per id, its ``(start, end)`` character span in ``text`` (``(0, 0)`` for the
    prefix ids added by the post-processor)."""

    ids: list[int]
    offsets: list[tuple[int, int]]
    text: str


@contextlib.contextmanager
def _content_mode(tokenizer):
    """``tokenizers.Tokenizer`` with special-token parsing off inside the block (restored after). The flag is
    the tokenizer's own state, so one tokenizer must not encode from two threads at once here."""
    before = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        yield tokenizer
    finally:
        tokenizer.encode_special_tokens = before


def _special_spans(tokenizer, text: str) -> list[tuple[int, int, int]]:
    """``(start, end, id)`` of the special tokens ``tokenizers`` finds in markup ``text``."""
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    enc = tokenizer.encode(text, add_special_tokens=False)
    return [(a, b, i) for i, (a, b) in zip(enc.ids, enc.offsets) if i in special]


def _encode_tokenizers(tokenizer, pieces: list[str]) -> tuple[list[int], list[tuple[int, int]]]:
    """The joined text cut at the markup's special tokens; the runs between them are encoded whole with
    special-token parsing off. ``tokenizers`` itself cuts at special tokens and encodes the runs, so
    for content without special-token text the ids equal ``tokenizer.encode(joined)``."""
    cuts, at = [], 0
    for piece in pieces:
        if isinstance(piece, Markup) and piece:
            cuts += [(at + a, at + b, i) for a, b, i in _special_spans(tokenizer, piece)]
        at += len(piece)
    text = "".join(pieces)
    ids, offsets, cursor = [], [], 0
    with _content_mode(tokenizer) as tok:
        for a, b, special_id in [*cuts, (len(text), len(text), None)]:
            if a > cursor:
                enc = tok.encode(text[cursor:a], add_special_tokens=False)
                ids += enc.ids
                offsets += [(cursor + x, cursor + y) for x, y in enc.offsets]
            if special_id is not None:
                ids.append(special_id)
                offsets.append((a, b))
            cursor = b
    return ids, offsets


def _encode_piece(tokenizer, text: str, markup: bool) -> list[int]:
    """One piece with a transformers tokenizer (``split_special_tokens``) or a callable ``text -> ids``."""
    if not text:
        return []
    if hasattr(tokenizer, "encode"):
        return [int(i) for i in tokenizer(text, add_special_tokens=False, split_special_tokens=not markup)["input_ids"]]
    return [int(i) for i in tokenizer(text)]


def encode_pieces(tokenizer: Any, pieces: Iterable[str]) -> Encoded:
    """Ids of ``"".join(pieces)``: special-token text counts only inside ``Markup`` pieces.

    Args:
      tokenizer: a ``tokenizers.Tokenizer``; also a transformers tokenizer or a callable ``text -> ids``
        (then each piece is encoded alone and its tokens' offsets are the piece's span).
      pieces: strings; ``Markup`` marks the trusted ones.

    Returns:
      ``Encoded(ids, offsets, text)``; offsets are character spans in the joined ``text``. No prefix.

    Raises:
      TypeError: a piece that is not a str.
    """
    pieces = list(pieces)
    for piece in pieces:
        if not isinstance(piece, str):
            raise TypeError(f"prompt piece must be a str; got {type(piece).__name__}")
    if hasattr(tokenizer, "encode_special_tokens"):          # tokenizers.Tokenizer
        ids, offsets = _encode_tokenizers(tokenizer, pieces)
        return Encoded([int(i) for i in ids], [tuple(o) for o in offsets], "".join(pieces))
    ids, offsets, at = [], [], 0
    for piece in pieces:
        piece_ids = _encode_piece(tokenizer, piece, isinstance(piece, Markup))
        ids += piece_ids
        offsets += [(at, at + len(piece))] * len(piece_ids)
        at += len(piece)
    return Encoded(ids, offsets, "".join(pieces))


def encode_content(tokenizer: Any, text: str) -> list[int]:
    """Token ids of untrusted ``text``: special-token text stays text; no prefix."""
    return encode_pieces(tokenizer, [text]).ids


def prefix_ids(tokenizer: Any) -> list[int]:
    """The ids the tokenizer's post-processor puts before a single sequence (e.g. ``[bos]``; ``[]`` if none).

    Read from the post-processor itself (``special_tokens_mask`` of a probe), so a tokenizer that adds
    BOS gets it and one that adds only a suffix (EOS) or nothing gets ``[]``.
    """
    if not hasattr(tokenizer, "encode_special_tokens"):
        return []
    enc = tokenizer.encode("a", add_special_tokens=True)
    count = 0
    for flag in enc.special_tokens_mask:
        if not flag:
            break
        count += 1
    return list(enc.ids[:count])


def encode_prompt(tokenizer: Any, pieces: Iterable[str], *, templated: bool) -> Encoded:
    """The one prompt encoder: ``encode_pieces`` plus the tokenizer-level prefix.

    Args:
      templated: True when a chat template rendered the pieces (it writes its own BOS, so no prefix is
        added); False for a plain-text prompt (``prefix_ids`` go first, as ``tokenizer.encode`` would).
    """
    body = encode_pieces(tokenizer, pieces)
    prefix = [] if templated else prefix_ids(tokenizer)
    return Encoded(prefix + body.ids, [(0, 0)] * len(prefix) + body.offsets, body.text)


def render_chat(template: str, messages: Sequence[dict], *, add_generation_prompt: bool = True, **special) -> str:
    """Render ``messages`` (``[{"role": ..., "content": ...}]``) with a Jinja chat ``template``.

    HF's rendering conventions: sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``.
    ``special``: variables the template may use (``bos_token``, ``eos_token``...). Raises ValueError
    when the template raises (``raise_exception``) or does not parse.
    """
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                                **special)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template does not render: {e}") from e


def chat_pieces(template: str, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                **special) -> list[str]:
    """``render_chat`` as pieces: the template's text as ``Markup``, each message's content as content.

    Each content is replaced by a random slot, the template rendered, and the rendering split at the
    slots; a template that trims its messages (``| trim``, Llama 3) gets the trimmed content, checked
    against the plain rendering. Raises ValueError (naming the message) if a template drops, repeats
    or otherwise changes a message's content, or see ``render_chat``.
    """
    slots = [f"\x00slot{secrets.token_hex(8)}\x00" for _ in messages]
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be a dict with a str 'content'; got {m!r:.120}")
    slotted = [{**m, "content": s} for m, s in zip(messages, slots)]
    text = render_chat(template, slotted, add_generation_prompt=add_generation_prompt, **special)
    real = render_chat(template, messages, add_generation_prompt=add_generation_prompt, **special)
    pieces: list[str] = []
    rest = text
    for i, slot in enumerate(slots):
        if rest.count(slot) != 1 or text.count(slot) != 1:
            raise ValueError(f"chat template renders messages[{i}] content {text.count(slot)} times; "
                             "expected once")
        before, rest = rest.split(slot)
        pieces += [Markup(before), messages[i]["content"]]
    pieces.append(Markup(rest))
    if "".join(pieces) == real:
        return pieces
    trimmed = [Markup(p) if isinstance(p, Markup) else p.strip() for p in pieces]
    if "".join(trimmed) == real:
        return trimmed
    raise ValueError("chat template changes the message content (beyond trimming it); cannot keep the content "
                     "apart from the template's markers")


def chat_encode(tokenizer: Any, template: str, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                **special) -> Encoded:
    """Ids of ``messages`` under a chat ``template``: markers special, contents as content, no extra prefix."""
    return encode_prompt(tokenizer, chat_pieces(template, messages, add_generation_prompt=add_generation_prompt,
                                                **special), templated=True)
