"""The KV cache's block pool: allocation, block tables, ref counts and prefix caching.

Prefix caching: each full block is named by a chain hash of (parent block's hash, its token
ids); the first block's parent is the request's chain root (its LoRA adapter, its position
offset), so KV computed under one adapter is never found by a request of another. A block found
under that name is reused only if its stored tokens are equal too. Freed blocks keep their name
until the pool hands them out again, least recently used first, so a prefix stays reusable for as
long as memory allows.

Sliding windows: when every layer of the model attends within a window (``sliding_window``,
the widest), a running request's blocks that lie wholly before the window of the next token
it computes are freed as it goes, so a long generation holds a bounded number of blocks. Such
a block keeps its entry in ``block_ids`` (its id is stale: the attention kernels never read
keys that old) and ``num_released_blocks`` counts them. It stays named as a prefix block: its
keys and values are those of its tokens at their positions, whoever computed them, so a
later request may still take it as part of a cached prefix until the pool hands it out again.
With any full-attention layer (Gemma 2/3's global layers) nothing can be freed early.

A request whose positions are offset (``rope_position_offset``: LongRoPE's long regime) has
other keys and values for the same tokens, so its chain of hashes starts from the offset.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from pagedlab.engine.request import Request


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    draft_ready: bool = False  # a draft model's keys and values of its tokens are in it too


@dataclass
class PrefixCacheStats:
    """Tokens new requests looked up in the prefix cache and found there; as vLLM's hit rate, a
    preempted request's lookup of its own recomputed tokens is not counted, nor a request that reads
    no cache (``skip_reading_prefix_cache``, or prefix caching off): it looks nothing up."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass
class PrefixHit:
    """A prefix-cache lookup's result: cached blocks holding a request's first tokens."""

    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)

    def num_tokens(self, block_size: int) -> int:
        return len(self.block_ids) * block_size


def hash_block(parent_hash: bytes | None, token_ids) -> bytes:
    data = np.asarray(token_ids, dtype=np.int64).tobytes()
    return hashlib.blake2b((parent_hash or b"") + data, digest_size=16).digest()


def _chain_root(request: Request) -> bytes | None:
    """The parent hash of a request's first block: its LoRA adapter and its position offset, where
    it has them (either changes the keys and values of the same tokens)."""
    offset = request.rope_position_offset
    root = (request.prefix_cache_salt or b"") + (offset.to_bytes(8, "little") if offset else b"")
    return root or None


