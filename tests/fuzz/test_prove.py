"""`kvfuzz prove`: the contracts hold on kvcache, and a planted arithmetic bug is caught."""

from __future__ import annotations

import os
import textwrap

import pytest

pytest.importorskip("crosshair", reason="`kvfuzz prove` needs CrossHair (the `fuzz` extra)")

from kvfuzz.fuzz.prove import FAILED, PROVED, UNKNOWN, contract_functions, prove
from kvfuzz.core.errors import KvfuzzError

PLANTED = textwrap.dedent('''
    """kvfuzz.fuzz.contracts with kvcache's hit trim aligned to the block size, not the alignment."""

    from kvfuzz.kvcache import block_math
    from kvfuzz.kvcache.kv_cache_utils import cdiv
    from kvfuzz.fuzz.contracts import *  # noqa: F401,F403


    def _trim_to_block(hit_length, block_size, alignment_tokens, drop_eagle_block):
        if drop_eagle_block and hit_length > 0:
            hit_length -= min(alignment_tokens, block_size)
        hit_length -= hit_length % block_size
        return hit_length, cdiv(hit_length, block_size)


    block_math.trim_hit = _trim_to_block
''')


def test_every_contract_holds(capsys):
    names = contract_functions()
    assert {"cdiv", "first_blocks_to_allocate", "first_blocks_to_allocate_undropped",
            "trim_hit", "aligned_num_blocks",
            "sliding_window_admission_cap", "chunked_local_cap_at_max_model_len"} <= set(names)
    assert prove(1.0) == 0
    out = capsys.readouterr().out
    for name in names:
        line = next(line for line in out.splitlines() if line.split()[:1] == [name])
        assert PROVED in line or UNKNOWN in line, line
    assert "counterexample:" not in out


def test_a_planted_bug_fails_with_its_counterexample(tmp_path, monkeypatch, capsys):
    (tmp_path / "planted_contracts.py").write_text(PLANTED)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert prove(2.0, module="planted_contracts", names=["trim_hit", "cdiv"]) == 1
    out = capsys.readouterr().out
    verdicts = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and
                line.split()[0] in ("trim_hit", "cdiv")}
    assert FAILED in verdicts["trim_hit"] and PROVED in verdicts["cdiv"]
    assert "post: __return__[0] % alignment_tokens == 0" in out
    assert "counterexample: false when calling trim_hit(" in out


def test_the_budget_must_be_positive():
    with pytest.raises(KvfuzzError, match="--per-function"):
        prove(0)
