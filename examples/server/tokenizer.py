"""A byte-level chat tokenizer for the tiny default model: nothing to download, and exact round trips.

Ids 0..255 are the bytes of UTF-8 text; the specials follow. The chat template renders::

    <|bos|> (<|role|> content-bytes <|end|>)* <|assistant|>

Why this shape: a returning conversation re-sends the assistant's earlier replies as text, and the
KV cached for a reply is only reusable if that text re-tokenises to exactly the ids that were
generated. Bytes decode and re-encode one to one as long as the reply is valid text that a JSON
client hands back unchanged, so generation is restricted (``suppress_ids``) to printable ASCII,
tab and newline, plus ``<|end|>`` to end the turn. A reply cut at ``max_tokens`` has no
``<|end|>``; the template adds it in the next turn, after the cached reply, so either way the next
turn restores everything but the reply's last token (whose KV ``generate`` never computed).

Message text can never produce a special id, so a user cannot forge a turn boundary.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

BOS, SYSTEM, USER, ASSISTANT, END = 256, 257, 258, 259, 260
VOCAB_SIZE = 264  # 256 bytes, 5 specials, 3 reserved: room to add a role without changing the model
ROLE_IDS = {"system": SYSTEM, "developer": SYSTEM, "user": USER, "assistant": ASSISTANT}
_GENERATABLE = frozenset([*range(0x20, 0x7F), ord("\t"), ord("\n"), END])


class ByteChatTokenizer:
    """The chat template and its inverse for the byte-level vocabulary above."""

    bos_id = BOS
    end_id = END
    vocab_size = VOCAB_SIZE
    # Every id generation must never pick: bytes that are not printable ASCII, and the specials
    # that only the template writes.
    suppress_ids: tuple[int, ...] = tuple(i for i in range(VOCAB_SIZE) if i not in _GENERATABLE)

    def encode_chat(self, messages: Iterable[tuple[str, str]]) -> list[int]:
        """Ids of ``(role, text)`` messages, ending with the assistant prefix that generation continues."""
        ids = [BOS]
        for role, text in messages:
            ids.append(ROLE_IDS[role])
            ids.extend(text.encode("utf-8"))
            ids.append(END)
        ids.append(ASSISTANT)
        return ids

    def count_chat(self, messages: Iterable[tuple[str, str]]) -> int:
        """``len(self.encode_chat(messages))``, without building the list (to refuse oversized input cheaply)."""
        return 2 + sum(len(text.encode("utf-8")) + 2 for _, text in messages)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids; specials (``<|end|>``) are not text and are left out."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
