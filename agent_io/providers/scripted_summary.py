"""The scripted model's compaction summaries: a checkpoint in the
summarizer's layout, built from the summary prompt alone, deterministic, and
never longer than its output budget by the policy's estimate."""

from __future__ import annotations

import re
from collections.abc import Sequence

from compaction.policy import estimate_text_tokens
from compaction.policy.tokens import utf16_length


def cut(text: str, units: int) -> str:
    """The longest prefix of `text` of at most `units` UTF-16 code units."""
    if utf16_length(text) <= units:
        return text
    if text.isascii():
        return text[: max(0, units)]
    end = 0
    for char in text:
        units -= 2 if ord(char) >= 0x10000 else 1
        if units < 0:
            break
        end += 1
    return text[:end]


# The labelled paragraphs of the policy's serialized transcript.
_TRANSCRIPT_LINE = re.compile(
    r"^\[(User|Assistant|Assistant thinking|Assistant tool calls|Tool result)\]: ?(.*)$",
    re.MULTILINE,
)
_CALLED_TOOL = re.compile(r"(?:^|; )([^;(]+)\(")
# Quotes get shorter until the summary fits its output budget.
_QUOTE_LIMITS = (160, 60, 20, 0)


def scripted_summary(prompt: str, max_tokens: int) -> str:
    """A checkpoint in the summarizer's layout, built from the prompt alone
    and never longer than `max_tokens` by the policy estimate."""
    conversation = _between(prompt, "<conversation>\n", "\n</conversation>")
    previous = _between(prompt, "<previous-summary>\n", "\n</previous-summary>")
    lines = _TRANSCRIPT_LINE.findall(prompt if conversation is None else conversation)
    summary = ""
    for limit in _QUOTE_LIMITS:
        summary = _checkpoint(lines, previous, limit)
        if estimate_text_tokens(summary) <= max_tokens:
            return summary
    return cut(summary, max_tokens * 4)


def _between(text: str, start: str, end: str) -> str | None:
    begin = text.find(start)
    if begin < 0:
        return None
    finish = text.find(end, begin + len(start))
    return text[begin + len(start) : finish if finish >= 0 else len(text)]


def _quote(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return f'"{flat}"' if len(flat) <= limit else f'"{flat[:limit]}..."'


def _previous_goal(previous: str | None) -> str | None:
    section = _between(previous or "", "## Goal\n", "\n## ")
    lines = [line.strip() for line in (section or "").splitlines() if line.strip()]
    return lines[0] if lines else None


def _checkpoint(lines: Sequence[tuple[str, str]], previous: str | None, limit: int) -> str:
    users = [text for label, text in lines if label == "User"]
    replies = sum(1 for label, _ in lines if label == "Assistant")
    results = [text for label, text in lines if label == "Tool result"]
    tools: dict[str, None] = {}
    for label, text in lines:
        if label == "Assistant tool calls":
            tools.update(dict.fromkeys(name.strip() for name in _CALLED_TOOL.findall(text)))
    first = _quote(users[0], limit) if users else "No request was recorded."
    goal = _previous_goal(previous) or first
    done = [
        f"- Went through {len(users)} user message(s), {replies} assistant "
        f"reply(ies) and {len(results)} tool result(s)."
    ]
    if tools:
        done.append(f"- Used the tools: {', '.join(tools)}.")
    if previous is not None:
        done.append("- Carried the previous checkpoint forward.")
    latest = f"- Latest request: {_quote(users[-1], limit)}" if users else "- Nothing."
    context = [f"- First request: {first}"]
    if results:
        context.append(f"- Last tool result: {_quote(results[-1], limit)}")
    sections = [
        f"## Goal\n{goal}",
        "## Constraints & Preferences\nNone stated.",
        "## Progress\n### Done\n"
        + "\n".join(done)
        + f"\n### In Progress\n{latest}\n### Blocked\n- Nothing.",
        "## Key Decisions\n- None recorded.",
        "## Next Steps\n1. Answer the latest request." if users else "## Next Steps\n1. Wait.",
        "## Critical Context\n" + "\n".join(context),
    ]
    return "\n\n".join(sections)
