"""What a compiled kernel's own assembly says about how many of its programs a processor holds:
the vendor-specific part of the resident-grid count (``ops.launch.resident_programs``)."""
from __future__ import annotations

import re
from typing import Optional

_OCCUPANCY = re.compile(r";\s*Occupancy:\s*(\d+)")


def compiler_occupancy(compiled) -> Optional[int]:
    """Waves per SIMD that the AMD compiler says a kernel can hold (``; Occupancy: N`` in its
    assembly: every limit it knows, VGPRs with their granule, AGPRs, SGPRs, LDS), or None where
    the assembly has no such line (NVIDIA)."""
    asm = getattr(compiled, "asm", None)
    try:
        text = asm["amdgcn"] if asm is not None and "amdgcn" in asm else None
    except TypeError:
        text = None
    found = _OCCUPANCY.findall(text) if isinstance(text, str) else []
    return min(int(n) for n in found) if found else None
