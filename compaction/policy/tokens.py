"""Token estimates: `ceil(chars / 4)` with chars in UTF-16 code units.

Pi measures strings with JavaScript's `.length` and tool-call arguments with
`JSON.stringify`; counting the same way keeps Keel's estimates (and so its cut
points) identical to pi's for the same transcript.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from decimal import Decimal

from compaction.policy.blocks import (
    Content,
    ImageBlock,
    Role,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)

# What an image block weighs, in characters (≈1200 tokens), whatever its size.
IMAGE_BLOCK_CHARS = 4800

# One shared encoder: json.dumps builds a new one per call when given options.
_COMPACT_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_SCALAR_TYPES = (str, int, bool, type(None))


def utf16_length(text: str) -> int:
    """Length of `text` in UTF-16 code units (an emoji outside the BMP is 2)."""
    if text.isascii():
        return len(text)
    # "surrogatepass" keeps lone surrogates (one unit each, as in JavaScript).
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def tokens_for_chars(chars: int) -> int:
    """The estimate for a character count: a quarter, rounded up."""
    return math.ceil(chars / 4)


def estimate_text_tokens(text: str) -> int:
    """The estimate of a bare text, e.g. a compaction summary."""
    return tokens_for_chars(utf16_length(text))


def compact_json(value: object) -> str:
    """JSON without spaces and with non-ASCII kept, as `JSON.stringify` writes it.

    Python and JavaScript only disagree on numbers (`1.0` vs `1`, `1e-05` vs
    `0.00001`), so the fast C encoder is used unless the value holds a float.
    """
    if not _contains_float(value):
        return _COMPACT_ENCODER.encode(value)
    return _encode_js(value)


def _contains_float(value: object) -> bool:
    # Concrete types first: ABC isinstance checks would dominate parsing time.
    if isinstance(value, float):
        return True
    if isinstance(value, _SCALAR_TYPES):
        return False
    if isinstance(value, dict):
        return any(_contains_float(item) for item in value.values())
    if isinstance(value, list | tuple):
        return any(_contains_float(item) for item in value)
    if isinstance(value, Mapping):
        return any(_contains_float(item) for item in value.values())
    if isinstance(value, Sequence):
        return any(_contains_float(item) for item in value)
    return False


def _encode_js(value: object) -> str:
    if isinstance(value, float):
        return _js_number(value)
    if isinstance(value, Mapping):
        members = (
            json.dumps(str(key), ensure_ascii=False) + ":" + _encode_js(item)
            for key, item in value.items()
        )
        return "{" + ",".join(members) + "}"
    if isinstance(value, Sequence) and not isinstance(value, str):
        return "[" + ",".join(_encode_js(item) for item in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def _js_number(number: float) -> str:
    """A float as JavaScript's `Number.prototype.toString` writes it."""
    if math.isnan(number) or math.isinf(number):
        return "null"  # what JSON.stringify emits for non-finite numbers
    if number == 0:
        return "0"
    sign = "-" if number < 0 else ""
    # repr() gives the shortest digits that round-trip, as JavaScript does;
    # only the placement of the decimal point and exponent differs.
    digits_tuple = Decimal(repr(abs(number))).normalize().as_tuple()
    digits = "".join(str(digit) for digit in digits_tuple.digits)
    exponent = digits_tuple.exponent
    assert isinstance(exponent, int)
    count = len(digits)
    point = count + exponent  # value = 0.<digits> * 10**point
    if count <= point <= 21:
        return sign + digits + "0" * (point - count)
    if 0 < point <= 21:
        return sign + digits[:point] + "." + digits[point:]
    if -6 < point <= 0:
        return sign + "0." + "0" * -point + digits
    power = point - 1
    mantissa = digits if count == 1 else digits[0] + "." + digits[1:]
    return f"{sign}{mantissa}e{'+' if power > 0 else '-'}{abs(power)}"


def content_chars(role: Role, content: Content) -> int:
    """The characters a message weighs, by role (see COMPACTION.md's table).

    User and tool-result messages weigh their text and images; assistant
    messages their text, thinking and tool calls (name + compact JSON of the
    arguments). Blocks a role does not carry count for nothing.
    """
    if isinstance(content, str):
        return utf16_length(content)
    chars = 0
    if role == "assistant":
        for block in content:
            if isinstance(block, TextBlock):
                chars += utf16_length(block.text)
            elif isinstance(block, ThinkingBlock):
                chars += utf16_length(block.thinking)
            elif isinstance(block, ToolCallBlock):
                chars += utf16_length(block.name) + utf16_length(compact_json(block.arguments))
        return chars
    for block in content:
        if isinstance(block, TextBlock):
            chars += utf16_length(block.text)
        elif isinstance(block, ImageBlock):
            chars += IMAGE_BLOCK_CHARS
    return chars
