"""kvcache's refusal of a call that breaks a precondition vLLM asserts."""

from __future__ import annotations


class PreconditionError(ValueError, AssertionError):
    """A call vLLM's own code refuses with an `assert` (a cut that is not block-aligned, a
    partial key off the hash grid): kvcache checks it always, with a message naming the bad
    value, and raises this, a ValueError as kvcache's other refusals are and the AssertionError
    vLLM raises, so that code written against either catches it."""
