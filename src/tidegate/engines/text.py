"""Text output of a sequence: stop sequences found across token boundaries."""

from __future__ import annotations

from collections.abc import Sequence


class StopScanner:
    """Feed text deltas; get back what may be shown and whether a stop sequence was hit.

    Text that could be the start of a stop sequence is held back until the next delta
    decides it, so a stop string split across tokens is never shown.
    """

    __slots__ = ("_pending", "_stops")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stop for stop in stops if stop)
        self._pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        text = self._pending + delta
        if not self._stops:
            return text, False
        hits = [index for index in (text.find(stop) for stop in self._stops) if index >= 0]
        if hits:
            self._pending = ""
            return text[: min(hits)], True
        keep = max((_overlap(text, stop) for stop in self._stops), default=0)
        self._pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """What was held back, once the sequence ended without a stop."""
        text, self._pending = self._pending, ""
        return text


class CatchUp:
    """A resumed sequence's text: its tokens from before the pause are replayed through a
    fresh detokenizer and stop scanner (``replayed``: what those released), which may have
    released more or less than the ``sent_chars`` characters the client got before the pause
    (held-back text is released at other points). The first deltas after it get the
    difference: the text the client lacks is sent first, what it has is not sent again."""

    __slots__ = ("_carry", "_skip")

    def __init__(self, replayed: str, sent_chars: int) -> None:
        self._carry = replayed[sent_chars:]
        self._skip = max(0, sent_chars - len(replayed))

    def __call__(self, delta: str) -> str:
        if self._carry:
            delta, self._carry = self._carry + delta, ""
        if self._skip:
            cut = min(self._skip, len(delta))
            self._skip -= cut
            delta = delta[cut:]
        return delta


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for size in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:size]):
            return size
    return 0
