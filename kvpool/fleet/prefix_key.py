"""A prompt's prefix as a hash chain over its first blocks, the key prefix routing
remembers (:mod:`kvpool.fleet.prefix_picker`).

Key ``i`` hashes key ``i - 1`` with block ``i``, so two prompts share key ``i`` exactly
when they share their first ``i + 1`` blocks (up to 64-bit hash collisions), the way an
engine's prefix cache keys its KV blocks. Token ids are cut into blocks of the engine's
block size (16 by default); text, which the router cannot tokenize, into fixed-size
character chunks (64 characters, about 16 tokens of English). Only full blocks count (an
engine caches only full blocks), and at most ``max_blocks`` of them: the work per request
is bounded whatever the prompt's length. The hash (BLAKE2b, 8 bytes) is the same in every
process, so a key means the same prefix after a router restart.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from hashlib import blake2b

from kvpool.fleet.prompt import Prompt

_MASK = (1 << 64) - 1  # a token id outside 0..2**64-1 is hashed modulo 2**64


def prefix_chain(prompt: Prompt, *, chars_per_block: int = 64, tokens_per_block: int = 16,
                 max_blocks: int = 128) -> list[int]:
    """The keys of ``prompt``'s first full blocks (at most ``max_blocks``); a prompt
    shorter than one block has none. The sizes must be positive (ValueError)."""
    if chars_per_block < 1 or tokens_per_block < 1 or max_blocks < 0:
        raise ValueError("block sizes must be positive and max_blocks not negative")
    keys: list[int] = []
    h = b"text" if isinstance(prompt, str) else b"ids"
    for block in _blocks(prompt, chars_per_block, tokens_per_block, max_blocks):
        h = blake2b(h + block, digest_size=8).digest()
        keys.append(int.from_bytes(h, "little"))
    return keys


def _blocks(prompt: Prompt, chars: int, tokens: int, max_blocks: int) -> Iterator[bytes]:
    if isinstance(prompt, str):
        for i in range(min(len(prompt) // chars, max_blocks)):
            yield prompt[i * chars:(i + 1) * chars].encode("utf-8", "surrogatepass")
    else:
        for i in range(min(len(prompt) // tokens, max_blocks)):
            yield array("Q", [t & _MASK for t in prompt[i * tokens:(i + 1) * tokens]]).tobytes()
