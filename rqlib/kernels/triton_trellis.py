"""Triton kernel: the trellis's encoder, a Viterbi search over the shift register's states.

One program codes one vector (its ``dim`` rotated coordinates, scaled to unit variance, in
float64) with the bitshift trellis of :mod:`rqlib.core.trellis`: ``2^L`` states, each reached
from ``2^k`` predecessors. A step keeps, for each state ``h * 2^k + s``, the cheapest of the
states ``top * 2^(L - k) + h`` it follows, and adds its squared error::

    best_h = min_top cost[top * 2^(L-k) + h]            the cost vector as [2^k, 2^(L-k)]
    cost'[h * 2^k + s] = best_h + (x_t - table[h * 2^k + s])^2

so the costs live in registers, viewed as ``[2^k, 2^(L-k)]`` to take the minimum over the
first axis and as ``[2^(L-k), 2^k]`` to add the errors. The back pointers (``top``, one byte a
state ``h`` and step) go to a scratch buffer; the walk back from the cheapest end reads them
one at a time and writes each symbol and the value at its register. A tail-biting trellis
makes two passes in the same program, as the torch encoder does: the vector turned half-way
round gives the register at the seam, and the second pass starts there and keeps only the
ends whose last ``L - k`` bits agree with it.

The arithmetic is the torch encoder's, in float64 and in the same order, so the interpreter
writes its symbols exactly; a compiler that fuses the multiply-add can break a near-tie
the other way, a path of equal cost to within a rounding.

Per vector: ``dim`` loads of a sample, ``dim * 2^(L-k)`` bytes of pointers written and
``dim`` read back, per pass; the ``2^L`` table entries are read once.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def viterbi_forward(x_row, table, pointers_row, dim, turn, first,
                    STATE_BITS: tl.constexpr, BITS: tl.constexpr):  # fmt: skip
    """The costs of the ``2^L`` end states of samples ``x_row[(t + turn) % dim]``, from the
    register ``first``; stores each step's back pointers at ``pointers_row``."""
    fan: tl.constexpr = 1 << BITS
    tail: tl.constexpr = 1 << (STATE_BITS - BITS)
    heads = tl.arange(0, tail)
    states = tl.arange(0, 1 << STATE_BITS)
    cost = tl.where(states == first, 0.0, float("inf")).to(tl.float64)
    for t in range(0, dim):
        sample = tl.load(x_row + (t + turn) % dim)
        best, top = tl.min(tl.reshape(cost, (fan, tail)), axis=0, return_indices=True)
        tl.store(pointers_row + t * tail + heads, top.to(tl.uint8))
        error = sample - table
        cost = tl.reshape(best[:, None] + error * error, (1 << STATE_BITS,))
    return cost


@triton.jit
def walk_back(cost, pointers_row, symbols_row, values_row, levels_ptr, dim, steps,
              STATE_BITS: tl.constexpr, BITS: tl.constexpr, WRITE: tl.constexpr):  # fmt: skip
    """From the cheapest end of ``cost``, ``steps`` steps back along the pointers; with
    ``WRITE`` each step's symbol and level (float32) are stored. Returns the register reached:
    the one after step ``dim - 1 - steps``."""
    tail: tl.constexpr = 1 << (STATE_BITS - BITS)
    tl.debug_barrier()  # the pointers were stored by every thread of the program
    state = tl.argmin(cost, axis=0).to(tl.int32)
    for i in range(0, steps):
        t = dim - 1 - i
        if WRITE:
            tl.store(symbols_row + t, (state & ((1 << BITS) - 1)).to(tl.uint8))
            tl.store(values_row + t, tl.load(levels_ptr + state).to(tl.float32))
        head = state >> BITS
        state = tl.load(pointers_row + t * tail + head).to(tl.int32) * tail + head
    return state


@triton.jit
def trellis_encode_kernel(
    x_ptr,  # fp64 [n, dim]: rotated unit vectors times sqrt(dim), contiguous
    table_ptr,  # fp64 [2^L]: the trellis's table (unit variance)
    levels_ptr,  # fp64 [2^L]: the levels the decoder reads (the table over sqrt(dim))
    pointers_ptr,  # uint8 [n, dim, 2^(L-k)] scratch
    symbols_ptr,  # uint8 [n, dim] out
    values_ptr,  # fp32 [n, dim] out: the level at each coordinate's register
    dim,
    STATE_BITS: tl.constexpr,
    BITS: tl.constexpr,
    TAIL_BITING: tl.constexpr,
):
    """The least-squares trellis path of one vector; see the module doc."""
    fan: tl.constexpr = 1 << BITS
    tail: tl.constexpr = 1 << (STATE_BITS - BITS)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * dim
    pointers_row = pointers_ptr + row * dim * tail
    symbols_row = symbols_ptr + row * dim
    values_row = values_ptr + row * dim
    # the value of state h * fan + s, as [tail, fan]
    table = tl.load(table_ptr + tl.arange(0, tail)[:, None] * fan + tl.arange(0, fan)[None, :])
    first = 0
    if TAIL_BITING:
        turn = dim // 2
        cost = viterbi_forward(x_row, table, pointers_row, dim, turn, 0, STATE_BITS, BITS)
        first = walk_back(cost, pointers_row, symbols_row, values_row, levels_ptr, dim, turn,
                          STATE_BITS, BITS, False)  # fmt: skip
        tl.debug_barrier()  # every thread has read the first pass's pointers
    cost = viterbi_forward(x_row, table, pointers_row, dim, 0, first, STATE_BITS, BITS)
    if TAIL_BITING:
        seam = (1 << (STATE_BITS - BITS)) - 1
        ends = tl.arange(0, 1 << STATE_BITS)
        cost = tl.where((ends & seam) == (first & seam), cost, float("inf"))
    walk_back(cost, pointers_row, symbols_row, values_row, levels_ptr, dim, dim, STATE_BITS, BITS,
              True)  # fmt: skip
