"""Data properties: the keys and values behind the block tables (docs/bugs.md #6, #16, #18; docs/spec.md I11, I13).

The structural invariants judge counts, queues and keys; these checks judge content. Per target
(in `ctx.memory`) they keep a `KVMirror`: one `kvcache.paged_kv.PagedKVCache` per group,
mirroring the target's pool, updated from what each op did, and ask after every op whether what
each running request reads through its tables is what its own tokens produce.

Content. The K/V (and query) of token p of a request is a deterministic function of its prefix:
the request's cache salt (standing in for any KV-changing identity, such as an adapter: docs/bugs.md #16-18)
and its tokens 0..p, through a rolling hash (`prefix_seeds`) mixed into fixed values by exact
integer arithmetic (`TokenContents`). Recomputation and reuse must therefore agree bit for bit; a
slot holding another prefix's KV, a stale or a never-written slot all read differently.

Checks (registry `DATA_CHECKS`; `data_checks(device, dtype)` binds them to a device and dtype):

- **D1** after every op, for every RUNNING request and every non-cross group, the K/V gathered
  through its table at the positions it has computed and that are still in the window
  (`skipped(n)..n-1`, n = num_computed_tokens; docs/spec.md §4.2; an R-SWA group without the
  whole blocks between its prompt and its window, §12.2; for a state group only n-1: a
  pass there writes only its last position, the state, after checking that the state it resumes
  from, at its first position - 1, is its own prefix's; with prefill checkpoint blocks it also
  writes the state at its checkpoint into the block the worker exports it to, docs/spec.md
  §11.6) equal the recomputed ones exactly. A
  write beyond a table or through the null block is reported here too. (An op that neither
  copies nor writes re-reads only the requests whose tables or computed count changed: nothing
  else can change what a request reads.)
- **D2** for every request that ran a forward pass in the op, paged attention of its next query
  over the cache (float32 accumulation, float64 for float64 data) equals dense attention over
  the recomputed K/V (float64) within the dtype's tolerance (`kvcache.paged_kv.tolerance`).
  With D1 holding, this tests the paged layer itself.

How an op updates the mirror, in this order:

1. **Copies** first, each the first time it appears: at the API level, pairs that are in
   `after.pending_copies` and were not in `before.pending_copies` (the copy-on-write redirect
   happens inside allocate_slots and the harness's forward pass runs right after it, so the
   writer's pending copy must run before its writes); at the scheduler level, the `copies` of a
   `step` result (the driver takes them at step end, before its forward pass). The snapshot does
   not say which group a pair belongs to, so a copy runs in every group's tensors: a block is in
   one group's tables at a time (I3), and in the other groups it only moves dead slots.
2. **Writes**: every `ctx.observations.forward` pass writes positions start..end-1 of its
   request through the tables it carries, in order, whatever happens to the request later in
   the op (up to the request's token count after the op: positions of spec-decode drafts the
   step rejected held tokens it never took, and the next pass rewrites them). Requests finished and freed within a step have written their KV, and later hits on
   their cached blocks read it; a block handed out again is overwritten, and lost its key.
   A failing synchronous KV load writes only the tokens it filled; its `unfilled` pass leaves
   the rest holding no request's KV (docs/spec.md §13.3, step 5). Right after that op D1
   and D2 pass over those positions (the step's failure handling settles who counts them
   computed); after any later op a request that reads them is reported.
3. **Reads** (D1, D2) after all of the op's writes: within a step's forward pass every KV write
   precedes the attention reads, so a same-step hit on blocks hashed at scheduling time is fine
   (docs/spec.md §10.7) and is not reported.

Where the checks report real hazards rather than planted bugs (tests/data/test_data_hazards.py):

- **Preempted after scheduled** (priority policy; docs/spec.md §10.7): the victim's allocate_slots
  hashed blocks in this step, its forward pass never runs, the keys stay; a later hit reads
  never-written KV.
- **Copy-on-write from a block written in the same step** (Tier B `partial_hits`): the driver
  executes copies before the forward pass, so a partial hit on a tail block that its owner
  writes in the same step copies KV that is not there yet.
- **A sharer of a block a failing KV load left unfilled** (docs/spec.md §13.3): it keeps the
  block computed for the request that marked it, which finishes before writing it again.

Scope: cross-attention, encoder-only and circular-buffer groups are skipped (no encoder K/V is
modelled; a ring's scratch block is reused modulo its size, never addressed by position). A side that reports no
token contents (the reference model) is skipped request by request. The caller must cache only
computed tokens: an API trace that `cache_blocks` past `num_computed_tokens` and lets another
request hit those blocks fails D1, as it would corrupt a real engine. Dimensions are small
(2 query heads, 1 KV head, head_dim 8 by default); bench/bench_data_layer.py measures the cost.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections import Counter
from dataclasses import dataclass

import torch

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.errors import ConfigError
from kvfuzz.core.sides import ForwardPass
from kvfuzz.core.snapshot import Snapshot
from kvfuzz.kvcache.paged_kv import PagedKVCache, dense_attention, tolerance
from kvfuzz.properties.invariants import cdiv, skipped_tokens
from kvfuzz.properties.registry import Check, CheckContext, Registry, transition
from kvfuzz.properties.states import checkpoint_write

DATA_CHECKS = Registry()

_MEMORY_KEY = "data"
_MODULUS = (1 << 61) - 1
_MULTIPLIER = 0x5DEECE66D1F3B
_CHUNK_BITS = 21
_PRIME = 2039
_UNFILLED_VALUE = 2.0
"""What a slot a failing KV load did not fill holds: no token's K/V (they lie in [-1, 1))."""


