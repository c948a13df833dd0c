"""Known byte patterns for simulated engines, and checking a pull against them.

Every 8-byte word of a buffer holds `salt + word index` (mod 2**64), so a
block copied to the wrong place, a byte copied twice or a region missed all
show up as a wrong word. Prefill and decode use different salts; after a
pull, each moved destination block must equal its source block and every
other destination byte must still hold the decode pattern.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt


def salt_for(role: str, seed: int, buffer_index: int) -> np.uint64:
    digest = hashlib.blake2b(f"{role}/{seed}/{buffer_index}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def pattern(salt: np.uint64, start_byte: int, nbytes: int) -> npt.NDArray[np.uint8]:
    """The pattern's bytes [start_byte, start_byte + nbytes) of a buffer."""
    first, skip = divmod(start_byte, 8)
    count = -(-(skip + nbytes) // 8)
    words = np.arange(first, first + count, dtype=np.uint64) + salt
    return words.view(np.uint8)[skip : skip + nbytes]


def fill(view: npt.NDArray[np.uint8], salt: np.uint64) -> None:
    """Write the pattern over a whole buffer, a slice at a time to bound memory."""
    step = 64 << 20
    for start in range(0, view.size, step):
        end = min(start + step, view.size)
        view[start:end] = pattern(salt, start, end - start)


def holds_pattern(
    view: npt.NDArray[np.uint8], salt: np.uint64, start_byte: int, nbytes: int
) -> bool:
    got = view[start_byte : start_byte + nbytes]
    return bool(np.array_equal(got, pattern(salt, start_byte, nbytes)))
