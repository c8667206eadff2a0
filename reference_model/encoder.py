"""docs/spec.md §7.2: the encoder budget of a step and the encoder cache of multimodal inputs.

Inputs are the request's `(identifier, offset, length)` triples (`Request.extras.mm_inputs`); an
input's output is `length` embeddings, cached under its identifier.
"""

from __future__ import annotations

from kvfuzz.reference_model.requests import Request


def inputs_of(r: Request) -> tuple[tuple[int, int, int], ...]:
    """The request's multimodal inputs, sorted by offset (as traces give them)."""
    return r.extras.mm_inputs if r.extras is not None else ()


class EncoderCache:
    """§7.2: entries by identifier, each referenced by the requests holding one of its inputs;
    an unreferenced entry stays until evicted, the longest unreferenced first. `size`: the
    embeddings it holds (None: no bound)."""

    def __init__(self, size: int | None) -> None:
        self.size = size
        self.entries: dict[int, tuple[int, set[str]]] = {}
        """identifier -> (embeddings, ids of the requests referencing it)."""
        self.idle: list[int] = []
        """Unreferenced identifiers, in the order they became unreferenced."""
        self.held: dict[str, set[int]] = {}
        """request id -> indices of its inputs it holds."""
        self.cross: dict[str, int] = {}
        """request id -> embeddings its encoder-decoder input occupies until its first output."""

    def _room(self) -> int:
        assert self.size is not None
        return (self.size - sum(n for n, _ in self.entries.values())
                - sum(self.cross.values()))

    def cross_room(self) -> int | None:
        """§7.2: the embeddings an encoder-decoder input may still take (None: no bound)."""
        return None if self.size is None else self._room()

    def _ref(self, r: Request, k: int, ident: int) -> None:
        refs = self.entries[ident][1]
        if not refs:
            self.idle.remove(ident)
        refs.add(r.request_id)
        self.held.setdefault(r.request_id, set()).add(k)

    def lookup(self, r: Request, k: int) -> bool:
        """Input k's output is cached: r references it."""
        ident = inputs_of(r)[k][0]
        if ident not in self.entries:
            return False
        self._ref(r, k, ident)
        return True

    def admits(self, length: int, left: int | None, pending: int) -> bool:
        """An input of `length` embeddings fits `left` of the step's budget and, beside the
        `pending` embeddings already chosen for the same request, the cache, once enough idle
        entries are evicted (which happens here)."""
        if left is not None and length > left:
            return False
        if self.size is None:
            return True
        need = length + pending
        if need > self._room() + sum(self.entries[i][0] for i in self.idle):
            return False
        while need > self._room():
            del self.entries[self.idle.pop(0)]
        return True

    def add(self, r: Request, k: int) -> None:
        """Input k's output is computed this step and cached: r references it."""
        ident, _, length = inputs_of(r)[k]
        self.entries.setdefault(ident, (length, set()))
        self.entries[ident][1].add(r.request_id)
        self.held.setdefault(r.request_id, set()).add(k)

    def drop(self, r: Request, k: int) -> None:
        """r no longer holds input k; its reference to the entry ends with the last input of
        the identifier it holds."""
        ident = inputs_of(r)[k][0]
        mine = self.held.get(r.request_id, set())
        mine.discard(k)
        if not mine:
            self.held.pop(r.request_id, None)
        entry = self.entries.get(ident)
        if entry is None or not entry[1]:
            return
        if any(inputs_of(r)[j][0] == ident for j in mine):
            return
        entry[1].discard(r.request_id)
        if not entry[1]:
            self.idle.append(ident)

    def drop_all(self, r: Request) -> None:
        self.cross.pop(r.request_id, None)
        for k in sorted(self.held.get(r.request_id, ())):
            self.drop(r, k)

    def drop_done(self, r: Request, settled: int) -> None:
        """After a step's output: the inputs r has computed past (by `settled` tokens); an
        encoder-decoder input once r has computed a token."""
        if r.num_computed_tokens > 0:
            self.cross.pop(r.request_id, None)
        for k in sorted(self.held.get(r.request_id, ())):
            _, offset, length = inputs_of(r)[k]
            if offset + length <= settled:
                self.drop(r, k)


def encoder_chunk(cache: EncoderCache, r: Request, start: int, n: int, left: int | None,
                  shift: int) -> tuple[int, list[int], list[int], int]:
    """§7.2: a chunk of n tokens from `start` against the step's `left` budget: (its tokens,
    the inputs it computes, those riding on an identifier computed with it, embeddings)."""
    computed: list[int] = []
    riding: list[int] = []
    idents: set[int] = set()
    spent = 0
    if n == 0:
        return 0, computed, riding, 0
    for k, (ident, offset, length) in enumerate(inputs_of(r)):
        if offset + length <= start or offset >= start + n + shift:
            continue
        if ident in idents:
            riding.append(k)
        elif not cache.lookup(r, k):
            if not cache.admits(length, None if left is None else left - spent, spent):
                return (min(n, offset - start) if start < offset else 0), computed, riding, spent
            idents.add(ident)
            computed.append(k)
            spent += length
    return n, computed, riding, spent


def cross_encoder_chunk(r: Request, start: int, n: int, left: int | None,
                        room: int | None = None) -> tuple[int, int]:
    """§7.2: an encoder-decoder request's encoder input, its `num_encoder_tokens` at offset 0,
    is encoded with its chunk from 0 against the step's `left` budget and the cache's `room`
    (never cached, so never hit); from 1 computed token on it needs nothing: (the chunk's
    tokens, embeddings)."""
    e = r.num_encoder_tokens
    if e == 0 or start != 0 or n == 0:
        return n, 0
    return (0, 0) if any(b is not None and e > b for b in (left, room)) else (n, e)
