"""The simulator's prefix cache: what a SGLang server's KV pool keeps of finished sequences, and what a new
request then finds cached (its prompt and prefix) or must prefill."""

from __future__ import annotations

from collections import OrderedDict


class RadixCache:
    """The KV pool of one server as the simulator sees it: finished sequences kept whole, keyed by their
    conversation (without the continued prefix), evicted least-recently-used when the cached tokens plus
    the running requests' reserved tokens exceed ``capacity`` tokens.

    No partial matches across conversations (a shared system prompt is not shared): conservative.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.running = 0  # tokens reserved by admitted requests (prompt + prefix + completion_tokens)
        self._cached = 0
        self._generated: OrderedDict[str, int] = OrderedDict()  # key -> generated tokens held, oldest first
        self._prompt: dict[str, int] = {}  # key -> prompt tokens of that sequence

    def admit(self, key: str, prompt_tokens: int, done: int, completion_tokens: int) -> tuple[int, int, int]:
        """A request of ``prompt_tokens`` + ``done`` prefix tokens, generating ``completion_tokens``, gets
        its slot: reserves its whole sequence, evicts, and returns ``(cached_tokens, prefill_tokens,
        held)``: a hit gets ``prompt_tokens + min(done, held)`` cached, ``held`` being the generated tokens
        of the cached sequence, which it takes out while it runs (SGLang locks it; pass ``held`` back to
        :meth:`finish`)."""
        held = self._generated.pop(key, None)
        if held is None:
            held, cached = 0, 0
        else:
            self._cached -= self._prompt.pop(key) + held
            cached = prompt_tokens + min(done, held)
        self.running += prompt_tokens + done + completion_tokens
        self._evict()
        return cached, prompt_tokens + done - cached, held

    def finish(self, key: str, prompt_tokens: int, done: int, completion_tokens: int, held: int = 0) -> None:
        """The admitted request finished: its sequence (or the longer one it took out, ``held``
        generated tokens) is cached, most recent, and its reservation released."""
        self.running -= prompt_tokens + done + completion_tokens
        old = self._generated.pop(key, None)
        if old is not None:  # the same conversation finished twice at once: keep one
            self._cached -= self._prompt.pop(key) + old
        generated = max(done + completion_tokens, held, old or 0)
        self._generated[key], self._prompt[key] = generated, prompt_tokens
        self._cached += prompt_tokens + generated
        self._evict()

    def _evict(self) -> None:
        while self._generated and self._cached + self.running > self.capacity:
            key, generated = self._generated.popitem(last=False)
            self._cached -= self._prompt.pop(key) + generated
