"""Splitting generated text into reasoning (`<think> ... </think>`) and answer, whole or streamed.

One state machine serves both paths: `parse()` is `feed(text) + finish()` on a fresh state, so a
streamed response always concatenates to exactly the non-streamed one. Text that may be the start
of a tag ("</thi") is held back until the next chunk says whether it is one, so no chunk ever
carries a piece of a tag.

Phases, in order (a response may start at any of them, depending on the prompt):

  OPENING    the output may still open a reasoning block: leading whitespace and a prefix of the
             start tag are held. A complete start tag (after optional whitespace) is dropped, with
             that whitespace, and REASONING begins. Anything else goes to the family's default
             side: REASONING when generation starts inside reasoning, CONTENT otherwise.
  REASONING  everything up to the end tag is reasoning; the end tag itself is dropped.
  AFTER_END  the newlines ("\\r", "\\n") directly after the end tag are dropped (models write
             "</think>\\n\\n"); the first other character starts CONTENT.
  CONTENT    everything is answer text, tags included: once the reasoning is over they are
             ordinary text.
"""

from __future__ import annotations

import copy
import dataclasses
import enum


@dataclasses.dataclass
class ReasoningDelta:
    reasoning: str = ""   # new reasoning text
    content: str = ""     # new answer text


class _Phase(enum.Enum):
    OPENING = "opening"
    REASONING = "reasoning"
    AFTER_END = "after_end"
    CONTENT = "content"


class ReasoningParser:
    """Base of the reasoning parsers; a family sets `name`, the tags, and `reasoning_by_default`."""

    name: str = ""
    start_tag: str = "<think>"
    end_tag: str = "</think>"
    # Whether generation is reasoning from its first token even without a start tag in the output
    # or the prompt (DeepSeek-R1 models often omit it: their template already wrote it).
    reasoning_by_default: bool = False
    # Characters dropped directly after the end tag, so content does not start with "\n\n".
    strip_after_end: str = "\r\n"

    def __init__(self, prompt_text: str = "") -> None:
        self._initial = self._initial_phase(prompt_text)
        self._reset()

    def _initial_phase(self, prompt_text: str) -> tuple[_Phase, bool]:
        """(phase, default side of OPENING is reasoning) for a generation that follows prompt_text."""
        if self.prompt_closes_reasoning(prompt_text):
            return _Phase.AFTER_END, False
        inside = self.reasoning_by_default or self.starts_in_reasoning(prompt_text)
        return _Phase.OPENING, inside

    def _reset(self) -> None:
        self._phase, self._opening_is_reasoning = self._initial
        self._held = ""          # text not yet handed out: a possible (partial) tag
        self._finished = False

    # ------------------------------------------------------------ state

    @property
    def in_reasoning(self) -> bool:
        """Inside a reasoning block (before OPENING resolves, when generation starts inside one)."""
        return self._phase is _Phase.REASONING or (
            self._phase is _Phase.OPENING and self._opening_is_reasoning)

    @property
    def reasoning_ended(self) -> bool:
        """The reasoning part is over: its end tag was seen, or it never started and cannot now."""
        return self._phase in (_Phase.AFTER_END, _Phase.CONTENT)

    @classmethod
    def prompt_closes_reasoning(cls, prompt_text: str) -> bool:
        """The template closed an (empty) block itself, e.g. Qwen3 with enable_thinking=false: no
        reasoning can come, the answer follows."""
        return prompt_text.rstrip().endswith(cls.end_tag)

    @classmethod
    def starts_in_reasoning(cls, prompt_text: str) -> bool:
        """Whether the prompt leaves a reasoning block open: its last start tag follows its last end tag."""
        return prompt_text.rfind(cls.start_tag) > prompt_text.rfind(cls.end_tag)

    # ------------------------------------------------------------ operations

    def feed(self, text: str) -> ReasoningDelta:
        """Take the next chunk of generated text; return what can be handed out now."""
        if self._finished:
            raise ValueError("feed() after finish(): the generation is over")
        out = ReasoningDelta()
        self._consume(self._held + text, out)
        return out

    def finish(self) -> ReasoningDelta:
        """End of generation: what was held back is no tag after all and goes to the current side."""
        out = ReasoningDelta()
        if self._finished:
            return out
        self._finished = True
        held, self._held = self._held, ""
        if self._phase is _Phase.OPENING:
            # Never became a start tag (e.g. "<thi" or only whitespace): the default side's text.
            if self._opening_is_reasoning:
                out.reasoning = held
            else:
                out.content = held
        elif self._phase is _Phase.REASONING:
            out.reasoning = held  # an unclosed block: all of it is reasoning
        return out

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """Whole output -> (reasoning_content, content), None for an empty side (as OpenAI reports)."""
        fresh = copy.copy(self)  # same family and prompt; this parser's own stream is untouched
        fresh._reset()
        first, last = fresh.feed(text), fresh.finish()
        reasoning = first.reasoning + last.reasoning
        content = first.content + last.content
        return reasoning or None, content or None

    # ------------------------------------------------------------ machinery

    def _consume(self, buf: str, out: ReasoningDelta) -> None:
        """Run buf through the phases, appending to out; keeps an undecided tail in self._held."""
        self._held = ""
        while buf:
            if self._phase is _Phase.OPENING:
                stripped = buf.lstrip()
                if stripped.startswith(self.start_tag):
                    buf = stripped[len(self.start_tag):]
                    self._phase = _Phase.REASONING
                elif self.start_tag.startswith(stripped):  # "", or a prefix of the tag: wait
                    self._held = buf
                    return
                else:
                    self._phase = _Phase.REASONING if self._opening_is_reasoning else _Phase.CONTENT
            elif self._phase is _Phase.REASONING:
                idx = buf.find(self.end_tag)
                if idx >= 0:
                    out.reasoning += buf[:idx]
                    buf = buf[idx + len(self.end_tag):]
                    self._phase = _Phase.AFTER_END
                else:
                    keep = _partial_tag_len(buf, self.end_tag)
                    out.reasoning += buf[:len(buf) - keep]
                    self._held = buf[len(buf) - keep:]
                    return
            elif self._phase is _Phase.AFTER_END:
                # Dropped at once rather than held: they are discarded however the stream continues.
                buf = buf.lstrip(self.strip_after_end)
                if buf:
                    self._phase = _Phase.CONTENT
            else:
                out.content += buf
                return


def _partial_tag_len(buf: str, tag: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of tag (0 if none)."""
    for n in range(min(len(buf), len(tag) - 1), 0, -1):
        if tag.startswith(buf[-n:]):
            return n
    return 0
