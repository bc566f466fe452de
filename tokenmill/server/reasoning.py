"""Reasoning parsers (``--reasoning-parser``, vLLM's names): the model's thinking, the text between ``<think>``
and ``</think>``, goes to ``reasoning_content`` apart from ``content``.

- ``qwen3``: reasoning only where the output opens with ``<think>`` (Qwen3's thinking mode); with
  ``chat_template_kwargs={"enable_thinking": false}`` none is parsed (the template closed the thinking in
  the prompt).
- ``deepseek_r1``: the template opens the thinking in the prompt, so the output starts inside it: everything
  up to ``</think>`` is reasoning (a leading ``<think>`` is dropped); an output that never closes it is all
  reasoning. An output under a structured-output constraint is constrained from its first token, so there it
  is read as qwen3 reads it.

Thinking that is cut off (max_tokens) before ``</think>`` stays reasoning, streamed or not. Streamed, a tag
split across deltas is held back until it is whole.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def check_reasoning_parser(name: str | None) -> None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}")


@dataclass(frozen=True)
class Reasoning:
    """How one request's output is split."""

    starts_inside: bool  # the output begins inside the thinking (its <think> was in the prompt)
    include: bool = True  # send reasoning_content (vLLM's include_reasoning)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.starts_inside)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; (None, text) when it holds no reasoning."""
        s = self.stream()
        reasoning, content = s.feed(text, True)
        if not s.found:
            return None, text
        return reasoning, content or None


def reasoning_for(parser: str | None, template_kwargs: dict | None, constrained: bool,
                  include: bool = True) -> Reasoning | None:
    """The request's split, or None where nothing is reasoning."""
    if parser is None:
        return None
    if parser == "qwen3" and (template_kwargs or {}).get("enable_thinking") is False:
        return None
    return Reasoning(starts_inside=parser == "deepseek_r1" and not constrained, include=include)


def _partial_tail(text: str, tag: str) -> int:
    """The length of text's longest tail that is a proper beginning of tag (it may become the tag)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


class ReasoningStream:
    """One choice's output as (reasoning, content) deltas while it comes."""

    def __init__(self, starts_inside: bool) -> None:
        self.starts_inside = starts_inside
        self.mode = "start"  # "start" (not yet known), "reasoning" or "content"
        self.held = ""  # text not yet sent: a beginning that may be <think>, a tail that may be </think>
        self.found = False  # some of the output is reasoning (the message gets reasoning_content)

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        self.held += delta
        reasoning = ""
        if self.mode == "start":
            head = self.held.lstrip()
            if head.startswith(THINK_START):
                self.held, self.mode = head[len(THINK_START):], "reasoning"
            elif THINK_START.startswith(head) and not final:  # whitespace or a part of the tag so far
                return "", ""
            else:
                self.mode = "reasoning" if self.starts_inside else "content"
        if self.mode == "reasoning":
            self.found = True
            at = self.held.find(THINK_END)
            if at < 0:
                keep = 0 if final else _partial_tail(self.held, THINK_END)
                cut = len(self.held) - keep
                reasoning, self.held = self.held[:cut], self.held[cut:]
                return reasoning, ""
            reasoning, self.held, self.mode = self.held[:at], self.held[at + len(THINK_END):], "content"
        content, self.held = self.held, ""
        return reasoning, content
