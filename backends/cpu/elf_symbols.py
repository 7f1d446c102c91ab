"""The symbols an ELF object file defines, read from its symbol table.

numba's cache keeps a kernel's machine code as an ELF relocatable object beside its LLVM bitcode; loading it,
numba parses the bitcode only to list the functions and globals it defines (which its JIT engine then reports as
found). For SmolLM2's first token that parse took 0.03 s of a second process's ~0.6 s (9 kernels, 2-core machine);
the object's own symbol table names the same definitions in ~0.1 ms a kernel (cache_load.py checks both agree
in the tests).
"""

from __future__ import annotations

import struct

SHT_SYMTAB = 2
SHN_UNDEF = 0
STT_SECTION, STT_FILE = 3, 4  # symbol types that name no definition


def defined(obj: bytes) -> set[str] | None:
    """Names of the symbols that a 64-bit little-endian ELF object defines (local ones too, as numba lists its
    internal functions), or None where `obj` is no such object or its tables do not parse (Mach-O, COFF)."""
    try:
        return _defined(memoryview(obj))
    except (struct.error, ValueError, IndexError, UnicodeDecodeError):
        return None


def _defined(obj: memoryview) -> set[str] | None:
    if bytes(obj[:6]) != b"\x7fELF\x02\x01":  # magic, ELFCLASS64, ELFDATA2LSB
        return None
    (shoff,) = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    data = bytes(obj)
    names: set[str] = set()
    tables = 0
    for i in range(shnum):
        header = shoff + i * shentsize
        (sh_type,) = struct.unpack_from("<I", obj, header + 4)
        if sh_type != SHT_SYMTAB:
            continue
        tables += 1
        offset, size, link = struct.unpack_from("<QQI", obj, header + 0x18)
        (strings,) = struct.unpack_from("<Q", obj, shoff + link * shentsize + 0x18)
        for name, info, _, section, _, _ in struct.iter_unpack("<IBBHQQ", obj[offset:offset + size]):
            if section == SHN_UNDEF or info & 0xF in (STT_SECTION, STT_FILE) or not name:
                continue
            start = strings + name
            names.add(data[start:data.index(b"\0", start)].decode())
    return names if tables == 1 else None
