"""Independent restatements of what our outputs must agree with: the draft-vocabulary rule
in plain Python. (SpecForge's reader and checks are called as SpecForge itself ships them.)"""

from __future__ import annotations

from collections import Counter


def reference_ids(counts: Counter[int], size: int, target_vocab: int) -> list[int]:
    """The documented rule in plain Python: top ``size`` by count then id, lowest unseen fill."""
    top = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    fill = [t for t in range(target_vocab) if t not in counts][: size - len(top)]
    return sorted(top + fill)
