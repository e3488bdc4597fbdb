"""Text for the OpenAI endpoint: a checkpoint's ``tokenizer.json`` (the ``tokenizers``
package), and one choice's tokens turned into text as they come, cut at stop strings.

Stop strings behave as OpenAI's: the text ends before the first stop string found (the
stop string itself is not returned) and the choice finishes with ``stop``. While
streaming, text that could be the start of a stop string is held back until the next
tokens show it is not (or the choice ends). The choice's ``token_ids`` keep every token
up to the one that completed the stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tpcache.errors import TpcacheError

TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(TpcacheError, ValueError):
    """A ``tokenizer.json`` that is there but cannot be loaded."""


class TextCodec:
    """A loaded tokenizer: text to token ids (with the tokenizer's special tokens, such
    as a BOS, as its post-processor adds them) and back (without special tokens). Safe
    to share between threads (the Rust tokenizer does not change on use)."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, directory: str | Path | None) -> TextCodec | None:
        """The tokenizer in ``directory``'s ``tokenizer.json``; None when ``directory`` is
        None or holds none. Raises ``TokenizerError`` if the file does not load."""
        if directory is None:
            return None
        path = Path(directory) / TOKENIZER_FILE
        if not path.is_file():
            return None
        from tokenizers import Tokenizer  # only a server with text needs the package

        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:  # the Rust side raises plain Exception
            raise TokenizerError(f"cannot load {path}: {exc}") from None

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text).ids)  # type: ignore[attr-defined]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))  # type: ignore[attr-defined]


class ChoiceText:
    """One choice's text, built token by token (owned by the one thread serving the
    request). Decodes a short window of tokens each time, not the whole output: the
    window starts at the last token that was turned into text, so a word split over
    tokens, or a UTF-8 character over byte tokens, comes out whole."""

    def __init__(self, codec: TextCodec | None, stops: tuple[str, ...] = ()) -> None:
        self.codec = codec
        self.stops = stops
        self.tokens: list[int] = []
        self.text = ""  # all text decoded so far (cut at a stop string once found)
        self.sent = 0  # characters of ``text`` already handed out by ``take``
        self.stopped = False  # a stop string was found: no more tokens are taken
        self._window = 0  # the window's first token
        self._read = 0  # tokens already turned into text

    def push(self, token: int) -> None:
        """Add the next generated token (ignored once a stop string was found)."""
        if self.stopped:
            return
        self.tokens.append(token)
        if self.codec is None:
            return
        before = self.codec.decode(self.tokens[self._window : self._read])
        now = self.codec.decode(self.tokens[self._window :])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return  # an incomplete character or word: wait for the next token
        self._add(now[len(before) :])
        self._window, self._read = self._read, len(self.tokens)

    def _add(self, new: str) -> None:
        start = len(self.text)
        self.text += new
        cut = -1
        for s in self.stops:
            i = self.text.find(s, max(0, start - len(s) + 1))
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
        if cut >= 0:
            self.text = self.text[:cut]
            self.stopped = True

    def _held(self) -> int:
        """How many characters at the end of ``text`` could begin a stop string."""
        if self.stopped:
            return 0
        held = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held

    def take(self) -> str:
        """The text not handed out yet that can no longer change."""
        end = max(self.sent, len(self.text) - self._held())
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def finish(self) -> str:
        """Everything not handed out yet (the choice has ended: no stop can follow)."""
        if self.codec is not None and not self.stopped and self._read < len(self.tokens):
            before = self.codec.decode(self.tokens[self._window : self._read])
            now = self.codec.decode(self.tokens[self._window :])
            self._add(now[len(before) :])
            self._read = len(self.tokens)
        out = self.text[self.sent :]
        self.sent = len(self.text)
        return out
