"""One-shot all-reduce over peer memory, in Triton, beside its plain-torch reference.

Every rank owns a buffer that every other rank can write (mapped into each GPU's address space
through CUDA IPC, reached over NVLink) with one slot per rank and call parity, and a signal pad
of int32 flags. Program ``b`` of each rank works on the same chunks of the message:

1. push its chunks of the input into its slot of every rank's buffer (remote writes are posted,
   so nothing waits on a round trip);
2. raise its flag at every rank (release, system scope: the pushed data is visible first), then
   wait until every rank's flag is up here (acquire);
3. sum the slots, in rank order and in float32, from local memory into the output (so every
   rank gets bitwise the same sum);
4. lower the flags here: the senders may use them for their next call.

A sender raising a flag that is still up waits: the receiver has not finished reading its
previous call. Alternating the slots between calls (a parity per program, kept on the device)
lets a sender write call k+1 while the receiver may still read call k, so one flag exchange per
call suffices and nothing is counted on the host: the kernel replays inside a CUDA graph. NCCL
stays for large messages, where its ring uses the links better.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def one_shot_all_reduce_reference(inputs: list[torch.Tensor]) -> torch.Tensor:
    """The sum of every rank's ``inputs[r]``: float32 in rank order, rounded once to the dtype."""
    total = torch.zeros_like(inputs[0], dtype=torch.float32)
    for x in inputs:
        total += x.float()
    return total.to(inputs[0].dtype)


@triton.jit
def _one_shot_all_reduce_kernel(x_ptr, out_ptr, buffer_ptrs, signal_pad_ptrs, numel, slot_numel, rank,
                                WORLD_SIZE: tl.constexpr, MAX_PROGRAMS: tl.constexpr, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    stride = tl.num_programs(0) * BLOCK
    elem = x_ptr.dtype.element_ty
    own_pad = tl.load(signal_pad_ptrs + rank).to(tl.pointer_type(tl.int32))
    parity_flag = own_pad + MAX_PROGRAMS * WORLD_SIZE + program  # this program's call parity, local
    parity = tl.load(parity_flag)
    # 1. push this rank's chunks into slot (parity, rank) of every rank's buffer
    for start in range(program * BLOCK, numel, stride):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < numel
        values = tl.load(x_ptr + offsets, mask=mask)
        for peer in tl.static_range(WORLD_SIZE):
            peer_buffer = tl.load(buffer_ptrs + peer).to(tl.pointer_type(elem))
            tl.store(peer_buffer + (parity * WORLD_SIZE + rank) * slot_numel + offsets, values, mask=mask)
    # 2. raise our flag at every rank (waiting while a rank still reads our previous call), then
    #    wait for every rank's flag here
    tl.debug_barrier()
    for peer in tl.static_range(WORLD_SIZE):
        peer_pad = tl.load(signal_pad_ptrs + peer).to(tl.pointer_type(tl.int32))
        flag = peer_pad + program * WORLD_SIZE + rank
        seen = tl.atomic_cas(flag, 0, 1, sem="release", scope="sys")
        while seen != 0:
            seen = tl.atomic_cas(flag, 0, 1, sem="release", scope="sys")
    for peer in tl.static_range(WORLD_SIZE):
        flag = own_pad + program * WORLD_SIZE + peer
        seen = tl.atomic_cas(flag, 1, 1, sem="acquire", scope="sys")
        while seen != 1:
            seen = tl.atomic_cas(flag, 1, 1, sem="acquire", scope="sys")
    tl.debug_barrier()
    # 3. sum the slots in rank order, from local memory
    own_buffer = tl.load(buffer_ptrs + rank).to(tl.pointer_type(elem))
    for start in range(program * BLOCK, numel, stride):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < numel
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for sender in tl.static_range(WORLD_SIZE):
            slot = own_buffer + (parity * WORLD_SIZE + sender) * slot_numel
            total += tl.load(slot + offsets, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)
    # 4. our reads are done: lower the flags, so the senders may raise them for the next call
    tl.debug_barrier()
    for peer in tl.static_range(WORLD_SIZE):
        tl.atomic_xchg(own_pad + program * WORLD_SIZE + peer, 0, sem="release", scope="sys")
    tl.store(parity_flag, 1 - parity)


def one_shot_all_reduce_triton(x: torch.Tensor, out: torch.Tensor, buffer_ptrs: torch.Tensor,
                               signal_pad_ptrs: torch.Tensor, rank: int, world_size: int, max_bytes: int,
                               max_programs: int, block: int = 1024) -> torch.Tensor:
    """The sum of every rank's ``x`` into ``out`` (which may be ``x``), ``x.nbytes <= max_bytes``.
    Every rank must call it with the same size at the same point of its stream.

    ``buffer_ptrs``/``signal_pad_ptrs`` are int64 tensors (on ``x``'s device) of each rank's
    buffer (``2 * world_size`` slots of ``max_bytes``) and signal pad (``max_programs *
    (world_size + 1)`` int32 flags, zeroed before the first call) addresses."""
    numel = x.numel()
    programs = max(1, min(max_programs, triton.cdiv(numel, block)))
    _one_shot_all_reduce_kernel[(programs,)](x, out, buffer_ptrs, signal_pad_ptrs, numel,
                                             max_bytes // x.element_size(), rank, WORLD_SIZE=world_size,
                                             MAX_PROGRAMS=max_programs, BLOCK=block, num_warps=4)
    return out
