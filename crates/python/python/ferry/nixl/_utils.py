"""NIXL's ``nixl._utils`` on Ferry: the raw-memory helpers NIXL's tests and examples use.

Each is NIXL's function of the same name (``src/bindings/python/nixl_utils.cpp``), through
``ctypes`` and the C library rather than a compiled module:

- ``malloc_passthru(size)``: the address of ``size`` bytes aligned to 4096 (``aligned_alloc``),
  0 if the allocation failed;
- ``free_passthru(addr)``: frees it;
- ``ba_buf(addr, size)``: fills ``size`` bytes at ``addr`` with ``0xba``;
- ``verify_transfer(addr1, addr2, size)``: ``AssertionError`` unless the two ranges hold the
  same bytes (NIXL's version is a C ``assert``, which aborts the process instead).

Addresses are the caller's contract, as in NIXL: nothing checks that they point at memory.
"""

from __future__ import annotations

import ctypes

#: NIXL's ``IO_SIZE``: the alignment of ``malloc_passthru``.
IO_SIZE = 4096

_libc = ctypes.CDLL(None, use_errno=True)
_aligned_alloc = _libc.aligned_alloc
_aligned_alloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
_aligned_alloc.restype = ctypes.c_void_p
_free = _libc.free
_free.argtypes = [ctypes.c_void_p]
_free.restype = None


def malloc_passthru(size: int) -> int:
    """The address of ``size`` new bytes aligned to 4096 (0 when the allocation failed)."""
    return int(_aligned_alloc(IO_SIZE, int(size)) or 0)


def free_passthru(buf: int) -> None:
    """Frees what ``malloc_passthru`` returned."""
    _free(ctypes.c_void_p(int(buf)))


def ba_buf(addr: int, size: int) -> None:
    """Fills ``size`` bytes at ``addr`` with ``0xba``."""
    ctypes.memset(int(addr), 0xBA, int(size))


def verify_transfer(addr1: int, addr2: int, size: int) -> None:
    """``AssertionError`` unless ``size`` bytes at ``addr1`` and ``addr2`` are the same."""
    a = ctypes.string_at(int(addr1), int(size))
    b = ctypes.string_at(int(addr2), int(size))
    if a != b:
        first = next(i for i in range(len(a)) if a[i] != b[i])
        raise AssertionError(
            f"verify_transfer: the ranges differ at byte {first} "
            f"(0x{int(addr1):x}: {a[first]:#04x}, 0x{int(addr2):x}: {b[first]:#04x})")
