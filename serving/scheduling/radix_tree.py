"""The radix-tree baseline: SGLang-style longest-prefix match, behind the CHT's interface.

The running requests' token sequences live in a compressed radix tree (edges hold runs of
tokens; each node counts the running requests through it). ``best_request`` walks the tree
once per waiting request and picks the longest match, so one selection costs
``O(W x prompt length)``; this is the cost Feather's CHT removes (and why SGLang turns
longest-prefix-match scheduling off past 128 waiting requests).

For a like-for-like comparison the match is reported as the CHT does: ``missing`` = full chunks
of the prompt not covered by the matched prefix. Adapter identity follows the same rule as the
CHT's keys: from the first chunk whose KV the adapter changes, tokens are ``(adapter, token)``
pairs, so sequences of different adapters diverge exactly there.
"""

from __future__ import annotations

from collections.abc import Sequence

from preft.rule import AdapterRule


def adapter_sequence(tokens: Sequence[int], chunk_tokens: int, adapter: str | None = None,
                     rule: AdapterRule | None = None, prompt_length: int | None = None) -> tuple:
    """The sequence the tree stores: tokens, adapter-tagged from the first adapted chunk on
    (:meth:`~preft.rule.AdapterRule.kv_adapter_span`); a prefill-only adapter's tokens past the
    rule's ``P`` (default: every token is prompt) are tagged with ``P`` too, since they ran without it."""
    if adapter is None:
        return tuple(tokens)
    rule = rule or AdapterRule()
    prompt_length = len(tokens) if prompt_length is None else prompt_length
    levels = len(tokens) // chunk_tokens
    first = next((level for level in range(1, levels + 1)
                  if rule.kv_adapter_span(level * chunk_tokens, prompt_length) is not None), None)
    if first is None:
        return tuple(tokens)
    cut = (first - 1) * chunk_tokens
    past = (adapter, "past", prompt_length) if rule.prefill_only else adapter
    return tuple(tokens[:cut]) + tuple((adapter if p < prompt_length else past, token)
                                       for p, token in enumerate(tokens[cut:], cut))


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict = {}  # first element -> (edge tuple, child node)
        self.count = 0


class RadixTree:
    """Running sequences in a radix tree; waiting requests matched against it on selection."""

    def __init__(self, chunk_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens
        self.root = _Node()
        self.sequences: dict[str, tuple] = {}
        self.waiting: dict[str, int] = {}  # request id -> arrival order
        self.arrival: dict[str, int] = {}  # every request in the tree -> arrival order
        self.active: set[str] = set()
        self._arrivals = 0

    def __len__(self) -> int:
        return len(self.waiting)

    def insert(self, request_id: str, sequence: tuple) -> None:
        if request_id in self.sequences:
            raise ValueError(f"request {request_id!r} is already in the tree")
        self.sequences[request_id] = sequence
        self.waiting[request_id] = self.arrival[request_id] = self._arrivals
        self._arrivals += 1

    def remove(self, request_id: str) -> None:
        del self.waiting[request_id]
        del self.sequences[request_id], self.arrival[request_id]

    def activate(self, request_id: str) -> None:
        del self.waiting[request_id]
        self.active.add(request_id)
        self._add(self.sequences[request_id], +1)

    def finish(self, request_id: str) -> None:
        self.active.remove(request_id)
        self._add(self.sequences.pop(request_id), -1)
        del self.arrival[request_id]

    def deactivate(self, request_id: str) -> None:
        """Running -> waiting again, as old as it was."""
        self.active.remove(request_id)
        self._add(self.sequences[request_id], -1)
        self.waiting[request_id] = self.arrival[request_id]

    def _add(self, sequence: tuple, delta: int) -> None:
        node, i = self.root, 0
        node.count += delta
        while i < len(sequence):
            entry = node.children.get(sequence[i])
            if entry is None:  # only when adding: a new leaf edge
                child = _Node()
                node.children[sequence[i]] = (sequence[i:], child)
                child.count += delta
                return
            edge, child = entry
            common = _common(edge, sequence, i)
            if common < len(edge):  # split the edge where the sequence leaves it
                middle = _Node()
                middle.count = child.count
                middle.children[edge[common]] = (edge[common:], child)
                node.children[sequence[i]] = (edge[:common], middle)
                edge, child = edge[:common], middle
            child.count += delta
            if child.count == 0:  # nothing runs through it any more
                del node.children[sequence[i]]
                return
            node, i = child, i + len(edge)

    def match_length(self, sequence: tuple) -> int:
        """Tokens of ``sequence`` that a running request's sequence shares from its start."""
        node, i = self.root, 0
        while i < len(sequence):
            entry = node.children.get(sequence[i])
            if entry is None:
                return i
            edge, child = entry
            common = _common(edge, sequence, i)
            i += common
            if common < len(edge):
                return i
            node = child
        return i

    def missing(self, request_id: str) -> int:
        sequence = self.sequences[request_id]
        return len(sequence) // self.chunk_tokens - self.match_length(sequence) // self.chunk_tokens

    def best_request(self) -> str | None:
        """Fewest missing chunks (longest prefix match), oldest first among equals: one walk per
        waiting request."""
        best, best_key = None, None
        for request_id, order in self.waiting.items():
            key = (self.missing(request_id), order)
            if best_key is None or key < best_key:
                best, best_key = request_id, key
        return best


def _common(edge: tuple, sequence: tuple, start: int) -> int:
    """Length of the common prefix of ``edge`` and ``sequence[start:]``."""
    limit = min(len(edge), len(sequence) - start)
    if edge[:limit] == sequence[start:start + limit]:
        return limit
    low, high = 0, limit  # edge[:low] matches, edge[:high] does not
    while high - low > 1:
        middle = (low + high) // 2
        if edge[:middle] == sequence[start:start + middle]:
            low = middle
        else:
            high = middle
    return low
