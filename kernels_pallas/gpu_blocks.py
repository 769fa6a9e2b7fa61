"""Block sizes of the GPU (Triton) ragged paged attention kernel: which shapes it takes, how a row's
lanes split into power-of-two parts, and the q tile / kv block / head block that fit an H100's shared
memory and registers (kernels_pallas/ragged_paged_attention_gpu.py's docstring gives the measurements).
Plain Python: no jax."""
from __future__ import annotations

from kernels_pallas._checks import is_power_of_two

_MIN_DOT = 16
# Largest head_dim `supports()` accepts: a latent row of 512 + 64 (DeepSeek-V3, Kimi K2); with the
# smallest blocks (16 rows, 16 keys) it fits MAX_SHARED_MEMORY in float32 with separate K and V
# (4 * 576 * (16 + 2 * 16 * 2) + (32 + 4 * 16) * 16 = 182 KiB).
MAX_HEAD_DIM = 576
# Float32 accumulator values [rows, Dv] one program keeps (in registers: 128 KiB of an SM's 256 KiB);
# more heads than that go to several programs (default_head_block).
MAX_ACCUMULATOR_VALUES = 32 * 1024
# Shared memory one thread block may use on sm_90 (H100 / H200): 227 KiB of the 228 KiB per SM
# (CUDA C++ Programming Guide, "Compute Capabilities" table; the target's
# shared_memory_per_block_optin). Smaller parts (A100: 163 KiB, sm_86/sm_89: 99 KiB) need smaller
# explicit blocks, or XLA rejects the program at compile time.
MAX_SHARED_MEMORY = 227 * 1024


def lane_parts(head_dim: int) -> tuple[tuple[int, int], ...]:
    """(offset, width) of the power-of-two lane parts a row of `head_dim` is read in, widest first:
    (0, 128) for 128, (0, 512), (512, 64) for a latent row of 576. Empty when a part would be narrower
    than a dot takes (16) or a row needs more than three parts."""
    parts, off = [], 0
    for bit in reversed(range(head_dim.bit_length())):
        width = 1 << bit
        if head_dim & width:
            parts.append((off, width))
            off += width
    if len(parts) > 3 or any(width < _MIN_DOT for _, width in parts):
        return ()
    return tuple(parts)


def value_parts(head_dim: int, v_head_dim: int) -> int:
    """How many of lane_parts(head_dim) the values take: the parts whose lanes make v_head_dim (0 when
    v_head_dim does not end on a part's end)."""
    ends = [off + width for off, width in lane_parts(head_dim)]
    return ends.index(v_head_dim) + 1 if v_head_dim in ends else 0


def supports(*, head_dim: int, page_size: int, v_head_dim: int | None = None) -> bool:
    """Whether this kernel handles these sizes: a head_dim of at most MAX_HEAD_DIM made of one to three
    power-of-two lane parts of at least 16 (`lane_parts`: Triton block shapes are powers of two, dots
    need 16), values (v_head_dim, for values read from the keys' rows) ending on a part, and a
    power-of-two page_size (any size: pages larger than a kv block are read a slice at a time)."""
    return (head_dim <= MAX_HEAD_DIM and bool(lane_parts(head_dim)) and is_power_of_two(page_size)
            and value_parts(head_dim, v_head_dim or head_dim) > 0)


def shared_memory_bytes(
    *, block_q: int, group_p: int, block_kv: int, head_dim: int, itemsize: int, num_stages: int,
    kv_blocks: int = 2, page_itemsize: int | None = None,
) -> int:
    """Upper bound on the shared memory one program uses: the q tile [block_q * group_p, D] (group_p:
    the q heads of one program) plus `kv_blocks` [BK, D] blocks (K and V; K alone when the values
    are the keys' rows) per pipeline stage, 32 bytes a q row for the row reductions and pipeline
    barriers, and for 4-byte inputs a float32 [rows, BK] tile (the IEEE float32 dots stage the
    probabilities through shared memory). 8-bit pages (`page_itemsize` 1) stage each key's row per
    pipeline stage in 8 bits, again widened to q's dtype for the dots, plus a byte a lane and 8
    bytes a key for the widening and the scales (measured on sm_90a at 128 and 576 lanes: 644 and
    2,628 bytes a key against 648 and 2,888 here). See the module docstring for the measurements."""
    rows = block_q * group_p
    stages = max(1, num_stages)
    if page_itemsize is not None and page_itemsize < itemsize:
        per_key = head_dim * (page_itemsize * stages + itemsize + 1) + 8
    else:
        per_key = itemsize * head_dim * stages
    tiles = itemsize * head_dim * rows + kv_blocks * block_kv * per_key
    return tiles + 32 * rows + (4 * rows * block_kv if itemsize >= 4 else 0)


def default_block_q(num_tokens: int, max_seqs: int, group_p: int) -> int:
    """Decode-heavy buckets (T <= 2S) get 16-row tiles, prefill buckets 64-row tiles."""
    target_rows = _MIN_DOT if num_tokens <= 2 * max_seqs else 64
    return max(1, target_rows // group_p)


def default_block_kv(page_size: int) -> int:
    """64 keys per kv block, or one whole page when pages are larger."""
    return max(64, page_size)


def default_head_block(block_q: int, group_p: int, v_head_dim: int) -> int:
    """q heads of a kv head's (padded) group that one program takes: all of them unless its float32
    accumulators, rows x Dv, would pass MAX_ACCUMULATOR_VALUES (MLA's 128 heads of 512 value lanes:
    64 heads a program); never fewer than a 16-row dot."""
    hb = group_p
    while block_q * hb * v_head_dim > MAX_ACCUMULATOR_VALUES and hb > 1 and block_q * hb // 2 >= _MIN_DOT:
        hb //= 2
    return hb


def choose_blocks(
    *,
    num_tokens: int,
    max_seqs: int,
    group_p: int,
    head_dim: int,
    page_size: int,
    itemsize: int,
    num_stages: int,
    block_q: int | None = None,
    block_kv: int | None = None,
    max_shared_memory: int | None = None,
    v_head_dim: int | None = None,
    shared: bool = False,
    page_itemsize: int | None = None,
) -> tuple[int, int, int]:
    """(block_q, block_kv, head_block): the given ones as they are; defaults for the others, the head
    block sized for the accumulators (default_head_block), then halved (the kv block first, down to
    16 keys, then the q tile, then the head block, down to 16 rows) until `shared_memory_bytes` fits
    `max_shared_memory` (default MAX_SHARED_MEMORY). The result may still not fit (explicit blocks,
    or no default small enough): the caller checks. `shared`: the values are the keys' rows;
    `page_itemsize`: the pages' bytes a value when they are 8-bit."""
    limit = MAX_SHARED_MEMORY if max_shared_memory is None else max_shared_memory
    bq = block_q or default_block_q(num_tokens, max_seqs, group_p)
    bk = block_kv or default_block_kv(page_size)
    hb = default_head_block(bq, group_p, v_head_dim or head_dim)

    def fits(bq: int, bk: int, hb: int) -> bool:
        return shared_memory_bytes(block_q=bq, group_p=hb, block_kv=bk, head_dim=head_dim, itemsize=itemsize,
                                   num_stages=num_stages, kv_blocks=1 if shared else 2,
                                   page_itemsize=page_itemsize) <= limit

    while not fits(bq, bk, hb):
        if block_kv is None and bk > _MIN_DOT:
            bk //= 2
        elif block_q is None and bq > 1 and bq * hb > _MIN_DOT:
            bq //= 2
        elif hb > 1 and bq * hb > _MIN_DOT:
            hb //= 2
        else:
            break
    return bq, bk, hb