@dataclass(frozen=True)
class DataLayout:
    """Where the mirror's K/V live and their (small) attention shape."""

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 8


DEFAULT_LAYOUT = DataLayout()


def prefix_seeds(tokens: tuple[int, ...], salt: str | None, start: int = 0,
                 seed: int | None = None) -> list[int]:
    """Seeds of positions start.. : a rolling hash of the salt and every token up to each one.

    `seed` is the seed of position start-1 (None: start must be 0).
    """
    if seed is None:
        seed = int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=7).digest()) if salt \
            else 1
    out = []
    for token in tokens[start:]:
        seed = (seed * _MULTIPLIER + token + 1) % _MODULUS
        out.append(seed)
    return out


class TokenContents:
    """K, V and query of tokens from their prefix seeds, per group.

    Integer arithmetic only (exact, so a token's values do not depend on how many are computed
    at once), ending on multiples of 1/1024 in [-1, 1), which float16 represents exactly.
    """

    def __init__(self, num_groups: int, layout: DataLayout) -> None:
        self.layout = layout
        width = max(layout.num_heads, layout.num_kv_heads) * layout.head_dim
        generator = torch.Generator().manual_seed(0)
        self._coefficients = torch.randint(1, 1 << 20, (num_groups, 3, 3, width),
                                           generator=generator, dtype=torch.int64)

    def __call__(self, seeds: list[int], group: int) -> tuple[torch.Tensor, ...]:
        """(K, V) [n, kv_heads, head_dim] and queries [n, heads, head_dim] on the layout's
        device and dtype; the query at index p is the one issued after position p."""
        lay = self.layout
        s = torch.tensor(seeds, dtype=torch.int64)
        mask = (1 << _CHUNK_BITS) - 1
        chunks = torch.stack([s & mask, (s >> _CHUNK_BITS) & mask, s >> (2 * _CHUNK_BITS)], 1)
        mixed = (chunks[:, None, :, None] * self._coefficients[group]).sum(dim=2) % _PRIME
        values = (mixed - _PRIME // 2).double() / 1024
        n, kv, heads = len(seeds), lay.num_kv_heads * lay.head_dim, lay.num_heads * lay.head_dim
        out = (
            values[:, 0, :kv].reshape(n, lay.num_kv_heads, lay.head_dim),
            values[:, 1, :kv].reshape(n, lay.num_kv_heads, lay.head_dim),
            values[:, 2, :heads].reshape(n, lay.num_heads, lay.head_dim),
        )
        return tuple(t.to(lay.device, lay.dtype) for t in out)


class KVMirror:
    """One target's pool as paged K/V per group, with the writer of every slot."""

    def __init__(self, config: Config, layout: DataLayout) -> None:
        self.config = config
        self.layout = layout
        self.contents = TokenContents(len(config.groups), layout)
        self.caches: list[PagedKVCache | None] = []
        self.writers: list[torch.Tensor | None] = []
        """Per group and flat slot: request index * max_model_len + position, -1 if unwritten."""
        self.unfilled: list[torch.Tensor | None] = []
        """Per group and flat slot: the step whose failing KV load left it unfilled, else -1."""
        for group in config.groups:
            # No paged KV written or read here: cross and encoder-only layers keep none, and a
            # circular buffer's one block is the worker's scratch, its slots reused modulo
            # block_size and never read through a hit (docs/spec.md §12.3).
            if group.kind in ("cross", "encoder_only", "circular_buffer"):
                self.caches.append(None)
                self.writers.append(None)
                self.unfilled.append(None)
                continue
            self.caches.append(PagedKVCache(
                config.num_blocks, group.block_size, layout.num_kv_heads, layout.head_dim,
                device=layout.device, dtype=layout.dtype,
            ))
            self.writers.append(torch.full((config.num_blocks, group.block_size), -1,
                                           dtype=torch.long, device=layout.device))
            self.unfilled.append(torch.full_like(self.writers[-1], -1))
        self.synced_step: int | None = None
        self.problem: str | None = None
        self.content_changed = False
        self._verified: dict[str, tuple[object, int]] = {}
        self._index: dict[str, int] = {}
        self._seeds: dict[str, list[int]] = {}
        self._expected: dict[str, tuple[int, list[tuple[torch.Tensor, ...] | None]]] = {}

    # ----- the op's effects -----

    def sync(self, before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
        """Apply the op's copies and writes once per step; the problem they met, if any."""
        if self.synced_step != ctx.step:
            self.synced_step = ctx.step
            copies = _new_copies(before, after, ctx)
            self.content_changed = bool(copies or ctx.observations.forward)
            self.copy(copies)
            self.problem = next(
                (p for fp in ctx.observations.forward if (p := self.write(fp, after, ctx))), None
            )
        return self.problem

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        index = torch.tensor(pairs, dtype=torch.long, device=self.layout.device)
        src, dst = index.unbind(1)
        for cache, writers, unfilled in zip(self.caches, self.writers, self.unfilled):
            if cache is not None:
                cache.copy_blocks(index)
                writers[dst] = writers[src]
                unfilled[dst] = unfilled[src]

    def write(self, fp: ForwardPass, after: Snapshot, ctx: CheckContext) -> str | None:
        view = after.requests[fp.request_id]
        # A pass over drafts the step rejected wrote their positions with tokens the request
        # never took; the next pass rewrites them: only the positions of its tokens count.
        fp = dataclasses.replace(fp, end=min(fp.end, len(view.tokens)))
        if fp.end <= fp.start:
            return None
        expected = self.expected(fp.request_id, view.tokens, ctx)
        base = self._index.setdefault(fp.request_id, len(self._index)) * self.config.max_model_len
        for g, cache in enumerate(self.caches):
            if cache is None:
                continue
            table = fp.tables[g] or ()
            start = fp.start
            if self.config.groups[g].kind == "mamba":
                # A state group keeps only the state after a pass's last token (docs/spec.md
                # §11), and a pass resumes from the state before its first one.
                if start and not fp.load:
                    problem = self._resume_problem(fp.request_id, g, table, start - 1,
                                                   expected[g], ctx)
                    if problem:
                        return problem
                start = fp.end - 1
            if fp.load:  # a load skips the window's leading nulls
                while start < fp.end and start // cache.block_size < len(table) and (
                        table[start // cache.block_size] == 0):
                    start = (start // cache.block_size + 1) * cache.block_size
                if start >= fp.end:
                    continue
            problem = _table_problem(fp.request_id, "writes", g, table, start, fp.end,
                                     cache.block_size)
            if problem:
                return problem
            key, value, _ = expected[g]
            if fp.unfilled:
                junk = torch.full_like(key[start:fp.end], _UNFILLED_VALUE)
                slots = cache.write(table, start, junk, junk)
                self.writers[g].view(-1)[slots] = -1
                self.unfilled[g].view(-1)[slots] = ctx.step
                continue
            slots = cache.write(table, start, key[start:fp.end], value[start:fp.end])
            self.writers[g].view(-1)[slots] = torch.arange(
                base + start, base + fp.end, device=slots.device
            )
            self.unfilled[g].view(-1)[slots] = -1
            checkpoint = None if fp.load else checkpoint_write(
                self.config, self.config.groups[g], fp.start, fp.end)
            if checkpoint is not None and 0 <= checkpoint[1] < len(table) and table[checkpoint[1]]:
                # The state after the checkpoint's tokens goes to block `checkpoint[1]`, where a
                # request hitting there reads it as its position `checkpoint[0] - 1`.
                position, column = checkpoint
                moved = list(table)
                moved[(position - 1) // cache.block_size] = table[column]
                slots = cache.write(moved, position - 1, key[position - 1:position],
                                    value[position - 1:position])
                self.writers[g].view(-1)[slots] = base + position - 1
                self.unfilled[g].view(-1)[slots] = -1
        return None

    def _resume_problem(self, rid: str, g: int, table: tuple[int, ...], position: int,
                        expected: tuple[torch.Tensor, ...], ctx: CheckContext) -> str | None:
        """Whether the state a pass of a state group resumes from is its own prefix's."""
        cache = self.caches[g]
        problem = _table_problem(rid, "resumes from", g, table, position, position + 1,
                                 cache.block_size)
        if problem:
            return problem
        key, value = cache.gather(table, position, position + 1)
        if torch.equal(key, expected[0][position:position + 1]) and torch.equal(
                value, expected[1][position:position + 1]):
            return None
        return self.describe(rid, g, table, position, ctx)

    # ----- what requests read -----

    def expected(self, rid: str, tokens: tuple[int, ...],
                 ctx: CheckContext) -> list[tuple[torch.Tensor, ...] | None]:
        """Per group, the recomputed (K, V, queries) of every token of the request."""
        known = self._expected.get(rid)
        if known is not None and known[0] == len(tokens):
            return known[1]
        seeds = self._seeds.setdefault(rid, [])
        seeds += prefix_seeds(tokens, ctx.requests[rid].cache_salt, len(seeds),
                              seeds[-1] if seeds else None)
        per_group = [None if cache is None else self.contents(seeds, g)
                     for g, cache in enumerate(self.caches)]
        self._expected[rid] = (len(tokens), per_group)
        return per_group

    def unverified_readers(self, after: Snapshot) -> list[str]:
        """Running requests whose reads may differ from when D1 last verified them: all of
        them after a copy or a write (the only ways the mirror changes), else those whose
        tables or computed count changed."""
        state = {rid: (view.tables, view.num_computed_tokens)
                 for rid, view in after.requests.items() if view.status == "RUNNING"}
        rids = list(state) if self.content_changed else [
            rid for rid, seen in state.items() if self._verified.get(rid) != seen
        ]
        self._verified = state
        return rids

    def reads(self, after: Snapshot, ctx: CheckContext, rids: list[str]):
        """(rid, group, table, lo, n, expected K/V/queries) of what running requests read."""
        for rid in rids:
            view = after.requests[rid]
            n = view.num_computed_tokens
            if view.status != "RUNNING" or not n or len(view.tokens) < n:
                continue
            expected = self.expected(rid, view.tokens, ctx)
            for g, cache in enumerate(self.caches):
                group = self.config.groups[g]
                lo = skipped_tokens(group, n)
                if cache is None or lo >= n:
                    continue
                table = view.tables[g] or ()
                gap = _rswa_gap(group, len(ctx.requests[rid].prompt), n)
                if gap is not None:  # the prompt, then the window
                    yield rid, g, table, 0, gap[0], expected[g]
                    lo = gap[1]
                yield rid, g, table, lo, n, expected[g]

    def unfilled_now(self, g: int, table: tuple[int, ...], lo: int, n: int,
                     ctx: CheckContext) -> torch.Tensor:
        """Per position lo..n-1: whether this op's failing KV load left its slot unfilled.
        What a request counts computed there is the step's failure handling's to settle
        (docs/spec.md §13.3, step 5): a pass that reads it in a later step is reported."""
        slots = self.caches[g].slots(table, lo, n)
        return self.unfilled[g].view(-1).index_select(0, slots) == ctx.step

    def describe(self, rid: str, g: int, table: tuple[int, ...], position: int,
                 ctx: CheckContext) -> str:
        """Which slot a mismatching read went through and who last wrote it."""
        bs = self.caches[g].block_size
        block = table[position // bs]
        code = int(self.writers[g][block, position % bs])
        step = int(self.unfilled[g][block, position % bs])
        if step >= 0:
            source = f"a failing KV load left unfilled at step {step}"
        elif code < 0:
            source = "was never written"
        else:
            writer = list(self._index)[code // self.config.max_model_len]
            salt = ctx.requests[writer].cache_salt
            source = (f"holds what {writer} (salt {salt!r}) wrote for its position "
                      f"{code % self.config.max_model_len}")
        return (f"{rid} (salt {ctx.requests[rid].cache_salt!r}) reads group {g} position "
                f"{position} through block {block}, which {source}, not the KV of its own prefix")


def _rswa_gap(group: GroupConfig, num_prompt_tokens: int, n: int) -> tuple[int, int] | None:
    """An R-SWA group's positions between the prompt's last block and the window after n
    computed tokens, as whole blocks (docs/spec.md §12.2), which its manager may have
    released; None when there is none."""
    if group.kind != "rswa":
        return None
    bs = group.block_size
    first, last = cdiv(num_prompt_tokens, bs) * bs, (n - group.rswa_window) // bs * bs
    return (first, last) if first < last else None


def _new_copies(before: Snapshot, after: Snapshot, ctx: CheckContext) -> list[tuple[int, int]]:
    """The copies this op makes executable, in order (see the module docstring)."""
    if ctx.level == "scheduler":
        result = ctx.result
        if ctx.op["op"] == "step" and isinstance(result, dict) and "copies" in result:
            return [(int(s), int(d)) for s, d in result["copies"]]
        return []
    old = Counter(before.pending_copies)
    new = []
    for pair in after.pending_copies:
        if old[pair]:
            old[pair] -= 1
        else:
            new.append(pair)
    return new


def _table_problem(rid: str, verb: str, g: int, table: tuple[int, ...], start: int, end: int,
                   bs: int) -> str | None:
    if len(table) < cdiv(end, bs):
        return (f"{rid} {verb} positions {start}..{end - 1} of group {g}, but its table has "
                f"only {len(table)} blocks of {bs}")
    for index in range(max(start, 0) // bs, cdiv(end, bs)):
        if table[index] == 0:
            return (f"{rid} {verb} position {max(start, index * bs)} of group {g} through the "
                    "null block")
    return None


def _mirror(ctx: CheckContext, layout: DataLayout) -> KVMirror:
    mirror = ctx.memory.get(_MEMORY_KEY)
    if mirror is None or mirror.layout != layout:
        mirror = ctx.memory[_MEMORY_KEY] = KVMirror(ctx.config, layout)
    return mirror


@transition(
    "D1",
    "what every running request reads through its tables (computed positions still in the "
    "window, every non-cross group) is the KV its own salt and tokens produce",
    covers=("I11", "I13", "bugs #6", "bugs #16", "bugs #18"),
    registry=DATA_CHECKS,
)
def reads_match_tokens(before: Snapshot, after: Snapshot, ctx: CheckContext,
                       layout: DataLayout = DEFAULT_LAYOUT) -> str | None:
    mirror = _mirror(ctx, layout)
    problem = mirror.sync(before, after, ctx)
    if problem:
        return problem
    for rid, g, table, lo, n, (key, value, _) in mirror.reads(
        after, ctx, mirror.unverified_readers(after)
    ):
        cache = mirror.caches[g]
        problem = _table_problem(rid, "reads", g, table, lo, n, cache.block_size)
        if problem:
            return problem
        got_k, got_v = cache.gather(table, lo, n)
        want_k, want_v = key[lo:n], value[lo:n]
        if torch.equal(got_k, want_k) and torch.equal(got_v, want_v):
            continue
        wrong = ((got_k != want_k) | (got_v != want_v)).flatten(1).any(1)
        wrong &= ~mirror.unfilled_now(g, table, lo, n, ctx)
        if not wrong.any():
            continue
        return mirror.describe(rid, g, table, lo + int(wrong.nonzero()[0]), ctx)
    return None


@transition(
    "D2",
    "paged attention of each request's next query, after its forward pass, equals dense "
    "attention over its recomputed K/V within the dtype's tolerance",
    covers=("bugs #6",),
    registry=DATA_CHECKS,
)
def paged_attention_matches_dense(before: Snapshot, after: Snapshot, ctx: CheckContext,
                                  layout: DataLayout = DEFAULT_LAYOUT) -> str | None:
    mirror = _mirror(ctx, layout)
    problem = mirror.sync(before, after, ctx)
    if problem:
        return problem
    rtol, atol = tolerance(layout.dtype)
    forwarded = list(dict.fromkeys(fp.request_id for fp in ctx.observations.forward))
    for rid, g, table, lo, n, (key, value, queries) in mirror.reads(after, ctx, forwarded):
        cache = mirror.caches[g]
        problem = _table_problem(rid, "reads", g, table, lo, n, cache.block_size)
        if problem:
            return problem
        if mirror.unfilled_now(g, table, lo, n, ctx).any():
            continue  # D1 judges it at the request's next pass
        paged = cache.attention(queries[n - 1], table, lo, n)
        dense = dense_attention(queries[n - 1], key[lo:n], value[lo:n])
        if not torch.allclose(paged, dense, rtol=rtol, atol=atol):
            error = float((paged.float() - dense.float()).abs().max())
            return (f"{rid} group {g}: paged attention over positions {lo}..{n - 1} differs "
                    f"from dense attention by {error:.3g} (tolerance {atol:g} in {layout.dtype})")
    return None


def data_checks_for(spec: str) -> list[Check]:
    """The data checks for a `DEVICE[:DTYPE]` spec (`cpu`, `cuda:bfloat16`, `cuda:1:float16`;
    dtype float32 by default), as `kvfuzz run/replay/shrink --data SPEC` takes it."""
    device, _, dtype_name = spec.rpartition(":")
    if not device or not isinstance(getattr(torch, dtype_name, None), torch.dtype):
        device, dtype_name = spec, "float32"
    dtype = getattr(torch, dtype_name)
    try:
        torch.device(device)
        tolerance(dtype)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"--data {spec!r}: {exc} (expected DEVICE[:DTYPE], e.g. cpu or "
                          "cuda:float16)") from None
    if torch.device(device).type not in ("cpu", "cuda"):
        raise ConfigError(f"--data {spec!r}: the data checks run on cpu or cuda, not on "
                          f"{torch.device(device).type!r}")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--data {spec!r}: CUDA is not available here")
    return data_checks(device, dtype)


def data_checks(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                names: list[str] | None = None) -> list[Check]:
    """The data checks bound to a device and dtype, for `Execution(..., checks=list(REGISTRY)
    + data_checks())` or `machine_for(..., checks=...)`."""
    layout = DataLayout(str(torch.device(device)), dtype)
    return [dataclasses.replace(check, fn=functools.partial(check.fn, layout=layout))
            for check in DATA_CHECKS.select(names)]
