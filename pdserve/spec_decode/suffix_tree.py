"""A suffix tree of bounded depth over token sequences, for suffix decoding (Arctic Inference's
SuffixDecoding, arXiv 2411.04975): every substring of at most `depth` tokens of the sequences
it holds is a path from the root, and each node counts how many times its substring occurs.
So the continuations seen after a pattern, and how often each came, are the children of the
pattern's node: a draft follows the most frequent child while its estimated probability (the
product of child count / parent count along the path) stays above a floor.

An uncompressed trie (one node per token) in plain Python: a sequence of n tokens adds at most
n * depth nodes, one dict look-up per node; a sequence can be removed again (the global tree
evicts old outputs that way), which deletes the nodes only it used.
"""
from __future__ import annotations


class Node:
    __slots__ = ("children", "count", "best")

    def __init__(self) -> None:
        self.children: dict[int, Node] = {}
        self.count = 0
        # The child with the highest count, kept on insertion (counts only grow there) and
        # recomputed when a removal lowers it: a draft step reads it instead of scanning children.
        self.best: tuple[int, Node] | None = None

    def add_child(self, token: int) -> Node:
        child = self.children.get(token)
        if child is None:
            child = self.children[token] = Node()
        child.count += 1
        if self.best is None or child.count > self.best[1].count:
            self.best = (token, child)
        return child


class Cursor:
    """Where a growing sequence's last substrings end: the node of each suffix of the sequence
    shorter than the tree's depth, longest first. Extending a sequence by one token moves each
    one level down, and the same list is the pattern matches a draft starts from."""
    __slots__ = ("nodes",)

    def __init__(self) -> None:
        self.nodes: list[Node] = []


class SuffixTree:
    def __init__(self, depth: int):
        self.depth = depth
        self.root = Node()

    def extend(self, cursor: Cursor, tokens) -> None:
        """Append tokens to the sequence the cursor follows (its substrings enter the tree)."""
        depth, root = self.depth, self.root
        nodes = cursor.nodes
        for token in tokens:
            root.count += 1
            grown = [node.add_child(token) for node in nodes]
            grown.append(root.add_child(token))
            nodes = grown[1:] if len(grown) >= depth else grown
        cursor.nodes = nodes

    def add(self, tokens: list[int]) -> None:
        self.extend(Cursor(), tokens)

    def remove(self, tokens: list[int]) -> None:
        """Take out a sequence added before (its substrings' counts, nodes left at zero)."""
        for start in range(len(tokens)):
            self.root.count -= 1
            node = self.root
            for token in tokens[start:start + self.depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                if node.best is not None and node.best[0] == token:
                    _rebest(node)
                node = child

    def match(self, context: list[int]) -> list[Node]:
        """The nodes of the context's suffixes of length 1, 2, ... present in the tree (a longer
        suffix is only present when the shorter one is), up to depth - 1 (room for a draft)."""
        out = []
        for length in range(1, min(len(context), self.depth - 1) + 1):
            node = self.root
            for token in context[len(context) - length:]:
                node = node.children.get(token)
                if node is None:
                    return out
            out.append(node)
        return out


def _rebest(node: Node) -> None:
    if node.children:
        token = max(node.children, key=lambda t: node.children[t].count)
        node.best = (token, node.children[token])
    else:
        node.best = None


def speculate_path(node: Node, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
    """From a pattern's node, the most frequent continuation while its probability (the product
    of child / parent counts) is at least min_prob; (tokens, score = the sum of those
    probabilities: the expected number of them accepted, if the counts were the odds)."""
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    while len(tokens) < max_tokens and node.best is not None:
        token, child = node.best
        prob *= child.count / node.count
        if prob < min_prob:
            break
        tokens.append(token)
        score += prob
        node = child
    return tokens, score


def speculate(nodes: list[Node], k: int, max_spec_factor: float, min_prob: float, depth: int
              ) -> tuple[list[int], float]:
    """The best draft over the matched pattern lengths (nodes[i]: the suffix of length i + 1):
    each may draft up to max_spec_factor times its length (a longer match earns a longer
    draft), within k and the tree's depth; ties go to the longer match."""
    best: tuple[list[int], float] = ([], 0.0)
    for i, node in enumerate(nodes):
        length = i + 1
        limit = min(k, int(length * max_spec_factor + 1e-6), depth - length)
        if limit <= 0:
            continue
        draft = speculate_path(node, limit, min_prob)
        if draft[1] >= best[1] and draft[0]:
            best = draft
    return best
