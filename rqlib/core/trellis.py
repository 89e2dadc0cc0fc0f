"""A bitshift trellis code: a sequence quantizer with a granular gain over scalar Lloyd-Max.

A sequence of ``n`` samples is stored as ``n`` symbols of ``k`` bits. The decoder keeps the
last ``L`` bits of the stream in a shift register (the *state*); each symbol shifts ``k`` new
bits in, and the sample is read from a table of ``2^L`` values at the new state::

    state_t = ((state_{t-1} << k) | symbol_t) mod 2^L,    x_hat_t = table[state_t]

so decoding is a shift and a lookup per sample (this is the structure of QTIP's trellis); at
one width the register at a step is just the ``ceil(L / k)`` symbols that end there, so every
sample can be read at once (:meth:`BitshiftTrellis.states`). The
encoder chooses the whole symbol sequence at once, by the Viterbi algorithm over the ``2^L``
states: from each state only ``2^k`` successors are reachable, and the best path through them
is found exactly. Steps may differ in width (one ``k`` per sample): a shift of ``k_t`` bits.
The register starts at 0, so no bits beyond ``k n`` are stored; the first
``ceil((L - k) / k)`` samples see fewer table values, which the measured distortion includes.

**Tail-biting** (``tail_biting=True``) removes that start. The stream is read as a circle: the
register starts from the last ``L`` bits of the stream itself, so every sample is read from
the whole table, again at no stored bit::

    state_{-1} = state_{n-1}    (the last L bits of the stream; needs k_0 + ... + k_{n-1} >= L)

The decoder reads ``state_{n-1}`` off the stream's last ``L`` bits (one pass of the shift
register, where the widths change) and then decodes as before. The encoder must choose a path whose
end agrees with its start: it guesses the register at the seam by coding the sequence turned
half-way round (its seam then lies in the middle, where the free-start code is good), and then
runs the Viterbi algorithm from that register, keeping only the ends whose last ``L - k_0``
bits equal it. That is two Viterbi passes instead of one; the code is exact given the guessed
seam, not over every seam.

The table holds the ``2^L`` quantiles of a unit Gaussian in a pseudo-random order fixed by a draw
number, so that the values reachable from any state look like independent Gaussian draws.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["BitshiftTrellis"]

#: Bytes of the costs one encode keeps (``8 * 2^L`` a sample and sequence): the sequences are
#: encoded in chunks of at most this much.
ENCODE_BYTES = 1 << 26


@functools.cache
def _table(state_bits: int, draw: int) -> torch.Tensor:
    levels = 1 << state_bits
    probabilities = (torch.arange(levels, dtype=torch.float64) + 0.5) / levels
    values = torch.special.ndtri(probabilities)
    values = values / values.pow(2).mean().sqrt()  # exactly unit variance
    order = torch.randperm(levels, generator=torch.Generator().manual_seed(draw))
    return values[order]


@dataclass(frozen=True)
class BitshiftTrellis:
    """A bitshift trellis with ``state_bits`` (``L``) bits of state; see the module docstring.

    Symbols of ``k`` bits need ``1 <= k < L``; ``k`` may change from step to step. With
    ``tail_biting`` the register starts from the stream's own end, which needs a stream of at
    least ``L`` bits."""

    state_bits: int = 10
    draw: int = 0
    tail_biting: bool = False

    def __post_init__(self) -> None:
        if not 2 <= self.state_bits <= 16:
            raise ValueError(f"state_bits must be in 2..16, got {self.state_bits!r}")
        if not isinstance(self.tail_biting, bool):
            raise TypeError(f"tail_biting must be a bool, got {self.tail_biting!r}")

    @property
    def table(self) -> torch.Tensor:
        return _table(self.state_bits, self.draw)

    def _steps(self, bits, length: int) -> list[int]:
        """The bits of each of ``length`` steps (``bits``: one int, or one per step)."""
        steps = [bits] * length if isinstance(bits, int) else [int(b) for b in bits]
        if len(steps) != length or not all(1 <= b < self.state_bits for b in steps):
            raise ValueError(
                f"a trellis of {self.state_bits} state bits codes 1..{self.state_bits - 1} bits a "
                f"sample, one width or one per sample ({length}), got {bits!r}"
            )
        if self.tail_biting and sum(steps) < self.state_bits:
            raise ValueError(
                f"a tail-biting trellis of {self.state_bits} state bits needs a stream of at "
                f"least {self.state_bits} bits, got {length} samples of {bits!r} bits"
            )
        return steps

    def _walk(
        self, symbols: torch.Tensor, steps: list[int], start: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The register after every symbol of ``symbols [N, n]``, from the registers ``start
        [N]`` (``None``: 0): ``[N, n]``, int64."""
        mask = (1 << self.state_bits) - 1
        state = torch.zeros(symbols.shape[0], dtype=torch.long, device=symbols.device)
        if start is not None:
            state = start.long()
        states = torch.empty(symbols.shape, dtype=torch.long, device=symbols.device)
        for t, k in enumerate(steps):
            state = ((state << k) | symbols[:, t].long()) & mask
            states[:, t] = state
        return states

    def states(self, symbols: torch.Tensor, bits) -> torch.Tensor:
        """The register ``[N, n]`` (int64) at every step of symbols ``[N, n]`` of ``bits`` bits
        (an int, or one per step): the index into :attr:`table` of each sample. Read from 0,
        or tail-biting: from the register that a first walk from 0 ends in.

        At one width ``k`` the register at step ``c`` is made of the ``ceil(L / k)`` symbols
        that end at it, ``sum_j symbol_{c-j} 2^(jk) mod 2^L`` (the symbols before the first
        read as 0, or tail-biting as those at the end of the row), so every step is read at
        once, as the kernels read it; widths that change from step to step walk the register."""
        steps = self._steps(bits, symbols.shape[1])
        if len(set(steps)) > 1:
            states = self._walk(symbols, steps)
            return self._walk(symbols, steps, states[:, -1]) if self.tail_biting else states
        width, length = steps[0], symbols.shape[1]
        symbols = symbols.long()
        states = torch.zeros_like(symbols)
        for lag in range(min(-(-self.state_bits // width), length)):
            if self.tail_biting:
                ending = symbols.roll(lag, dims=1)
            else:
                ending = torch.nn.functional.pad(symbols[:, : length - lag], (lag, 0))
            states |= ending << (lag * width)
        return states & ((1 << self.state_bits) - 1)

    def decode(self, symbols: torch.Tensor, bits) -> torch.Tensor:
        """Samples ``[N, n]`` (float64) from symbols ``[N, n]`` of ``bits`` bits (an int, or a
        sequence of ``n`` ints: the width of each step)."""
        return self.table.to(symbols.device)[self.states(symbols, bits)]

    def encode(self, x: torch.Tensor, bits) -> torch.Tensor:
        """Symbols ``[N, n]`` (int64) of the path of least squared error for ``x`` ``[N, n]``
        (``bits`` as for :meth:`decode`)."""
        x = torch.as_tensor(x, dtype=torch.float64)
        if x.dim() != 2:
            raise ValueError(f"x must be [N, n], got {tuple(x.shape)}")
        steps = self._steps(bits, x.shape[1])
        if not bool(torch.isfinite(x).all()):
            raise ValueError("x must be finite")
        code = self._tail_biting if self.tail_biting else self._viterbi
        chunk = max(1, ENCODE_BYTES // max(1, 8 * x.shape[1] << self.state_bits))
        return torch.cat(
            [code(rows, steps) for rows in x.split(chunk)]
            or [torch.zeros(0, x.shape[1], dtype=torch.long, device=x.device)]
        )

    def _tail_biting(self, x: torch.Tensor, steps: list[int]) -> torch.Tensor:
        """Two passes: the seam's register from the sequence turned half-way round, then the
        best path from that register among those that end where they started."""
        turn = x.shape[1] // 2
        turned = self._viterbi(x.roll(-turn, dims=1), steps[turn:] + steps[:turn])
        seam = self._walk(turned, steps[turn:] + steps[:turn])[:, -1 - turn]
        return self._viterbi(x, steps, start=seam)

    def _viterbi(
        self, x: torch.Tensor, steps: list[int], start: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The least-error symbols for ``x [N, n]`` from the register 0, or from the registers
        ``start [N]`` with the ends restricted to those whose last ``L - k_0`` bits match.

        Forward, a step keeps for each state ``h * 2^k + s`` the cheapest of the states
        ``top * 2^(L-k) + h`` it follows and adds its squared error; the costs before each step
        are kept, and the walk back takes, at each step, the cheapest predecessor of the state
        it stands on (the first of equal ones)."""
        n_seq, device = x.shape[0], x.device
        table = self.table.to(device)
        rows = torch.arange(n_seq, device=device)
        cost = torch.full((n_seq, 1 << self.state_bits), torch.inf, dtype=torch.float64,
                          device=device)  # fmt: skip
        cost[rows, 0 if start is None else start] = 0.0
        before = []  # the costs before each step
        for t, k in enumerate(steps):
            tail, fan = 1 << (self.state_bits - k), 1 << k
            before.append(cost)
            best = cost.view(n_seq, fan, tail).amin(dim=1)  # [N, tail]
            error = x[:, t, None, None] - table.view(tail, fan)[None]
            cost = (best[:, :, None] + error * error).view(n_seq, -1)
        if start is not None:  # the decoder reads the register before step 0 from the end
            seam = (1 << (self.state_bits - steps[0])) - 1
            ends = torch.arange(1 << self.state_bits, device=device)
            cost = cost.masked_fill((ends[None] & seam) != (start[:, None] & seam), torch.inf)
        state = cost.argmin(dim=1)
        symbols = torch.empty(x.shape, dtype=torch.long, device=device)
        for t in range(len(steps) - 1, -1, -1):
            k = steps[t]
            tail = 1 << (self.state_bits - k)
            symbols[:, t] = state & ((1 << k) - 1)
            head = state >> k
            top = before[t].view(n_seq, 1 << k, tail)[rows, :, head].argmin(dim=1)
            state = top * tail + head
        return symbols