class KVCacheManager:
    """Hands out fixed-size blocks of KV slots to requests."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # every layer's keys older than this are dead (None: none)
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently freed first (the eviction order).
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reads_prefix_cache(self, request: Request) -> bool:
        """Whether ``request`` looks its prompt up in the prefix cache (vLLM's
        ``prefix_cache_lookup_enabled``): prefix caching is on and the request does not skip it."""
        return self.enable_prefix_caching and not request.skips_reading_prefix_cache

    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """Blocks already holding a prefix of ``request``'s tokens (for a request holding no
        block), and their hashes; nothing changes until ``allocate_slots`` takes them.

        The last token is never taken from the cache: at least one token must be computed so the
        request gets logits to sample from.
        """
        hit = PrefixHit()
        if not self.reads_prefix_cache(request):
            return hit
        tokens = request.all_token_ids
        for i in range((len(tokens) - 1) // self.block_size):
            block_tokens = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            block_hash = hash_block(hit.block_hashes[-1] if hit.block_hashes else _chain_root(request),
                                    block_tokens)
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != block_tokens:
                break
            hit.block_ids.append(block_id)
            hit.block_hashes.append(block_hash)
        return hit

    def draft_ready_tokens(self, hit: PrefixHit) -> int:
        """The tokens of ``hit``'s leading blocks that hold a draft model's keys and values too."""
        ready = 0
        while ready < len(hit.block_ids) and self.blocks[hit.block_ids[ready]].draft_ready:
            ready += 1
        return ready * self.block_size

    def mark_draft_ready(self, request: Request, num_tokens: int) -> None:
        """A draft model holds ``request``'s keys and values for its first ``num_tokens`` tokens:
        the blocks they fill hold them too (marked from the last back to one marked already)."""
        for i in range(num_tokens // self.block_size - 1, request.num_released_blocks - 1, -1):
            block = self.blocks[request.block_ids[i]]
            if block.draft_ready:
                break
            block.draft_ready = True

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       prefix_hit: PrefixHit | None = None) -> bool:
        """Give ``request`` blocks for ``num_new_tokens`` more tokens after its computed ones;
        False (nothing changed) if the pool is too small. ``prefix_hit`` (for a request that holds
        no block yet) is what ``find_cached_prefix`` found: its blocks come first, and the new
        tokens follow them; passing it, even empty, counts the lookup in ``stats``."""
        is_first_allocation = prefix_hit is not None
        if self.sliding_window is not None and not is_first_allocation:
            self._release_out_of_window(request)
        total = request.num_computed_tokens + num_new_tokens
        if not is_first_allocation and total <= len(request.block_ids) * self.block_size and (
                not self.enable_prefix_caching or total // self.block_size <= len(request.block_hashes)):
            return True  # the common decode step: room in the last block, no block newly full
        hit = prefix_hit or PrefixHit()
        total += hit.num_tokens(self.block_size)
        num_new_blocks = self.blocks_needed(total) - len(request.block_ids) - len(hit.block_ids)
        num_cached_free = sum(1 for b in hit.block_ids if self.blocks[b].ref_count == 0)
        if num_new_blocks > self.num_free_blocks - num_cached_free:
            return False
        if is_first_allocation and not request.num_preemptions and self.reads_prefix_cache(request):
            self.stats.queried_tokens += request.num_tokens
            self.stats.hit_tokens += hit.num_tokens(self.block_size)
        for block_id in hit.block_ids:
            self._take(block_id)
        request.block_ids.extend(hit.block_ids)
        request.block_hashes.extend(hit.block_hashes)
        for _ in range(max(num_new_blocks, 0)):
            block_id = next(iter(self.free_blocks))
            self._take(block_id)
            self._evict(block_id)
            request.block_ids.append(block_id)
        self._cache_full_blocks(request, total)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks; the tail goes first so shared prefixes are evicted last.
        Full blocks whose keys and values are computed are named first, so a finished or
        preempted sequence can be found again as a prefix; blocks it named for tokens it never
        computed (their step failed or was interrupted) lose their name."""
        self._cache_full_blocks(request, request.num_computed_tokens)
        self._forget_uncomputed_blocks(request)
        for block_id in reversed(request.block_ids[request.num_released_blocks:]):
            self._release(block_id)
        request.block_ids.clear()
        request.block_hashes.clear()
        request.num_released_blocks = 0

    def _forget_uncomputed_blocks(self, request: Request) -> None:
        """Unname the blocks named when slots were allocated for a step whose keys and values were
        never written (``num_computed_tokens`` stops short of them), so no prefix lookup finds them."""
        for i in range(request.num_computed_tokens // self.block_size, len(request.block_hashes)):
            block_id = request.block_ids[i]
            if self.blocks[block_id].block_hash == request.block_hashes[i]:
                self._evict(block_id)

    def _release_out_of_window(self, request: Request) -> None:
        """Free the request's blocks that no query from its next token on can see: those ending
        at or before ``num_computed_tokens - sliding_window + 1`` (already computed). They are
        named first: a block filled by a token whose id was still pending when its slots were
        allocated is not named yet, and naming it once the pool may have handed it out again
        would give another sequence's keys that name."""
        self._cache_full_blocks(request, request.num_computed_tokens)
        num_dead = max(request.num_computed_tokens - self.sliding_window + 1, 0) // self.block_size
        for block_id in request.block_ids[request.num_released_blocks:num_dead]:
            self._release(block_id)
        request.num_released_blocks = max(request.num_released_blocks, num_dead)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed more often than taken"
        if block.ref_count == 0:
            self.free_blocks[block_id] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; blocks in use stay valid but are no longer shared."""
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
        self.cached_blocks.clear()
        self.stats = PrefixCacheStats()

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.draft_ready = False
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) == block_id:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
            block.token_ids = None

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Name the request's blocks that ``num_tokens`` known tokens fill completely."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        tokens = request.all_token_ids
        for i in range(len(request.block_hashes), num_full):
            parent = request.block_hashes[-1] if request.block_hashes else _chain_root(request)
            block_tokens = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            block_hash = hash_block(parent, block_tokens)
            request.block_hashes.append(block_hash)
            block = self.blocks[request.block_ids[i]]
            if block.block_hash is None:
                block.block_hash = block_hash
                block.token_ids = block_tokens
                self.cached_blocks.setdefault(block_hash, block.block_id)
