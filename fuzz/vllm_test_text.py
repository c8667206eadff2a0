"""The text both vLLM-test exporters write (fuzz/vllm_test_export.py for manager calls,
fuzz/vllm_scheduler_test_export.py for vLLM's Scheduler): the module docstring, vLLM's sha256
import, the KV cache groups with vLLM's spec classes, the finding's title and the test's name.
"""

from __future__ import annotations

import keyword
import re
from pathlib import Path

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.errors import KvfuzzError
from kvfuzz.core.trace import Trace

SPEC_CLASSES = {"full": "FullAttentionSpec", "sliding_window": "SlidingWindowSpec",
                "chunked_local": "ChunkedLocalAttentionSpec", "sink_full": "SinkFullAttentionSpec",
                "mamba": "MambaSpec"}
"""The group kinds a generated test can build, and vLLM's spec class for each."""

SHA256_IMPORT = '''try:
    from vllm.utils.hashing import sha256
except ImportError:  # older releases
    from vllm.utils import sha256
'''
"""vLLM's sha256 block hash, which moved between releases."""


class VllmTestUnsupported(KvfuzzError):
    """The trace uses something a plain vLLM test cannot express (exit 2, nothing written)."""


def docstring(title: str, finding: str, source: str, *lines: str) -> str:
    """The generated module's docstring: the finding, the command that wrote it, what the test
    does and asserts (`lines`), and what it needs."""
    return "\n".join([f'"""{title}', "",
                      f"kvfuzz finding {finding}, exported by "
                      f"`kvfuzz export {source} --vllm-test`.",
                      *lines,
                      "It needs only vllm, torch and pytest (and the standard library), and fails "
                      "while the bug is present.", '"""', "", ""])


def ident(rid: str, taken: set[str]) -> str:
    """A Python name for request `rid`: the id itself where it is one, else req_<n>."""
    name = rid if rid.isidentifier() and not keyword.iskeyword(rid) else ""
    if not name or name in taken:
        name = "req_" + re.sub(r"\W", "_", rid)
    while name in taken:
        name += "_"
    return name


def spec(group: GroupConfig) -> str:
    """vLLM's KV cache spec of `group`, as Python source."""
    cls = SPEC_CLASSES.get(group.kind)
    if cls is None:
        raise VllmTestUnsupported(f"group kind {group.kind!r}: a vLLM test builds "
                                  f"{', '.join(SPEC_CLASSES)} groups")
    if group.eagle:
        raise VllmTestUnsupported("EAGLE groups (is_eagle_group) are not exported")
    if group.kind == "mamba":
        args = [f"block_size={group.block_size}", "shapes=((8,),)", "dtypes=(DTYPE,)",
                f"mamba_cache_mode={group.mamba_cache_mode!r}"]
        if group.num_speculative_blocks:
            args.append(f"num_speculative_blocks={group.num_speculative_blocks}")
        if group.num_prefill_checkpoint_blocks or group.prefill_checkpoint_alignment is not None:
            args += [f"num_prefill_checkpoint_blocks={group.num_prefill_checkpoint_blocks}",
                     f"prefill_checkpoint_alignment={group.prefill_checkpoint_alignment}"]
        return f"MambaSpec({', '.join(args)})"
    args = [f"block_size={group.block_size}", "num_kv_heads=1", "head_size=8", "dtype=DTYPE"]
    if group.kind == "sliding_window":
        args.append(f"sliding_window={group.sliding_window}")
        if group.extra_retained_tokens:
            args.append(f"extra_retained_tokens={group.extra_retained_tokens}")
    elif group.kind == "chunked_local":
        args.append(f"attention_chunk_size={group.attention_chunk_size}")
    elif group.kind == "sink_full":
        args.append(f"sink_len={group.sink_len}")
    return f"{cls}({', '.join(args)})"


def spec_imports(config: Config) -> str:
    """The names the test imports from vllm.v1.kv_cache_interface."""
    return ", ".join(["KVCacheConfig", "KVCacheGroupSpec",
                      *sorted({SPEC_CLASSES[g.kind] for g in config.groups})])


def group_specs(config: Config) -> str:
    """The `kv_cache_groups` entries of the test's KVCacheConfig, one a line."""
    return "\n".join(f"            KVCacheGroupSpec([\"layer.{i}\"], {spec(g)}),"
                     for i, g in enumerate(config.groups))


def retention_arg(config: Config) -> str:
    """The KVCacheConfig's retention interval argument, where the config sets one."""
    if config.prefix_cache_retention_interval is None:
        return ""
    return f"\n        prefix_cache_retention_interval={config.prefix_cache_retention_interval},"


def finding_doc(trace: Trace, source: Path) -> Path:
    """The finding document its meta names, beside `source` or one folder up; else FILE.md."""
    named = trace.meta.get("finding")
    if named:
        for folder in (source.parent, source.parent.parent):
            if (folder / Path(str(named)).name).exists():
                return folder / Path(str(named)).name
    return source.with_suffix(".md")


def title(trace: Trace, source: Path) -> tuple[str, str]:
    """The test's title (its finding doc's heading) and the finding's name."""
    doc = finding_doc(trace, source)
    if doc.exists():
        first = doc.read_text(encoding="utf-8").splitlines()[0].lstrip("# ").strip()
        return first, doc.stem
    check = trace.meta.get("check") or "a finding"
    return f"A kvfuzz counterexample ({check}) as a vLLM regression test", "(no finding doc)"


def function_name(finding: str) -> str:
    """The test function's name, from the finding's name without its number."""
    return "test_" + re.sub(r"\W", "_", finding if finding != "(no finding doc)"
                            else "exported_trace").lower().lstrip("0123456789_")
